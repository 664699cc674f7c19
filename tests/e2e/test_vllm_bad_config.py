"""A bad tierkv config stops vLLM's start-up with a message naming the key and the allowed values."""
from pathlib import Path

import pytest

from _engine import EngineRunError, run_workload, tierkv_kv_config


def test_bad_layout_named_at_engine_startup(tiny_model, tmp_path):
    with pytest.raises(EngineRunError) as e:
        run_workload(tiny_model, [[1, 2, 3]], kv_transfer_config=tierkv_kv_config({"host_pool": {"layout": "rows"}}),
                     num_gpu_blocks_override=20, extra_engine_args={"max_model_len": 512}, workdir=tmp_path,
                     timeout_s=600)
    log = Path(tmp_path / "engine.log").read_text() if (tmp_path / "engine.log").exists() else str(e.value)
    text = str(e.value) + log
    assert "bad value 'rows' for 'host_pool.layout'" in text
    assert "'layer_first'" in text and "'page_first_direct'" in text


def test_host_pool_larger_than_the_host_budget_stops_startup(tiny_model, tmp_path):
    """``host_pool.size_gb: 100`` on a machine with less memory: a clear error before any page is allocated (not
    PyTorch's "can't allocate memory", nor a worker killed later as pages fill)."""
    with pytest.raises(EngineRunError) as e:
        run_workload(tiny_model, [[1, 2, 3]], kv_transfer_config=tierkv_kv_config({"host_pool": {"size_gb": 100000}}),
                     num_gpu_blocks_override=20, extra_engine_args={"max_model_len": 512}, workdir=tmp_path,
                     timeout_s=600)
    log = Path(tmp_path / "engine.log").read_text() if (tmp_path / "engine.log").exists() else str(e.value)
    text = str(e.value) + log
    assert "host_pool.size_gb" in text and "100000.00 GiB requested, budget" in text, text[-3000:]
    assert "can't allocate memory" not in text
