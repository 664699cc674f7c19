"""Charts (PNG, matplotlib) of the benchmark results, drawn from the JSON files alone.

Each benchmark calls :func:`render` on the JSON it just wrote; the charts can be redrawn at any time from the
committed results without re-running anything::

    python -m benchmarks.plots                                   # every benchmarks/results/*.json
    python -m benchmarks.plots benchmarks/results/transfer.json  # one file

Charts are written next to their JSON (``<name>_<chart>.png``):

- ``e2e_cpu``: ``_ttft.png``, time to first token per round (median bar, 90th percentile tick) for each
  configuration (no connector, ideal = vLLM with an L1 that holds everything, tierkv per tier and policy).
- ``transfer``: ``_gbps.png``, L1 <-> L2 GB/s per host layout and direction next to the two lines measured in the
  same run: a plain ``copy_`` of the same bytes and the same copy with non-temporal stores.
- ``reserved_cpu``: ``_tpot.png``, decode milliseconds per token with and without ``VLLM_CPU_NUM_OF_RESERVED_CPU``.
- ``storage_lmcache``: ``_mbps.png``, tierkv's ZMQ server (frames and shared memory) next to LMCache's server,
  LMCache's own client and raw pyzmq.
- ``storage_sglang``: ``_mbps.png``, tierkv's stores through SGLang's HiCacheStorage interface next to SGLang's own
  classes.
- ``storage``: ``_mbps.png``, L3 MB/s per store and operation next to the raw medium measured in the same run
  (plain file, raw pyzmq, raw Mooncake) and the SGLang HiCache peer where it ran; files holding several runs show
  the median and the range.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _plt():
    import matplotlib  # imported on first use: the benchmarks still run (without charts) where it is missing

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: Path) -> Path:
    plt = _plt()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return quantize_png(path)


def quantize_png(path) -> Path:
    """Rewrite the PNG at ``path`` with a 64-colour palette (a chart's few colours survive; the file shrinks 3-4x, so
    ``results/`` stays within its budget)."""
    from PIL import Image

    with Image.open(path) as im:
        small = im.convert("RGB").quantize(colors=64)
    small.save(path, optimize=True)
    return Path(path)


def plot_e2e(data: dict, out: Path) -> list[Path]:
    configs = data["configs"]
    names = list(configs)
    rounds = [w for w in data.get("workloads") or [] if any(w in configs[c]["workloads"] for c in names)]
    if not rounds:
        rounds = sorted({w for c in names for w in configs[c]["workloads"]})
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(7, 1.4 * len(rounds) * len(names) / 3 + 3), 4.2))
    width = 0.8 / len(names)
    for i, c in enumerate(names):
        ws = configs[c]["workloads"]
        xs = [r + (i - (len(names) - 1) / 2) * width for r in range(len(rounds))]
        p50 = [ws.get(w, {}).get("ttft_p50_s") for w in rounds]
        p90 = [ws.get(w, {}).get("ttft_p90_s") for w in rounds]
        bars = ax.bar([x for x, v in zip(xs, p50) if v is not None], [v for v in p50 if v is not None], width,
                      label=c)
        ax.scatter([x for x, v in zip(xs, p90) if v is not None], [v for v in p90 if v is not None], marker="_",
                   s=120, color=bars.patches[0].get_facecolor() if bars.patches else "k", zorder=3)
    ax.set_xticks(range(len(rounds)), rounds)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT, seconds (bar: median, tick: p90; log)")
    ax.set_title(f"{out.stem}: time to first token per round and configuration")
    ax.legend(fontsize=8, ncol=min(5, len(names)), loc="upper center", bbox_to_anchor=(0.5, -0.1))
    return [_save(fig, out.with_name(out.stem + "_ttft.png"))]


def plot_transfer(data: dict, out: Path) -> list[Path]:
    rows = data["rows"]
    devs = sorted({r["device_layout"] for r in rows})
    pages = max(r["pages"] for r in rows)
    plt = _plt()
    fig, axes = plt.subplots(len(devs), 1, figsize=(13, 3.9 * len(devs)), squeeze=False)
    for ax, dev in zip(axes[:, 0], devs):
        sel = [r for r in rows if r["device_layout"] == dev and r["pages"] == pages]
        labels = [f"{r['layout']}\n{r['direction']}\n{r['ids']}" for r in sel]
        xs = range(len(sel))
        ax.bar(xs, [r["gbps"] for r in sel], 0.6, label="tierkv kernel")
        ax.scatter(xs, [r.get("copy_gbps") for r in sel], marker="_", s=300, color="k", zorder=3,
                   label="memcpy (copy_, same threads)")
        if all("nt_copy_gbps" in r for r in sel):
            ax.scatter(xs, [r["nt_copy_gbps"] for r in sel], marker="_", s=300, color="tab:red", zorder=3,
                       label="non-temporal copy")
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_ylabel("GB/s")
        ax.set_title(f"L1 <-> L2 transfer, {dev}, {pages} pages per call")
        ax.legend(fontsize=8, loc="lower right")
    return [_save(fig, out.with_name(out.stem + "_gbps.png"))]


def _storage_runs(data: dict) -> list[dict]:
    return data["runs"] if "runs" in data else [data]


def plot_storage(data: dict, out: Path) -> list[Path]:
    runs = _storage_runs(data)
    keyed: dict[tuple, dict[str, list]] = {}
    for run in runs:
        for r in run["rows"]:
            k = (r["page_bytes"], r["backend"], r["op"])
            d = keyed.setdefault(k, {"mbps": [], "ref_mbps": [], "sglang_mbps": []})
            for f in d:
                if r.get(f) is not None:
                    d[f].append(r[f])
    sizes = sorted({k[0] for k in keyed})
    plt = _plt()
    fig, axes = plt.subplots(len(sizes), 1, figsize=(11, 3.8 * len(sizes)), squeeze=False)
    for ax, size in zip(axes[:, 0], sizes):
        ks = [k for k in keyed if k[0] == size]
        xs = list(range(len(ks)))
        for off, field, label in ((-0.27, "mbps", "tierkv"), (0.0, "ref_mbps", "raw medium (same run)"),
                                  (0.27, "sglang_mbps", "SGLang HiCache peer")):
            pts = [(x, keyed[k][field]) for x, k in zip(xs, ks) if keyed[k][field]]
            if not pts:
                continue
            med = [statistics.median(v) for _, v in pts]
            err = [[m - min(v) for m, (_, v) in zip(med, pts)], [max(v) - m for m, (_, v) in zip(med, pts)]]
            ax.bar([x + off for x, _ in pts], med, 0.26, label=label, yerr=err if len(runs) > 1 else None,
                   capsize=3)
        ax.set_xticks(xs, [f"{b}\n{op}" for _, b, op in ks], fontsize=8)
        ax.set_ylabel("MB/s")
        ax.set_title(f"L3 stores, {size // 1024} KiB pages" + (f" (median and range of {len(runs)} runs)"
                                                               if len(runs) > 1 else ""))
        ax.legend(fontsize=8)
    return [_save(fig, out.with_name(out.stem + "_mbps.png"))]


def plot_reserved_cpu(data: dict, out: Path) -> list[Path]:
    plt = _plt()
    summ = data["summary"]
    names = list(summ)
    fig, ax = plt.subplots(figsize=(7, 3.8))
    med = [summ[n]["tpot_ms_median"] for n in names]
    err = [[m - summ[n]["tpot_ms_range"][0] for m, n in zip(med, names)],
           [summ[n]["tpot_ms_range"][1] - m for m, n in zip(med, names)]]
    ax.bar(range(len(names)), med, 0.6, yerr=err, capsize=4)
    labels = [f"{n}\nreserved={data['configs'][n]['VLLM_CPU_NUM_OF_RESERVED_CPU'] or 'unset'}\n"
              f"cores {summ[n]['core_ids']}" for n in names]
    ax.set_xticks(range(len(names)), labels, fontsize=8)
    ax.set_ylabel("decode ms per token (median, range)")
    ax.set_title("Decode with and without VLLM_CPU_NUM_OF_RESERVED_CPU")
    return [_save(fig, out.with_name(out.stem + "_tpot.png"))]


_LMC_VARIANTS = [("raw_mbps", "raw pyzmq"), ("zmq_mbps", "tierkv zmq"), ("zmq_shm_mbps", "tierkv zmq shm"),
                 ("lmcache_mbps", "LMCache server (lmcache store)"), ("lmcache_keys_mbps", "same, named by key"),
                 ("lmcache_native_mbps", "LMCache's own client")]


def _grouped_bars(groups: list[str], series: list[tuple[str, list]], title: str, out: Path) -> list[Path]:
    """One bar per series in each group (MB/s); ``None`` values are left out."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(7, 0.5 * len(groups) * len(series) + 2), 4.2))
    width = 0.8 / max(1, len(series))
    for i, (label, vals) in enumerate(series):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        pts = [(x, v) for x, v in zip(xs, vals) if v is not None]
        if pts:
            ax.bar([x for x, _ in pts], [v for _, v in pts], width, label=label)
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    ax.set_ylabel("MB/s (batch bytes / median batch time)")
    ax.set_title(title)
    ax.legend(fontsize=8, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    return [_save(fig, out)]


def plot_storage_lmcache(data: dict, path: Path) -> list[Path]:
    """``storage_lmcache``: MB/s of tierkv's ZMQ server (TCP frames, shared memory) next to LMCache's server and
    raw pyzmq, per page size and operation."""
    rows = data["rows"]
    groups = [f"{r['page_kib']} KiB {r['op']}" for r in rows]
    series = [(label, [r.get(k) for r in rows]) for k, label in _LMC_VARIANTS if any(r.get(k) for r in rows)]
    return _grouped_bars(groups, series, f"{path.stem}: L3 servers on loopback, batches of "
                         f"{data.get('batch_pages', 64)} pages", path.with_name(path.stem + "_mbps.png"))


def plot_storage_sglang(data: dict, path: Path) -> list[Path]:
    """``storage_sglang``: MB/s of tierkv's stores through SGLang's HiCacheStorage interface next to SGLang's own
    storage class on the same pages."""
    rows = data["rows"]
    groups = [f"{r['backend'].split()[0]} {r['page_bytes'] >> 10} KiB\n{r['op']}" for r in rows]
    series = [("tierkv via SGLang's interface", [r.get("mbps") for r in rows]),
              ("SGLang's own class", [r.get("sglang_mbps") for r in rows])]
    return _grouped_bars(groups, series, f"{path.stem}: tierkv stores as SGLang HiCache backends",
                         path.with_name(path.stem + "_mbps.png"))


PLOTTERS = {"e2e_cpu": plot_e2e, "transfer": plot_transfer, "storage": plot_storage, "reserved_cpu": plot_reserved_cpu,
            "storage_lmcache": plot_storage_lmcache, "storage_sglang": plot_storage_sglang}


def render(json_path: str | Path) -> list[Path]:
    """Draw the charts of one results file next to it. Returns the PNG paths (none for an unknown benchmark).
    Raises ``OSError`` / ``json.JSONDecodeError`` for an unreadable file."""
    path = Path(json_path)
    data = json.loads(path.read_text())
    kind = data.get("benchmark") or (data.get("runs") or [{}])[0].get("benchmark")
    fn = PLOTTERS.get(kind)
    return fn(data, path) if fn else []


def charts_for(json_path: str | Path) -> list[Path]:
    """:func:`render` for the benchmarks, right after they wrote ``json_path``: prints each chart written; without
    matplotlib (``pip install matplotlib``, in tierkv's ``test`` and ``bench`` extras) says so and returns []."""
    try:
        paths = render(json_path)
    except ImportError as e:
        print(f"charts not drawn ({e}); pip install matplotlib, then: python -m benchmarks.plots {json_path}")
        return []
    for p in paths:
        print(f"wrote {p}")
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Draw the benchmark charts from results JSON files.")
    ap.add_argument("files", nargs="*", help="results JSON files (default: benchmarks/results/*.json)")
    args = ap.parse_args(argv)
    files = [Path(f) for f in args.files] or sorted(RESULTS.glob("*.json"))
    rc = 0
    for f in files:
        try:
            for p in render(f):
                print(p)
        except (OSError, ValueError, KeyError) as e:
            print(f"plots: {f}: {e}", file=sys.stderr)
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
