"""Every fact that changes a page's bytes is in the page namespace, so tenants and configurations never share pages: the
device's packing (CPU ISA, CPU vs GPU layouts), the KV cache dtype (bf16, FP8 e4m3, FP8 e5m2), the model dtype and
weight quantisation, and a LoRA adapter's identity (name and content digest of its files).

Each pair of engines that differ in one fact gets different namespace digests (so neither reads the other's pages
from a shared store), and equal facts give equal digests (so engines that can share, do). Namespaces are built by
the real :class:`TierKVConnector` from vLLM's own config objects (``vllm_parts``); the cross-engine LoRA cases run
on the fake engine with a shared file store.
"""
import logging
from types import SimpleNamespace

import pytest
import torch
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.platforms import current_platform
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

import vllm.v1.attention.backends.cpu_attn  # noqa: F401  loads vLLM's kernels for this CPU before _amx patches
import tierkv.connector.core.page_hash as page_hash
from tests.helpers.fake_engine import P, FakeEngine, Req
from tierkv.connector.core.config import ConfigError
from tierkv.connector.l2.device_pool import DevicePool, device_layout_tag
from tierkv.connector.core.page_hash import adapter_digest, lora_identity, request_root
from tierkv.connector.vllm.connector import TierKVConnector, kv_dtype_name, lora_key
from tierkv.storage_backends.file.store import FileStore
from tests.helpers.vllm_parts import BLOCK, HEAD_DIM, KV_HEADS, LAYER_NAMES, SCHEDULER, WORKER, TierkvLoggerState, write_model


@pytest.fixture
def model(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERKV_LEDGER_DIR", str(tmp_path))
    state = TierkvLoggerState()
    yield write_model(tmp_path / "model")
    state.restore()


def _conn(model, role=SCHEDULER, *, cache_dtype="auto", dtype="bfloat16", layout=None, extra=None, caches=None):
    """A connector of ``role`` for an engine with these settings (``caches``: register these KV tensors)."""
    kt = KVTransferConfig(kv_connector="TierKVConnector", kv_connector_module_path="tierkv.connector.vllm.connector",
                          kv_role="kv_both", kv_connector_extra_config={"host_pool.num_pages": 4, **(extra or {})})
    mc = ModelConfig(model=model, skip_tokenizer_init=True, dtype=dtype, max_model_len=1024)
    vc = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=BLOCK, cache_dtype=cache_dtype),
                    kv_transfer_config=kt)
    el = torch.uint8 if cache_dtype.startswith("fp8") else getattr(torch, dtype)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=el)
    kvc = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYER_NAMES, spec)],
                        kv_cache_layout=layout)
    c = TierKVConnector(vc, role, kvc)
    if caches is not None:
        c.register_kv_caches(caches)
    return c


def _digest(model, **kw) -> bytes:
    return _conn(model, **kw).namespace.digest()


