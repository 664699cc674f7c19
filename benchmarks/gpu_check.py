"""tierkv's CUDA path checked and timed in one run (issue 18): Triton kernels, pinned L2, side stream, L3.

    python -m benchmarks.gpu_check --out gpu_check.json     # on a CUDA machine: under 6 minutes
    TRITON_INTERPRET=1 python -m benchmarks.gpu_check --quick --out /tmp/q.json   # CPU (CI): tiny shapes
    python -m benchmarks.gpu_check --readme-from gpu_check.json    # prints a "## gpu_check" README section

``--readme-from`` runs in the checkout: a result from the GPU machine (a copy of the working tree without ``.git``)
records the git blob hashes of its code files, and the section names the commit whose files they are; a result of
uncommitted code, a ``--quick`` run or a file lacking a key is refused (``results_check.check_results``).

Five parts, each recorded with its target and a pass/fail (``passed``: true, false, or null when not measured)
in one JSON file, and summed up on stdout:

* ``correctness``: the Triton kernels (``impl="triton"``) against the torch reference (``impl="torch"``, run on a
  CPU copy of the same KV bytes), bit for bit, for every host layout (``layer_first``, ``page_first``,
  ``page_first_direct``), every GPU KV layout of :data:`tierkv.kernels.testing.DEVICE_LAYOUTS` (FlashAttention NHD,
  FlashInfer NHD/HND, the block-outermost layouts, MLA; ``--quick``: NHD, HND and MLA), bf16, FP8 (``float8_e4m3fn``)
  and FP8 stored as ``uint8``, one and two kernel blocks per page, all layers and a subset, random non-contiguous
  block ids and slots. Each case saves, compares the host buffers, loads into other random blocks, compares the
  device bytes, and checks the loaded blocks hold the saved blocks' bytes (the layers not selected untouched).
* ``bandwidth`` (CUDA only): L1->L2 and L2->L1 of scattered pages of 64 KiB to 2 MiB (random block ids and
  slots) against one contiguous pinned ``copy_(non_blocking=True)`` of the same bytes; target >= 0.8 of that copy.
* ``overlap`` (CUDA only): saves and loads on tierkv's side stream while a bf16 matmul loop runs on the compute
  stream; the compute's slowdown (target <= 5 %) and the share of the transfer time hidden.
* ``pinned`` (CUDA only): the host memory an L2 of 1, 3, 5 and 6 GiB takes (field scenario R29: pinned
  allocations rounded up to a power of two), each in a fresh process, from ``/proc/self/status`` (VmRSS, VmLck,
  VmPin) and ``torch.cuda.host_memory_stats()``; next to it the same bytes pinned with ``cudaHostRegister``.
  Target: taken <= requested + 5 %.
* ``round_trip``: the fake engine of ``tests/helpers/fake_engine.py`` with its L1 on the device (FlashAttention NHD),
  a pinned L2 and a file L3 under a temp dir, ``write_through``: one engine computes pages, saves them to L2 and
  backs them up; a second engine (empty L1 and L2) on the same directory prefetches them from L3 and loads them;
  every loaded page is compared with the bytes first computed. The file store needs pydantic: when it is not
  importable the script installs the wheels carried in ``.whl/`` (``pip install --no-index --target`` a temp dir);
  without them the part is recorded as skipped ("needs pydantic: not on the GPU machine").

Without an installed tierkv (the GPU machine has none) the script maps ``tierkv.*`` onto the checkout itself.
A time budget (``--budget-s``, default 330 s) stops a part that would run past it; what did not run is recorded.
"""
from __future__ import annotations

import argparse
import atexit
import importlib
import importlib.util
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
BW_TARGET = 0.8
SLOWDOWN_TARGET = 0.05
PINNED_SLACK = 0.05
PINNED_GIB = (1, 3, 5, 6)
NOT_MEASURED = "cpu: not measured"
NEEDS_PYDANTIC = "needs pydantic: not on the GPU machine (carry the wheels in .whl/, see benchmarks/README.md)"


# ---------------------------------------------------------------------------------------------- environment
def bootstrap_tierkv() -> str:
    """Make ``import tierkv.connector`` work: the installed package when there is one, else the checkout (its
    top-level folders ``connector/``, ``kernels/``, ... become ``tierkv.connector``, ... as setup.py maps them; run
    from the checkout's root as ``python -m benchmarks.gpu_check``, which puts the root first on the import path).
    Returns how tierkv was found."""
    try:
        if importlib.util.find_spec("tierkv.connector") is not None:
            return "installed"
    except ModuleNotFoundError:
        pass
    for name in [m for m in sys.modules if m == "tierkv" or m.startswith("tierkv.")]:
        del sys.modules[name]
    import tierkv
    tierkv.__path__.append(str(ROOT))
    return "checkout"


#: set in the environment of the re-run :func:`carried_pydantic` starts: how pydantic was found, and its folder
PYDANTIC_FROM_ENV = "GPU_CHECK_PYDANTIC_FROM"


def carried_pydantic() -> str:
    """Make pydantic importable if it is not: install the wheels of ``.whl/`` (env ``GPU_CHECK_WHEELS``: another
    folder) into a temp dir and run this command again with that dir on ``PYTHONPATH`` (this call then does not
    return). Returns ``"installed"``, ``"from .whl (N wheels)"`` (in the re-run), ``"missing"`` or
    ``"pip failed: ..."``."""
    found = os.environ.get(PYDANTIC_FROM_ENV)
    if found:   # the re-run: the folder is ours to remove at exit
        atexit.register(shutil.rmtree, os.environ["PYTHONPATH"].split(os.pathsep)[0], True)
    try:
        import pydantic  # noqa: F401
        return found or "installed"
    except ImportError:
        if found:
            return f"pip failed: {found} not importable"
    wheels = sorted(Path(os.environ.get("GPU_CHECK_WHEELS", ROOT / ".whl")).glob("*.whl"))
    if not wheels:
        return "missing"
    target = tempfile.mkdtemp(prefix="gpu_check_site_")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--target", target, *map(str, wheels)], capture_output=True, text=True)
    if r.returncode:
        shutil.rmtree(target, True)
        return "pip failed: " + (r.stderr or r.stdout)[-300:]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (target, os.environ.get("PYTHONPATH")) if x))
    env[PYDANTIC_FROM_ENV] = f"from .whl ({len(wheels)} wheels)"
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "benchmarks.gpu_check", *sys.argv[1:]], env)


