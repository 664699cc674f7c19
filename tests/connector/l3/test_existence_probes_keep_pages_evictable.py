"""Existence probes do not pin pages: the file store and the ZMQ server do not refresh recency on a
probe, and tierkv does not keep probing Mooncake objects it does not read (a probe grants a lease)."""
from __future__ import annotations

import random
import time

import pytest
import torch

from tests.helpers.fake_engine import P, FakeEngine
from tierkv.connector.l3.io import l3_key



from tests.helpers.l3_scenarios import (keys_of, l3io, pump, toks)

def _fixture(kind):
    import importlib
    return importlib.import_module(f"tests.helpers.fixtures_{kind}")


@pytest.mark.parametrize("kind", ["file", "zmq"])
def test_probes_do_not_refresh_recency_and_a_full_store_still_takes_every_write(tmp_path, kind):
    """Existence probes must not pin objects, or eviction finds nothing. The rule for the file store and the ZMQ
    server: an existence query changes nothing (no lease, no recency); a read makes a page most recently used. A store
    of 16 pages at capacity whose every page is probed over and over (with absent keys mixed in) but only pages 0-1
    are read takes all 8 new writes, and its victims are exactly the 8 least recently *read or written* pages (2-9),
    probed or not."""
    pb = 4096
    (tmp_path / kind).mkdir()
    with _fixture(kind).make_backend(tmp_path / kind, pb, bytes(16), capacity_pages=16) as h:
        assert h.capacity_pages == 16
        st = h.backend
        rng = random.Random(38)
        ks = [rng.randbytes(16).hex() for _ in range(34)]
        src = [torch.full((pb,), i, dtype=torch.uint8) for i in range(24)]
        for i in range(16):
            assert st.batch_set([ks[i]], [src[i]]) == [True]
        dst = [torch.zeros(pb, dtype=torch.uint8) for _ in range(2)]
        for _ in range(20):
            assert st.batch_exists(ks[:16]) == 16
            assert st.batch_exists(ks[24:34]) == 0
            assert st.batch_exists(list(reversed(ks[:16]))) == 16
            assert st.batch_get(ks[:2], dst) == [True, True]
        assert [st.batch_set([ks[i]], [src[i]]) for i in range(16, 24)] == [[True]] * 8
        assert [st.batch_exists([k]) for k in ks[:24]] == [1, 1] + [0] * 8 + [1] * 14
        out = [torch.zeros(pb, dtype=torch.uint8) for _ in range(24)]
        got = st.batch_get(ks[:24], out)
        assert all(torch.equal(out[i], src[i]) for i in range(24) if got[i])


MC_PROMPTS, MC_PAGES = 28, 120          # 3,360 pages of 4 KiB (+ 64 B header) fill ~83 % of a 16 MiB segment
MC_LEASE_MS = 300                       # the master's default_kv_lease_ttl (10 s by default): short, for a fast test