def _amx(monkeypatch, on: bool):
    """Make vLLM's ISA choice see a CPU with AVX-512, with or without AMX, whatever this machine has (vLLM's CPU
    backend takes an FP8 KV cache only with one of them; an AVX2-only CPU refuses it, so the FP8 facts are those of
    such a CPU). Its kernel library for this machine's CPU is loaded at the module's import, before any patch."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: on)
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: True)


def _gpu(monkeypatch):
    monkeypatch.setattr(type(current_platform), "is_cpu", classmethod(lambda cls: False))


# ------------------------------------------------------------------ item 7: the device's packing
def test_amx_and_non_amx_cpu_packing_get_different_namespaces(model, monkeypatch):
    _amx(monkeypatch, True)
    amx = _conn(model).namespace
    _amx(monkeypatch, False)
    vec = _conn(model).namespace
    assert amx.kv_layout == "layer_first/cpu-amx/LBHNC" and vec.kv_layout == "layer_first/cpu-vec/LBHNC"
    assert amx.digest() != vec.digest()
    _amx(monkeypatch, True)
    assert _digest(model) == amx.digest()   # equal facts, equal digests (a second engine on the same kind of CPU)


def test_amx_is_chosen_for_bf16_only_so_an_fp16_engine_names_vec(model, monkeypatch):
    _amx(monkeypatch, True)  # vLLM's CPU backend uses AMX for bf16 models only
    assert _conn(model, dtype="float16").namespace.kv_layout == "layer_first/cpu-vec/LBHNC"


def test_cpu_and_gpu_layouts_get_different_namespaces(model, monkeypatch):
    _amx(monkeypatch, False)
    cpu = _digest(model)
    _gpu(monkeypatch)
    nhd = _conn(model, layout="NHD").namespace
    hnd = _conn(model, layout="HND").namespace
    assert nhd.kv_layout == "layer_first/flash/LBNHC" and hnd.kv_layout == "layer_first/flash/LBHNC"
    assert len({cpu, nhd.digest(), hnd.digest()}) == 3
    assert _digest(model, layout="LBNHC") == nhd.digest()  # an alias of the same byte order is the same namespace
    assert _digest(model, extra={"host_pool.layout": "page_first"}, layout="NHD") != nhd.digest()


def test_the_worker_pool_packs_pages_as_the_namespace_names(model, monkeypatch):
    """The scheduler (no tensors) and the worker (the real device pool) name the same packing; a worker whose pool
    would pack otherwise stops at start-up instead of storing other bytes under the scheduler's keys."""
    for amx in (True, False):
        _amx(monkeypatch, amx)
        caches = {n: torch.zeros(8, KV_HEADS, BLOCK, 2 * HEAD_DIM, dtype=torch.bfloat16) for n in LAYER_NAMES}
        w = _conn(model, WORKER, caches=caches)
        assert w._worker.host.kv_layout == w.namespace.kv_layout == _conn(model).namespace.kv_layout
        assert w._worker.dev.isa == ("amx" if amx else "vec")
        w.shutdown()
    monkeypatch.setattr(DevicePool, "from_vllm", _with_isa(DevicePool.from_vllm, "vec16"))
    with pytest.raises(ConfigError, match="cpu-vec16"):
        _conn(model, WORKER, caches=caches)


def _with_isa(f, isa):
    def g(*a, **kw):
        kw["isa"] = isa
        return f(*a, **kw)
    return g


def test_device_layout_tags_name_each_packing():
    tags = {device_layout_tag("cpu", "LBHNC", isa) for isa in ("amx", "vec", "vec16", "neon")}
    tags |= {device_layout_tag("flash", lay) for lay in ("LBNHC", "LBHNC", "BLNHC", "BLHNC")}
    tags |= {device_layout_tag("mla", "LBNHC")}
    assert len(tags) == 9
    assert device_layout_tag("flash", "NHD") == device_layout_tag("flash", "LBNHC")
    assert device_layout_tag("cpu", "HND", "amx") == "cpu-amx/LBHNC"


# ------------------------------------------------------------------ item 2: the KV cache dtype
def test_fp8_formats_and_bf16_get_different_namespaces(model, monkeypatch):
    _amx(monkeypatch, False)
    d = {cd: _conn(model, cache_dtype=cd).namespace for cd in ("auto", "fp8_e4m3", "fp8_e5m2", "fp8")}
    assert {k: ns.dtype for k, ns in d.items()} == {"auto": "bfloat16", "fp8_e4m3": "fp8_e4m3",
                                                    "fp8_e5m2": "fp8_e5m2", "fp8": "fp8"}
    assert len({ns.digest() for ns in d.values()}) == 4   # the KV tensors are uint8 for every FP8 format
    assert _digest(model, cache_dtype="fp8_e5m2") == d["fp8_e5m2"].digest()
    assert _digest(model, cache_dtype="bfloat16") == d["auto"].digest()  # bf16 spelled out: the same bytes


def test_the_model_dtype_under_an_fp8_cache_is_in_the_namespace(model, monkeypatch):
    _amx(monkeypatch, False)
    assert _digest(model, cache_dtype="fp8_e4m3") != _digest(model, cache_dtype="fp8_e4m3", dtype="float16")


def test_fnuz_fp8_and_unsupported_cache_dtypes():
    assert kv_dtype_name("fp8_e4m3", torch.uint8, fp8_fnuz=True) == "fp8_e4m3-fnuz"
    assert kv_dtype_name("auto", torch.float16) == "float16"
    with pytest.raises(ConfigError, match="int8_per_token_head"):
        kv_dtype_name("int8_per_token_head", torch.int8)