def machine_info(torch, device) -> dict[str, Any]:
    """GPU name, driver, torch/triton/CUDA versions, Python, host, interpreter flag."""
    import triton
    info: dict[str, Any] = {
        "python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1", "device": str(device),
    }
    try:
        import numba
        info["numba"] = numba.__version__
    except ImportError:
        info["numba"] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), sm_count=p.multi_processor_count,
                    capability=f"{p.major}.{p.minor}")
        try:
            r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20)
            info["driver"] = r.stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            info["driver"] = None
    else:
        info.update(gpu=None, driver=None)
    return info


class Budget:
    """Wall-clock deadline shared by the parts."""

    def __init__(self, seconds: float):
        self.t0 = time.perf_counter()
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.t0)


def _sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------- correctness
def _same_views_on(torch, kv: dict, storage, device):
    """``kv`` (views of ``storage``) rebuilt over a copy of ``storage`` on ``device``: same offsets and strides."""
    st = storage.to(device, copy=True)
    out = {}
    for name, t in kv.items():
        out[name] = torch.empty(0, dtype=t.dtype, device=device).set_(
            st.untyped_storage(), t.storage_offset(), t.shape, t.stride())
    return out, st


def correctness(torch, device, quick: bool, budget: Budget, stop_at: float) -> dict[str, Any]:
    """Triton vs torch, bit for bit (module docstring). ``stop_at``: budget seconds left at which to stop."""
    from tierkv.connector.l2.device_pool import DevicePool
    from tierkv.connector.l2.host_pool import HOST_POOL_LAYOUTS, HostPool
    from tierkv.kernels import load_pages, save_pages
    from tierkv.kernels.testing import DEVICE_LAYOUTS, make_kv_caches

    dtypes = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_as_uint8": torch.uint8}
    if quick:
        layouts = ["flash_attn_nhd", "flashinfer_hnd", "mla"]
        geo = dict(num_layers=2, num_blocks=8, block_size=16, num_kv_heads=2, head_dim=8)
        n_pages, n_slots, subset = 3, 5, [1]
    else:
        layouts = [n for n in DEVICE_LAYOUTS if n != "cpu"]
        geo = dict(num_layers=4, num_blocks=48, block_size=16, num_kv_heads=4, head_dim=64)
        n_pages, n_slots, subset = 12, 20, [1, 3]
    pinned = device.type == "cuda"
    cases, not_run = [], 0
    fill_host, fill_dev = 0xA5, 0x5A
    for name in layouts:
        backend, kv_layout, use_mla, _phys = DEVICE_LAYOUTS[name]
        for ratio in (1, 2):
            if ratio == 2 and name.endswith(("blhnc", "blnhc")):
                continue  # block-outermost layouts: one kernel block per page (vLLM's)
            for dname, dt in dtypes.items():
                for host_layout in HOST_POOL_LAYOUTS:
                    for layers in (None, subset):
                        case = {"device_layout": name, "dtype": dname, "host_layout": host_layout,
                                "layers": "all" if layers is None else layers, "kernel_blocks_per_page": ratio}
                        if budget.left() < stop_at:
                            not_run += 1
                            continue
                        tag = f"{name}/{ratio}/{dname}/{host_layout}/{layers}"
                        rng = random.Random(zlib.crc32(tag.encode()))
                        try:
                            case.update(_one_case(torch, device, pinned, DevicePool, HostPool, save_pages,
                                                  load_pages, make_kv_caches, geo, name, backend, kv_layout,
                                                  use_mla, ratio, dt, host_layout, layers, rng, n_pages, n_slots,
                                                  fill_host, fill_dev))
                        except Exception as e:  # a kernel that breaks is a failed case, the others still run
                            case.update(passed=False, error=f"{type(e).__name__}: {e}"[:500])
                        cases.append(case)
    failed = [c for c in cases if not c["passed"]]
    return {"status": "measured", "target": "every case bit-identical to the torch reference", "cases": cases,
            "n_cases": len(cases),
            "n_failed": len(failed), "n_not_run": not_run,
            "passed": bool(cases) and not failed and not not_run}


