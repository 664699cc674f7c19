"""Shared helpers of the L3 scenario tests on the fake engine: real scheduler and worker halves, real L1/L2
tensors and real stores, with the fault wrapper only where a store cannot produce a fault on demand."""
from __future__ import annotations

import time


from tests.helpers.fake_engine import P, FakeEngine, Req
from tierkv.connector.l3.io import l3_key
from tierkv.connector.core.page_hash import page_keys, request_root
from tierkv.storage_backends.faulty import FaultyBackend
from tierkv.storage_backends.file.store import FileStore



def toks(a, n):
    return list(range(a, a + n))


def file_store(root, faulty=None):
    """Store factory of FakeEngine: a FileStore at ``root`` per rank; ranks named in ``faulty`` (rank -> fault
    settings, possibly empty) get it wrapped in a FaultyBackend whose faults the test arms."""
    def make(rank, ns, page_bytes):
        st = FileStore(ns, page_bytes, root=str(root))
        if faulty is not None and rank in faulty:
            return FaultyBackend(st, **faulty[rank])
        return st
    return make


def write_to_l3(store, docs, tp_size=1):
    """An earlier engine serves every doc once with write_through (all ranks) and exits: L3 holds their pages.
    ``store``: a directory (file store) or a FakeEngine store factory."""
    e = FakeEngine(store=store if callable(store) else file_store(store), tp_size=tp_size)
    for i, d in enumerate(docs):
        e.run_l3(Req(f"w{i}", d + [1]))
    e.settle()
    e.close()


def keys_of(e, tokens):
    return page_keys(request_root(e.sched.ns_digest), tokens, P)


def l3_keys(e, rank, keys):
    ns = e.ranks[rank][3].l3.rank_namespace
    return [l3_key(ns, k) for k in keys]


def l3io(e, rank=0):
    return e.ranks[rank][3].l3


def wait_ios(e):
    for _l1, _dev, _host, w in e.ranks:
        assert w.l3.wait_idle(30), "L3 jobs did not end"


def pump(e):
    """Send the pending jobs (one step), let the I/O threads end them, deliver the reports (another step)."""
    e.step(compute=False)
    wait_ios(e)
    e.step(compute=False)


def drain_backups(e):
    """Let queued backups reach the store and deliver their reports (their pages are locked until then), while a
    reader may be hung on purpose (so ``wait_idle`` would not return)."""
    deadline = time.monotonic() + 10
    while any(w.l3._queued_backup_pages for _l1, _dev, _host, w in e.ranks):
        assert time.monotonic() < deadline, "backups did not reach the store"
        time.sleep(0.002)
    e.step(compute=False)


def l2_run(e, keys):
    return e.sched.index.match_len(keys, len(keys), require_l2=True)[0]


def assert_nothing_reserved(e):
    """Every reservation is released: at idle every one is back. Index invariants, slots (indexed + free == pool), no
    lock, no job, no staging slot, no request state on either side of the controller."""
    e.idle_check()
    s, c = e.sched, e.sched.ctl
    assert s.allocator.num_free + len(s.index.all_slots()) == s.num_slots
    assert not s.requests, f"request state kept: {sorted(s.requests)}"
    assert not s._l3_since and not s._drops and not s._plan_locks
    assert not c._recv_open, f"request side still open: {c._recv_open}"
    assert not c._req_prefetch and not c._fetching and not c._backing_up
    assert not c._room_waits, f"room waits kept: {c._room_waits}"
    assert not c._exists_pending, f"existence waits kept: {c._exists_pending}"
    for _l1, _dev, _host, w in e.ranks:
        assert not w.l3._prefetches and w.l3._busy == 0 and w.l3._queued_backup_pages == 0


class _EveryRequest:
    """Identity of ``&``: lets a rank's poll leave the decision to the last rank's (see vllm_finished_aggregation)."""

    def __and__(self, other):
        return other


def vllm_finished_aggregation(e):
    """Make the engine treat ``finished_recving`` as vLLM's KVOutputAggregator does: a request's load ended once every
    rank named it, in whatever steps (FakeEngine intersects the ranks' answers within one step only)."""
    seen: dict[str, set[int]] = {}
    n = len(e.ranks)
    for rank, (_l1, _dev, _host, w) in enumerate(e.ranks):
        real = w.poll

        def poll(finished=(), _real=real, _rank=rank):
            for rid in _real(finished):
                seen.setdefault(rid, set()).add(_rank)
            if _rank < n - 1:
                return _EveryRequest()
            done = {rid for rid, rs in seen.items() if len(rs) == n}
            for rid in done:
                del seen[rid]
            return done
        w.poll = poll


def start_async_load(e, req, expect_pages, max_steps=20):
    """Look ``req`` up until the answer is known (pumping the existence query), check it is an L3 hit of
    ``expect_pages`` pages, allocate its blocks and order the prefetch (not yet handed to the workers)."""
    e.sched.add_request(req.req_id, req.tokens)
    for _ in range(max_steps):
        ext = e.sched.lookup(req.req_id, 0)
        if ext is not None:
            break
        pump(e)
    assert ext == expect_pages * P and e.sched.lookup_is_async(req.req_id), ext
    req.blocks = [e.free_blocks.pop(0) for _ in range((len(req.tokens) + P - 1) // P)]
    e.sched.on_alloc(req.req_id, req.blocks, ext)
    e.waiting[req.req_id] = req
    return ext


def complete_async_load(e, req, ext, max_steps=50):
    """After ``start_async_load``: step until every rank named the load ended, cut the hit at the first failed block
    (kv_load_failure_policy=recompute), compute the rest, check every loaded page on every rank, finish. Returns the
    tokens actually loaded."""
    for _ in range(max_steps):
        if req.req_id in e.recv:
            break
        e.step(compute=False)
        if req.req_id in e.recv:
            break
        wait_ios(e)  # (not reached for a request its deadline released while its read still hangs)
    assert req.req_id in e.recv, f"{req.req_id}: load never ended"
    e.recv.discard(req.req_id)
    e.waiting.pop(req.req_id)
    bad = [i for i, b in enumerate(req.blocks) if b in e.failed_blocks]
    if bad:
        ext = min(ext, bad[0] * P)
        e.failed_blocks -= set(req.blocks)
    e.sched.on_alloc(req.req_id, req.blocks, 0)
    req.external, req.num_computed = ext, 0
    e.running[req.req_id] = req
    e.step()
    for rank in range(e.tp_size):
        for i in range(ext // P):
            assert e.page_ok(req, i, rank), f"{req.req_id}: page {i} loaded on rank {rank} has wrong bytes"
    e.finish(req)
    return ext


