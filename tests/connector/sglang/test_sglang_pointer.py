"""The pointer form of ``HiCacheStorage.get``/``set`` (``target_location`` = an address, ``target_sizes`` = its bytes,
as SGLang's Mooncake backend takes them) on tierkv's backend: a whole page inside the host pool round-trips bit for
bit and shares its records with the copy path; anything else is refused with False / None and one log line, never an
exception (before: ``'NoneType' object has no attribute 'contiguous'``)."""
from __future__ import annotations

import logging

import pytest
import torch

from tests.helpers import sgl as _sgl  # noqa: F401  (shims + SGLang imports)
from tests.helpers.sgl import attach, extra_config, keys, mha_pool


@pytest.fixture
def rig(tmp_path):
    pool = mha_pool()
    b = attach(extra_config({"backend": "file", "file": {"root": str(tmp_path / "l3")}}, split_kv=True), pool)
    buf = pool.kv_buffer.reshape(-1).view(torch.uint8)
    buf[: 4 * b.page_bytes] = torch.randint(0, 256, (4 * b.page_bytes,), dtype=torch.uint8,
                                            generator=torch.Generator().manual_seed(5))
    yield b, pool, buf
    b.close()


def test_whole_page_round_trip_and_shares_records_with_the_copy_path(rig):
    b, pool, buf = rig
    pb, ptr = b.page_bytes, buf.data_ptr()
    k = keys(2, "ptr")
    assert b.set(k[0], target_location=ptr, target_sizes=pb) is True
    assert b.exists(k[0])
    assert b.get(k[0], target_location=ptr + 2 * pb, target_sizes=pb) is True
    assert torch.equal(buf[2 * pb:3 * pb], buf[:pb])
    flat = b.get(k[0], pool.get_dummy_flat_data_page())  # the copy path reads the same records
    assert torch.equal(flat.view(torch.uint8), buf[:pb])
    # one address per record (K then V) works too, and batch forms take a list per key
    half = b.part_bytes
    assert b.set(k[1], None, [ptr + pb + half, ptr + pb], [half, half]) is True  # V bytes first: a different page
    assert b.batch_get(k, [ptr + 3 * pb, ptr + 2 * pb], [pb, pb]) == [True, True]
    assert torch.equal(buf[3 * pb:4 * pb], buf[:pb])  # key 0 into page 3, key 1 into page 2
    assert torch.equal(buf[2 * pb:2 * pb + half], buf[pb + half:2 * pb])
    assert torch.equal(buf[2 * pb + half:3 * pb], buf[pb:pb + half])
    assert b.batch_set(keys(1, "b"), None, [ptr], [pb]) is True and b.stats()["pointer_rejected"] == 0


@pytest.mark.parametrize("case", ["half_page", "outside_pool", "no_location", "past_the_end", "not_an_int"])
def test_anything_but_a_whole_page_in_the_pool_is_refused_with_one_log_line(rig, caplog, case):
    b, pool, buf = rig
    pb, ptr = b.page_bytes, buf.data_ptr()
    other = torch.zeros(pb, dtype=torch.uint8)
    loc, size = {"half_page": (ptr, pb // 2), "outside_pool": (other.data_ptr(), pb), "no_location": (None, None),
                 "past_the_end": (ptr + buf.numel() - pb // 2, pb), "not_an_int": (float(ptr), pb)}[case]
    k = keys(1, case)
    caplog.set_level(logging.WARNING, logger="tierkv.connector.sglang.hicache")
    caplog.clear()
    assert b.set(k[0], None, loc, size) is False
    assert b.exists(k[0]) is False and b.stats()["pages_set"] == 0
    assert len([r for r in caplog.records if "nothing stored" in r.getMessage() or "not stored" in r.getMessage()]) \
        <= 1  # one line (rate-limited across tests in one process)
    if case != "no_location":
        assert b.stats()["pointer_rejected"] == 1
        assert b.get(k[0], loc, size) is None and b.stats()["pointer_rejected"] == 2


def test_a_pointer_get_of_a_missing_or_corrupt_page_is_none(rig, tmp_path):
    b, pool, buf = rig
    pb, ptr = b.page_bytes, buf.data_ptr()
    assert b.get(keys(1, "nothing")[0], ptr + 3 * pb, pb) is None
    k = keys(1, "flip")[0]
    assert b.set(k, None, ptr, pb) is True
    v = b.tierkv_keys(k)[1]
    path = tmp_path / "l3" / b._ns_digest.hex() / v[:2] / f"{v}.page"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    assert b.get(k, ptr + 3 * pb, pb) is None and b.stats()["store"]["corrupt"] == 1
