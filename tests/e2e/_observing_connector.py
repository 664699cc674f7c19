"""Test-only connector: tierkv's :class:`TierKVConnector`, unchanged, that also counts two scheduler-side events
tierkv's own stats do not name, so that a test can prove that its workload reached them.

- ``test_prefetch_jobs_with_device_hit``: L3 prefetches ordered for a request that also had a device (L1) prefix hit
  (``update_state_after_alloc`` after a ``get_num_new_matched_tokens`` that saw ``num_computed_tokens > 0`` and
  answered an asynchronous load); ``test_prefetch_device_hit_tokens`` sums those device hits.
- ``test_l3_gap_saves``: saves of a request whose path, at the moment ``build_connector_meta`` plans them, has a
  page without an L2 copy (L3 only) before a page with one: the state in which the scheduler before dc0dd69 handed
  one L2 slot to two saves of the same plan. It is read from the radix index
  (side-effect free: no split, no LRU touch) before tierkv plans the step.

The counters are added to the scheduler's stats file (``stats_path``), with ``test_scheduler_file``: the file of the
``tierkv.connector.core.scheduler`` module the engine imported (which checkout is under test). Nothing else changes.

Load it with ``"kv_connector": "ObservingTierKVConnector", "kv_connector_module_path": "_observing_connector"``
and ``tests/e2e`` on ``PYTHONPATH`` (the engine's subprocesses inherit it).
"""
from __future__ import annotations

from tierkv.connector.core import scheduler as _scheduler_module
from tierkv.connector.vllm.connector import TierKVConnector


class ObservingTierKVConnector(TierKVConnector):
    """:class:`TierKVConnector` that counts prefetches with a device hit and saves behind L3-only pages."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._obs = {"test_prefetch_jobs_with_device_hit": 0, "test_prefetch_device_hit_tokens": 0,
                     "test_l3_gap_saves": 0, "test_plan_slot_conflicts": 0,
                     "test_scheduler_file": _scheduler_module.__file__}
        self._answer: dict[str, tuple[int, bool]] = {}  # req id -> (device hit of its last lookup, async answer)
        if self._sched is not None:
            inner = self._stats.snapshot
            self._stats.snapshot = lambda: {**inner(), **self._obs}

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        n, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        self._answer[request.request_id] = (int(num_computed_tokens), bool(load_async))
        return n, load_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        device, load_async = self._answer.pop(request.request_id, (0, False))
        if load_async and num_external_tokens > 0 and device > 0 and self._sched.ctl is not None:
            self._obs["test_prefetch_jobs_with_device_hit"] += 1
            self._obs["test_prefetch_device_hit_tokens"] += device
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        n_sched = scheduler_output.num_scheduled_tokens
        todo = [(nr.req_id, nr.num_computed_tokens + n_sched.get(nr.req_id, 0))
                for nr in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        todo += [(rid, cached.num_computed_tokens[i] + n_sched.get(rid, 0)) for i, rid in enumerate(cached.req_ids)]
        for rid, tokens_after in todo:
            if self._gap_before_save(rid, tokens_after):
                self._obs["test_l3_gap_saves"] += 1
        meta = super().build_connector_meta(scheduler_output)
        slots = [int(s) for o in getattr(meta, "saves", None) or () for s in o.slots]
        alloc = self._sched.allocator
        self._obs["test_plan_slot_conflicts"] += (len(slots) - len(set(slots))
                                                  + sum(1 for s in set(slots) if not alloc.is_allocated(s)))
        return meta

    def _gap_before_save(self, rid: str, tokens_after: int) -> bool:
        sched = self._sched
        st = sched.requests.get(rid)
        if st is None or sched.num_slots == 0:
            return False
        full = min(tokens_after, len(st.tokens)) // sched.page_size
        if full <= st.num_indexed:
            return False  # nothing to save in this step
        keys = st.keys.extend(st.tokens)[:full]
        slots = sched.index.match_prefix(keys, require_l2=False).host_slots
        missing = [i for i, s in enumerate(slots) if s < 0]
        return bool(missing) and any(s >= 0 for s in slots[missing[0] + 1:])
