"""MLA pages under tensor parallelism are stored once in L3: every TP rank holds the same latent page, every rank uses
TP rank 0's namespace (so the same L3 key), only the writer rank (``backup_writer``) sends it, and every rank reads the
one record.

Real parts: the MLA device pool over vLLM's CPU MLA tensor shape ``[num_blocks, block_size, 576]`` (bf16), the MLA
host pool, a real :class:`~tierkv.storage_backends.file.store.FileStore` per rank over one shared directory, and
:class:`~tierkv.connector.l3.io.L3IO` with its I/O threads, as the vLLM connector's ``_build_l3`` builds them.
"""
from __future__ import annotations

import dataclasses

import torch

from tierkv.connector.l2.device_pool import DevicePool
from tierkv.connector.l2.host_pool import HostPool
from tierkv.connector.l3.io import L3IO
from tierkv.connector.core.page_checksums import SlotChecksums
from tierkv.connector.core.page_hash import ModelNamespace
from tierkv.connector.core.plan import JOB_BACKUP, JOB_PREFETCH, Job
from tierkv.storage_backends.file.store import FileStore

P, LAYERS, LATENT = 16, 2, 576   # vLLM's CPU MLA: block_size 16, kv_lora_rank 512 + qk_rope_head_dim 64
NUM_BLOCKS, NUM_SLOTS, PAGES = 8, 8, 5


def _rank(rank: int, root, *, writer: bool):
    """One TP rank's worker side: MLA L1, L2, its own file-store object and L3IO (as ``_build_l3`` makes them)."""
    l1 = {f"model.layers.{i}.self_attn.attn": torch.zeros(NUM_BLOCKS, P, LATENT, dtype=torch.bfloat16)
          for i in range(LAYERS)}
    dev = DevicePool.from_vllm(l1, num_blocks=NUM_BLOCKS, block_size=P, backend="CPU_MLA", use_mla=True)
    host = HostPool.for_device(dev, NUM_SLOTS, "layer_first")
    ns = ModelNamespace("tiny-mla", "bfloat16", host.kv_layout, P, LAYERS, 1, LATENT, tp_size=2, tp_rank=rank,
                        use_mla=True)
    rank_ns = dataclasses.replace(ns, tp_rank=0)   # the connector: tp_rank 0 for MLA
    store = FileStore(rank_ns.digest(), host.page_bytes, root=str(root))
    l3 = L3IO(store, host, rank_ns.digest(), SlotChecksums(NUM_SLOTS), batch_pages=2, rank=rank, backup_writer=writer)
    return ns, host, store, l3


def _pages(host) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(20)
    return [torch.randint(0, 256, (host.page_bytes,), dtype=torch.uint8, generator=g) for _ in range(PAGES)]


def _run(l3s, jobs_per_rank, skip=None):
    for r, l3 in enumerate(l3s):
        l3.submit(jobs_per_rank[r], (skip or {}).get(r))
    for l3 in l3s:
        assert l3.wait_idle(30)


def test_mla_namespace_is_the_same_on_every_rank(tmp_path):
    ns0, host, _s0, l3a = _rank(0, tmp_path, writer=True)
    ns1, _h, _s1, l3b = _rank(1, tmp_path, writer=False)
    assert host.geometry.use_mla and host.kv_layout.startswith("layer_first-mla/")
    assert host.page_bytes == LAYERS * P * LATENT * 2   # one latent plane, bf16
    assert ns0.digest() == ns1.digest()          # the digest ignores tp_rank for MLA
    assert dataclasses.replace(ns0, use_mla=False).digest() != dataclasses.replace(ns1, use_mla=False).digest()
    for l3 in (l3a, l3b):
        l3.close()


