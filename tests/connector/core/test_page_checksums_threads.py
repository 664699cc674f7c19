"""SlotChecksums is written by the worker's step and by the L3 readers at once: an entry is never seen half
written (the key of one page with the checksum of another)."""
from __future__ import annotations

import sys
import threading

from tierkv.connector.core.page_checksums import SlotChecksums

A, B = b"\xaa" * 16, b"\xbb" * 16


def torn_reads(table: SlotChecksums, rounds: int = 20000) -> int:
    """A writer alternates slot 0 between (A, 1) and (B, 2) while this thread reads A's entry; returns how many
    reads saw A with B's checksum."""
    stop = threading.Event()

    def writer():
        while not stop.is_set():
            table.record(0, A, 1)
            table.record(0, B, 2)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)   # switch threads as often as the interpreter allows: races show up at once
    t = threading.Thread(target=writer)
    t.start()
    torn = 0
    try:
        for _ in range(rounds):
            torn += table.get(0, A) not in (None, 1)
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)
    return torn


def test_no_read_sees_a_half_written_entry():
    assert torn_reads(SlotChecksums(4)) == 0
