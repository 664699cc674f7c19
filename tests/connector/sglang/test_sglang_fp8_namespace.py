"""SGLang's host pool holds every FP8 KV cache as ``uint8``: the adapter's namespace then names the ``kv_cache_dtype``
of the extra config, so e4m3 and e5m2 pages never share keys, and refuses a uint8 pool without it (one line naming the
key) instead of mixing the formats."""
import pytest
import torch

from tests.helpers.sgl import attach, extra_config, mha_pool, storage_config
from tierkv.connector.core.config import ConfigError
from tierkv.connector.sglang.hicache import build_namespace


def _digest(pool, kv_cache_dtype=None):
    return build_namespace(storage_config({}, layout=pool.layout), pool, kv_cache_dtype=kv_cache_dtype).digest()


def test_fp8_formats_in_a_uint8_pool_get_different_namespaces_and_bf16_another():
    u8, bf = mha_pool(dtype=torch.uint8), mha_pool(dtype=torch.bfloat16)
    d = {f: _digest(u8, f) for f in ("fp8_e4m3", "fp8_e5m2")}
    assert d["fp8_e4m3"] != d["fp8_e5m2"] != _digest(bf)
    assert _digest(mha_pool(dtype=torch.uint8), "fp8_e4m3") == d["fp8_e4m3"]   # equal facts, equal digests
    assert _digest(bf, "fp8_e4m3") == _digest(bf)   # not a uint8 pool: the pool's dtype says it all


def test_a_uint8_pool_without_kv_cache_dtype_is_refused_at_attach(tmp_path):
    pool = mha_pool(dtype=torch.uint8)
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        attach(extra_config({"backend": "file", "file": {"root": str(tmp_path)}}), pool)
    b = attach(extra_config({"backend": "file", "file": {"root": str(tmp_path)}}, kv_cache_dtype="fp8_e5m2"), pool)
    assert b.namespace.dtype == "uint8/fp8_e5m2"
    b.close()


def test_the_operator_salt_enters_the_namespace_and_comes_from_config_or_environment(tmp_path, monkeypatch):
    from tierkv.connector.core.page_hash import NAMESPACE_SALT_ENV
    from tierkv.connector.sglang.hicache import parse_extra_config

    pool = mha_pool(dtype=torch.bfloat16)
    sc = storage_config({}, layout=pool.layout)
    plain, s1, s2 = (build_namespace(sc, pool, salt=s).digest() for s in (None, "one", "two"))
    assert len({plain, s1, s2}) == 3 and build_namespace(sc, pool, salt="one").digest() == s1
    l3 = {"backend": "file", "file": {"root": str(tmp_path)}}
    monkeypatch.setenv(NAMESPACE_SALT_ENV, "one")
    assert parse_extra_config({"l3": l3}).namespace_salt == "one"
    with pytest.raises(ConfigError, match="both set and differ"):
        parse_extra_config({"l3": l3, "namespace_salt": "two"})
    b = attach(extra_config(l3), pool)
    try:
        assert b._ns_digest == s1
    finally:
        b.close()
