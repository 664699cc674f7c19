"""``tierkv plan TRACE --admission LIST``: compare L3 admission modes (``l3.admission``) on one trace.

For each mode (``always``, ``second_sight``, ``reused_in_l2``) and each pair of L2 and L3 sizes, the trace is replayed
through the engine's scheduler side and controller (:func:`tierkv.cli_plan.replay`, L3 written through its
admission) and reported: hit rate, tokens served per tier, pages written to L3 (bytes with ``--page-bytes``: pages x
page bytes) and the admission counters. Against ``always`` at the same sizes each row also gives the share of L3
writes saved and the hit-rate points lost. Raises CliError(EXIT_USAGE) for an unknown mode.
"""
from __future__ import annotations

import json
from typing import Optional

from tierkv.cli_common import EXIT_OK, EXIT_USAGE, CliError, progress


def parse_admissions(text: str) -> list[str]:
    """``"always,second_sight"`` -> ``["always", "second_sight"]`` (duplicates dropped, order kept).

    Raises:
        CliError(EXIT_USAGE): an unknown mode, naming ``--admission`` and the allowed ones.
    """
    from tierkv.connector.core.config import L3_ADMISSIONS

    out: list[str] = []
    for part in text.split(","):
        mode = part.strip()
        if mode not in L3_ADMISSIONS:
            raise CliError(EXIT_USAGE, f"--admission {mode!r}: allowed values are {', '.join(L3_ADMISSIONS)}")
        if mode not in out:
            out.append(mode)
    return out


def compare(rows: list[dict]) -> None:
    """Add to each row, against the ``always`` row of the same sizes (when replayed): ``written_saved`` (share of
    its L3 pages not written) and ``hit_rate_lost_points`` (percentage points of hit rate lost)."""
    base = {(r["l2_pages"], r["l3_pages"]): r for r in rows if r["admission"] == "always"}
    for r in rows:
        b = base.get((r["l2_pages"], r["l3_pages"]))
        if b is None:
            continue
        bw = b.get("l3_written_pages", 0)
        r["written_saved"] = 1 - r.get("l3_written_pages", 0) / bw if bw else 0.0
        r["hit_rate_lost_points"] = 100 * (b["hit_rate"] - r["hit_rate"])


def format_table(rows: list[dict], page_bytes: Optional[int]) -> str:
    """One line per admission mode and pair of sizes."""
    written = "L3 written" if page_bytes else "L3 pages wr"
    lines = [f"{'admission':>13} {'L2 pages':>9} {'L3 pages':>9} {'hit rate':>9} {'L2 tokens':>12} {'L3 tokens':>12} "
             f"{written:>13} {'saved':>7} {'lost pts':>9} {'rejected':>9} {'rej. hits':>9}"]
    for r in rows:
        w = r.get("l3_written_pages", 0)
        wtxt = f"{w * page_bytes / 2**30:,.1f} GiB" if page_bytes else f"{w:,}"
        saved = f"{100 * r['written_saved']:.0f}%" if "written_saved" in r else "-"
        lost = f"{r['hit_rate_lost_points']:.2f}" if "hit_rate_lost_points" in r else "-"
        lines.append(f"{r['admission']:>13} {r['l2_pages']:>9} {r['l3_pages']:>9} {100 * r['hit_rate']:>8.1f}% "
                     f"{r['l2_tokens']:>12,} {r['l3_tokens']:>12,} {wtxt:>13} {saved:>7} {lost:>9} "
                     f"{r.get('ctl_admission_rejected_pages', 0):>9,} {r.get('ctl_admission_rejected_hit_pages', 0):>9,}")
    return "\n".join(lines)


def cmd_admission(args, trace, l2s: list, l3s: list, page_bytes: Optional[int], policy: str, l1) -> int:
    """``tierkv plan --admission``: the replays, then the table or (``--json``) one JSON document."""
    from tierkv.cli_plan import replay

    modes = parse_admissions(args.admission)
    rows = []
    with progress(len(modes) * len(l2s) * len(l3s), "replaying", quiet=args.json, unit="replay") as bar:
        for l3 in l3s:
            for l2 in l2s:
                for mode in modes:
                    r = replay(trace, l2, l3, policy, l1, args.l3_policy, admission=mode)
                    r["admission"] = mode
                    if page_bytes:
                        r["l3_written_bytes"] = r.get("l3_written_pages", 0) * page_bytes
                    rows.append(r)
                    bar.update(1)
    compare(rows)
    if args.json:
        print(json.dumps({"trace": args.trace, "format": trace.kind, "requests": len(trace.requests),
                          "page_size": trace.page_size, "page_bytes": page_bytes, "policy": policy, "l1": l1,
                          "admissions": modes, "results": rows}, indent=1))
        return EXIT_OK
    print(f"{args.trace}: {trace.kind}, {len(trace.requests)} requests, page {trace.page_size} tokens, policy {policy}; "
          "L3 written through its admission (l3.admission); saved / lost pts: L3 writes saved and hit-rate points "
          "lost against always at the same sizes")
    print(format_table(rows, page_bytes))
    return EXIT_OK
