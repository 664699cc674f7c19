"""The L3 writer hands a page that lies in several runs of L2 (``layer_first``: one run per layer) to a store that
takes runs (``StorageBackend.vectored_sources``: the file and ZMQ stores) as those runs, with no staging copy, and
stages it into one contiguous page for a store that does not, and for any store when its runs are short
(``VECTORED_MIN_RUN_BYTES``); either way the record is the page's bytes and its
checksum, so it reads back bit for bit (connector/l3/io/runners.py ``_run_backup``). The readers the same way back: a
store that reads into runs (``vectored_destinations``) gets the slot's runs, and the slot's checksum is the one the store
verified (``verified_checksums``) or the readers' hash (``_run_prefetch``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tierkv.connector.l2.host_pool import HostPool
from tierkv.connector.l3.io import L3IO, VECTORED_MIN_RUN_BYTES, l3_key
from tierkv.connector.core.page_checksums import SlotChecksums
from tierkv.connector.core.plan import JOB_BACKUP, Job
from tierkv.connector.l2.worker import MultiBlockPages
from tierkv.storage_backends import FaultyBackend
from tierkv.storage_backends.file.store import FileStore

NS = bytes(range(16))


class StagedFileStore(FileStore):
    """A file store that takes whole pages only, as Mooncake and LMCache do."""
    vectored_sources = False

    def batch_set(self, keys, sources, checksums=None, tokens=None):
        assert not any(isinstance(s, (list, tuple)) for s in sources), "runs given to a store that does not take them"
        return super().batch_set(keys, sources, checksums=checksums, tokens=tokens)


@pytest.mark.parametrize("store_kind", ["file", "staged", "faulty_file"])
@pytest.mark.parametrize("blocks_per_page,run_bytes", [(1, VECTORED_MIN_RUN_BYTES), (2, VECTORED_MIN_RUN_BYTES // 2),
                                                       (1, 4096)])
def test_backup_of_a_page_in_runs_reads_back_bit_for_bit(tmp_path, store_kind, blocks_per_page, run_bytes):
    """Runs of at least VECTORED_MIN_RUN_BYTES go to a store that takes them as runs (also when a page of two blocks
    makes them so); shorter ones are staged for every store."""
    rows = HostPool(8, 3, run_bytes)  # layer_first: a page is 3 runs, one per layer (k blocks each with MultiBlockPages)
    host = rows if blocks_per_page == 1 else MultiBlockPages(rows, blocks_per_page)
    rows.buffer.copy_(torch.from_numpy(np.random.default_rng(7).integers(0, 256, rows.nbytes, dtype=np.uint8)))
    inner = (StagedFileStore if store_kind == "staged" else FileStore)(NS, host.page_bytes, root=str(tmp_path))
    store = FaultyBackend(inner) if store_kind == "faulty_file" else inner
    checksums = SlotChecksums(host.num_slots)
    l3 = L3IO(store, host, NS, checksums, read_threads=1, batch_pages=2)
    try:
        assert l3._vectored is (store_kind != "staged" and run_bytes * blocks_per_page >= VECTORED_MIN_RUN_BYTES)
        slots = list(range(host.num_slots))
        keys = [bytes([s]) * 16 for s in slots]
        checksums.record(slots[0], keys[0], host.page_checksum(slots[0]))  # one page hashed when it entered L2
        l3.submit([Job(1, JOB_BACKUP, keys, slots=slots)])
        assert l3.wait_idle(30.0)
        (rep,) = l3.take_reports()
        assert rep.ok == [True] * len(slots)
        dst = [torch.empty(host.page_bytes, dtype=torch.uint8) for _ in slots]
        assert inner.batch_get([l3_key(NS, k) for k in keys], dst) == [True] * len(slots)
        for s, d in zip(slots, dst):
            assert torch.equal(d, host.read_page(s)), f"slot {s}"
        assert inner.stats()["corrupt"] == 0
    finally:
        l3.close(0)
        store.close()


class StagedReadFileStore(FileStore):
    """A file store that reads into whole pages only and hands back no checksum (as Mooncake and LMCache)."""
    vectored_destinations = False
    verified_checksums = False

    def batch_get(self, keys, destinations, tokens=None, checksums=None):
        assert checksums is None, "checksums asked of a store that does not hand them back"
        assert not any(isinstance(d, (list, tuple)) for d in destinations), "runs given to a store that reads whole"
        return super().batch_get(keys, destinations, tokens=tokens)


@pytest.mark.parametrize("store_kind", ["file", "staged", "faulty_file"])
@pytest.mark.parametrize("run_bytes", [VECTORED_MIN_RUN_BYTES, 4096])
def test_prefetch_into_a_slot_in_runs_lands_the_page_and_its_checksum(tmp_path, store_kind, run_bytes):
    """The readers read a page straight into its L2 slot's runs from a store that reads into runs (long runs), else
    into a staging page copied into the slot; the checksum recorded for the slot is the one the store verified
    (file store) or the readers' own hash, either way the page's; a page missing from L3 is not ok and records
    nothing."""
    from tierkv.connector.core.plan import JOB_PREFETCH

    host = HostPool(8, 3, run_bytes)
    pages = np.random.default_rng(9).integers(0, 256, (4, host.page_bytes), dtype=np.uint8)
    inner = (StagedReadFileStore if store_kind == "staged" else FileStore)(NS, host.page_bytes, root=str(tmp_path))
    store = FaultyBackend(inner) if store_kind == "faulty_file" else inner
    keys = [bytes([40 + i]) * 16 for i in range(5)]
    assert inner.batch_set([l3_key(NS, k) for k in keys[:4]], list(pages)) == [True] * 4
    checksums = SlotChecksums(host.num_slots)
    l3 = L3IO(store, host, NS, checksums, read_threads=1, batch_pages=2)
    try:
        assert l3._vectored_read is (store_kind != "staged" and run_bytes >= VECTORED_MIN_RUN_BYTES)
        assert l3._store_sums is (store_kind != "staged")
        slots = [6, 2, 5, 1, 3]
        l3.submit([Job(1, JOB_PREFETCH, keys, slots=slots, block_ids=[10, 11, 12, 13, 14], fetch=[True] * 5,
                       req_id="r")])
        assert l3.wait_idle(30.0)
        res = l3.poll()
        assert res.finished == {"r"} and res.failed_blocks == {14}
        (rep,) = l3.take_reports()
        assert rep.ok == [True, True, True, True, False]
        for i, s in enumerate(slots[:4]):
            assert np.array_equal(host.read_page(s).numpy(), pages[i]), f"slot {s}"
            assert checksums.get(s, keys[i]) == host.page_checksum(s)
        assert checksums.get(slots[4], keys[4]) is None
    finally:
        l3.close(0)
        store.close()
