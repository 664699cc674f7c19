"""serve_cpu's ``trace`` workload: a window of Mooncake's public conversation trace, replayed as vLLM's ``timed_trace``.

``benchmarks/traces/mooncake_conversation.jsonl.gz`` gives each request one hash id per 512-token block (equal ids =
equal prefixes). :func:`to_timed_trace` scales it to this machine: each id becomes one 32-token chunk (one page of
:data:`~benchmarks.serve_cpu.configs.BLOCK` tokens), a request keeps its leading ids up to what fits
``max_model_len`` less its output, and ids are offset by ``seed * 10**9`` as the multiturn traces are, so runs of one
server share no page while equal ids still give equal chunks. :func:`window` picks the requests: from ``tr_offset``
on, those of one conversation in ``tr_sample`` (a request's first id after the shared one, hashed), until
``tr_requests``: whole conversations, so every reuse between kept requests survives while the reuse distance shrinks
about ``tr_sample``-fold (consecutive requests of the trace share few pages: turns are minutes apart).
"""
from __future__ import annotations

import functools
import gzip
import json
from pathlib import Path

from benchmarks.harness import REPO
from benchmarks.make_multiturn_trace import CHUNK, ID_STRIDE

MOONCAKE = REPO / "benchmarks" / "traces" / "mooncake_conversation.jsonl.gz"


@functools.lru_cache(maxsize=2)
def load(path: Path = MOONCAKE) -> tuple[dict, ...]:
    """The trace's requests in order (``timestamp`` in ms, ``input_length``, ``output_length``, ``hash_ids``)."""
    with gzip.open(path, "rt") as f:
        return tuple(json.loads(line) for line in f if line.strip())


def conversation_key(ids: list[int]) -> int:
    """What marks a request's conversation: its first id after the one every request shares (its only id if none)."""
    return ids[min(1, len(ids) - 1)]


def window(rows, *, offset: int, requests: int, sample: int) -> list[tuple[int, list[int]]]:
    """``(index in the trace, hash ids)`` of the ``requests`` requests from ``offset`` on whose conversation key hashes
    to 0 modulo ``sample`` (Knuth's multiplicative hash: keys are assigned in order). Raises ValueError when the
    trace ends first."""
    if offset < 0 or requests < 1 or sample < 1:
        raise ValueError("offset >= 0, requests >= 1, sample >= 1")
    out = []
    for i in range(offset, len(rows)):
        ids = rows[i]["hash_ids"]
        if ids and (conversation_key(ids) * 2654435761) % (1 << 32) % sample == 0:
            out.append((i, list(ids)))
            if len(out) == requests:
                return out
    raise ValueError(f"the trace has {len(out)} requests of one conversation in {sample} from {offset} on, "
                     f"not {requests}")


def to_timed_trace(picked: list[tuple[int, list[int]]], *, seed: int, max_model_len: int,
                   output_len: int) -> list[dict]:
    """vLLM ``timed_trace`` rows of :func:`window`'s requests: id ``h`` -> chunk ``seed * 10**9 + h``, at most
    ``(max_model_len - output_len) // 32`` chunks, every chunk full. Deterministic; ``trace_index`` is for readers."""
    pages = (max_model_len - output_len) // CHUNK
    if seed < 0 or output_len < 1 or pages < 1:
        raise ValueError("seed >= 0, output_len >= 1, and max_model_len must leave one page for the prompt")
    rows = []
    for i, ids in picked:
        if max(ids) >= ID_STRIDE:
            raise ValueError(f"trace id {max(ids)} does not fit one seed's id range ({ID_STRIDE})")
        cut = [seed * ID_STRIDE + h for h in ids[:pages]]
        rows.append({"timestamp": 0.0, "input_length": CHUNK * len(cut), "output_length": output_len,
                     "hash_ids": cut, "trace_index": i})
    return rows


def make_trace(p: dict, seed: int) -> list[dict]:
    """The ``trace`` workload's rows for sizes ``p`` (``tr_offset``, ``tr_requests``, ``tr_sample``,
    ``tr_output_len``, ``max_model_len``) and run seed ``seed``."""
    picked = window(load(), offset=p["tr_offset"], requests=p["tr_requests"], sample=p["tr_sample"])
    return to_timed_trace(picked, seed=seed, max_model_len=p["max_model_len"], output_len=p["tr_output_len"])


def reuse_stats(rows: list[dict]) -> dict:
    """What the window asks of the cache: requests, prompt pages (all / distinct), the tokens of pages an earlier
    request of the window already sent (reusable if still cached: with Mooncake's ids a repeated id has a repeated
    prefix) and the span of the trace it covers."""
    pages = sum(len(r["hash_ids"]) for r in rows)
    distinct = len({h for r in rows for h in r["hash_ids"]})
    return {"requests": len(rows), "prompt_pages": pages, "distinct_pages": distinct,
            "reusable_tokens": CHUNK * (pages - distinct),
            "trace_indices": [rows[0]["trace_index"], rows[-1]["trace_index"]] if rows else None}
