"""Test-only connector: tierkv's :class:`TierKVConnector` that corrupts chosen L2 pages right after they were saved.

DRAM bit rot cannot be produced on demand in a real engine, so this subclass makes it:
after ``wait_for_save`` (the step's L1 -> L2 saves are complete and, with ``verify_checksums``, their checksums
recorded), it inverts every bit of the page's bytes in the host pool (``HostPool.page_views``: one run per layer for
``layer_first``, K and V for the semantic layouts; bf16 values become huge or NaN, so a page loaded anyway changes
the outputs), for the saved pages chosen by the
environment variable ``TIERKV_TEST_CORRUPT_SAVES``: comma-separated 0-based ordinals of pages in this worker's save
order (the n-th page the worker saved since start-up, counting every page of every save order of every step).

Load it with ``"kv_connector": "CorruptingTierKVConnector", "kv_connector_module_path": "_corrupting_connector"``
and ``tests/e2e`` on ``PYTHONPATH`` (the engine's subprocesses inherit it). Nothing else changes: the scheduler side
and the worker's load path are tierkv's own, so a corrupt page must be caught by the checksum check and reported as
a failed load (``get_block_ids_with_load_errors``), and vLLM must recompute it.

Counters for the test (added to the worker's stats file): ``test_corrupted_slots`` (list of the slots corrupted, in
order) and ``test_corrupted_pages`` (their number).
"""
from __future__ import annotations

import os

from tierkv.connector.core.plan import StepPlan
from tierkv.connector.vllm.connector import TierKVConnector

ENV = "TIERKV_TEST_CORRUPT_SAVES"


class CorruptingTierKVConnector(TierKVConnector):
    """:class:`TierKVConnector` whose worker corrupts the L2 copies of the saved pages named by ``$TIERKV_TEST_CORRUPT_SAVES``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._corrupt_ordinals = {int(x) for x in os.environ.get(ENV, "").split(",") if x.strip()}
        self._saved_so_far = 0
        self._corrupted_slots: list[int] = []

    def wait_for_save(self) -> None:
        plan = self._get_connector_metadata() if self._worker is not None else None
        super().wait_for_save()
        if not isinstance(plan, StepPlan) or not plan.saves:
            return
        host = self._worker.host
        for order in plan.saves:
            for slot in order.slots:
                if self._saved_so_far in self._corrupt_ordinals:
                    for run in host.page_views(slot):
                        run.bitwise_not_()
                    self._corrupted_slots.append(int(slot))
                self._saved_so_far += 1

    def _worker_stats(self) -> dict:
        d = super()._worker_stats()
        if d:
            d.update(test_corrupted_slots=list(self._corrupted_slots), test_corrupted_pages=len(self._corrupted_slots))
        return d
