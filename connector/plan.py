"""Per-step transfer orders from the scheduler side to the worker side.

A :class:`StepPlan` is built once per engine step by :class:`tierkv.connector.scheduler.CacheScheduler`,
pickled by the engine to every worker (vLLM sends it inside ``SchedulerOutput``), and executed by
:class:`tierkv.connector.worker.CacheWorker`: loads (L2 -> L1) before the layers read them, saves (L1 -> L2)
after the forward wrote them. Plain lists of ints and bytes only: small and cheap to pickle.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PageOrder:
    """Move pages between L1 blocks and L2 slots for one request.

    ``block_ids[i]`` (engine block id) <-> ``slots[i]`` (L2 host slot); ``keys[i]`` is the 16-byte page key,
    used for checksum verification and L3 backup.
    """

    req_id: str
    block_ids: list[int]
    slots: list[int]
    keys: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.block_ids) != len(self.slots):
            raise ValueError(f"order for {self.req_id}: {len(self.block_ids)} blocks vs {len(self.slots)} slots")


@dataclass
class StepPlan:
    """All transfer orders of one engine step. ``loads`` run before the forward (L2 -> L1), ``saves`` after
    it (L1 -> L2); the worker finishes both within the step, so a slot or block named here may be reused by
    any later step."""

    step: int = 0
    loads: list[PageOrder] = field(default_factory=list)
    saves: list[PageOrder] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not self.loads and not self.saves
