"""How many engine steps does an L3 hit wait in the real engine? Counts, not timings: the scheduler side's
``l3_hit_wait_steps`` histogram (plans built from the step whose lookup found the hit to the step whose output named
its load ended; an L2 hit waits 0, an L3 hit at least 1 with vLLM's CPU backend, which schedules synchronously) and the
worker's ``read_waits`` / ``read_wait_timeouts`` (steps whose ``get_finished`` found a read it started still running).

One engine subprocess per phase (``tests/helpers/engine.py``, vLLM's CPU backend, the ``test`` preset of
``examples/make_tiny_model.py`` unless ``--preset``), all phases on one file L3 (``write_through``):

1. ``write``: ``docs`` documents of ``doc_pages`` pages, each with a question, computed and backed up to L3.
2. ``hits_1`` .. ``hits_<rounds>``: a fresh engine (empty L1 and L2) gets, in one ``LLM.generate`` call, the same
   documents with new questions (L3 hits, existence answered in the scheduler) and ``misses`` new documents that
   compute while the hits are read.

    .venv/bin/python -m benchmarks.l3_wait_steps    # prints one JSON object: the counts per phase
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

from benchmarks import harness

REPO = Path(__file__).resolve().parent.parent
PAGE = 32
WORKER_KEYS = ("read_waits", "read_wait_timeouts", "read_wait_seconds", "l3_prefetch_pages", "l3_prefetch_seconds")
KEYS = ("l3_hits", "l3_hit_wait_steps", "l3_hit_wait_steps_1", "l3_hit_wait_steps_2", "l3_hit_wait_steps_3_4",
        "l3_hit_wait_steps_5_8", "l3_hit_wait_steps_9_plus", "ctl_l3_hit_tokens", "ctl_lookups_deferred")


engine = harness.e2e_engine()
make_tiny_model = harness.make_tiny_model()


def doc(rng: random.Random, pages: int) -> list[int]:
    """``pages`` pages of token ids drawn from 100..999."""
    return [rng.randrange(100, 1000) for _ in range(pages * PAGE)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="test")
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--doc-pages", type=int, default=8)
    ap.add_argument("--misses", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args(argv)
    model_dir = make_tiny_model.make_model(REPO / "runs" / "serve_cpu" / "models" / a.preset, a.preset)
    rng = random.Random(19)
    docs = [doc(rng, a.doc_pages) for _ in range(a.docs)]
    work = Path(tempfile.mkdtemp(prefix="tierkv-l3-wait-"))
    extra = {"host_pool": {"num_pages": 4 * a.docs * a.doc_pages},
             "l3": {"backend": "file", "file": {"root": str(work / "l3")}}}
    kvc = engine.tierkv_kv_config(extra, load_failure_policy="recompute")
    out = {"preset": a.preset, "docs": a.docs, "doc_pages": a.doc_pages, "misses": a.misses}
    phases = [("write", [d + [7, 8, 9] for d in docs])]
    for r in range(a.rounds):
        q = 11 + 2 * r
        phases.append((f"hits_{r + 1}", [d + [q, q + 1] for d in docs] + [doc(rng, a.doc_pages) + [5]
                                                                          for _ in range(a.misses)]))
    for name, prompts in phases:
        res = engine.run_job(model_dir, [{"name": name, "prompts": prompts, "sequential": False}],
                             kv_transfer_config=kvc, num_gpu_blocks_override=512, max_tokens=a.max_tokens,
                             workdir=work / name)
        roles = engine.stats_by_role(res)
        out[name] = {k: roles["scheduler"].get(k, 0) for k in KEYS}
        out[name].update({k: roles["worker"].get(k, 0) for k in WORKER_KEYS})
        out[name]["cached_tokens"] = res["workloads"][name]["num_cached_tokens"]
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
