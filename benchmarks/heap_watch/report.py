"""What a memray capture (``sitecustomize.py`` of this folder) allocated and had not freed when recording stopped,
summed by Python stack: the candidates for memory a long run keeps.

    python -m benchmarks.heap_watch.report DIR/memray-<pid>.bin [--frames 6] [--top 12]

memray must be importable, or its ``pip install --target`` folder named by ``TIERKV_HEAP_WATCH_MEMRAY``. Allocations made by C code (libraries, vLLM's
kernels) are filed under the Python frames that called into it; those with no Python frame at all (threads of C
libraries) under ``(no Python stack)``.
"""
from __future__ import annotations

import argparse
import json
from collections import Counter


def _short(path: str) -> str:
    """A source path from its package on (``.../site-packages/vllm/model_executor/layers/linear.py`` ->
    ``vllm/model_executor/layers/linear.py``); other paths by their last two parts."""
    parts = path.split("/")
    for i in range(len(parts) - 2, -1, -1):
        if parts[i] in ("site-packages", "dist-packages"):
            return "/".join(parts[i + 1:])
    return "/".join(parts[-2:])


def leaked_by_stack(path: str, frames: int = 6, top: int = 12) -> dict:
    """``{"allocations": n, "mib": MiB, "top": [{"mib", "allocations", "stack"}, ...]}`` of the allocations in the
    capture ``path`` not freed by its end; ``stack`` is the innermost ``frames`` Python frames, innermost first,
    as ``file:line`` (:func:`_short` paths)."""
    from benchmarks.heap_watch.sitecustomize import import_memray

    FileReader = import_memray().FileReader

    size: Counter = Counter()
    count: Counter = Counter()
    for rec in FileReader(path).get_leaked_allocation_records(merge_threads=True):
        st = rec.stack_trace(max_stacks=frames)
        key = " <- ".join(f"{_short(fname)}:{line}" for _fn, fname, line in st) or "(no Python stack)"
        size[key] += rec.size
        count[key] += rec.n_allocations
    return {"allocations": sum(count.values()), "mib": round(sum(size.values()) / 2**20, 2),
            "top": [{"mib": round(v / 2**20, 2), "allocations": count[k], "stack": k} for k, v in size.most_common(top)]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("capture")
    ap.add_argument("--frames", type=int, default=6)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args(argv)
    print(json.dumps(leaked_by_stack(args.capture, args.frames, args.top), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
