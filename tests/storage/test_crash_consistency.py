"""Crash consistency under load: 8 writer processes (an engine's workers) write the same keys at once to the file
L3 and to the tierkv server and are all SIGKILLed in the middle of their writes; the store is then opened again
(the file store rescans its directory; the server is the same process) and every hit must be a whole page one
writer wrote, bit for bit: a torn, mixed or foreign page is never loaded."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from tests.helpers import fixtures_file as FF
from tests.helpers import fixtures_zmq as FZ
from tests.helpers import hostile as H
from tests.helpers.contract_workers import check

PB = 64 << 10
NS = bytes(range(80, 96))
WRITERS, KEYS = 8, 32


@pytest.mark.parametrize("fixtures", [FF, FZ], ids=["file", "zmq"])
def test_sigkill_of_every_writer_mid_write_never_leaves_a_wrong_page(tmp_path, fixtures):
    keys = [f"{0xc0de:08x}{i:024x}" for i in range(KEYS)]
    with fixtures.make_backend(tmp_path, PB, NS) as h:
        ctx = mp.get_context("spawn")
        progress = ctx.Array("i", WRITERS)
        procs = [ctx.Process(target=H.crash_writer, args=(h.client_factory(), keys, w, PB, progress, 100_000),
                             daemon=True) for w in range(WRITERS)]
        for p in procs:
            p.start()
        try:
            t_end = time.monotonic() + 120
            while min(progress[:]) < 2 and time.monotonic() < t_end:  # every writer is well into its loop
                time.sleep(0.02)
            assert min(progress[:]) >= 2, list(progress[:])
        finally:
            for p in procs:  # all at once, wherever each one is
                if p.pid is not None and p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
            for p in procs:
                p.join(30)
        assert all(p.exitcode == -signal.SIGKILL for p in procs), [p.exitcode for p in procs]
        reader = h.restart() if fixtures is FF else h.new_client()  # the file store rescans its directory
        dst = [torch.zeros(PB, dtype=torch.uint8) for _ in keys]
        hits = reader.batch_get(keys, dst)
        assert sum(hits) >= KEYS // 2, hits
        for i, (hit, d) in enumerate(zip(hits, dst)):
            if hit:
                ok, w, r = check(d.numpy().tobytes(), i, PB)
                assert ok and w < WRITERS, (i, w, r)
        if fixtures is FF:  # the killed writers' temporary files are gone after the rescan
            leftovers = [f for _d, _s, fs in os.walk(str(tmp_path)) for f in fs if f.startswith(".tmp.")]
            assert not leftovers, leftovers[:5]
