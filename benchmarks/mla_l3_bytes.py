"""L3 bytes per cached token of MLA pages under tensor parallelism (issue 20 item 1): tierkv's one record per page,
written by TP rank 0 and read by every rank, against a per-rank scheme (each rank stores its own copy under its own
namespace, as tierkv does for K/V pages, whose heads differ per rank) and against every rank writing the one shared
record (what tierkv's workers did before: the same key and bytes sent ``tp`` times).

Deterministic (sizes and counts, no timing), through the worker's own path: per rank an MLA
:class:`~tierkv.connector.l2.device_pool.DevicePool` over vLLM's MLA cache shape ``[blocks, page, 576]`` (bf16), its
:class:`~tierkv.connector.l2.host_pool.HostPool` (``layer_first``), a :class:`~tierkv.storage_backends.file.store.FileStore`
over one shared directory and :class:`~tierkv.connector.l3.io.L3IO` with ``backup_writer`` as the vLLM connector
sets it. Every rank backs up the same ``--pages`` pages (identical bytes in every rank's L2), then every rank reads
them all back and checks them byte for byte. Reported per model, TP size, page size and scheme:

- ``disk_bytes_per_token``: bytes of the ``*.page`` files under the store (payload + 64-byte header) per cached token;
- ``written_bytes_per_token``: payload bytes the store was sent (``bytes_written`` summed over the ranks' stores);
- ``records``, ``sets`` (store writes, all ranks) and ``reads`` (store hits, all ranks).

    .venv/bin/python -m benchmarks.mla_l3_bytes             # writes benchmarks/results/mla_l3_bytes.json
    .venv/bin/python -m benchmarks.mla_l3_bytes --readme-from benchmarks/results/mla_l3_bytes.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import results as results_check

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = REPO_ROOT / "benchmarks" / "results" / "mla_l3_bytes.json"
SECTION = "## MLA L3 bytes per cached token"

LATENT = 576   # kv_lora_rank 512 + qk_rope_head_dim 64 (DeepSeek-V2/V3)
#: name -> layers with an MLA KV cache
MODELS = {"mla preset": 2, "DeepSeek-V2-Lite": 27, "DeepSeek-V3": 61}
TP_SIZES = (1, 2, 8)
PAGE_SIZES = (16, 64)
SCHEMES = ("once", "per_rank", "all_ranks_write")


def run_case(layers: int, tp: int, page: int, scheme: str, pages: int, root: Path) -> dict:
    """Back up ``pages`` identical latent pages from each of ``tp`` ranks under ``scheme``, read them back on every
    rank; returns the counts (see the module docstring). Raises AssertionError if a page reads back wrong."""
    import torch

    from tierkv.connector.l2.device_pool import DevicePool
    from tierkv.connector.l2.host_pool import HostPool
    from tierkv.connector.l3.io import L3IO
    from tierkv.connector.core.page_checksums import SlotChecksums
    from tierkv.connector.core.page_hash import ModelNamespace
    from tierkv.connector.core.plan import JOB_BACKUP, JOB_PREFETCH, Job
    from tierkv.storage_backends.file.store import FileStore

    g = torch.Generator().manual_seed(1)
    data = None
    ranks = []
    for r in range(tp):
        l1 = {f"model.layers.{i}.self_attn.attn": torch.zeros(1, page, LATENT, dtype=torch.bfloat16)
              for i in range(layers)}
        dev = DevicePool.from_vllm(l1, num_blocks=1, block_size=page, backend="CPU_MLA", use_mla=True)
        host = HostPool.for_device(dev, 2 * pages, "layer_first")
        if data is None:
            data = [torch.randint(0, 256, (host.page_bytes,), dtype=torch.uint8, generator=g) for _ in range(pages)]
        for i, d in enumerate(data):
            host.write_page(i, d)
        ns = ModelNamespace("mla-bench", "bfloat16", host.kv_layout, page, layers, 1, LATENT, tp_rank=r, tp_size=tp,
                            use_mla=True)
        if scheme == "per_rank":   # each rank its own namespace, as for K/V pages
            digest, writer = dataclasses.replace(ns, use_mla=False).digest(), True
        else:                      # the connector: TP rank 0's namespace for MLA
            digest = dataclasses.replace(ns, tp_rank=0).digest()
            writer = r == 0 or scheme == "all_ranks_write"
        store = FileStore(digest, host.page_bytes, root=str(root))
        ranks.append((host, store, L3IO(store, host, digest, SlotChecksums(2 * pages), rank=r, backup_writer=writer)))
    keys = [i.to_bytes(16, "little") for i in range(pages)]
    for _h, _s, l3 in ranks:
        l3.submit([Job(1, JOB_BACKUP, keys, slots=list(range(pages)))])
    for _h, _s, l3 in ranks:
        assert l3.wait_idle(120)
        assert all(all(rep.ok) for rep in l3.take_reports())
    slots = list(range(pages, 2 * pages))
    for _h, _s, l3 in ranks:
        l3.submit([Job(2, JOB_PREFETCH, keys, slots=slots, block_ids=list(range(1, pages + 1)), fetch=[True] * pages,
                       req_id="r")])
    for host, _s, l3 in ranks:
        assert l3.wait_idle(120) and l3.poll().finished == {"r"}
        for i, s in enumerate(slots):
            assert torch.equal(host.read_page(s).view(torch.uint8).flatten(), data[i])
    records = list(root.glob("*/*/*.page"))
    stats = [s.stats() for _h, s, _l in ranks]
    out = {"layers": layers, "tp": tp, "page_size": page, "scheme": scheme, "pages": pages,
           "page_bytes": ranks[0][0].page_bytes, "records": len(records),
           "disk_bytes": sum(p.stat().st_size for p in records),
           "written_bytes": sum(s["bytes_written"] for s in stats), "sets": sum(s["sets"] for s in stats),
           "reads": sum(s["hits"] for s in stats),
           "l2_bytes_per_rank": ranks[0][0].page_bytes * 2 * pages}
    tokens = pages * page
    out["disk_bytes_per_token"] = out["disk_bytes"] / tokens
    out["written_bytes_per_token"] = out["written_bytes"] / tokens
    for _h, s, l3 in ranks:
        l3.close()
        s.close()
    return out


def measure(pages: int) -> dict:
    rows = []
    for name, layers in MODELS.items():
        for tp in TP_SIZES:
            for page in PAGE_SIZES:
                for scheme in SCHEMES:
                    with tempfile.TemporaryDirectory(prefix="tierkv-mla-l3-") as d:
                        row = run_case(layers, tp, page, scheme, pages, Path(d))
                    rows.append({"model": name, **row})
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                            text=True).stdout.strip()
    return {"benchmark": "mla_l3_bytes", "commit": commit, "pages": pages, "latent": LATENT, "rows": rows}


def section(data: dict) -> str:
    """The README section rendered from a result file (``data``: what :func:`measure` returns)."""
    rows = {(r["model"], r["tp"], r["page_size"], r["scheme"]): r for r in data["rows"]}
    lines = [SECTION, "",
             "`benchmarks/mla_l3_bytes.py` (issue 20 item 1): L3 bytes per cached token of MLA latent pages "
             f"({data['latent']} bf16 values per token and layer) in a file store, through the workers' L3 path "
             f"(`L3IO`, `FileStore`; {data['pages']} pages backed up by every rank, then read back by every rank, byte "
             "for byte). Sizes and counts only, no timing: the same on any machine. "
             f"Result `benchmarks/results/mla_l3_bytes.json`, code at `{data['commit']}`.", "",
             "- **once** (tierkv): one record per page under TP rank 0's namespace, written by rank 0, read by "
             "every rank;",
             "- **per rank**: each rank writes its own copy under its own namespace (how K/V pages are kept, whose "
             "heads differ per rank);",
             "- **all ranks write**: one record, but every rank sends it (tierkv's workers before this change).", "",
             "| model (MLA layers) | TP | page tokens | L3 bytes/token once | per rank | written bytes/token once | "
             "all ranks write | records once / per rank | reads (all ranks) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, layers in MODELS.items():
        for tp in TP_SIZES:
            for page in PAGE_SIZES:
                o, p, a = (rows.get((name, tp, page, s)) for s in SCHEMES)
                if o is None or p is None or a is None:
                    continue
                lines.append(f"| {name} ({layers}) | {tp} | {page} | {o['disk_bytes_per_token']:,.0f} | "
                             f"{p['disk_bytes_per_token']:,.0f} | {o['written_bytes_per_token']:,.0f} | "
                             f"{a['written_bytes_per_token']:,.0f} | {o['records']} / {p['records']} | "
                             f"{o['reads']} |")
    lines += ["", "Per rank costs TP times the L3 bytes of once (and TP times the records); all ranks write stores "
              "once but sends TP times the bytes. L2 is not shared: each rank keeps its own copy of a page in its own "
              "host pool (its L2 -> L1 copies run in its own process), `page_bytes` per page per rank.", "",
              "```bash", ".venv/bin/python -m benchmarks.mla_l3_bytes",
              ".venv/bin/python -m benchmarks.mla_l3_bytes --readme-from benchmarks/results/mla_l3_bytes.json",
              "```", ""]
    return "\n".join(lines)


def write_readme(data: dict) -> None:
    """Print the README block (:func:`section`)."""
    results_check.print_section(section(data))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=4, help="pages backed up by every rank")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--no-readme", action="store_true")
    ap.add_argument("--readme-from", default=None, metavar="JSON")
    args = ap.parse_args(argv)
    if args.readme_from:
        write_readme(json.loads(Path(args.readme_from).read_text()))
        return 0
    data = measure(args.pages)
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    if not args.no_readme:
        write_readme(data)
    print(section(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
