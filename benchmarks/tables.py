"""Draw the ``transfer`` table of ``benchmarks/README.md`` from its result file (the other benchmarks print theirs).

    .venv/bin/python -m benchmarks.tables transfer     # from results/transfer.json

One row per (device layout, host layout): GB/s ranges of each direction over batch sizes and block-id patterns,
the ratio to a plain ``copy_`` and to a non-temporal copy of the same bytes, and the cells that meet the target.
"""
from __future__ import annotations

import sys

from benchmarks.harness import RESULTS
from benchmarks.harness.results import load_result


def _span(xs, fmt: str) -> str:
    return f"{min(xs):{fmt}}-{max(xs):{fmt}}"


def transfer(data: dict | None = None) -> str:
    """The README's transfer table of ``data`` (default: the committed ``results/transfer.json``)."""
    d = load_result(RESULTS / "transfer.json") if data is None else data
    groups: dict[tuple, list[dict]] = {}
    for r in d["rows"]:
        groups.setdefault((r["device_layout"], r["layout"]), []).append(r)
    out = ["| device layout | host layout | target | L1->L2 GB/s | L2->L1 GB/s | vs `copy_` | vs non-temporal copy | "
           "cells meeting target |", "|---|---|---|---|---|---|---|---|"]
    for (dev, host), rows in groups.items():
        save = [r["gbps"] for r in rows if r["direction"] == "L1->L2"]
        load = [r["gbps"] for r in rows if r["direction"] == "L2->L1"]
        nt = [r["gbps"] / r["nt_copy_gbps"] for r in rows if r.get("nt_copy_gbps")]
        out.append(f"| {dev} | {host} | {rows[0]['target']:.0%} | {_span(save, '.1f')} | {_span(load, '.1f')} | "
                   f"{_span([r['ratio'] for r in rows], '.0%')} | {_span(nt, '.0%') if nt else '-'} | "
                   f"{sum(r['meets_target'] for r in rows)} of {len(rows)} |")
    return "\n".join(out)


if __name__ == "__main__":
    print({"transfer": transfer}[sys.argv[1]]())
