"""Render the markdown tables of ``benchmarks/README.md`` from the committed result files.

    .venv/bin/python -m benchmarks.tables transfer     # from results/transfer.json
(``benchmarks/storage.py`` and ``benchmarks/e2e_cpu.py`` print their own tables.)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def transfer() -> str:
    d = json.loads((RESULTS / "transfer.json").read_text())
    nt = any(r.get("nt_copy_gbps") for r in d["rows"])
    out = [f"Measured {d['time']}; kernels: {d.get('impl', '?')}; reference: {d['reference']}.", "",
           "| device layout | host layout | direction | pages | block ids | tierkv GB/s | copy_ GB/s | ratio | target |"
           + (" non-temporal copy GB/s |" if nt else ""),
           "|---|---|---|---|---|---|---|---|---|" + ("---|" if nt else "")]
    for r in d["rows"]:
        ok = "ok" if r["meets_target"] else "MISSED"
        out.append(f"| {r['device_layout']} | {r['layout']} | {r['direction']} | {r['pages']} | {r['ids']} | "
                   f"{r['gbps']:.2f} | {r['copy_gbps']:.2f} | {r['ratio']:.0%} | {r['target']:.0%} {ok} |"
                   + (f" {r['nt_copy_gbps']:.2f} |" if nt and r.get("nt_copy_gbps") else (" |" if nt else "")))
    lw = d.get("layerwise")
    if lw:
        keys = [k for k in ("load_ms", "compute_ms", "sequential_ms", "layerwise_ms") if k in lw]
        if keys:
            out += ["", "Layer-wise load: " + ", ".join(f"{k} {lw[k]:.1f}" for k in keys)]
    return "\n".join(out)


if __name__ == "__main__":
    print({"transfer": transfer}[sys.argv[1]]())