def _one_case(torch, device, pinned, DevicePool, HostPool, save_pages, load_pages, make_kv_caches, geo, name,
              backend, kv_layout, use_mla, ratio, dt, host_layout, layers, rng, n_pages, n_slots, fill_host,
              fill_dev) -> dict[str, Any]:
    nb, bs = geo["num_blocks"], geo["block_size"]
    kv_ref, st_ref, _spec = make_kv_caches(name, kernel_block_size=bs // ratio, dtype=dt,
                                           seed=rng.randrange(1 << 30), **geo)
    kv_dev, st_dev = _same_views_on(torch, kv_ref, st_ref, device)
    pool_kw = dict(num_blocks=nb, block_size=bs, kv_cache_layout=kv_layout, backend=backend, use_mla=use_mla)
    ref = DevicePool.from_vllm(kv_ref, **pool_kw)
    dev = DevicePool.from_vllm(kv_dev, **pool_kw)
    h_ref = HostPool.for_device(ref, n_slots, host_layout)
    h_dev = HostPool.for_device(dev, n_slots, host_layout, pin_memory=pinned)
    h_ref.buffer.fill_(fill_host)
    h_dev.buffer.fill_(fill_host)
    blocks = rng.sample(range(nb), n_pages)
    slots = rng.sample(range(n_slots), n_pages)
    save_pages(dev, h_dev, blocks, slots, layers, impl="triton")
    _sync(torch, device)
    save_pages(ref, h_ref, blocks, slots, layers, impl="torch")
    save_equal = torch.equal(h_dev.buffer, h_ref.buffer)
    save_moved = bool(h_ref.buffer.ne(fill_host).any())
    sel = range(ref.num_layers) if layers is None else layers
    saved = {(l, i): ref.block_bytes_view(l)[b].clone() for l in sel for i, b in enumerate(blocks)}
    # load the slots back into other random blocks of a pool filled with a known byte
    blocks2 = rng.sample(range(nb), n_pages)
    st_ref.fill_(fill_dev)
    st_dev.fill_(fill_dev)
    load_pages(h_dev, dev, slots, blocks2, layers, impl="triton")
    _sync(torch, device)
    load_pages(h_ref, ref, slots, blocks2, layers, impl="torch")
    load_equal = torch.equal(st_dev.cpu(), st_ref)
    restored = all(torch.equal(ref.block_bytes_view(l)[blocks2[i]], v) for (l, i), v in saved.items())
    others = [l for l in range(ref.num_layers) if l not in sel]
    untouched = all(bool(ref.block_bytes_view(l).eq(fill_dev & 0xFF).all()) for l in others)
    return {"blocks": blocks, "slots": slots, "load_blocks": blocks2, "save_equal": save_equal,
            "load_equal": load_equal, "round_trip_restored": restored, "other_layers_untouched": untouched,
            "passed": bool(save_equal and save_moved and load_equal and restored and untouched)}