def test_fp8_pages_are_half_the_bytes_and_round_trip_bit_exact(model, monkeypatch):
    _amx(monkeypatch, False)
    g = torch.Generator().manual_seed(3)
    shape = (8, KV_HEADS, BLOCK, 2 * HEAD_DIM)
    caches = {n: torch.randint(0, 256, shape, dtype=torch.uint8, generator=g) for n in LAYER_NAMES}
    w = _conn(model, WORKER, cache_dtype="fp8_e5m2", caches=caches)
    bf = _conn(model, WORKER, caches={n: torch.zeros(shape, dtype=torch.bfloat16) for n in LAYER_NAMES})
    assert 2 * w.page_bytes == bf.page_bytes
    from tierkv import kernels
    kernels.save_pages(w._worker.dev, w._worker.host, [2, 5], [0, 1])
    for t in caches.values():
        t[6:8].zero_()
    kernels.load_pages(w._worker.host, w._worker.dev, [0, 1], [6, 7])
    assert all(torch.equal(t[6], t[2]) and torch.equal(t[7], t[5]) for t in caches.values())
    w.shutdown()
    bf.shutdown()


# ------------------------------------------------------------------ item 6: LoRA identity
def _adapter(d, weights: bytes, config: str = '{"r": 8}'):
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_model.safetensors").write_bytes(weights)
    (d / "adapter_config.json").write_text(config)
    return str(d)


def test_adapter_digest_follows_the_content_of_every_file(tmp_path):
    a = _adapter(tmp_path / "a", b"w" * 1000)
    assert adapter_digest(a) == adapter_digest(_adapter(tmp_path / "copy", b"w" * 1000))  # path-independent
    assert adapter_digest(a) != adapter_digest(_adapter(tmp_path / "b", b"w" * 999 + b"x"))
    assert adapter_digest(a) != adapter_digest(_adapter(tmp_path / "c", b"w" * 1000, '{"r": 16}'))
    (tmp_path / "a" / ".cache").mkdir()
    (tmp_path / "a" / ".cache" / "junk").write_text("x")
    assert adapter_digest(a) == adapter_digest(tmp_path / "copy")
    with pytest.raises(OSError):
        adapter_digest(str(tmp_path / "missing"))


def test_lora_identity_names_the_adapter_and_its_weights(tmp_path, monkeypatch):
    monkeypatch.setattr(page_hash, "_LORA_IDS", {})
    v1 = _adapter(tmp_path / "v1", b"old weights")
    v2 = _adapter(tmp_path / "v2", b"new weights")
    assert lora_identity(None, v1) is None and lora_identity("", v1) is None
    x1, x2, y1 = lora_identity("x", v1), lora_identity("x", v2), lora_identity("y", v1)
    assert len({x1, x2, y1}) == 3
    ns = b"\0" * 16
    assert len({request_root(ns, x1), request_root(ns, x2), request_root(ns, y1), request_root(ns)}) == 4
    # computed once per adapter: a later change of the files under the same (name, path, id) is not re-read
    _adapter(tmp_path / "v1", b"changed later")
    assert lora_identity("x", v1) == x1
    monkeypatch.setattr(page_hash, "_LORA_IDS", {})  # a new engine process reads the new files
    assert lora_identity("x", v1) not in (x1, x2)


def test_the_connector_keys_lora_requests_by_identity(model, tmp_path, monkeypatch):
    monkeypatch.setattr(page_hash, "_LORA_IDS", {})
    v1, v2 = _adapter(tmp_path / "v1", b"old"), _adapter(tmp_path / "v2", b"new")

    def req(rid, lora):
        return SimpleNamespace(request_id=rid, all_token_ids=list(range(1, 3 * BLOCK)), lora_request=lora,
                               cache_salt=None, skip_reading_prefix_cache=False)

    def lr(name, path, i):
        return SimpleNamespace(lora_name=name, lora_path=path, lora_int_id=i)

    c = _conn(model)
    rs = {"base": None, "x1": lr("x", v1, 1), "x2": lr("x", v2, 2), "y1": lr("y", v1, 3), "base2": None}
    for rid, lora in rs.items():
        c.on_new_request(req(rid, lora))
    roots = {rid: c._sched.requests[rid].keys.root for rid in rs}
    assert roots["base"] == roots["base2"] == request_root(c._sched.ns_digest)
    assert len({roots[k] for k in ("base", "x1", "x2", "y1")}) == 4
    assert roots["x1"] == request_root(c._sched.ns_digest, lora_key(rs["x1"]))
    seen: list[str] = []
    h = logging.Handler()
    h.emit = lambda r: seen.append(r.getMessage())
    tk = logging.getLogger("tierkv")
    tk.addHandler(h)
    try:  # files that cannot be read: this engine's own pages only, said once
        gone = lr("z", str(tmp_path / "gone"), 4)
        assert lora_key(gone) == lora_key(gone) != lora_key(lr("z", str(tmp_path / "gone"), 5))
        assert "z" in lora_key(gone) and "@process:" in lora_key(gone)
    finally:
        tk.removeHandler(h)
    assert sum("cannot be read" in m for m in seen) == 1, seen
    c.shutdown()


