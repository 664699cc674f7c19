"""Process bodies for the multi-process contract test (importable by spawned children).

A page written by writer ``w`` in round ``r`` for key index ``i`` is ``tag || rng(tag).bytes(...)`` with
``tag = struct.pack("<QQQ", w, r, i)`` (24 bytes): a reader that gets a hit recomputes the whole page from its
tag, so a torn page, a mix of two writers' pages or another key's page shows up as a mismatch.
"""
from __future__ import annotations

import struct

import numpy as np

TAG = struct.Struct("<QQQ")


def page(writer: int, rnd: int, idx: int, page_bytes: int) -> bytes:
    tag = TAG.pack(writer, rnd, idx)
    seed = int.from_bytes(tag[:8], "little") * 1_000_003 + rnd * 7919 + idx
    return tag + np.random.default_rng(seed).bytes(page_bytes - TAG.size)


def check(buf: bytes, idx: int, page_bytes: int) -> tuple[bool, int, int]:
    """(page is a complete page of key ``idx``, writer, round)."""
    w, r, i = TAG.unpack_from(buf, 0)
    if i != idx or w > 64 or r > 1_000_000:
        return False, w, r
    return bytes(buf) == page(w, r, i, page_bytes), w, r


def writer(factory, keys: list[str], writer_id: int, rounds: int, page_bytes: int, start, out, read_once) -> None:
    """Write every key ``rounds`` times; half way, wait until the reader has completed a pass (so reads really
    interleave with the writes; a reader that never gets there fails the writer)."""
    store = factory()
    ok = 0
    start.wait(timeout=120)  # every process has its client: writes overlap with reads
    try:
        for r in range(rounds):
            if r == rounds // 2 and not read_once.wait(timeout=120):
                raise AssertionError("the reader completed no pass while the writers were half way")
            res = store.batch_set(keys, [page(writer_id, r, i, page_bytes) for i in range(len(keys))])
            ok += sum(res)
    finally:
        store.close()
    out.put(("writer", writer_id, ok))


def reader(factory, keys: list[str], reader_id: int, page_bytes: int, start, stop, out, read_once) -> None:
    """Read every key until ``stop`` (then one more pass); reports hits, bad pages, passes and the passes that
    started before ``stop`` (while writers may still write) and the hits in those."""
    import torch

    store = factory()
    hits = bad = passes = during = hits_during = 0
    dsts = [torch.zeros(page_bytes, dtype=torch.uint8) for _ in keys]
    start.wait(timeout=120)
    try:
        while True:
            last = stop.is_set()  # one full pass after the writers are done
            res = store.batch_get(keys, dsts)
            for i, (r, d) in enumerate(zip(res, dsts)):
                if r:
                    hits += 1
                    hits_during += not last
                    good, _, _ = check(d.numpy().tobytes(), i, page_bytes)
                    bad += not good
            passes += 1
            during += not last
            read_once.set()
            if last:
                break
    finally:
        store.close()
    out.put(("reader", reader_id, hits, bad, passes, during, hits_during))