# ---------------------------------------------------------------------------------------------- bandwidth
def _device_kv(torch, name: str, L: int, num_blocks: int, bs: int, H: int, D: int, dtype, device, seed: int):
    """vLLM-like per-layer views of one random allocation on ``device`` (physical orders of DEVICE_LAYOUTS)."""
    from tierkv.kernels.testing import DEVICE_LAYOUTS
    backend, layout, use_mla, phys = DEVICE_LAYOUTS[name]
    H = 1 if use_mla else H
    C = D if use_mla else 2 * D
    flat = torch.empty(L * num_blocks * H * bs * C, dtype=dtype, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    flat.view(torch.uint8).random_(0, 256, generator=g)
    kv = {}
    for l in range(L):
        if phys == "LBHNC":
            t = flat.view(L, num_blocks, H, bs, C)[l]
        elif phys == "LBNHC":
            t = flat.view(L, num_blocks, bs, H, C)[l].transpose(1, 2)
        else:
            raise ValueError(f"bandwidth layouts are LBHNC/LBNHC, got {phys}")
        kv[f"model.layers.{l}.self_attn.attn"] = t[:, 0] if use_mla else t
    return kv, flat, dict(num_blocks=num_blocks, block_size=bs, kv_cache_layout=layout, backend=backend,
                          use_mla=use_mla)


def _timed(torch, device, fn, reps: int) -> float:
    """Median wall seconds of ``fn`` (after one warm-up), each run ended by a device synchronize."""
    fn()
    _sync(torch, device)
    times = []
    for _ in range(reps):
        _sync(torch, device)
        t0 = time.perf_counter()
        fn()
        _sync(torch, device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bandwidth(torch, device, quick: bool, budget: Budget, stop_at: float) -> dict[str, Any]:
    """Scattered page transfers vs one contiguous pinned copy of the same bytes (module docstring)."""
    if device.type != "cuda":
        return {"status": NOT_MEASURED, "passed": None, "target_ratio": BW_TARGET}
    from tierkv.connector.l2.device_pool import DevicePool
    from tierkv.connector.l2.host_pool import HOST_POOL_LAYOUTS, HostPool
    from tierkv.kernels import load_pages, save_pages

    total = (256 if quick else 1024) * 2**20
    reps = 3 if quick else 5
    # 64 KiB per layer and page (bf16): flash H=8, D=128, 16 tokens; MLA C=512, 64 tokens
    shapes = {"flash_attn_nhd": (16, 8, 128), "flashinfer_hnd": (16, 8, 128), "mla": (64, 1, 512)}
    rows, not_run = [], 0
    for n_layers in (1, 4, 16, 32):
        for name, (bs, H, D) in shapes.items():
            for host_layout in HOST_POOL_LAYOUTS:
                if budget.left() < stop_at:
                    not_run += 1
                    continue
                row: dict[str, Any] = {"device_layout": name, "host_layout": host_layout}
                try:
                    row.update(_bw_one(torch, device, DevicePool, HostPool, save_pages, load_pages, name, host_layout,
                                       n_layers, bs, H, D, total, reps))
                except Exception as e:
                    row.update(passed=False, error=f"{type(e).__name__}: {e}"[:500])
                rows.append(row)
                torch.cuda.empty_cache()
    failed = [r for r in rows if not r["passed"]]
    return {"status": "measured", "target_ratio": BW_TARGET, "bytes_per_run": total, "rows": rows,
            "n_failed": len(failed), "n_not_run": not_run, "passed": bool(rows) and not failed and not not_run,
            "note": "wall time of save_pages/load_pages(sync=True) incl. argument checks and launch; the copy is "
                    "copy_(non_blocking=True) between the pinned host buffer and the KV allocation, same bytes"}


def _bw_one(torch, device, DevicePool, HostPool, save_pages, load_pages, name, host_layout, n_layers, bs, H, D,
            total, reps) -> dict[str, Any]:
    """One (page size, device layout, host layout): both directions, each against the contiguous copy."""
    page_bytes = n_layers * bs * (1 if name == "mla" else 2 * H) * D * 2
    n = max(8, total // page_bytes)
    rng = random.Random(zlib.crc32(f"{name}/{host_layout}/{n_layers}".encode()))
    kv, flat, pool_kw = _device_kv(torch, name, n_layers, 2 * n, bs, H, D, torch.bfloat16, device, n_layers)
    dev = DevicePool.from_vllm(kv, **pool_kw)
    assert dev.block_bytes * n_layers == page_bytes, (dev.block_bytes, n_layers, page_bytes)
    host = HostPool.for_device(dev, n, host_layout, pin_memory=True)
    blocks = rng.sample(range(2 * n), n)   # random block table: scattered over twice as many blocks
    slots = rng.sample(range(n), n)
    nbytes = n * page_bytes
    dflat = flat.view(torch.uint8)[:nbytes]
    out = {"page_bytes": page_bytes, "layers": n_layers, "pages": n, "bytes": nbytes}
    # host-side share of a call: argument checks and the launch lists (no byte moves), to tell Python from PCIe
    from tierkv.kernels import triton_impl, validate_transfer
    def prep() -> None:
        list(triton_impl._jobs(dev, host, *validate_transfer(dev, host, blocks, slots, None)))
    out["host_prep_ms"] = round(1e3 * _timed(torch, device, prep, reps), 3)
    ok = True
    for direction, fn, copy in (
            ("L1->L2", lambda: save_pages(dev, host, blocks, slots, impl="triton"),
             lambda: host.buffer.copy_(dflat, non_blocking=True)),
            ("L2->L1", lambda: load_pages(host, dev, slots, blocks, impl="triton"),
             lambda: dflat.copy_(host.buffer, non_blocking=True))):
        t_k = _timed(torch, device, fn, reps)
        t_c = _timed(torch, device, copy, reps)
        ratio = t_c / t_k
        key = "save" if direction == "L1->L2" else "load"
        out[key] = {"direction": direction, "kernel_gbps": round(nbytes / t_k / 1e9, 2),
                    "copy_gbps": round(nbytes / t_c / 1e9, 2), "ratio": round(ratio, 3),
                    "passed": ratio >= BW_TARGET}
        ok &= ratio >= BW_TARGET
    out["passed"] = ok
    return out


# ---------------------------------------------------------------------------------------------- overlap
def overlap(torch, device, quick: bool, budget: Budget) -> dict[str, Any]:
    """Transfers on the side stream during a matmul loop on the compute stream (module docstring)."""
    if device.type != "cuda":
        return {"status": NOT_MEASURED, "passed": None, "target_slowdown": SLOWDOWN_TARGET}
    from tierkv.connector.l2.device_pool import DevicePool
    from tierkv.connector.l2.host_pool import HostPool
    from tierkv.kernels import load_pages, save_pages

    n_mm = 4096 if quick else 8192
    a = torch.randn(n_mm, n_mm, dtype=torch.bfloat16, device=device)
    b = torch.randn(n_mm, n_mm, dtype=torch.bfloat16, device=device)
    c = torch.empty_like(a)

    def mm(k: int) -> None:
        for _ in range(k):
            torch.matmul(a, b, out=c)

    # 1 MiB pages (16 layers x 64 KiB), 256 pages per transfer, layer_first (the default host layout)
    n_layers, n = 16, 256
    kv, _flat, pool_kw = _device_kv(torch, "flash_attn_nhd", n_layers, 2 * n, 16, 8, 128, torch.bfloat16, device, 7)
    dev = DevicePool.from_vllm(kv, **pool_kw)
    host = HostPool.for_device(dev, n, "layer_first", pin_memory=True)
    rng = random.Random(18)
    blocks, slots = rng.sample(range(2 * n), n), rng.sample(range(n), n)
    t_save = _timed(torch, device, lambda: save_pages(dev, host, blocks, slots, impl="triton"), 3)
    t_load = _timed(torch, device, lambda: load_pages(host, dev, slots, blocks, impl="triton"), 3)
    t_x = (t_save + t_load) / 2
    t_mm = _timed(torch, device, lambda: mm(4), 3) / 4
    k = max(1, round(t_x / t_mm))          # matmuls per transfer: one transfer's worth of compute
    rounds = 10 if quick else 20

    def compute_only() -> float:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        mm(k * rounds)
        e.record()
        e.synchronize()
        return s.elapsed_time(e) / 1e3

    def with_transfers() -> tuple[float, float]:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        s.record()
        evs = []
        for i in range(rounds):  # each transfer waits for the matmuls issued before it, then runs beside the next
            if i % 2 == 0:
                evs.append(save_pages(dev, host, blocks, slots, impl="triton", sync=False))
            else:
                evs.append(load_pages(host, dev, slots, blocks, impl="triton", sync=False))
            mm(k)
        e.record()
        e.synchronize()
        for ev in evs:
            ev.synchronize()
        return s.elapsed_time(e) / 1e3, time.perf_counter() - t0

    compute_only()
    with_transfers()
    alone = statistics.median(compute_only() for _ in range(3))
    runs = [with_transfers() for _ in range(3)]
    busy = statistics.median(r[0] for r in runs)
    wall = statistics.median(r[1] for r in runs)
    slowdown = busy / alone - 1
    xfer_total = rounds * t_x
    exposed = max(0.0, wall - alone)
    hidden = max(0.0, 1 - exposed / xfer_total)
    return {"status": "measured", "target_slowdown": SLOWDOWN_TARGET, "matmul": f"{n_mm}x{n_mm}x{n_mm} bf16",
            "matmuls_per_transfer": k, "rounds": rounds, "transfer_bytes": n * dev.block_bytes * n_layers,
            "transfer_s": round(t_x, 5), "compute_alone_s": round(alone, 5), "compute_with_transfers_s": round(busy, 5),
            "wall_with_transfers_s": round(wall, 5), "slowdown": round(slowdown, 4),
            "transfer_hidden": round(hidden, 3), "passed": slowdown <= SLOWDOWN_TARGET}


# ---------------------------------------------------------------------------------------------- pinned memory
def _proc_status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmLck", "VmPin"):
                out[k] = int(v.split()[0]) * 1024
    return out


def pinned_probe(gib: int, how: str) -> dict[str, Any]:
    """In this (fresh) process: pin ``gib`` GiB the way tierkv's L2 does (``how="hostpool"``: HostPool with
    ``pin_memory=True``) or with ``cudaHostRegister`` of an exact-size buffer (``how="register"``); the host
    memory that took, from /proc/self/status and the caching host allocator's stats."""
    import torch
    bootstrap_tierkv()
    from tierkv.connector.l2.host_pool import HostPool
    torch.cuda.init()
    torch.empty(1, device="cuda")
    want = gib * 2**30
    before = _proc_status()
    t0 = time.perf_counter()
    res: dict[str, Any] = {"requested_bytes": want, "how": how}
    if how == "hostpool":
        pool = HostPool(gib * 1024, 1, 2**20, "layer_first", pin_memory=True)
        res["pinned"] = pool.buffer.is_pinned()
    else:
        buf = torch.empty(want, dtype=torch.uint8)
        err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), want, 0)
        res["pinned"] = int(err) == 0 and buf.is_pinned()
        res["cuda_error"] = int(err)
    res["alloc_s"] = round(time.perf_counter() - t0, 3)
    after = _proc_status()
    for k in after:
        res[f"{k}_delta_bytes"] = after[k] - before.get(k, 0)
    try:
        st = torch.cuda.host_memory_stats()
        res["host_allocator_reserved_bytes"] = int(st.get("reserved_bytes.current", st.get("segment.current", 0)))
        res["host_allocator_stats"] = {k: int(v) for k, v in st.items() if "current" in k}
    except Exception as e:  # older torch: no host stats
        res["host_allocator_reserved_bytes"] = None
        res["host_allocator_error"] = str(e)[:200]
    taken = max([res.get("VmRSS_delta_bytes", 0), res.get("VmLck_delta_bytes", 0), res.get("VmPin_delta_bytes", 0),
                 res.get("host_allocator_reserved_bytes") or 0])
    res["taken_bytes"] = taken
    res["taken_over_requested"] = round(taken / want, 3)
    return res


def pinned(torch, device, quick: bool, budget: Budget, stop_at: float) -> dict[str, Any]:
    """Host memory taken by pinned L2s of 1, 3, 5, 6 GiB (``--quick``: 1 GiB), each probe a fresh process."""
    if device.type != "cuda":
        return {"status": NOT_MEASURED, "passed": None, "target": f"taken <= requested x {1 + PINNED_SLACK}"}
    rows, not_run = [], 0
    for gib in ((1,) if quick else PINNED_GIB):
        for how in ("hostpool", "register"):
            if budget.left() < stop_at:
                not_run += 1
                continue
            r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--pinned-probe", str(gib), how],
                               capture_output=True, text=True, timeout=max(30, budget.left() - stop_at + 30))
            try:
                row = json.loads(r.stdout.strip().splitlines()[-1])
            except (IndexError, ValueError):
                row = {"requested_bytes": gib * 2**30, "how": how, "error": (r.stderr or r.stdout)[-500:]}
            row["gib"] = gib
            row["passed"] = bool(row.get("pinned")) and "taken_bytes" in row and \
                row["taken_bytes"] <= row["requested_bytes"] * (1 + PINNED_SLACK)
            rows.append(row)
    tierkv_rows = [r for r in rows if r["how"] == "hostpool"]
    return {"status": "measured", "target": f"taken <= requested x {1 + PINNED_SLACK}", "rows": rows,
            "n_not_run": not_run,
            "tierkv_does": "HostPool allocates its L2 with torch.empty(pin_memory=True), i.e. through torch's "
                           "caching host allocator; the 'register' rows show the same bytes pinned with "
                           "cudaHostRegister of an exact-size buffer",
            "passed": bool(tierkv_rows) and all(r["passed"] for r in tierkv_rows) and not not_run}