def _file_store(root):
    return lambda rank, ns, page_bytes: FileStore(ns, page_bytes, root=str(root))


def _serve(root, req):
    """A fresh engine (empty L1, L2 and index, as a new process) on the file store at ``root`` serves ``req`` once
    and writes its pages through; returns its hit in tokens (loaded pages are checked against the request's tag)."""
    e = FakeEngine(store=_file_store(root), controller={"write_policy": "write_through"})
    hit = e.run_l3(req)
    e.settle()
    e.idle_check()
    e.close()
    return hit


def test_a_changed_adapter_under_the_same_name_never_loads_old_pages(tmp_path, monkeypatch):
    """vLLM #44250: a new engine serving adapter "x" with new weights loaded pages written
    under the old weights. Fingerprints depend on the tag (the weights), so a wrong hit fails the page check."""
    v1, v2 = _adapter(tmp_path / "v1", b"old weights"), _adapter(tmp_path / "v2", b"new weights")
    doc = list(range(100, 100 + 4 * P))
    store = tmp_path / "l3"

    def ident(path):  # each engine is a new process: the digest is read afresh
        monkeypatch.setattr(page_hash, "_LORA_IDS", {})
        return lora_identity("x", path)

    assert _serve(store, Req("a", doc + [1], lora=ident(v1), tag="x-old")) == 0
    assert _serve(store, Req("b", doc + [2], lora=ident(v2), tag="x-new")) == 0        # new weights: no hit
    assert _serve(store, Req("c", doc + [3], lora=ident(v1), tag="x-old")) == 4 * P    # old weights: its own pages
    assert _serve(store, Req("d", doc + [4], lora=ident(v2), tag="x-new")) == 4 * P
    assert _serve(store, Req("e", doc + [5], lora=lora_identity("y", v1), tag="y")) == 0  # another adapter
    assert _serve(store, Req("f", doc + [6])) == 0                                       # base model: its own
    assert _serve(store, Req("g", doc + [7])) == 4 * P                                   # shared by base requests


def test_two_adapters_on_one_server_never_share_pages_and_base_requests_do(tmp_path):
    x, y = lora_identity("x", _adapter(tmp_path / "x", b"x")), lora_identity("y", _adapter(tmp_path / "y", b"x"))
    e = FakeEngine()
    doc = list(range(7, 7 + 3 * P))
    assert e.run(Req("x1", doc + [1], lora=x, tag="x")) == 0
    assert e.run(Req("y1", doc + [2], lora=y, tag="y")) == 0
    assert e.run(Req("b1", doc + [3])) == 0
    assert e.run(Req("x2", doc + [4], lora=x, tag="x")) == 3 * P
    assert e.run(Req("y2", doc + [5], lora=y, tag="y")) == 3 * P
    assert e.run(Req("b2", doc + [6])) == 3 * P
    e.idle_check()


# ------------------------------------------------------------------ the operator's namespace salt (docs/tenants.md)
def test_the_operator_salt_from_config_or_environment_is_in_the_namespace(model, monkeypatch):
    monkeypatch.delenv(page_hash.NAMESPACE_SALT_ENV, raising=False)
    plain = _digest(model)
    one = _conn(model, extra={"namespace_salt": "deployment-one"}).namespace
    assert one.digest() != plain and _digest(model, extra={"namespace_salt": "deployment-two"}) != one.digest()
    assert "deployment-one" not in repr(one) and one.describe()["namespace_salt"] == "set"
    monkeypatch.setenv(page_hash.NAMESPACE_SALT_ENV, "deployment-one")
    assert _digest(model) == one.digest()   # the container's variable means the same as the config key