def _mooncake_probe_run(tmp_path, first_absent: bool):
    """A real Mooncake master (lease ``MC_LEASE_MS``) with one 16 MiB segment, an engine whose L3 is that store, and
    28 prompts of 120 pages written by an earlier engine (with ``first_absent``: page 0 of each is missing). Traffic:
    every prompt is looked up again and again for 3 lease times (at least) while a writer gets 128 pages of 256 KiB
    accepted (four times the segment);
    every L3 hit is declined as slower than recomputing, so probed pages are never read. Returns (existence jobs
    the engine sent, old pages still in the store, writes accepted, writes tried)."""
    import numpy as np
    (tmp_path / "mc").mkdir()
    now = [0.0]
    mc = _fixture("mooncake")
    with mc.make_backend(tmp_path / "mc", 4096, bytes(16), global_segment_size=16 << 20,
                         master_args=("-default_kv_lease_ttl", str(MC_LEASE_MS))) as h:
        e = FakeEngine(store=lambda rank, ns, pb: h.new_client(namespace=ns), clock=lambda: now[0],
                       controller={"probe_interval_s": 1e9, "negative_ttl_s": 2.0})
        st, ns = l3io(e).store, l3io(e).rank_namespace
        prompts = [toks(1_000_000 * (i + 1), MC_PAGES * P) for i in range(MC_PROMPTS)]
        old = []
        for p in prompts:
            ks = [l3_key(ns, k) for k in keys_of(e, p)]
            old += ks[1:]
            put = ks[1:] if first_absent else ks
            assert all(st.batch_set(put, [torch.zeros(4096, dtype=torch.uint8)] * len(put)))
        ctl = e.sched.ctl
        ctl.fetch_s_per_page.add(1.0)                      # 1 s per page vs 0.1 ms per token: every hit declined
        ctl.observe_prefill(1.0, 10_000)
        n = [0]

        def traffic():
            now[0] += 2.1                                  # past negative_ttl_s: an absent page may be asked again
            for p in prompts:
                rid = f"q{n[0]}"
                n[0] += 1
                e.sched.add_request(rid, p + [1])
                assert e.sched.lookup(rid, 0) in (None, 0)
                e.sched.on_finished(rid)
            pump(e)
        traffic()
        writer = h.backend.client                         # another client's writes (raw Mooncake puts)
        rng = np.random.default_rng(38)
        big = bytes(256 << 10)
        ok = tried = 0
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3 * MC_LEASE_MS / 1000 or ok < 256:   # 256 accepted: four times the segment
            assert time.monotonic() - t0 < 30, f"only {ok} of {tried} writes accepted"
            traffic()
            res = [writer.upsert(f"probe-writer/{rng.bytes(16).hex()}", big) == 0 for _ in range(4)]
            ok, tried = ok + sum(res), tried + len(res)
        assert l3io(e).counters.prefetch_jobs == 0         # nothing was read
        assert first_absent or ctl.counters.l3_declined_slow_pages > 0
        exists_jobs = l3io(e).counters.exists_jobs
        left = sum(1 for r in st.client.batch_is_exist([st.object_name(k) for k in old]) if r == 1)
        e.close()
    return exists_jobs, left, ok, tried


def test_mooncake_pages_probed_but_not_read_stay_evictable(tmp_path):
    """The same with a real Mooncake master. Mooncake's ``batch_is_exist`` (tierkv's ``MooncakeStore.batch_exists``)
    grants a read lease on every object it finds, and eviction skips leased objects. tierkv asks L3 about a page
    only while its index does not know it: a found page is indexed (L3-only) and never probed again, however many
    requests look it up. So pages probed once and then not read (every hit declined) lose their lease after
    ``default_kv_lease_ttl`` and eviction takes them: after writes of four times the segment, (almost) none of the 3,332
    old pages is left, and the engine sent one existence query per prompt."""
    exists_jobs, left, ok, tried = _mooncake_probe_run(tmp_path, first_absent=False)
    assert exists_jobs == MC_PROMPTS
    assert left <= MC_PROMPTS * (MC_PAGES - 1) // 10, f"{left} probed-but-unread pages were never evicted"
    assert ok > 0


def test_mooncake_pages_after_an_absent_page_are_not_kept_leased_by_repeated_probes(tmp_path):
    """Page 0 of each prompt is missing, pages 1-119 present; existence probes repeated every negative_ttl_s must
    not keep the unreadable pages from eviction. Before the fix one query asked every page of the rest of the prompt
    and Mooncake leased every page it found, although none after the hole can ever be read."""
    exists_jobs, left, ok, tried = _mooncake_probe_run(tmp_path, first_absent=True)
    assert exists_jobs > MC_PROMPTS
    assert left <= MC_PROMPTS * (MC_PAGES - 1) // 10, \
        f"{left} of {MC_PROMPTS * (MC_PAGES - 1)} pages nobody can read stayed leased by existence probes"
