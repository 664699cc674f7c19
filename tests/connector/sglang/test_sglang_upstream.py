"""SGLang 0.5.23's own storage-backend tests, as its wheel ships them, run against tierkv's backend built through
SGLang's ``dynamic`` factory (file store). The wheel's runnable ones:

- ``mem_cache/storage/mooncake_store/test_mooncake_store.py``: ``test_batch_operation`` (zero-copy form:
  ``batch_set_v1`` / ``batch_exists`` / ``batch_get_v1`` over a host pool that only offers ``get_page_buffer_meta``;
  its four configs) passes; ``test_single_operation`` (pointer form) stores a 4 KiB object that is one of the two
  records of its pool's 8 KiB page: tierkv stores whole pages, so ``set`` returns False as ``HiCacheStorage.set``
  allows (one log line) and the test's own assert fires; checked here as that documented outcome.
- ``mem_cache/storage/aibrix_kvcache/unit_test.py``: the copy form (``batch_set`` / ``batch_get`` / ``batch_exists``
  of flat pages over SGLang's MHA host pool). Its constructor calls predate 0.5.23 (``HiCacheStorageConfig``
  without the PP/CP fields, ``MHATokenToKVPool`` with ``start_layer``/``end_layer`` positional); they are adapted to
  0.5.23's signatures, and ``aibrix_kvcache`` (a logging helper, the store's metrics summary) is stood in for.

Not runnable: ``simm/test_simm.py`` imports ``python.sglang...`` (a source-tree path), ``eic/test_unit.py`` needs an
EIC server, ``tensorcast_store`` tests exercise Tensorcast internals; the wheel ships no v2 test of a backend (the
v2 form is covered by tests/connector/sglang/test_sglang_v2.py through SGLang's hybrid controller).
"""
from __future__ import annotations

import functools
import importlib
import logging
import sys
import types
from types import SimpleNamespace

import pytest

from tests.helpers import sgl as _sgl  # noqa: F401  (shims + SGLang imports)
from tests.helpers.sgl import StorageBackendFactory, extra_config

MOONCAKE_TEST = "sglang.srt.mem_cache.storage.mooncake_store.test_mooncake_store"
AIBRIX_TEST = "sglang.srt.mem_cache.storage.aibrix_kvcache.unit_test"


@pytest.fixture(autouse=True)
def _root_logger_as_before():
    """SGLang's test modules call ``logging.basicConfig(level=INFO)`` when imported: put the root logger back."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield
    root.setLevel(level)
    for h in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(h)


def tierkv_factory(tmp_path, made: list):
    """``config -> backend``: tierkv's backend through SGLang's ``dynamic`` factory on a file store (the tests' configs
    name no model, so the extra config gives one)."""
    def make(config, mem_pool=None):
        config.extra_config = extra_config({"backend": "file", "file": {"root": str(tmp_path / "l3")}},
                                           model_id="sglang-own-tests")
        backend = StorageBackendFactory.create_backend("dynamic", config, mem_pool)
        made.append(backend)
        return backend
    return make


@pytest.fixture
def mooncake_test(tmp_path, monkeypatch):
    mod = importlib.import_module(MOONCAKE_TEST)
    made: list = []
    monkeypatch.setattr(mod, "MooncakeStore", tierkv_factory(tmp_path, made))
    return mod, made


@pytest.mark.parametrize("mla,tp_rank,tp_size", [(False, 0, 1), (True, 0, 1), (False, 1, 4), (True, 3, 8)])
def test_mooncake_batch_operation(mooncake_test, mla, tp_rank, tp_size):
    mod, made = mooncake_test
    mod.test_batch_operation(mod.make_hicache_storage_config(is_mla_model=mla, tp_rank=tp_rank, tp_size=tp_size))
    (b,) = made
    assert b.kv.mode == "meta" and b.parts_per_page == (1 if mla else 2) and b.zero_copy
    st = b.stats()
    assert (st["pages_set"], st["pages_hit"], st["errors"]) == (13, 13, 0)
    b.close()


def test_mooncake_single_operation_pointer_form_of_half_a_page_is_refused(mooncake_test):
    mod, made = mooncake_test
    with pytest.raises(AssertionError, match="set operation failed"):
        mod.test_single_operation()
    (b,) = made
    assert b.stats()["pointer_rejected"] == 1 and b.stats()["pages_set"] == 0
    b.close()


@pytest.fixture
def aibrix_test(tmp_path, monkeypatch):
    from sglang.srt.mem_cache import memory_pool
    from sglang.srt.mem_cache.pool_host import mha

    absl = types.ModuleType("aibrix_kvcache.common.absl_logging")
    absl.log_every_n_seconds = lambda logger, level, msg, n: logger.log(level, "%s", msg)
    made: list = []
    make = tierkv_factory(tmp_path, made)

    def storage(config, mem_pool):
        backend = make(config, mem_pool)
        backend.register_mem_pool_host(mem_pool)
        backend.kv_cache_manager = SimpleNamespace(metrics=SimpleNamespace(summary=backend.stats))
        return backend

    store_mod = types.ModuleType("aibrix_kvcache_storage")
    store_mod.AibrixKVCacheStorage = storage
    for name, m in {"aibrix_kvcache": types.ModuleType("aibrix_kvcache"),
                    "aibrix_kvcache.common": types.ModuleType("aibrix_kvcache.common"),
                    "aibrix_kvcache.common.absl_logging": absl, "aibrix_kvcache_storage": store_mod}.items():
        monkeypatch.setitem(sys.modules, name, m)
    monkeypatch.delitem(sys.modules, AIBRIX_TEST, raising=False)
    mod = importlib.import_module(AIBRIX_TEST)

    def kv_pool(size, page_size, dtype, head_num, head_dim, layer_num, device, saver, start_layer, end_layer):
        return memory_pool.MHATokenToKVPool(size, page_size, dtype, head_num, head_dim, layer_num, device, saver,
                                            start_layer=start_layer, end_layer=end_layer)

    monkeypatch.setattr(mod, "HiCacheStorageConfig", functools.partial(
        mod.HiCacheStorageConfig, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, enable_storage_metrics=False))
    monkeypatch.setattr(mod, "MHATokenToKVPool", kv_pool)
    monkeypatch.setattr(mod, "MHATokenToKVPoolHost", functools.partial(mha.MHATokenToKVPoolHost, pin_memory=False))
    yield mod, made
    sys.modules.pop(AIBRIX_TEST, None)


def test_aibrix_batch_copy_form(aibrix_test):
    mod, made = aibrix_test
    mod.AIBrixKVCacheStorageTest().test_with_page_size()
    assert len(made) == 2  # page sizes 1 and 2
    for b in made:
        st = b.stats()
        assert (st["pages_set"], st["pages_hit"], st["errors"]) == (4, 6, 0) and b.parts_per_page == 1
        b.close()
