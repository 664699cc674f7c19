"""The recompute estimate outlives the engine process (connector/l3/estimates.py): a restarted scheduler of the same
page namespace on the same host starts from its predecessor's prefill time per token."""
from __future__ import annotations

import json

import pytest

from tierkv.connector.l3.estimates import SAVE_INTERVAL_S, EstimateFile


def test_an_estimate_is_written_when_due_and_read_back(tmp_path):
    now = [0.0]
    f = EstimateFile("ab" * 16, str(tmp_path), clock=lambda: now[0])
    assert f.load() is None                              # no file: no estimate
    assert f.maybe_save(2e-4) and f.load() == 2e-4
    assert not f.maybe_save(3e-4)                        # within the interval: not written
    now[0] += SAVE_INTERVAL_S
    assert not f.maybe_save(2.05e-4)                     # moved by less than 5 %: not written
    assert f.maybe_save(3e-4)
    assert EstimateFile("ab" * 16, str(tmp_path)).load() == 3e-4
    assert EstimateFile("cd" * 16, str(tmp_path)).load() is None   # another namespace: its own file


@pytest.mark.parametrize("text", ["{", "[]", '{"prefill_s_per_token": "1e-4"}', '{"prefill_s_per_token": -1}',
                                  '{"prefill_s_per_token": 5.0}', '{"prefill_s_per_token": NaN}',
                                  '{"prefill_s_per_token": true}'])
def test_a_damaged_or_implausible_file_is_no_estimate(tmp_path, text):
    f = EstimateFile("ab" * 16, str(tmp_path))
    with open(f.path, "w") as fh:
        fh.write(text)
    assert f.load() is None


def test_a_restarted_scheduler_starts_from_its_predecessors_estimate(tmp_path, monkeypatch):
    from tests.helpers.vllm_parts import SCHEDULER, connector, write_model
    monkeypatch.setenv("TIERKV_LEDGER_DIR", str(tmp_path / "ledger"))
    monkeypatch.setenv("TIERKV_ESTIMATES_DIR", str(tmp_path / "est"))
    (tmp_path / "ledger").mkdir()
    (tmp_path / "est").mkdir()
    model = write_model(tmp_path / "model")
    cfg = {"host_pool.num_pages": 8, "l3.backend": "file", "l3.file.root": str(tmp_path / "l3")}
    first = connector(model, SCHEDULER, cfg)
    assert first._sched.ctl.prefill_s_per_token.value is None
    first._side.observe_forwards([(3, 256, 0.0512)])          # one timed prefill step: 200 us per prompt token
    first.shutdown()
    saved = json.loads(next((tmp_path / "est").glob("tierkv-estimates-*.json")).read_text())
    assert saved["prefill_s_per_token"] == pytest.approx(2e-4)
    second = connector(model, SCHEDULER, cfg)
    assert second._sched.ctl.prefill_s_per_token.value == pytest.approx(2e-4)
    # with the estimate a stalled read is waited for at most 5 % of recomputing its pages (not the 0.5 s fallback)
    assert second._sched.ctl.deadline_s(64) == pytest.approx(0.05 * 2e-4 * 64 * second.page_size)
    second.shutdown()
    other = connector(model, SCHEDULER, {**cfg, "host_pool.layout": "page_first"})   # another namespace
    assert other._sched.ctl.prefill_s_per_token.value is None
    other.shutdown()
