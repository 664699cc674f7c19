"""A scheduler stub and a fake L1 for engine-free tests of the connector core (field-scenario harness).

L1 is a real CPU tensor per layer in vLLM's CPU-backend shape ``[num_blocks, H, N, 2D]`` (bf16) wrapped by
the real :class:`DevicePool`; L2 is the real :class:`HostPool`; the scheduler side is the real
:class:`CacheScheduler` and the worker side the real :class:`CacheWorker`. Only vLLM's scheduler is stubbed:
block allocation, "computing" a page (writing its fingerprint into the block) and the hook order of one step
(lookup -> alloc -> build plan -> loads -> forward -> saves).

Fingerprint fill (shared/cases/field-scenarios.md): the bytes of page ``i`` of layer ``l`` are a pure function of
(namespace tag, token prefix up to the end of page ``i``, ``l``), so any page read back from any tier can be
checked byte for byte.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Optional

import torch

from tierkv.connector.device_pool import DevicePool
from tierkv.connector.host_pool import HostPool
from tierkv.connector.page_hash import ModelNamespace
from tierkv.connector.scheduler import CacheScheduler
from tierkv.connector.worker import CacheWorker

P = 32
LAYERS, HEADS, HEAD_DIM = 2, 2, 8


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


class FakeEngine:
    def __init__(self, num_blocks: int = 64, num_slots: int = 64, verify: bool = True, policy: str = "lru"):
        self.ns = ModelNamespace("fake-model", "bfloat16", "layer_first/LBHNC", P, LAYERS, HEADS, HEAD_DIM)
        base = torch.zeros(LAYERS, num_blocks, HEADS, P, 2 * HEAD_DIM, dtype=torch.bfloat16)
        self.l1 = {f"model.layers.{i}.self_attn.attn": base[i] for i in range(LAYERS)}
        self.dev = DevicePool.from_vllm(self.l1, num_blocks=num_blocks, block_size=P, kv_cache_layout="LBHNC",
                                        backend="CPU_ATTN")
        self.host = HostPool.for_device(self.dev, num_slots, "layer_first")
        self.sched = CacheScheduler(self.ns, P, P, num_slots, policy)
        self.worker = CacheWorker(self.dev, self.host, verify=verify)
        self.free_blocks = list(range(1, num_blocks))  # block 0 is vLLM's null block
        self.running: dict[str, Req] = {}
        self.failed_blocks: set[int] = set()

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
        'forward' (write fingerprints of computed pages), run saves."""
        scheduled = []
        for req in self.running.values():
            if req.num_computed < len(req.tokens):
                self.sched.schedule_saves(req.req_id, len(req.tokens), req.blocks)
                scheduled.append(req)
        plan = self.sched.build_plan()
        self.worker.start_loads(plan)
        self.worker.finish_loads()
        self.failed_blocks |= self.worker.take_failed_blocks()
        if compute:
            for req in scheduled:
                for i in range(req.external // P, len(req.tokens) // P):
                    self.write_page(req, i)
                req.num_computed = len(req.tokens)
        self.worker.run_saves(plan)

    def write_page(self, req: Req, i: int) -> None:
        for layer, t in enumerate(self.l1.values()):
            t[req.blocks[i]].copy_(fingerprint(req.tag, req.tokens[: (i + 1) * P], layer))

    def page_ok(self, req: Req, i: int) -> bool:
        return all(torch.equal(t[req.blocks[i]], fingerprint(req.tag, req.tokens[: (i + 1) * P], layer))
                   for layer, t in enumerate(self.l1.values()))

    def finish(self, req: Req) -> None:
        self.sched.on_finished(req.req_id)
        self.running.pop(req.req_id, None)
        self.free_blocks.extend(req.blocks)
        req.blocks = []

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
        """At idle: no lock held, every slot either free or owned by the index exactly once."""
        self.sched.check_invariants()
        assert self.sched.index.locked_pages == 0
        assert not self.running
