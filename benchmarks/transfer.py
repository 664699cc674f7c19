"""L1 <-> L2 page transfer benchmark (tierkv issue 4).

For each host-pool layout and direction (L1->L2 save, L2->L1 load), moves pages of the bench model
(32 tokens x 8 layers x 4 KV heads x 64 dims x bf16 x K,V = 256 KiB per page, 32 KiB per layer block) in batches of
64 and 1,024 pages, and reports GB/s next to a plain contiguous ``copy_`` of the same byte count measured in the
same run (interleaved with the transfer, so machine noise hits both alike). Block ids are either one consecutive
run ("run") or a random sample of the L1 pool ("scattered", what a busy engine hands out); slots come from the
:class:`SlotAllocator` (ascending).

It also times a layer-wise load (:class:`LayerwiseLoad`) against a fake forward pass (a fixed amount of matmul
work per layer) and writes the timeline: load of layer ``l+1`` overlapping compute of layer ``l``.

    python -m benchmarks.transfer                 # CPU: numba kernels (torch without numba), vLLM CPU-backend layout
    TIERKV_CPU_KERNELS=torch python -m benchmarks.transfer   # CPU: the torch kernels
    python -m benchmarks.transfer --device cuda   # GPU: Triton kernels vs pinned copy_, FlashAttention NHD layout
    python -m benchmarks.transfer --quick         # fewer repetitions; writes $TMPDIR/transfer_quick.json

Results: ``benchmarks/results/transfer.json`` (CPU) or ``transfer_gpu.json`` (CUDA).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import runpy
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness.results import code_state

os.environ.setdefault("TIERKV_COPY_THREADS", "1")  # copies single-threaded, as measured and committed

import torch  # noqa: E402

from tierkv.connector.l2.device_pool import DevicePool
from tierkv.connector.l2.host_pool import HOST_POOL_LAYOUTS, HostPool
from tierkv.connector.l2.slot_allocator import SlotAllocator
from tierkv.connector.l2.layer_loader import LayerwiseLoad
from tierkv.kernels import _impl, load_pages, numba_impl, save_pages
from tierkv.kernels.torch_impl import COPY_THREADS, copy_threads
from tierkv.kernels.testing import make_kv_caches

MODEL = dict(num_layers=8, block_size=32, num_kv_heads=4, head_dim=64, dtype=torch.bfloat16)
TARGET = {"layer_first": 0.80, "page_first_direct": 0.80, "page_first": 0.60}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def build(device: torch.device, num_blocks: int, num_slots: int, name: str):
    kv, storage, spec = make_kv_caches(name, num_blocks=num_blocks, pad_bytes=0, **MODEL)
    if device.type == "cuda":
        storage = storage.to(device)
        kv2 = {}
        flat = storage.view(spec.dtype)
        for (k, t) in kv.items():
            kv2[k] = flat.as_strided(t.shape, t.stride(), t.storage_offset())
        kv = kv2
    dev = DevicePool.from_vllm(kv, num_blocks=num_blocks, block_size=spec.block_size,
                               kv_cache_layout=spec.kv_cache_layout, backend=spec.backend)
    return dev, storage


def bench_transfers(device, dev, pools, batches, patterns, reps):
    rows = []
    page_bytes = dev.num_layers * dev.block_bytes
    max_bytes = max(batches) * page_bytes
    pin = device.type == "cuda"
    ref_src = torch.empty(max_bytes, dtype=torch.uint8, pin_memory=pin).fill_(1)
    ref_dst = torch.empty(max_bytes, dtype=torch.uint8, device=device).fill_(2)
    ref_host = torch.empty(max_bytes, dtype=torch.uint8, pin_memory=pin).fill_(3)
    rng = random.Random(0)
    for layout, host in pools.items():
        alloc = SlotAllocator(host.num_slots)
        for n in batches:
            slots = alloc.alloc(n)
            for pattern in patterns:
                if pattern == "run":
                    b0 = rng.randrange(0, dev.num_blocks - n)
                    blocks = list(range(b0, b0 + n))
                else:
                    blocks = rng.sample(range(dev.num_blocks), n)
                nbytes = n * page_bytes
                for direction in ("L1->L2", "L2->L1"):
                    if direction == "L1->L2":
                        op = lambda: save_pages(dev, host, blocks, slots)  # noqa: E731
                        ref = lambda: ref_host[:nbytes].copy_(ref_dst[:nbytes])  # noqa: E731  (device -> host)
                    else:
                        op = lambda: load_pages(host, dev, slots, blocks)  # noqa: E731
                        ref = lambda: ref_dst[:nbytes].copy_(ref_src[:nbytes])  # noqa: E731  (host -> device)
                    ref_default = ref
                    if device.type == "cpu":
                        ref_default = (lambda: ref_host[:nbytes].copy_(ref_src[:nbytes]))  # noqa: E731

                        def ref():  # same thread count as the torch kernels
                            with copy_threads():
                                ref_host[:nbytes].copy_(ref_src[:nbytes])
                    ref_nt = None
                    if device.type == "cpu" and numba_impl.available():  # same copy, non-temporal stores
                        ref_nt = lambda: numba_impl.copy_contiguous(ref_host[:nbytes], ref_src[:nbytes])  # noqa: E731
                        ref_nt()
                    op(), ref(), ref_default()  # warm up (page faults, Triton compile)
                    t_op, t_ref, t_def, t_nt = [], [], [], []
                    for _ in range(reps):
                        t_ref.append(_time(ref, device))
                        t_op.append(_time(op, device))
                        if device.type == "cpu":
                            t_def.append(_time(ref_default, device))
                        if ref_nt is not None:
                            t_nt.append(_time(ref_nt, device))
                    gbps = nbytes / statistics.median(t_op) / 1e9
                    ref_gbps = nbytes / statistics.median(t_ref) / 1e9
                    def_gbps = nbytes / statistics.median(t_def) / 1e9 if t_def else None
                    row = dict(device_layout=dev.layout_tag, layout=layout, direction=direction, pages=n, ids=pattern, bytes=nbytes,
                               gbps=round(gbps, 2), copy_gbps=round(ref_gbps, 2), ratio=round(gbps / ref_gbps, 3),
                               target=TARGET[layout], meets_target=gbps / ref_gbps >= TARGET[layout],
                               best_gbps=round(nbytes / min(t_op) / 1e9, 2),
                               best_copy_gbps=round(nbytes / min(t_ref) / 1e9, 2),
                               copy_default_threads_gbps=round(def_gbps, 2) if def_gbps else None,
                               nt_copy_gbps=round(nbytes / statistics.median(t_nt) / 1e9, 2) if t_nt else None)
                    rows.append(row)
                    nt_txt = f"  nt-copy {row['nt_copy_gbps']:6.2f} GB/s" if row["nt_copy_gbps"] else ""
                    print(f"{layout:18s} {direction:7s} {n:5d} {pattern:9s} {gbps:7.2f} GB/s  copy_ {ref_gbps:7.2f} GB/s"
                          f"  {100 * gbps / ref_gbps:5.0f}%  (target {100 * TARGET[layout]:.0f}%){nt_txt}", flush=True)
            alloc.free(slots)
    return rows


def bench_layerwise(device, dev, host, n_pages, compute_ms):
    """Sequential (load everything, then run every layer) vs layer-wise (layer l waits only for its own pages)."""
    blocks = random.Random(1).sample(range(dev.num_blocks), n_pages)
    slots = list(range(n_pages))
    save_pages(dev, host, blocks, slots)
    a = torch.randn(256, 256, device=device)
    # calibrate one layer of fake forward work to about compute_ms: warm the matmul up first (the first calls pay
    # one-off set-up costs that made an earlier calibration pick far too few repetitions), then time a fixed batch
    # of repetitions several times and take the median
    with copy_threads(1 if device.type == "cpu" else 0):
        for _ in range(20):
            a @ a
        _sync(device)
        per_rep = statistics.median(_time(lambda: [a @ a for _ in range(50)], device) / 50 for _ in range(5))
    reps = max(1, int(compute_ms / 1e3 / per_rep))

    def layer_compute():  # the engine's forward on its own core(s): one thread, as the copy thread has one
        with copy_threads(1 if device.type == "cpu" else 0):
            for _ in range(reps):
                a @ a
        _sync(device)

    t_compute = _time(lambda: [layer_compute() for _ in range(dev.num_layers)], device)
    t_load = _time(lambda: load_pages(host, dev, slots, blocks), device)

    def sequential():
        load_pages(host, dev, slots, blocks)
        _sync(device)
        for _ in range(dev.num_layers):
            layer_compute()

    t_seq = min(_time(sequential, device) for _ in range(3))
    best = None
    for _ in range(3):
        events = []
        t0 = time.perf_counter()
        ld = LayerwiseLoad(host, dev, slots, blocks)
        ld.start()
        for l in range(dev.num_layers):
            ld.wait_layer(l)
            c0 = time.perf_counter()
            layer_compute()
            events.append(("compute", l, c0 - t0, time.perf_counter() - t0))
        ld.wait_all()
        total = time.perf_counter() - t0
        loads = [("load", l, s - t0, e - t0) for l, s, e in ld.timeline]
        if best is None or total < best[0]:
            best = (total, sorted(loads + events, key=lambda x: x[2]))
    t_lw, timeline = best
    print(f"\nlayer-wise load of {n_pages} pages ({n_pages * dev.num_layers * dev.block_bytes / 2**20:.0f} MiB) with "
          f"{t_compute * 1e3 / dev.num_layers:.1f} ms of fake compute per layer (target {compute_ms:.0f} ms):")
    print(f"  load alone {t_load * 1e3:.1f} ms, compute alone {t_compute * 1e3:.1f} ms, sequential "
          f"{t_seq * 1e3:.1f} ms, layer-wise {t_lw * 1e3:.1f} ms "
          f"(hidden: {100 * (t_seq - t_lw) / max(1e-9, min(t_load, t_compute)):.0f}% of the shorter phase)")
    print("  timeline (ms since start):")
    for kind, l, s, e in timeline:
        bar_s, bar_e = int(s / t_lw * 60), max(int(s / t_lw * 60) + 1, int(e / t_lw * 60))
        print(f"    {kind:7s} L{l}  {s * 1e3:7.1f} .. {e * 1e3:7.1f}  |{' ' * bar_s}{'#' * (bar_e - bar_s)}")
    return dict(pages=n_pages, compute_ms_per_layer_target=compute_ms,
                compute_ms_per_layer=round(t_compute * 1e3 / dev.num_layers, 2), load_ms=round(t_load * 1e3, 2),
                compute_ms=round(t_compute * 1e3, 2), sequential_ms=round(t_seq * 1e3, 2),
                layerwise_ms=round(t_lw * 1e3, 2),
                timeline=[dict(kind=k, layer=l, start_ms=round(s * 1e3, 2), end_ms=round(e * 1e3, 2))
                          for k, l, s, e in timeline])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--device-layout", default=None,
                    help="device KV layout (kernels.testing.DEVICE_LAYOUTS); default cpu / flash_attn_nhd on cuda")
    ap.add_argument("--extra-device-layouts", default="flash_attn_nhd",
                    help="CPU only: also measure these device layouts (batch 1024) to show the cost of decoding")
    ap.add_argument("--batches", default="64,1024")
    ap.add_argument("--patterns", default="run,scattered")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--layerwise-only", action="store_true", help="only the layer-wise timeline; merged into --out")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device")
    name = args.device_layout or ("cpu" if device.type == "cpu" else "flash_attn_nhd")
    batches = [int(x) for x in args.batches.split(",")]
    reps = 3 if args.quick else args.reps
    num_blocks = max(batches) + 512
    dev, storage = build(device, num_blocks, max(batches), name)
    pools = {lay: HostPool.for_device(dev, max(batches), lay, pin_memory=device.type == "cuda")
             for lay in HOST_POOL_LAYOUTS}
    for p in pools.values():
        p.buffer.fill_(0)
    print(f"{dev}\nhost pools: {max(batches)} slots x {pools['layer_first'].page_bytes} B; torch threads "
          f"{torch.get_num_threads()}; kernels {_impl(dev, None).__name__}; reps {reps}\n")
    print(f"{'layout':18s} {'dir':7s} {'pages':>5s} {'ids':9s} {'tierkv':>12s}  {'reference':>16s}  ratio")
    # --quick never overwrites the committed results unless --out says so
    default_dir = Path(tempfile.gettempdir()) if args.quick else Path(__file__).parent / "results"
    path = Path(args.out) if args.out else default_dir / (
        ("transfer" if device.type == "cpu" else "transfer_gpu") + ("_quick" if args.quick else "") + ".json")
    if args.layerwise_only:
        old = json.loads(path.read_text())
        old["layerwise"] = bench_layerwise(device, dev, pools["layer_first"], min(1024, max(batches)),
                                           compute_ms=(30.0 if device.type == "cpu" else 1.0))
        path.write_text(json.dumps(old, indent=1) + "\n")
        print(f"\nupdated {path}")
        runpy.run_path(str(Path(__file__).with_name("plots.py")))["charts_for"](path)  # PNG charts next to the JSON
        return
    rows = bench_transfers(device, dev, pools, batches, args.patterns.split(","), reps)
    if device.type == "cpu":
        for extra in [x for x in args.extra_device_layouts.split(",") if x and x != name]:
            edev, _ = build(device, num_blocks, max(batches), extra)
            epools = {lay: HostPool.for_device(edev, max(batches), lay) for lay in HOST_POOL_LAYOUTS}
            print(f"\n{edev}")
            rows += bench_transfers(device, edev, epools, [max(batches)], args.patterns.split(","), reps)
            del edev, epools
    lw = bench_layerwise(device, dev, pools["layer_first"], min(1024, max(batches)),
                         compute_ms=(30.0 if device.type == "cpu" else 1.0))
    out = dict(
        benchmark="transfer", code=code_state(), device=str(device), device_layout=dev.layout_tag, backend=dev.backend,
        model=dict(MODEL, dtype=str(MODEL["dtype"]), page_bytes=dev.num_layers * dev.block_bytes,
                   block_bytes=dev.block_bytes),
        impl=_impl(dev, None).__name__.rsplit(".", 1)[-1],
        reference="contiguous copy_ of the same byte count" + (
            " (pinned host <-> device)" if device.type == "cuda" else
            " (host -> host, same intra-op thread count as the kernels; copy_default_threads_gbps = torch default; "
            "nt_copy_gbps = the same contiguous copy with non-temporal stores, as the numba kernels store)"),
        conditions=dict(machine=platform.machine(), cpus=os.cpu_count(), torch=torch.__version__,
                        threads=torch.get_num_threads(), copy_threads=COPY_THREADS, reps=reps, note="shared, noisy machine; medians of "
                        "interleaved repetitions"),
        time=time.strftime("%Y-%m-%d %H:%M:%S"), rows=rows, layerwise=lw)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"\nwrote {path}")
    runpy.run_path(str(Path(__file__).with_name("plots.py")))["charts_for"](path)  # PNG charts next to the JSON


if __name__ == "__main__":
    main()
