"""The L3 writer hands a page that lies in several runs of L2 (``layer_first``: one run per layer) to a store that
takes runs (``StorageBackend.vectored_sources``: the file and ZMQ stores) as those runs, with no staging copy, and
stages it into one contiguous page for a store that does not, and for any store when its runs are short
(``VECTORED_MIN_RUN_BYTES``); either way the record is the page's bytes and its
checksum, so it reads back bit for bit (connector/l3_io.py ``_run_backup``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tierkv.connector.host_pool import HostPool
from tierkv.connector.l3_io import L3IO, VECTORED_MIN_RUN_BYTES, l3_key
from tierkv.connector.page_checksums import SlotChecksums
from tierkv.connector.plan import JOB_BACKUP, Job
from tierkv.connector.worker import MultiBlockPages
from tierkv.storage_backends import FaultyBackend
from tierkv.storage_backends.file import FileStore

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
