"""A scheduler stub and a fake L1 for engine-free tests of the connector core.

L1 is a real CPU tensor per layer in vLLM's CPU-backend shape ``[num_blocks, H, N, 2D]`` (bf16) wrapped by
the real :class:`DevicePool`; L2 is the real :class:`HostPool`; the scheduler side is the real
:class:`CacheScheduler` and the worker side the real :class:`CacheWorker`. Only vLLM's scheduler is stubbed:
block allocation, "computing" a page (writing its fingerprint into the block) and the hook order of one step
(lookup -> alloc -> build plan -> loads -> forward -> saves). With ``layerwise=True`` the forward waits for each
layer's loads in layer order (vLLM's ``wait_for_layer_load``) and the step's loads end in the save hook (vLLM's
``wait_for_save``). A request with a block whose load failed (``get_block_ids_with_load_errors``) is rolled back to
its first failed block and computed again from there by the next :meth:`FakeEngine.step`, as vLLM does with
``kv_load_failure_policy=recompute``; the failed blocks reach the scheduler side as vLLM's ``invalid_block_ids``.

A computed page's bytes depend on what its prefix holds in L1: on the right prefix they are the page's fingerprint,
on a broken one (a failed load) they differ, as attention over wrong keys and values would make them.

Fingerprint fill: the right bytes of page ``i`` of layer ``l`` are a pure function of
(namespace tag, token prefix up to the end of page ``i``, ``l``), so any page read back from any tier can be
checked byte for byte.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Optional

import torch

from tierkv import kernels
from tierkv.connector.l2 import layer_loader
from tierkv.connector.l2.device_pool import DevicePool
from tierkv.connector.l2.host_pool import HostPool
from tierkv.connector.l3.io import L3IO
from tierkv.connector.core.page_checksums import SlotChecksums
from tierkv.connector.core.page_hash import ModelNamespace
from tierkv.connector.core.scheduler import CacheScheduler
from tierkv.connector.l2.worker import CacheWorker

P = 32
LAYERS, HEADS, HEAD_DIM = 2, 2, 8
REAL_LOAD_PAGES = kernels.load_pages


def fingerprint(tag: str, prefix: list[int], layer: int) -> torch.Tensor:
    """bf16 tensor [H, N, 2D] determined by (tag, prefix, layer)."""
    seed = int.from_bytes(hashlib.blake2b(repr((tag, tuple(prefix), layer)).encode(), digest_size=8).digest(), "little")
    g = torch.Generator().manual_seed(seed & ((1 << 63) - 1))
    return torch.randn(HEADS, P, 2 * HEAD_DIM, generator=g).to(torch.bfloat16)


@dataclass
class Req:
    req_id: str
    tokens: list[int]
    tag: str = ""                 # namespace tag of its fingerprints (salt / lora)
    lora: Optional[str] = None
    salt: Optional[str] = None
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    external: int = 0


def rank_namespace(ns: ModelNamespace, rank: int) -> bytes:
    """The L3 namespace digest of TP rank ``rank`` (what the vLLM connector builds for each worker)."""
    from dataclasses import replace
    return replace(ns, tp_rank=rank).digest()


class FakeEngine:
    """``store``: a callable ``(rank, rank namespace digest, page bytes) -> L3 store`` turns the controller on;
    ``controller``: keyword arguments of :class:`tierkv.connector.l3.controller.Controller`; ``tp_size``: worker
    ranks (each with its own L1 and L2 copy and its own L3 keys, one scheduler side)."""

    def __init__(self, num_blocks: int = 64, num_slots: int = 64, verify: bool = True, policy: str = "lru",
                 store=None, controller: Optional[dict] = None, tp_size: int = 1, batch_pages: int = 4,
                 clock=None, layout: str = "layer_first", layerwise: bool = False, reads_end_in_forward: bool = False,
                 scheduler_exists: bool = False, sync_loads: bool = False):
        self.ns = ModelNamespace("fake-model", "bfloat16", f"{layout}/LBHNC", P, LAYERS, HEADS, HEAD_DIM,
                                 tp_size=tp_size)
        self.tp_size = tp_size
        self.reads_end_in_forward = reads_end_in_forward  # the forward outlasts every L3 read started before it
        self.ranks = []
        for rank in range(tp_size):
            base = torch.zeros(LAYERS, num_blocks, HEADS, P, 2 * HEAD_DIM, dtype=torch.bfloat16)
            l1 = {f"model.layers.{i}.self_attn.attn": base[i] for i in range(LAYERS)}
            dev = DevicePool.from_vllm(l1, num_blocks=num_blocks, block_size=P, kv_cache_layout="LBHNC",
                                       backend="CPU_ATTN")
            host = HostPool.for_device(dev, num_slots, layout)
            l3io = None
            checksums = SlotChecksums(num_slots)
            if store is not None:
                st = store(rank, rank_namespace(self.ns, rank), host.page_bytes)
                kw = {} if clock is None else {"clock": clock}
                l3io = L3IO(st, host, rank_namespace(self.ns, rank), checksums, batch_pages=batch_pages,
                            rank=rank, **kw)
            self.ranks.append((l1, dev, host, CacheWorker(dev, host, verify=verify, l3=l3io, checksums=checksums,
                                                          layerwise=layerwise)))
        self.l1, self.dev, self.host, self.worker = self.ranks[0][:4]
        ctl = None
        if store is not None:
            ctl = dict(controller or {})
            ctl.setdefault("world_size", tp_size)
            if not sync_loads:  # every L3 hit an asynchronous load, unless the test asks for synchronous ones
                ctl.setdefault("sync_load_max_s", 0.0)
            if clock is not None:
                ctl.setdefault("clock", clock)
            if scheduler_exists:  # the connector's exists_fn: the scheduler process's own store objects, per rank
                from tierkv.connector.l3.io import l3_key
                mine = [(rank_namespace(self.ns, r), store(r, rank_namespace(self.ns, r), self.host.page_bytes))
                        for r in range(tp_size)]
                self.scheduler_stores = [s for _d, s in mine]
                ctl["exists_fn"] = lambda keys: min(s.batch_exists([l3_key(d, k) for k in keys]) for d, s in mine)
        self.sched = CacheScheduler(self.ns, P, P, num_slots, policy, controller=ctl)
        self.free_blocks = list(range(1, num_blocks))  # block 0 is vLLM's null block
        self.running: dict[str, Req] = {}
        self.waiting: dict[str, Req] = {}   # asynchronous (L3) loads in flight
        self.finished_ids: set[str] = set()  # finished since the last step (vLLM's finished_req_ids)
        self.delayed: dict[str, Req] = {}    # finished, blocks kept until the worker reports the load ended
        self.failed_blocks: set[int] = set()
        self.recv: set[str] = set()
        self.rolled_back: set[str] = set()  # requests rolled back to a failed block (recomputed by the next step)

    # -------------------------------------------------------------- engine steps
    def admit(self, req: Req) -> int:
        """Lookup + allocate blocks for the whole prompt; returns the external (L2) hit in tokens."""
        self.sched.add_request(req.req_id, req.tokens, lora=req.lora, cache_salt=req.salt)
        ext = self.sched.lookup(req.req_id, 0)
        n_blocks = (len(req.tokens) + P - 1) // P
        assert len(self.free_blocks) >= n_blocks, "fake L1 full"
        req.blocks = [self.free_blocks.pop(0) for _ in range(n_blocks)]
        self.sched.on_alloc(req.req_id, req.blocks, ext)
        req.external = ext
        req.num_computed = 0
        self.running[req.req_id] = req
        return ext

    def step(self, compute: bool = True) -> None:
        """One engine step: build the plan for every running request (whole prompt scheduled), run loads,
        'forward' (write fingerprints of computed pages), run saves, hand L3 jobs to the I/O threads, collect
        ended asynchronous loads (vLLM's get_finished) and deliver the job reports to the scheduler side."""
        scheduled = []
        for req in self.running.values():
            if req.num_computed < len(req.tokens):
                self.sched.schedule_saves(req.req_id, len(req.tokens), req.blocks)
                scheduled.append(req)
        plan = self.sched.build_plan()
        step_failed: set[int] = set()
        for rank, (_l1, dev, _host, worker) in enumerate(self.ranks):
            worker.start_reads(plan)  # vLLM's bind_connector_metadata: L3 reads overlap the forward
            verified = worker.finish_sync_reads()  # start_load_kv: the step's synchronous L3 loads, then L2 -> L1
            worker.start_loads(plan, verified)
            if self.reads_end_in_forward and worker.l3 is not None:
                assert worker.l3.wait_idle(30)
            if worker.layerwise:
                for name in dev.layer_names:  # the forward: each attention layer waits for its own pages
                    worker.wait_layer(name)
            else:
                worker.finish_loads()
            if compute:  # the forward computes every scheduled page on top of whatever its prefix holds in L1
                for req in scheduled:
                    for i in range(req.external // P, len(req.tokens) // P):
                        self.write_page(req, i, rank)
            worker.end_sync_step(plan)  # wait_for_save: the step's loads have ended, then the saves run
            worker.finish_loads()
            worker.run_saves(plan)
            worker.submit_jobs(plan)
            step_failed |= worker.take_failed_blocks()
        self.failed_blocks |= step_failed
        for req in scheduled:
            if not compute:
                continue
            # kv_load_failure_policy=recompute: a request with a failed block rolls back to its first failed block;
            # the next step computes it again from there (this step's output for it is discarded)
            bad = [i for i, b in enumerate(req.blocks[: req.external // P]) if b in step_failed]
            if bad:
                req.external = req.num_computed = bad[0] * P
                self.rolled_back.add(req.req_id)
            else:
                req.num_computed = len(req.tokens)
        finished, self.finished_ids = self.finished_ids, set()
        recv = None
        reports = []
        for _l1, _dev, _host, worker in self.ranks:
            got = worker.poll(finished)
            recv = got if recv is None else recv & got  # vLLM waits for every rank
            polled = worker.take_failed_blocks()
            self.failed_blocks |= polled
            step_failed |= polled
            reports.extend(worker.take_reports())
        self.recv |= recv or set()
        self.sched.on_finished_recving(recv or set(), step_failed)  # vLLM: finished_recving, invalid_block_ids
        self.sched.on_reports(reports)
        self.sched.on_load_errors(step_failed)  # vLLM: KVConnectorOutput.invalid_block_ids, union of the ranks
        for rid in list(self.recv):
            if rid in self.delayed:
                req = self.delayed.pop(rid)
                self.free_blocks.extend(req.blocks)
                req.blocks = []
                self.recv.discard(rid)

    def settle(self, max_steps: int = 200) -> None:
        """Let every queued L3 job end and its report reach the scheduler side (empty engine steps)."""
        for _ in range(max_steps):
            for _l1, _dev, _host, w in self.ranks:
                if w.l3 is not None:
                    assert w.l3.wait_idle(30), "L3 jobs did not end"
            self.step(compute=False)
            if self.sched.ctl is None or (self.sched.ctl.pending_jobs() == 0 and not self.delayed):
                return
        raise AssertionError("controller jobs still pending")

    def write_page(self, req: Req, i: int, rank: int = 0) -> None:
        """'Compute' page ``i``: its fingerprint when the page before it holds the right bytes in L1; on top of a
        wrong prefix (a failed load) bytes that depend on what that prefix holds, so a page computed on a broken
        prefix differs from the right one (as attention over wrong keys and values would)."""
        tag = req.tag + (f"/r{rank}" if rank else "")
        l1 = self.ranks[rank][0]
        if i > 0 and not self.page_ok(req, i - 1, rank):
            h = hashlib.blake2b(digest_size=8)
            for t in l1.values():
                h.update(t[req.blocks[i - 1]].contiguous().view(torch.uint8).numpy().tobytes())
            tag += "/on-broken-prefix:" + h.hexdigest()
        for layer, t in enumerate(l1.values()):
            t[req.blocks[i]].copy_(fingerprint(tag, req.tokens[: (i + 1) * P], layer))

    def page_ok(self, req: Req, i: int, rank: int = 0) -> bool:
        return all(torch.equal(t[req.blocks[i]], fingerprint(req.tag + (f"/r{rank}" if rank else ""),
                                                             req.tokens[: (i + 1) * P], layer))
                   for layer, t in enumerate(self.ranks[rank][0].values()))

    def finish(self, req: Req) -> None:
        delay = self.sched.on_finished(req.req_id)
        self.running.pop(req.req_id, None)
        self.waiting.pop(req.req_id, None)
        self.finished_ids.add(req.req_id)
        if delay:
            self.delayed[req.req_id] = req
            return
        self.free_blocks.extend(req.blocks)
        req.blocks = []

    def admit_l3(self, req: Req, max_steps: int = 200) -> int:
        """Admit through the controller as vLLM would: while the lookup answers None, step (after letting the
        I/O threads answer); an asynchronous hit waits until every rank reported the load ended, and a failed
        block cuts the hit there (kv_load_failure_policy=recompute). Returns the external hit in tokens."""
        self.sched.add_request(req.req_id, req.tokens, lora=req.lora, cache_salt=req.salt)
        for _ in range(max_steps):
            ext = self.sched.lookup(req.req_id, 0)
            if ext is not None:
                break
            for _l1, _dev, _host, w in self.ranks:
                if w.l3 is not None:
                    w.l3.wait_idle(30)
            self.step(compute=False)
        else:
            raise AssertionError(f"{req.req_id}: lookup never answered")
        is_async = self.sched.lookup_is_async(req.req_id)
        n_blocks = (len(req.tokens) + P - 1) // P
        assert len(self.free_blocks) >= n_blocks, "fake L1 full"
        req.blocks = [self.free_blocks.pop(0) for _ in range(n_blocks)]
        self.sched.on_alloc(req.req_id, req.blocks, ext)
        req.num_computed = 0
        if is_async and ext:
            self.waiting[req.req_id] = req
            for _ in range(max_steps):
                for _l1, _dev, _host, w in self.ranks:
                    if w.l3 is not None:
                        w.l3.wait_idle(30)
                self.step(compute=False)
                if req.req_id in self.recv:
                    self.recv.discard(req.req_id)
                    break
            else:
                raise AssertionError(f"{req.req_id}: asynchronous load never ended")
            self.waiting.pop(req.req_id)
            bad = [i for i, b in enumerate(req.blocks) if b in self.failed_blocks]
            if bad:
                ext = min(ext, bad[0] * P)
                self.failed_blocks -= set(req.blocks)
            self.sched.on_alloc(req.req_id, req.blocks, 0)
        req.external = ext
        self.running[req.req_id] = req
        return ext

    def run_l3(self, req: Req, max_steps: int = 8) -> int:
        """admit_l3 + computing steps until the prompt is computed (a synchronous L3 load whose pages did not all
        arrive rolls the request back to its first failed block, and the next step recomputes from there) + checks
        of every loaded page on every rank + finish. Returns the tokens served from the tiers."""
        self.admit_l3(req)
        for _ in range(max_steps):
            self.step()
            if req.num_computed >= len(req.tokens):
                break
        else:
            raise AssertionError(f"{req.req_id}: not computed after {max_steps} steps")
        ext = req.external
        for rank in range(self.tp_size):
            for i in range(ext // P):
                assert self.page_ok(req, i, rank), f"{req.req_id}: page {i} loaded on rank {rank} has wrong bytes"
        self.finish(req)
        return ext

    def close(self) -> None:
        for _l1, _dev, _host, w in self.ranks:
            if w.l3 is not None:
                w.close(drain_s=10)

    def preempt(self, req: Req) -> None:
        self.sched.on_preempted(req.req_id)
        self.running.pop(req.req_id, None)
        self.free_blocks.extend(req.blocks)
        req.blocks = []

    def run(self, req: Req) -> int:
        """Admit, compute/load and finish one request; returns its L2 hit (tokens) after checking every
        loaded page against its fingerprint."""
        ext = self.admit(req)
        self.step()
        for i in range(ext // P):
            assert self.page_ok(req, i), f"{req.req_id}: page {i} loaded from L2 has wrong bytes"
        self.finish(req)
        return ext

    def idle_check(self) -> None:
        """At idle: no lock held, every slot either free or owned by the index exactly once, no job pending."""
        self.sched.check_invariants()
        assert self.sched.index.locked_pages == 0
        assert not self.running and not self.waiting and not self.delayed
        if self.sched.ctl is not None:
            assert self.sched.ctl.pending_jobs() == 0
            assert not self.sched.ctl.staging_slots()
            for _l1, _dev, _host, w in self.ranks:
                assert w.l3 is None or w.l3.pending() == 0


def inject_copy_fault(monkeypatch, layer: int) -> list:
    """Make the L2 -> L1 copy of ``layer`` raise (the layers before it are copied by the real kernel first, as a
    copy that breaks part-way would leave them). Returns the list of layer lists the copies were asked for."""
    real = REAL_LOAD_PAGES
    asked = []

    def faulty(host, dev, slots, block_ids, layers=None, **kw):
        ls = list(range(dev.num_layers)) if layers is None else list(layers)
        asked.append(ls)
        if layer in ls:
            before = [x for x in ls if x < layer]
            if before:
                real(host, dev, slots, block_ids, before, **kw)
            raise RuntimeError(f"injected copy fault at layer {layer}")
        return real(host, dev, slots, block_ids, layers, **kw)

    monkeypatch.setattr(kernels, "load_pages", faulty)
    monkeypatch.setattr(layer_loader, "load_pages", faulty)
    return asked
