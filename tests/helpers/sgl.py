"""Helpers of the SGLang adapter tests: SGLang's own host pool classes built on the CPU, its storage config, and
the tierkv adapter built through SGLang's own ``StorageBackendFactory`` (``dynamic``), as SGLang's
``HiCacheController.attach_storage_backend`` does (create, then ``register_mem_pool_host``).

SGLang 0.5.23 is installed in the project venv without its dependencies (``.ci/setup_env.sh``); its host-pool and
server-argument modules reach model configs that import torchvision, which has no CPU build on PyPI, so
``benchmarks/peers/sglang_cpu_shims.py`` is imported first (it changes nothing when a real torchvision exists).
"""
from __future__ import annotations


from benchmarks.peers import sglang_cpu_shims  # noqa: E402,F401  (before the first sglang.srt import that reaches model configs)
import torch  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

MODULE = "tierkv.connector.sglang.hicache"
CLASS = "TierKVHiCacheStorage"
MODEL = "Qwen/Qwen3-0.6B"


def mha_pool(layout: str = "page_first", *, layers: int = 2, heads: int = 2, head_dim: int = 64,
             page_size: int = 16, pages: int = 16, dtype=torch.bfloat16) -> MHATokenToKVPoolHost:
    """SGLang's MHA host pool (L2) on the CPU, unpinned, holding ``pages`` pages (plus SGLang's padding page) of
    ``page_size`` tokens; the "device" buffers it mirrors are CPU tensors too (only their geometry is used)."""
    ntok = pages * page_size
    k = tuple(torch.zeros(ntok, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(ntok, heads, head_dim, dtype=dtype) for _ in range(layers))
    bufs = KVBuffers(k=k, v=v, k_data_ptrs=torch.tensor([t.data_ptr() for t in k]),
                     v_data_ptrs=torch.tensor([t.data_ptr() for t in v]), layout=KVBufferLayout.NHD)
    info = MHABufferInfo(buffers=bufs, page_size=page_size, head_num=heads, head_dim=head_dim, v_head_dim=head_dim,
                         dtype=dtype, device=torch.device("cpu"))
    return MHATokenToKVPoolHost(info, 1.0, 0, page_size, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=ntok, start_layer=0, end_layer=layers)


def mla_pool(layout: str = "page_first", *, layers: int = 2, kv_lora_rank: int = 64, rope_dim: int = 16,
             page_size: int = 16, pages: int = 16, dtype=torch.bfloat16):
    """SGLang's MLA host pool (one latent row of ``kv_lora_rank + rope_dim`` per token and layer) on the CPU."""
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    ntok = pages * page_size
    bufs = tuple(torch.zeros(ntok, 1, kv_lora_rank + rope_dim, dtype=dtype) for _ in range(layers))
    info = MLABufferInfo(buffers=bufs, data_ptrs=torch.tensor([b.data_ptr() for b in bufs]),
                         layer_indices=tuple(range(layers)), device_layer_num=layers, page_size=page_size,
                         kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope_dim, kv_cache_dim=kv_lora_rank + rope_dim,
                         dtype=dtype, device=torch.device("cpu"))
    return MLATokenToKVPoolHost(info, 1.0, 0, page_size, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=ntok, start_layer=0, end_layer=layers,
                                target_layer_num=layers)


def storage_config(extra: dict, *, tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1,
                   mla: bool = False, model: str = MODEL, layout: str = "page_first") -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
                                attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                                is_page_first_layout=layout == "page_first", model_name=model,
                                extra_config=dict(extra))


def extra_config(l3: dict, **more) -> dict:
    """``--hicache-storage-backend-extra-config`` for the tierkv backend (zero-copy path on)."""
    return {"backend_name": "tierkv", "module_path": MODULE, "class_name": CLASS, "interface_v1": 1,
            "l3": l3, **more}