# ---------------------------------------------------------------------------------------------- round trip
def round_trip(torch, device, quick: bool, pydantic_from: str) -> dict[str, Any]:
    """Save -> back up to a file L3 -> new engine (empty L1/L2) -> prefetch -> load, through the controller."""
    try:
        import pydantic  # noqa: F401
    except ImportError:
        return {"status": "skipped", "passed": None, "reason": NEEDS_PYDANTIC, "pydantic": pydantic_from}
    from benchmarks.harness import load_file

    fake_engine = load_file("tierkv_fake_engine", ROOT / "tests" / "helpers" / "fake_engine.py")
    from tierkv.connector.l2.device_pool import DevicePool
    from tierkv.connector.l2.host_pool import HostPool
    from tierkv.storage_backends.file.store import FileStore

    pinned_l2 = device.type == "cuda"

    class DeviceL1:
        """Stands in for DevicePool inside FakeEngine.__init__: puts the fake engine's L1 on ``device`` in
        FlashAttention's NHD layout (physically [L, B, N, H, 2D], registered as [B, H, N, 2D] views)."""

        @staticmethod
        def from_vllm(l1, *, num_blocks, block_size, **_kw):
            t0 = next(iter(l1.values()))
            B, H, N, C = t0.shape
            base = torch.zeros(len(l1), B, N, H, C, dtype=t0.dtype, device=device)
            for i, name in enumerate(list(l1)):
                l1[name] = base[i].transpose(1, 2)
            return DevicePool.from_vllm(l1, num_blocks=num_blocks, block_size=block_size, kv_cache_layout="NHD",
                                        backend="FLASH_ATTN")

    class PinnedL2:
        """Stands in for HostPool inside FakeEngine.__init__: the L2 is pinned on CUDA."""

        @staticmethod
        def for_device(dev, num_slots, layout="layer_first"):
            return HostPool.for_device(dev, num_slots, layout, pin_memory=pinned_l2)

    class DeviceFakeEngine(fake_engine.FakeEngine):
        """FakeEngine whose L1 lives on the device (pages compared on the CPU)."""

        def __init__(self, **kw):
            saved = fake_engine.DevicePool, fake_engine.HostPool
            fake_engine.DevicePool, fake_engine.HostPool = DeviceL1, PinnedL2
            try:
                super().__init__(**kw)
            finally:
                fake_engine.DevicePool, fake_engine.HostPool = saved

        def page_ok(self, req, i, rank=0):
            return all(torch.equal(t[req.blocks[i]].cpu(), fake_engine.fingerprint(
                req.tag + (f"/r{rank}" if rank else ""), req.tokens[: (i + 1) * fake_engine.P], layer))
                for layer, t in enumerate(self.ranks[rank][0].values()))

    P = fake_engine.P
    n_pages = 4 if quick else 16
    runs = []
    for layout in ("layer_first", "page_first", "page_first_direct"):
        root = tempfile.mkdtemp(prefix="gpu_check_l3_")
        r: dict[str, Any] = {"host_layout": layout, "pages": n_pages}
        try:
            def store(rank, ns, page_bytes, root=root):
                return FileStore(ns, page_bytes, root=root)

            doc = list(range(1000, 1000 + n_pages * P))
            ctl = {"write_policy": "write_through"}
            e1 = DeviceFakeEngine(num_blocks=2 * n_pages + 8, num_slots=2 * n_pages, store=store, controller=ctl,
                                  layout=layout)
            r["l1"] = f"{e1.dev.device} {e1.dev.layout_tag}"
            r["l2_pinned"] = e1.host.pinned
            e1.run_l3(fake_engine.Req("a", doc + [1]))
            e1.settle()
            r["backed_up_pages"] = e1.sched.ctl.counters.backup_stored_pages
            e1.close()
            e2 = DeviceFakeEngine(num_blocks=2 * n_pages + 8, num_slots=2 * n_pages, store=store, controller=ctl,
                                  layout=layout)
            r["l1_empty_before_load"] = all(not bool(t.any()) for t in e2.l1.values())
            hit = e2.run_l3(fake_engine.Req("b", doc + [2]))   # prefetch L3 -> L2, load L2 -> L1, pages checked
            r["l3_hit_tokens"] = hit
            r["prefetch_loaded_pages"] = e2.sched.ctl.counters.prefetch_loaded_pages
            e2.settle()
            r["l2_hit_tokens"] = e2.run_l3(fake_engine.Req("c", doc + [3]))
            e2.settle()
            e2.idle_check()
            e2.close()
            r["passed"] = (r["backed_up_pages"] == n_pages and r["l1_empty_before_load"]
                           and hit == n_pages * P and r["prefetch_loaded_pages"] == n_pages
                           and r["l2_hit_tokens"] == n_pages * P)
        except Exception as e:  # run_l3 raises AssertionError on a page loaded with wrong bytes
            r.update(passed=False, error=f"{type(e).__name__}: {e}"[:500])
        finally:
            shutil.rmtree(root, ignore_errors=True)
        runs.append(r)
    return {"status": "measured", "pydantic": pydantic_from, "target": "every page loaded back bit-identical",
            "runs": runs, "passed": all(r["passed"] for r in runs)}