def test_only_the_writer_rank_sends_a_page_and_every_rank_reads_it(tmp_path):
    ranks = [_rank(0, tmp_path, writer=True), _rank(1, tmp_path, writer=False)]
    l3s = [r[3] for r in ranks]
    pages = _pages(ranks[0][1])
    keys = [bytes([i]) * 16 for i in range(PAGES)]
    for _ns, host, _st, _l3 in ranks:          # the same latent bytes in both ranks' L2, slots 0..PAGES-1
        for i, page in enumerate(pages):
            host.write_page(i, page)
    backup = Job(1, JOB_BACKUP, keys, slots=list(range(PAGES)))
    _run(l3s, [[backup], [backup]])
    reports = [l3.take_reports() for l3 in l3s]
    assert [[r.ok for r in rep] for rep in reports] == [[[True] * PAGES]] * 2
    c0, c1 = (l3.counters for l3 in l3s)
    assert (c0.backup_pages, c0.backup_other_rank_pages, c0.backup_bytes) == (PAGES, 0, PAGES * ranks[0][1].page_bytes)
    assert (c1.backup_pages, c1.backup_other_rank_pages, c1.backup_bytes) == (0, PAGES, 0)
    assert c0.backup_failed_pages == c1.backup_failed_pages == 0
    s0, s1 = ranks[0][2].stats(), ranks[1][2].stats()
    assert (s0["sets"], s1["sets"]) == (PAGES, 0)
    records = sorted(tmp_path.glob("*/*/*.page"))
    assert len(records) == PAGES and len({p.parent.parent for p in records}) == 1   # one namespace directory

    # every rank reads the one record into its own L2 (other slots than the ones written)
    for _ns, host, _st, _l3 in ranks:
        for i in range(PAGES):
            host.write_page(NUM_SLOTS - 1 - i, torch.zeros(host.page_bytes, dtype=torch.uint8))
    slots = [NUM_SLOTS - 1 - i for i in range(PAGES)]
    jobs = [[Job(2, JOB_PREFETCH, keys, slots=slots, block_ids=list(range(1, PAGES + 1)), fetch=[True] * PAGES,
                 req_id="r")] for _ in l3s]
    _run(l3s, jobs)
    for (_ns, host, store, l3) in ranks:
        polled = l3.poll()
        assert polled.finished == {"r"} and not polled.failed_blocks
        assert l3.counters.prefetch_pages == PAGES and l3.counters.prefetch_failed_pages == 0
        assert store.stats()["hits"] == PAGES
        for i, slot in enumerate(slots):
            assert torch.equal(host.read_page(slot).view(torch.uint8).flatten(), pages[i]), (l3.rank, i)
    for l3 in l3s:
        l3.close()


def test_a_page_the_other_rank_did_not_save_is_reported_not_done(tmp_path):
    """The non-writer reports a page whose slot it never saved (a skipped save) as not done, like the writer would: the
    controller's minimum over ranks then keeps that page out of the index's L3 copies."""
    ranks = [_rank(0, tmp_path, writer=True), _rank(1, tmp_path, writer=False)]
    l3s = [r[3] for r in ranks]
    pages = _pages(ranks[0][1])
    keys = [bytes([i + 1]) * 16 for i in range(PAGES)]
    for _ns, host, _st, _l3 in ranks:
        for i, page in enumerate(pages):
            host.write_page(i, page)
    backup = Job(7, JOB_BACKUP, keys, slots=list(range(PAGES)))
    _run(l3s, [[backup], [backup]], skip={1: {7: {3}}})
    ok = [l3.take_reports()[0].ok for l3 in l3s]
    assert ok == [[True] * PAGES, [True, True, True, False, True]]
    assert [min(a, b) for a, b in zip(*ok)] == [True, True, True, False, True]
    assert l3s[1].counters.backup_other_rank_pages == PAGES - 1 and l3s[1].counters.backup_skipped_pages == 1
    assert l3s[1].counters.backup_failed_pages == 0
    for l3 in l3s:
        l3.close()


def test_without_a_single_writer_both_ranks_write_the_same_record(tmp_path):
    """What the worker did before (every MLA rank a writer): the same key written twice, one record on disk."""
    ranks = [_rank(0, tmp_path, writer=True), _rank(1, tmp_path, writer=True)]
    pages = _pages(ranks[0][1])
    keys = [bytes([i + 9]) * 16 for i in range(PAGES)]
    for _ns, host, _st, _l3 in ranks:
        for i, page in enumerate(pages):
            host.write_page(i, page)
    backup = Job(3, JOB_BACKUP, keys, slots=list(range(PAGES)))
    _run([r[3] for r in ranks], [[backup], [backup]])
    assert [r[2].stats()["sets"] for r in ranks] == [PAGES, PAGES]
    assert len(list(tmp_path.glob("*/*/*.page"))) == PAGES
    for r in ranks:
        r[3].close()
