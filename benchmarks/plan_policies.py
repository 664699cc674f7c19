"""Eviction policies on Mooncake's public traces: ``tierkv plan --policy all`` over L2 and L3 sizes from small to large.

Runs the real ``tierkv plan`` command once per trace of ``benchmarks/traces/`` (one request at a time through tierkv's
scheduler side: the radix index evicting in each policy's order, the L3 controller over a store evicting with the
file store's code), collects the hit rate per policy and pair of sizes, and writes
``benchmarks/results/plan_policies.json`` (the commands included) and ``plan_policies.png`` (hit rate against L2
size, one panel per trace and L3 size, one line per policy; dashed: the same L2 policies over an L3 that stays lru,
``--l3-policy lru``). Pages are the traces' 512-token blocks.

Usage: ``python -m benchmarks.plan_policies [--l2 1024,4096,16384] [--l3 0,16384,65536]``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

from benchmarks.plots import quantize_png

HERE = os.path.dirname(os.path.abspath(__file__))
TRACES = ("mooncake_conversation", "mooncake_synthetic")


def run_plan(trace: str, l2: str, l3: str, *extra: str) -> tuple[list[str], dict, float]:
    exe = shutil.which("tierkv", path=os.path.dirname(sys.executable)) or "tierkv"
    cmd = [exe, "plan", trace, "--l2", l2, "--l3", l3, "--policy", "all", *extra, "--json"]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return cmd, json.loads(out), time.perf_counter() - t0


def best(rows: list[dict]) -> dict:
    """Per pair of sizes: the policy with the highest hit rate, and each policy's gain over lru (points)."""
    out = {}
    for key in sorted({(r["l2_pages"], r["l3_pages"]) for r in rows}):
        at = {r["policy"]: r["hit_rate"] for r in rows if (r["l2_pages"], r["l3_pages"]) == key}
        top = max(at, key=lambda p: (round(at[p], 6), p == "lru"))
        out[f"L2 {key[0]} / L3 {key[1]}"] = {"best": top, "vs_lru_points": {p: round(100 * (v - at["lru"]), 2)
                                                                         for p, v in at.items()}}
    return out


def chart(results: dict, path: str, l3_lru: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    l3s = sorted({r["l3_pages"] for d in results.values() for r in d["results"]})
    fig, axes = plt.subplots(len(results), len(l3s), figsize=(4.2 * len(l3s), 3.6 * len(results)), squeeze=False)
    for i, (name, d) in enumerate(results.items()):
        rows = d["results"]
        pols = list(dict.fromkeys(r["policy"] for r in rows))
        for j, l3 in enumerate(l3s):
            ax = axes[i][j]
            for k, pol in enumerate(pols):
                pts = sorted((r["l2_pages"], 100 * r["hit_rate"]) for r in rows
                             if r["l3_pages"] == l3 and r["policy"] == pol)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="os^D"[k % 4], color=f"C{k}", label=pol)
                alt = sorted((r["l2_pages"], 100 * r["hit_rate"]) for r in l3_lru.get(name, {}).get("results", [])
                             if r["l3_pages"] == l3 and r["policy"] == pol and pol != "lru")
                if alt:
                    ax.plot([p[0] for p in alt], [p[1] for p in alt], marker="os^D"[k % 4], color=f"C{k}",
                            linestyle="--", alpha=0.7, label=f"{pol} (L3 lru)")
            l2s = sorted({r["l2_pages"] for r in rows})
            ax.set_xscale("log")
            ax.set_xticks(l2s)
            ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _p: f"{v:,.0f}"))
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_title(f"{name}, L3 {l3:,} pages", fontsize=10)
            ax.set_xlabel("L2 size (pages of 512 tokens)")
            ax.set_ylabel("hit rate (% of lookup tokens)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
    fig.suptitle("tierkv plan: eviction policies on Mooncake's traces (solid: L2 and L3 evict with the same policy; "
                 "dashed: that policy in L2 over an lru L3)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    quantize_png(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--l2", default="1024,4096,16384")
    p.add_argument("--l3", default="0,16384,65536")
    p.add_argument("--out", default=os.path.join(HERE, "results", "plan_policies.json"))
    a = p.parse_args()
    results, meta, l3_lru = {}, {}, {}
    l3_cached = ",".join(x for x in a.l3.split(",") if x.strip() != "0")
    for name in TRACES:
        trace = os.path.relpath(os.path.join(HERE, "traces", f"{name}.jsonl.gz"))
        cmd, out, dt = run_plan(trace, a.l2, a.l3)
        results[name] = out
        meta[name] = {"command": " ".join(["tierkv", *cmd[1:]]), "seconds": round(dt, 1), "best": best(out["results"])}
        if l3_cached:
            cmd2, out2, dt2 = run_plan(trace, a.l2, l3_cached, "--l3-policy", "lru")
            l3_lru[name] = out2
            meta[name]["l3_lru"] = {"command": " ".join(["tierkv", *cmd2[1:]]), "seconds": round(dt2, 1),
                                    "best": best(out2["results"])}
        print(f"{name}: {dt:.0f} s", file=sys.stderr)
        for r in out["results"]:
            print(f"  {r['policy']:>7} L2 {r['l2_pages']:>6} L3 {r['l3_pages']:>6} {100 * r['hit_rate']:6.2f} %",
                  file=sys.stderr)
    doc = {"what": "hit rate per eviction policy and pair of sizes, tierkv plan on Mooncake's public traces",
           "page_tokens": 512, "runs": meta, "results": results, "results_l3_lru": l3_lru}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    chart(results, a.out[:-len(".json")] + ".png", l3_lru)
    print(f"wrote {a.out} and {a.out[:-len('.json')]}.png", file=sys.stderr)


if __name__ == "__main__":
    main()
