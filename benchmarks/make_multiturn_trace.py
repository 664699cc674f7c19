"""Seeded multi-turn conversations in vLLM's ``timed_trace`` dataset format (``vllm bench serve --dataset-name
timed_trace``), for ``benchmarks/serve_cpu``.

The format (``vllm/benchmarks/datasets/datasets.py``, class ``TimedTrace``, vLLM 0.32): a JSONL file, one request
per line, with ``timestamp`` (seconds, multiplied by ``--timed-trace-sec-multiplier``), ``input_length``,
``output_length`` and ``hash_ids``. Each hash id stands for one chunk of ``--timed-trace-chunk-hash-size`` tokens
(32 here: one vLLM block / tierkv page); vLLM turns it into tokens drawn by ``random.Random(hash(f"{id}:{size}") &
0xFFFFFFFF)`` from the tokenizer's vocabulary, so equal ids give equal tokens *within one client process*, and
equal tokens across processes only when ``PYTHONHASHSEED`` is fixed (Python salts ``hash()`` of a string per
process otherwise). The prompt is the chunks in order, cut at ``input_length``; other keys of a line are ignored by
vLLM (this file adds ``conversation`` and ``turn`` for readers).

Conversations: ``--conversations`` of ``--turns`` turns. Turn 1 is ``--system-chunks`` chunks shared by every
conversation (a system prompt; 0 = none) plus ``--first-chunks`` chunks of the conversation's own; each later turn
is the previous turn's whole prompt plus ``--turn-chunks`` new chunks (the assistant's answer and the next user
message, both synthetic: the model's real output is not fed back). So turn t's prompt is a strict prefix of turn
t+1's, every chunk is full (``input_length`` = 32 x chunks) and only whole pages are reused.

Order (what makes a small L1 forget): turn-major, conversations in the same order every turn: turn 1 of every
conversation, then turn 2 of every conversation, ... The reuse distance of a conversation's prefix is therefore
exactly ``conversations`` requests, whose prompts hold ``sum of the other conversations' prompt chunks`` blocks:
an engine whose prefix cache (L1) holds fewer blocks than that has evicted the prefix (LRU) by the next turn,
while a second tier that holds the whole trace still has it. ``timestamp`` = request index x ``--interval-s``
(for ``--self-timed`` replays; ``serve_cpu.py`` replays closed-loop with ``--no-self-timed --max-concurrency``).

Hash ids are ``seed * 10**9 + k`` (k = 0, 1, ...): traces of different seeds share no chunk (the system chunks
are per seed too), and the same arguments always give the same file, byte for byte.

    .venv/bin/python -m benchmarks.make_multiturn_trace --out /tmp/trace.jsonl --seed 1 \\
        --conversations 16 --turns 3 --first-chunks 8 --turn-chunks 2 --output-len 8
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

CHUNK = 32
ID_STRIDE = 10 ** 9


def make_trace(*, seed: int, conversations: int, turns: int, first_chunks: int, turn_chunks: int,
               output_len: int, system_chunks: int = 0, interval_s: float = 0.0) -> list[dict]:
    """The trace as a list of dicts, in request order (see the module docstring). Deterministic in its arguments."""
    if seed < 0 or conversations < 1 or turns < 1 or first_chunks < 1 or turn_chunks < 1 or output_len < 1:
        raise ValueError("seed >= 0; conversations, turns, first_chunks, turn_chunks, output_len >= 1")
    if system_chunks < 0:
        raise ValueError("system_chunks >= 0")
    total = system_chunks + conversations * (first_chunks + (turns - 1) * turn_chunks)
    if total >= ID_STRIDE:
        raise ValueError(f"{total} chunks do not fit one seed's id range ({ID_STRIDE})")
    next_id = seed * ID_STRIDE

    def new_ids(n: int) -> list[int]:
        nonlocal next_id
        out = list(range(next_id, next_id + n))
        next_id += n
        return out

    system = new_ids(system_chunks)
    prompts = [system + new_ids(first_chunks) for _ in range(conversations)]
    rows = []
    for t in range(turns):
        if t:
            prompts = [p + new_ids(turn_chunks) for p in prompts]
        for c, ids in enumerate(prompts):
            rows.append({"timestamp": round(len(rows) * interval_s, 6), "input_length": CHUNK * len(ids),
                         "output_length": output_len, "hash_ids": list(ids), "conversation": c, "turn": t + 1})
    return rows


def write_trace(path: str | Path, rows: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))
    return path


def reuse_stats(rows: list[dict]) -> dict:
    """What the trace asks of the cache: requests, prompt blocks (all / distinct), the tokens of later turns that
    repeat the conversation's previous prompt (reusable if still cached), and per later turn the blocks of the
    other requests sent between the conversation's previous turn and this one (what L1 must hold for the prefix
    to survive there; min and max over the trace)."""
    last: dict[int, int] = {}
    gaps, reusable = [], 0
    for i, r in enumerate(rows):
        c = r["conversation"]
        if c in last:
            gaps.append(sum(len(x["hash_ids"]) for x in rows[last[c] + 1:i]))
            reusable += CHUNK * len(rows[last[c]]["hash_ids"])
        last[c] = i
    return {"requests": len(rows), "prompt_blocks": sum(len(r["hash_ids"]) for r in rows),
            "distinct_blocks": len({h for r in rows for h in r["hash_ids"]}), "reusable_tokens": reusable,
            "reuse_gap_blocks_min": min(gaps) if gaps else None, "reuse_gap_blocks_max": max(gaps) if gaps else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSONL file to write")
    ap.add_argument("--seed", type=int, default=0, help="trace seed (hash ids seed*1e9+k; default 0)")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--first-chunks", type=int, default=8, help="32-token chunks of a conversation's first turn")
    ap.add_argument("--turn-chunks", type=int, default=2, help="32-token chunks each later turn adds")
    ap.add_argument("--system-chunks", type=int, default=0, help="32-token chunks shared by all conversations")
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--interval-s", type=float, default=0.0, help="timestamp step between requests (s)")
    args = ap.parse_args(argv)
    rows = make_trace(seed=args.seed, conversations=args.conversations, turns=args.turns,
                      first_chunks=args.first_chunks, turn_chunks=args.turn_chunks, output_len=args.output_len,
                      system_chunks=args.system_chunks, interval_s=args.interval_s)
    write_trace(args.out, rows)
    print(json.dumps({"out": args.out, **reuse_stats(rows)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