# ---------------------------------------------------------------------------------------------- code identity
#: folders whose .py/.yaml files make up the code a run measured (blob hashes recorded in the result)
CODE_DIRS = ("connector", "kernels", "storage_backends", "tierkv", "configs", "benchmarks", "tests/helpers")


def _git_blob_sha(data: bytes) -> str:
    import hashlib
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def code_files(root: Path = ROOT) -> dict[str, str]:
    """``{path: git blob sha1}`` of the code files under :data:`CODE_DIRS` (the GPU machine gets a copy of the
    working tree without ``.git``: these hashes let ``--readme-from``, run in the checkout, name the commit).
    Folders whose name starts with ``.`` (local virtual environments such as ``benchmarks/peers/.lmcache-venv``,
    never committed) and ``__pycache__`` are not entered."""
    out = {}
    for d in CODE_DIRS:
        for dirpath, dirnames, filenames in os.walk(root / d):
            dirnames[:] = [n for n in dirnames if not n.startswith(".") and n != "__pycache__"]
            for name in filenames:
                f = Path(dirpath) / name
                if f.suffix in (".py", ".yaml") and f.is_file():
                    out[f.relative_to(root).as_posix()] = _git_blob_sha(f.read_bytes())
    return dict(sorted(out.items()))


def commit_of(files: dict[str, str], repo: Path = ROOT, depth: int = 300) -> Optional[str]:
    """The newest of the last ``depth`` commits of ``repo`` whose code files (:data:`CODE_DIRS`, .py/.yaml) are
    exactly ``files``; None when none is (the run measured uncommitted code)."""
    try:
        revs = subprocess.run(["git", "rev-list", "-n", str(depth), "HEAD"], cwd=repo, capture_output=True,
                              text=True, check=True, timeout=60).stdout.split()
        for rev in revs:
            ls = subprocess.run(["git", "ls-tree", "-r", rev, "--", *CODE_DIRS], cwd=repo, capture_output=True,
                                text=True, check=True, timeout=60).stdout
            tree = {}
            for line in ls.splitlines():
                meta, _, path = line.partition("\t")
                if path.endswith((".py", ".yaml")):
                    tree[path] = meta.split()[2]
            if tree == files:
                return rev
    except (OSError, subprocess.SubprocessError):
        return None
    return None


