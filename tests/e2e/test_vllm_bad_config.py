"""A bad tierkv config stops vLLM's start-up with a message naming the key and the allowed values.

Both engines fail at start-up independently of each other; they start at once (``_engine.in_parallel``)."""
from pathlib import Path

import pytest

from tests.helpers.engine import EngineRunError, in_parallel, run_workload, tierkv_kv_config

BAD = {"layout": {"host_pool": {"layout": "rows"}}, "budget": {"host_pool": {"size_gb": 100000}}}


def _start(tiny_model, workdir, extra):
    """The :class:`EngineRunError` of an engine started with tierkv config ``extra``; None if the engine ran."""
    try:
        run_workload(tiny_model, [[1, 2, 3]], kv_transfer_config=tierkv_kv_config(extra),
                     num_gpu_blocks_override=20, extra_engine_args={"max_model_len": 512}, workdir=workdir,
                     timeout_s=600)
    except EngineRunError as e:
        return e
    return None


@pytest.fixture(scope="module")
def failed_starts(tiny_model, tmp_path_factory):
    """``{name: (workdir, EngineRunError or None)}`` for each config of :data:`BAD`."""
    wd = {name: tmp_path_factory.mktemp(name) for name in BAD}
    errs = in_parallel(**{name: (lambda name=name: _start(tiny_model, wd[name], BAD[name])) for name in BAD})
    return {name: (wd[name], errs[name]) for name in BAD}


def _text(workdir: Path, err: EngineRunError) -> str:
    log = Path(workdir / "engine.log").read_text() if (workdir / "engine.log").exists() else str(err)
    return str(err) + log


def test_bad_layout_named_at_engine_startup(failed_starts):
    tmp_path, err = failed_starts["layout"]
    assert isinstance(err, EngineRunError), "the engine started with host_pool.layout 'rows'"
    text = _text(tmp_path, err)
    assert "bad value 'rows' for 'host_pool.layout'" in text
    assert "'layer_first'" in text and "'page_first_direct'" in text


def test_host_pool_larger_than_the_host_budget_stops_startup(failed_starts):
    """``host_pool.size_gb: 100`` on a machine with less memory: a clear error before any page is allocated (not
    PyTorch's "can't allocate memory", nor a worker killed later as pages fill)."""
    tmp_path, err = failed_starts["budget"]
    assert isinstance(err, EngineRunError), "the engine started with host_pool.size_gb 100000"
    text = _text(tmp_path, err)
    assert "host_pool.size_gb" in text and "100000.00 GiB requested, budget" in text, text[-3000:]
    assert "can't allocate memory" not in text
