"""L2 + L3 replay for ``tierkv plan``: the engine's own scheduler side and L3 controller, a stand-in for the store.

Each request goes through :class:`~tierkv.connector.core.scheduler.CacheScheduler` with its
:class:`~tierkv.connector.l3.controller.Controller` (write-through backups, existence answered at once as the file
store does from the scheduler's process, asynchronous loads, failed reads recomputed and backed up again), as an
engine runs it one request at a time. Only the worker's I/O is modelled, by :class:`PolicyStore`: the file store's and
``tierkv server``'s capacity rule, with their eviction code (:mod:`tierkv.storage_backends.eviction`). A write is a
new entry of the policy (lru: the most recently used end) and evicts in policy order beyond the capacity; a read hit
counts as a hit (lru: to that end); an existence check or an L2 hit does not touch it.
So a page hot in L2 ages in L3 and may be gone when L2 drops it; the index still takes it for stored, and the read
that finds it missing is a load error (recomputed, counted as a miss) that clears the mark and backs it up again.
"""
from __future__ import annotations

from typing import Sequence

from tierkv.storage_backends.eviction import make_key_policy


class PolicyStore:
    """Page keys held by an L3 of ``capacity`` pages in ``policy``'s eviction order (no bytes), as the file store
    keeps them: a write of a held key is a new entry."""

    def __init__(self, capacity: int, policy: str = "lru"):
        self.capacity = capacity
        self.policy = policy
        self.pages = make_key_policy(policy)

    def write(self, key: bytes) -> bool:
        pages = self.pages
        pages.remove(key)
        while len(pages) >= self.capacity and pages.pop_victim() is not None:
            pass
        pages.insert(key)
        return True

    def read(self, key: bytes) -> bool:
        if key in self.pages:
            self.pages.hit(key)
            return True
        return False

    def leading(self, keys: Sequence[bytes]) -> int:
        """Leading ``keys`` held (an existence check: no recency change)."""
        for i, k in enumerate(keys):
            if k not in self.pages:
                return i
        return len(keys)


def run_jobs(sched, plan, store: PolicyStore) -> list[int]:
    """Do the L3 jobs of ``plan`` as one worker rank would and hand their reports to ``sched``. Returns the blocks of
    prefetched pages that did not arrive (vLLM's invalid block ids)."""
    from tierkv.connector.core.plan import JOB_BACKUP, JOB_PREFETCH, JobReport

    reports, bad = [], []
    for job in plan.jobs:
        if job.kind == JOB_BACKUP:
            ok = [store.write(k) for k in job.keys]
        elif job.kind == JOB_PREFETCH:
            ok = [(s >= 0 and store.read(k)) if f else True for k, f, s in zip(job.keys, job.fetch, job.slots)]
            lead = next((i for i, v in enumerate(ok) if not v), len(ok))
            bad += [job.block_ids[i] for i in range(lead, min(len(ok), len(job.block_ids)))]
        else:  # an existence query
            n = store.leading(job.keys)
            ok = [i < n for i in range(len(job.keys))]
        reports.append(JobReport(job.job_id, job.kind, ok))
    sched.on_reports(reports)
    return bad


def controller_kwargs(store: PolicyStore, admission: str = "always") -> dict:
    """The controller of a write-through engine whose L3 answers existence in the scheduler's process (the file
    store) and whose every L3 hit is an asynchronous load (the planner has no clock), with ``l3.admission``
    ``admission``."""
    return {"write_policy": "write_through", "sync_load_max_s": 0.0, "exists_fn": store.leading,
            "admission": admission}