#: keys ``--readme-from`` needs (results_check.check_results refuses a file without them)
README_SCHEMA = {"mode": None, "quick": None, "machine": {"gpu": None, "driver": None, "torch": None, "triton": None,
                                                          "cuda": None, "python": None},
                 "wall_s": None, "passed": None, "code": {"commit": None, "dirty": None},
                 "parts": {"correctness": {"status": None, "passed": None},
                           "bandwidth": {"status": None, "passed": None}, "overlap": {"status": None, "passed": None},
                           "pinned": {"status": None, "passed": None},
                           "round_trip": {"status": None, "passed": None}}}


def checked_for_readme(res: dict[str, Any], name: str, repo: Path = ROOT) -> dict[str, Any]:
    """``res`` ready for a README table: when it ran outside a git checkout (the GPU machine), its commit is found
    from its code files' hashes (:func:`commit_of`); then ``results_check.check_results`` (every key present, a
    commit, no dirty code, not --quick) must pass. Raises ``results_check.ResultsError`` naming what is wrong."""
    from benchmarks.harness.results import check_results
    code = res.get("code") or {}
    if not code.get("commit") and code.get("files"):
        found = commit_of(code["files"], repo)
        res = dict(res, code=dict(code, commit=found, dirty=[] if found else
                                  ["(code files match no recent commit of this checkout)"]))
    check_results(res, README_SCHEMA, name)
    return res


# ---------------------------------------------------------------------------------------------- report
def _fmt_pass(p) -> str:
    return "n/a" if p is None else ("PASS" if p else "FAIL")


def _not_measured(part: dict[str, Any]) -> str:
    """A part that did not measure: its status and why (reason or error)."""
    why = part.get("reason") or part.get("error") or ""
    return f"{part['status']}: {why}" if why else part["status"]


def summary(res: dict[str, Any]) -> str:
    """Short text summary of a result (what the script prints)."""
    m = res["machine"]
    lines = [f"gpu_check ({res['mode']}) on {m.get('gpu') or 'CPU'}: driver {m.get('driver')}, torch {m['torch']}, "
             f"triton {m['triton']}, cuda {m['cuda']}, {res['wall_s']} s"]
    p = res["parts"]
    c = p["correctness"]
    if c["status"] == "measured":
        lines.append(f"  correctness  {_fmt_pass(c['passed'])}: {c['n_cases'] - c['n_failed']}/{c['n_cases']} "
                     f"cases bit-identical, {c['n_not_run']} not run")
        for fc in [x for x in c["cases"] if not x["passed"]][:5]:
            lines.append(f"    failed: {fc['device_layout']} {fc['dtype']} {fc['host_layout']} layers={fc['layers']} "
                         f"r={fc['kernel_blocks_per_page']} {fc.get('error', '')}")
    else:
        lines.append(f"  correctness  {_not_measured(c)}")
    bw = p["bandwidth"]
    if bw["status"] == "measured":
        ratios = [r[d]["ratio"] for r in bw["rows"] if "save" in r for d in ("save", "load")]
        lines.append(f"  bandwidth    {_fmt_pass(bw['passed'])}: ratio to contiguous copy min "
                     f"{min(ratios) if ratios else None}, median {statistics.median(ratios) if ratios else None} "
                     f"(target >= {BW_TARGET}); {bw['n_failed']} of {len(bw['rows'])} rows below")
    else:
        lines.append(f"  bandwidth    {_not_measured(bw)}")
    ov = p["overlap"]
    if ov["status"] == "measured":
        lines.append(f"  overlap      {_fmt_pass(ov['passed'])}: compute slowdown {ov['slowdown']:.1%} (target <= "
                     f"{SLOWDOWN_TARGET:.0%}), transfer hidden {ov['transfer_hidden']:.0%}")
    else:
        lines.append(f"  overlap      {_not_measured(ov)}")
    pn = p["pinned"]
    if pn["status"] == "measured":
        lines.append(f"  pinned       {_fmt_pass(pn['passed'])}: " + ", ".join(
            f"{r['gib']} GiB {r['how']} -> {r.get('taken_over_requested', 'err')}x" for r in pn["rows"]))
    else:
        lines.append(f"  pinned       {_not_measured(pn)}")
    rt = p["round_trip"]
    if rt["status"] == "measured":
        lines.append(f"  round trip   {_fmt_pass(rt['passed'])}: " + ", ".join(
            f"{r['host_layout']} {'ok' if r['passed'] else r.get('error', 'FAIL')}" for r in rt["runs"]))
    else:
        lines.append(f"  round trip   {_not_measured(rt)}")
    lines.append(f"  overall      {_fmt_pass(res['passed'])}")
    return "\n".join(lines)