def attach(extra: dict, pool, **cfg):
    """Build the backend through SGLang's factory and register the host pool, as SGLang's attach does."""
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra, layout=pool.layout, **cfg),
                                                   pool)
    backend.register_mem_pool_host(pool)
    return backend


def fill_pages(pool, n: int, seed: int) -> torch.Tensor:
    """Random bytes in the first ``n`` pages of ``pool``; returns their host indices (``n * page_size`` slots)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.arange(n * pool.page_size, dtype=torch.int64)
    for i in range(n):
        page = pool.get_data_page(i * pool.page_size, flat=True)
        rnd = torch.randint(0, 256, (page.numel() * page.element_size(),), dtype=torch.uint8, generator=g)
        pool.set_from_flat_data_page(i * pool.page_size, rnd.view(pool.dtype))
    return idx


def page_bytes_of(pool, i: int) -> torch.Tensor:
    """Copy of page ``i`` in the flat byte order SGLang's file backend stores."""
    return pool.get_data_page(i * pool.page_size, flat=True).contiguous().view(torch.uint8).clone()


def keys(n: int, salt: str = "") -> list[str]:
    """SGLang-style page keys: 64 lowercase hex (SHA-256)."""
    import hashlib

    return [hashlib.sha256(f"{salt}/{i}".encode()).hexdigest() for i in range(n)]


def build_namespace_for(pool, records: int = 1, **cfg):
    """The tierkv namespace the adapter will use for ``pool`` under :func:`storage_config` ``(**cfg)`` with
    ``records`` records per page."""
    from tierkv.connector.sglang.hicache import build_namespace

    return build_namespace(storage_config({}, layout=pool.layout, **cfg), pool, records=records)


def mamba_pool(layout: str = "page_first", *, layers: int = 2, slots: int = 8):
    """SGLang's Mamba state host pool on the CPU (one page = one state slot: fp32 temporal state and a bf16 conv
    state per layer)."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(temporal=torch.zeros(layers, slots, 4, 8, dtype=torch.float32),
                                conv=(torch.zeros(layers, slots, 3, 16, dtype=torch.bfloat16),))
    return MambaPoolHost(info, 2.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout=layout)


def fill_slots(pool, slots, seed: int) -> None:
    """Random bytes in the pages (state slots, or token pages) starting at host indices ``slots``."""
    g = torch.Generator().manual_seed(seed)
    for s in slots:
        n = pool.get_dummy_flat_data_page().numel() * pool.get_dummy_flat_data_page().element_size()
        pool.set_from_flat_data_page(s, torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(
            pool.get_dummy_flat_data_page().dtype))


def slot_bytes(pool, s: int) -> torch.Tensor:
    """Copy of the page at host index ``s`` in its flat byte order."""
    return pool.get_data_page(s, flat=True).contiguous().reshape(-1).view(torch.uint8).clone()


def hybrid_controller(backend, pools: dict, page_size: int):
    """SGLang's own ``HybridCacheController`` object, not started (no device, threads or process groups), holding
    just what its storage paths read (``_storage_hit_query``, ``_page_backup_with_stable_layout``,
    ``_page_transfer_with_stable_layout``): the backend and its storage config (``backup_skip``), the page size, the zero-copy page functions, the host pool
    group's ``entry_map`` and the prefetch ack queue. Its methods then run unchanged."""
    from queue import Queue
    from types import SimpleNamespace

    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    ctl = object.__new__(HybridCacheController)
    ctl.storage_backend, ctl.storage_config, ctl.page_size = backend, backend.storage_config, page_size
    ctl.storage_backend_type = "dynamic"
    ctl.page_get_func, ctl.page_set_func = ctl._page_get_zero_copy, ctl._page_set_zero_copy
    ctl.prefetch_sync_queue = Queue()
    ctl.released = []
    ctl.append_host_mem_release = lambda *a, **k: ctl.released.append((a, k))
    ctl.mem_pool_host = SimpleNamespace(page_size=page_size,
                                        entry_map={n: SimpleNamespace(host_pool=p) for n, p in pools.items()})
    return ctl
