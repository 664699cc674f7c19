"""``tierkv plan`` models L2 and L3 as the engine runs them: a small timed_trace replayed by the planner and run
through the engine's own scheduler side, controller, L3 I/O threads and a real file store of the same capacity
(the fake engine, no vLLM) gives the same L2 and L3 hit tokens, L3 recency included (an L2 hit does not refresh a
page in L3)."""
from __future__ import annotations

import json
import random

import pytest

from tests.helpers.fake_engine import P, FakeEngine, Req
from tierkv.cli_plan import read_trace, replay
from tierkv.storage_backends.file.store import FileStore
from tierkv.storage_backends.page_format import HEADER_BYTES


def trace_rows(seed: int = 3, requests: int = 40) -> list[dict]:
    """Conversations over a few shared documents: each request is a document's chunks and some of its own, so the
    same prefixes come back at varied distances."""
    rng = random.Random(seed)
    docs = [list(range(100 * d, 100 * d + rng.randrange(2, 5))) for d in range(6)]
    rows, nid = [], 10_000
    for i in range(requests):
        ids = list(docs[min(5, int(rng.expovariate(0.6)))]) + list(range(nid, nid + rng.randrange(1, 3)))
        nid += 10
        rows.append({"timestamp": i, "input_length": P * len(ids), "output_length": 1, "hash_ids": ids})
    return rows


def tokens_of(ids: list[int]) -> list[int]:
    """The prompt a hash id list stands for: chunk ``h`` is P tokens determined by ``h`` alone."""
    return [t for h in ids for t in range(h * P, h * P + P)]


def run_engine(tmp_path, rows, l2_pages: int, l3_pages: int) -> dict:
    def store(rank, ns, page_bytes):
        return FileStore(ns, page_bytes, root=str(tmp_path / "l3"),
                         capacity_bytes=l3_pages * (HEADER_BYTES + page_bytes))

    e = FakeEngine(num_blocks=64, num_slots=l2_pages, store=store)
    try:
        for i, r in enumerate(rows):
            e.run_l3(Req(f"q{i}", tokens_of(r["hash_ids"])))
            e.settle()  # the planner's write-through is instant: every backup lands before the next request
        e.idle_check()
        return dict(e.sched.lookup_stats.tokens)
    finally:
        e.close()


@pytest.mark.parametrize("l2_pages,l3_pages", [(4, 16), (8, 16), (12, 16), (8, 40)])
def test_planner_and_engine_hit_the_same_tiers(tmp_path, l2_pages, l3_pages):
    rows = trace_rows()
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plan = replay(read_trace(str(path), output_pages=False), l2_pages, l3_pages)
    got = run_engine(tmp_path, rows, l2_pages, l3_pages)
    assert (got["l2"], got["l3"]) == (plan["l2_tokens"], plan["l3_tokens"]), (got, plan)
    assert plan["l2_tokens"] > 0 and plan["miss_tokens"] > 0


def test_a_larger_l2_can_lower_the_hit_rate_at_a_fixed_l3(tmp_path):
    """The engine's rule, as the planner replays it: pages hot in L2 are not refreshed in L3, age out of it, and are
    gone from both tiers once L2 drops them; with 4 L2 pages they are read from L3 (which refreshes them) instead."""
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in trace_rows()))
    trace = read_trace(str(path), output_pages=False)
    small, larger = replay(trace, 4, 16), replay(trace, 8, 16)
    assert small["hit_rate"] > larger["hit_rate"] and small["l3_tokens"] > larger["l3_tokens"]