def readme_section(res: dict[str, Any], source: str = "benchmarks/results/gpu_check.json") -> str:
    """The ``## gpu_check`` section of benchmarks/README.md, from a result file alone."""
    m, p = res["machine"], res["parts"]
    out = ["## gpu_check", "",
           f"`python -m benchmarks.gpu_check` on {m.get('gpu') or 'CPU'} (driver {m.get('driver')}, torch "
           f"{m['torch']}, Triton {m['triton']}, CUDA {m['cuda']}, Python {m['python']}), {res['mode']} mode, "
           f"{res['wall_s']} s, commit {str(res.get('code', {}).get('commit'))[:10]}; results in `{source}`. "
           f"Overall: **{_fmt_pass(res['passed'])}**.", "",
           "| part | target | result |", "| --- | --- | --- |"]
    c = p["correctness"]
    if c["status"] == "measured":
        out.append(f"| correctness | Triton = torch reference, bit for bit | {_fmt_pass(c['passed'])}: "
                   f"{c['n_cases'] - c['n_failed']}/{c['n_cases']} cases, {c['n_not_run']} not run |")
    else:
        out.append(f"| correctness | Triton = torch reference, bit for bit | "
                   f"{_not_measured(c)[:200].replace('|', '/')} |")
    for name, key, tgt in (("bandwidth", "bandwidth", f">= {BW_TARGET} of a contiguous pinned copy"),
                           ("overlap", "overlap", f"compute slowdown <= {SLOWDOWN_TARGET:.0%}"),
                           ("pinned memory", "pinned", f"taken <= requested x {1 + PINNED_SLACK}"),
                           ("round trip", "round_trip", "pages loaded back bit-identical")):
        part = p[key]
        if part["status"] != "measured":
            out.append(f"| {name} | {tgt} | {_not_measured(part)[:200].replace('|', '/')} |")
            continue
        detail = ""
        if key == "overlap":
            detail = f": slowdown {part['slowdown']:.1%}, transfer hidden {part['transfer_hidden']:.0%}"
        elif key == "bandwidth":
            detail = f": {part['n_failed']} of {len(part['rows'])} rows below target"
        out.append(f"| {name} | {tgt} | {_fmt_pass(part['passed'])}{detail} |")
    bw = p["bandwidth"]
    if bw["status"] == "measured" and bw["rows"]:
        out += ["", "Bandwidth, scattered pages (random block ids and slots) vs one contiguous "
                    "`copy_(non_blocking=True)` of the same bytes (GB/s):", "",
                "| page | device layout | host layout | L1->L2 | copy | ratio | L2->L1 | copy | ratio |",
                "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in bw["rows"]:
            if "save" not in r:
                out.append(f"| | {r['device_layout']} | {r['host_layout']} | error: {r.get('error', '')[:80]} "
                           f"| | | | | |")
                continue
            s, ld = r["save"], r["load"]
            out.append(f"| {r['page_bytes'] // 1024} KiB | {r['device_layout']} | {r['host_layout']} | "
                       f"{s['kernel_gbps']} | {s['copy_gbps']} | {s['ratio']} | {ld['kernel_gbps']} | "
                       f"{ld['copy_gbps']} | {ld['ratio']} |")
    pn = p["pinned"]
    if pn["status"] == "measured" and pn["rows"]:
        out += ["", "Pinned L2 (field scenario R29), host memory taken per process:", "",
                "| requested | how | taken | taken / requested | pass |", "| ---: | --- | ---: | ---: | --- |"]
        for r in pn["rows"]:
            taken = r.get("taken_bytes")
            out.append(f"| {r['gib']} GiB | {r['how']} | {'-' if taken is None else f'{taken / 2**30:.2f} GiB'} | "
                       f"{r.get('taken_over_requested', '-')} | {_fmt_pass(r['passed'])} |")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CI, CPU under TRITON_INTERPRET=1)")
    ap.add_argument("--out", default=None, help="result JSON (default benchmarks/results/gpu_check[_quick].json)")
    ap.add_argument("--budget-s", type=float, default=330.0, help="wall-clock budget of the whole run")
    ap.add_argument("--readme-from", metavar="JSON", help="print the README section of a result file and exit")
    ap.add_argument("--pinned-probe", nargs=2, metavar=("GIB", "HOW"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.readme_from:
        src = Path(args.readme_from).resolve()
        shown = src.relative_to(ROOT) if src.is_relative_to(ROOT) else Path("benchmarks/results") / src.name
        from benchmarks.harness.results import ResultsError
        try:
            res = checked_for_readme(json.loads(src.read_text()), str(shown))
        except ResultsError as e:
            print(f"gpu_check: {e}", file=sys.stderr)
            return 2
        print(readme_section(res, str(shown)), end="")
        return 0
    if args.pinned_probe:
        print(json.dumps(pinned_probe(int(args.pinned_probe[0]), args.pinned_probe[1])))
        return 0
    t0 = time.perf_counter()
    budget = Budget(args.budget_s)
    found = bootstrap_tierkv()
    pyd = carried_pydantic()
    import torch
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("gpu_check: no CUDA device; on a CPU run it with TRITON_INTERPRET=1 (and --quick)", file=sys.stderr)
        return 2
    from benchmarks.harness.results import code_state
    code = code_state(ROOT)
    code["files"] = code_files(ROOT)
    res: dict[str, Any] = {"schema": 1, "mode": "quick" if args.quick else "full", "quick": args.quick,
                           "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "machine": machine_info(torch, device), "tierkv": found, "code": code,
                           "budget_s": args.budget_s, "parts": {}}
    parts = res["parts"]
    default = ROOT / "benchmarks" / "results" / ("gpu_check_quick.json" if args.quick else "gpu_check.json")
    out = Path(args.out) if args.out else default
    out.parent.mkdir(parents=True, exist_ok=True)
    # each part's stop point: the budget seconds left at which it stops (what it did not run is recorded)
    plan = (("correctness", lambda: correctness(torch, device, args.quick, budget, stop_at=0.55 * args.budget_s)),
            ("round_trip", lambda: round_trip(torch, device, args.quick, pyd)),
            ("bandwidth", lambda: bandwidth(torch, device, args.quick, budget, stop_at=0.25 * args.budget_s)),
            ("overlap", lambda: overlap(torch, device, args.quick, budget)),
            ("pinned", lambda: pinned(torch, device, args.quick, budget, stop_at=15.0)))
    for name, _run in plan:
        parts[name] = {"status": "not run (an earlier part did not end)", "passed": False}
    for name, run_part in plan:
        print(f"gpu_check: {name} ...", flush=True)
        try:
            parts[name] = run_part()
        except Exception as e:  # one broken part must not lose the others' results
            import traceback
            parts[name] = {"status": "error", "passed": False, "error": f"{type(e).__name__}: {e}"[:1000],
                           "traceback": traceback.format_exc()[-3000:]}
        res["wall_s"] = round(time.perf_counter() - t0, 1)
        verdicts = [p["passed"] for p in parts.values() if p["passed"] is not None]
        res["passed"] = bool(verdicts) and all(verdicts)
        out.write_text(json.dumps(res, indent=1) + "\n")   # after every part: a run killed later keeps these
    print(summary(res))
    print(f"wrote {out}")
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
