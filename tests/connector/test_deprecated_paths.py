"""The import paths users wrote before the connector was split into sub-packages still load the same module, with a
DeprecationWarning that names the new path."""
import importlib
import sys

import pytest

OLD_TO_NEW = [
    ("tierkv.connector.vllm_connector", "tierkv.connector.vllm.connector", "TierKVConnector"),
    ("tierkv.connector.vllm_params_check", "tierkv.connector.vllm.params_check", "TierKVParamsCheck"),
    ("tierkv.connector.sglang_hicache", "tierkv.connector.sglang.hicache", "TierKVHiCacheStorage"),
]


@pytest.mark.parametrize("old,new,cls", OLD_TO_NEW)
def test_old_path_warns_and_loads_the_new_module(old, new, cls, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        mod = importlib.import_module(old)
    assert mod is importlib.import_module(new)
    assert getattr(mod, cls) is getattr(importlib.import_module(new), cls)
