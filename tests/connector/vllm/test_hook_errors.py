"""An error inside a tierkv hook never reaches vLLM's forward nor its scheduler loop; it becomes a miss or failed pages
(vLLM recomputes them), a counter and one log line. Built in-process from vLLM's own config objects (``vllm_parts``),
one injected fault per hook: a real copy or a real store cannot be made to raise on demand."""
import logging
from types import SimpleNamespace

import pytest
import torch

from tierkv import kernels
from tierkv.connector.core.plan import PageOrder
from tierkv.connector.vllm.connector import ConnectorPlan
from tests.helpers.vllm_parts import SCHEDULER, TierkvLoggerState, connector, run_step, worker_connector, write_model


@pytest.fixture
def model(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TIERKV_LEDGER_DIR", str(tmp_path))
    state = TierkvLoggerState()
    tk = logging.getLogger("tierkv")
    tk.addHandler(caplog.handler)
    tk.propagate = False
    yield write_model(tmp_path / "model")
    state.restore()




def _fill(l1, blocks, seed):
    g = torch.Generator().manual_seed(seed)
    for t in l1.values():
        for b in blocks:
            t[b].copy_(torch.randn(*t.shape[1:], generator=g).to(torch.bfloat16))


def test_a_save_whose_copy_raises_is_never_loaded_and_the_step_goes_on(model, monkeypatch, caplog):
    c, l1 = worker_connector(model, {"host_pool.num_pages": 8})
    _fill(l1, [3, 4], 1)

    def broken(*a, **k):
        raise RuntimeError("injected save fault")
    monkeypatch.setattr(kernels, "save_pages", broken)
    assert run_step(c, ConnectorPlan(step=1, saves=[PageOrder("a", [3, 4], [1, 2], [b"k1" * 8, b"k2" * 8])])) == set()
    monkeypatch.undo()
    assert c._worker.counters.save_failed_pages == 2
    assert any("L1 -> L2 save of 2 pages failed" in r.getMessage() for r in caplog.records)
    # a later load of those slots under those keys is refused: vLLM recomputes the blocks
    _fill(l1, [6, 7], 2)
    before = [t[6:8].clone() for t in l1.values()]
    assert run_step(c, ConnectorPlan(step=2, loads=[PageOrder("b", [6, 7], [1, 2], [b"k1" * 8, b"k2" * 8])])) == {6, 7}
    assert all(torch.equal(t[6:8], b) for t, b in zip(l1.values(), before))  # nothing was copied into L1


def test_a_load_hook_that_raises_reports_the_blocks_as_failed(model, monkeypatch):
    c, _l1 = worker_connector(model, {"host_pool.num_pages": 8})

    def broken(plan):
        raise RuntimeError("injected")
    monkeypatch.setattr(c._worker, "start_loads", broken)
    assert run_step(c, ConnectorPlan(step=1, loads=[PageOrder("b", [6, 7], [1, 2], [])])) == {6, 7}
    assert c._worker.counters.hook_errors == 1


def test_submitting_jobs_that_raises_answers_them_not_done(model, monkeypatch):
    from tierkv.connector.core.plan import JOB_PREFETCH, Job
    c, _l1 = worker_connector(model, {"host_pool.num_pages": 8})

    def broken(plan):
        raise RuntimeError("injected")
    monkeypatch.setattr(c._worker, "start_reads", broken)   # before the forward ...
    monkeypatch.setattr(c._worker, "submit_jobs", broken)   # ... and after it
    job = Job(7, JOB_PREFETCH, [b"k" * 16, b"j" * 16], slots=[1, 2], block_ids=[5, 6], fetch=[True, True],
              req_id="r", deadline_s=1.0)
    assert run_step(c, ConnectorPlan(step=1, jobs=[job])) == {5, 6}
    assert c.get_finished(set()) == (None, {"r"})            # the request is named as ended: nobody waits for it
    assert c._worker.counters.hook_errors == 2
    meta = c.build_connector_worker_meta()
    assert [(r.job_id, r.ok) for r in meta.reports] == [(7, [False, False])]
    # loads the scheduler side promised but could not order arrive as plan failures: reported the same way
    assert run_step(c, ConnectorPlan(step=2, failed_blocks=[8], failed_requests=["q"])) == {8}
    assert c.get_finished(set()) == (None, {"q"})


def _request(rid, n):
    return SimpleNamespace(request_id=rid, all_token_ids=list(range(1, n + 1)), lora_request=None, cache_salt=None,
                           skip_reading_prefix_cache=False)


def test_scheduler_hooks_that_raise_become_a_miss_or_failed_blocks(model, monkeypatch):
    c = connector(model, SCHEDULER, {"host_pool.num_pages": 8})
    req = _request("a", 100)
    monkeypatch.setattr(c._sched, "lookup", lambda *a: 1 / 0)
    assert c.get_num_new_matched_tokens(req, 0) == (0, False)   # a miss
    assert c._sched.counters.hook_errors == 1
    monkeypatch.undo()

    def broken_alloc(*a):
        raise RuntimeError("injected")
    monkeypatch.setattr(c._sched, "on_alloc", broken_alloc)
    blocks = SimpleNamespace(get_block_ids=lambda: ([11, 12, 13, 14],))
    c._sched.requests["a"].last_num_computed = 0
    c.update_state_after_alloc(req, blocks, 64)                  # promised 2 pages it cannot order
    assert c._sched.counters.hook_errors == 2
    so = SimpleNamespace(preempted_req_ids=(), num_scheduled_tokens={}, scheduled_new_reqs=[],
                         scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]))
    plan = c.build_connector_meta(so)
    assert plan.failed_blocks == [11, 12] and plan.failed_requests == []
    assert c.request_finished(req, [11, 12, 13, 14]) == (False, None)
