"""Page record headers: golden bytes of a header and a record (the stored format is pinned), the batch encoder writes
exactly the bytes of the per-page one, and a reader accepts both."""
import numpy as np
import pytest
import xxhash

from tierkv.storage_backends import page_format
from tierkv.storage_backends.page_format import (HEADER_BYTES, NewerFormatError, PageFormatError, check_record,
                                                 decode_header, decode_record, encode_header, encode_headers,
                                                 encode_record, read_header)

_RNG = np.random.default_rng(20261201)  # fixed: keys and namespaces are the same in every run


def _rand16() -> bytes:
    return _RNG.bytes(16)


# ------------------------------------------------------------------------------------------------ golden bytes
# Computed once and pinned. These are the bytes every L3 store keeps (file store files, zmq server memory, Mooncake
# objects, LMCache chunks): changing any of them (field order, byte order, sizes, checksum function, magic) makes
# stored data unreadable and must be a deliberate decision that bumps page_format.VERSION (the record's version
# field, offset 4), and then these constants. See the header table in storage_backends/page_format.py.
GOLDEN_NS = bytes.fromhex("bcb5938b46a2e6356a9a5226012ea5de")   # tests/connector/core/test_page_hash.py GOLDEN_NS
GOLDEN_KEY = "6ce9b292b484b2540201e8629d95e3ad"                   # tests/connector/core/test_page_hash.py GOLDEN_KEYS[0]
GOLDEN_PAYLOAD = bytes(range(48))
GOLDEN_PAYLOAD_XXH3 = 0x57433C648F7D24C9  # XXH3-64 of GOLDEN_PAYLOAD
GOLDEN_HEADER = bytes.fromhex(
    "544b5650"                               # 0  magic b"TKVP"
    "0100"                                   # 4  version 1, uint16 LE
    "0000"                                   # 6  flags 0
    "bcb5938b46a2e6356a9a5226012ea5de"       # 8  namespace digest
    "6ce9b292b484b2540201e8629d95e3ad"       # 24 page key (raw)
    "3000000000000000"                       # 40 payload length 48, uint64 LE
    "c9247d8f643c4357"                       # 48 XXH3-64 of the payload, uint64 LE
    "913d8ac1622a2096")                      # 56 XXH3-64 of bytes 0..56, uint64 LE
GOLDEN_RECORD = GOLDEN_HEADER + GOLDEN_PAYLOAD
# a caller-given payload checksum is written as given (batch_set(..., checksums=...))
GOLDEN_HEADER_GIVEN_SUM = bytes.fromhex(
    "544b565001000000bcb5938b46a2e6356a9a5226012ea5de6ce9b292b484b2540201e8629d95e3ad3000000000000000"
    "efcdab8967452301ffd6a7b96231d5d5")


def test_golden_header_and_record_bytes():
    assert page_format.VERSION == 1 and page_format.MAGIC == b"TKVP" and HEADER_BYTES == 64
    assert len(GOLDEN_HEADER) == HEADER_BYTES
    assert encode_header(GOLDEN_KEY, GOLDEN_NS, GOLDEN_PAYLOAD) == GOLDEN_HEADER
    assert encode_record(GOLDEN_KEY, GOLDEN_NS, GOLDEN_PAYLOAD) == GOLDEN_RECORD
    assert encode_headers([bytes.fromhex(GOLDEN_KEY)], GOLDEN_NS, [GOLDEN_PAYLOAD], 48) == [GOLDEN_HEADER]
    assert encode_header(GOLDEN_KEY, GOLDEN_NS, GOLDEN_PAYLOAD, checksum=0x0123456789ABCDEF) == GOLDEN_HEADER_GIVEN_SUM
    assert encode_headers([bytes.fromhex(GOLDEN_KEY)], GOLDEN_NS, [GOLDEN_PAYLOAD], 48,
                          [0x0123456789ABCDEF]) == [GOLDEN_HEADER_GIVEN_SUM]


def test_golden_bytes_parse_to_the_fixed_fields():
    """The pinned bytes are read back field by field (the reader side of the format is pinned too)."""
    assert read_header(GOLDEN_HEADER) == {"version": 1, "namespace": GOLDEN_NS, "key": GOLDEN_KEY, "length": 48,
                                          "checksum": GOLDEN_PAYLOAD_XXH3}
    assert read_header(GOLDEN_HEADER_GIVEN_SUM)["checksum"] == 0x0123456789ABCDEF
    assert decode_header(GOLDEN_HEADER, GOLDEN_KEY, GOLDEN_NS, 48) == GOLDEN_PAYLOAD_XXH3
    assert bytes(decode_record(GOLDEN_RECORD, GOLDEN_KEY, GOLDEN_NS, 48)) == GOLDEN_PAYLOAD
    assert check_record(GOLDEN_HEADER, GOLDEN_PAYLOAD, GOLDEN_KEY, GOLDEN_NS)["length"] == 48
    assert xxhash.xxh3_64_intdigest(GOLDEN_PAYLOAD) == GOLDEN_PAYLOAD_XXH3
    # the same bytes with a higher version (header checksum recomputed) are a newer record, not data
    newer = bytearray(GOLDEN_HEADER)
    newer[4:6] = (2).to_bytes(2, "little")
    newer[56:64] = xxhash.xxh3_64_intdigest(bytes(newer[:56])).to_bytes(8, "little")
    assert read_header(bytes(newer))["version"] == 2
    with pytest.raises(PageFormatError, match="unsupported page format version 2"):
        decode_header(bytes(newer), GOLDEN_KEY, GOLDEN_NS, 48)
    with pytest.raises(NewerFormatError):
        check_record(bytes(newer), GOLDEN_PAYLOAD)


@pytest.mark.parametrize("offset", [0, 4, 6, 8, 24, 40, 48, 56, 63])
def test_any_changed_golden_header_byte_is_refused(offset):
    bad = bytearray(GOLDEN_HEADER)
    bad[offset] ^= 0x01
    with pytest.raises(PageFormatError):
        decode_header(bytes(bad), GOLDEN_KEY, GOLDEN_NS, 48)
    with pytest.raises(PageFormatError):
        decode_record(bytes(bad) + GOLDEN_PAYLOAD, GOLDEN_KEY, GOLDEN_NS, 48)


def test_encode_headers_equals_encode_header_per_page():
    ns = _rand16()
    keys = [_rand16().hex() for _ in range(5)]
    pages = [np.random.default_rng(i).integers(0, 256, 4096, dtype=np.uint8) for i in range(5)]
    batch = encode_headers([bytes.fromhex(k) for k in keys], ns, pages, 4096)
    assert batch == [encode_header(k, ns, memoryview(p)) for k, p in zip(keys, pages)]
    for k, p, h in zip(keys, pages, batch):
        assert decode_header(h, k, ns, 4096) == xxhash.xxh3_64_intdigest(p)
    assert len(set(batch)) == 5  # key and payload are in every header


def test_encode_headers_refuses_bad_input():
    ns = _rand16()
    with pytest.raises(ValueError, match="16 bytes"):
        encode_headers([b"short"], ns, [b"x" * 8], 8)
    with pytest.raises(ValueError, match="2 keys but 1 payloads"):
        encode_headers([_rand16()] * 2, ns, [b"x" * 8], 8)
    with pytest.raises(ValueError, match="namespace"):
        encode_headers([_rand16()], b"ns", [b"x" * 8], 8)


def test_given_checksums_give_the_same_headers_without_hashing_payloads(monkeypatch):
    """"Checksum once": headers built from precomputed payload checksums are byte-identical to computed ones, and
    only the 56 header bytes are hashed."""
    from tierkv.storage_backends.page_format import payload_checksum

    ns = _rand16()
    keys = [_rand16().hex() for _ in range(4)]
    pages = [np.random.default_rng(10 + i).integers(0, 256, 4096, dtype=np.uint8) for i in range(4)]
    sums = [payload_checksum(p) for p in pages]
    assert sums == [xxhash.xxh3_64_intdigest(p) for p in pages]
    want = encode_headers([bytes.fromhex(k) for k in keys], ns, pages, 4096)
    sizes = []
    real = xxhash.xxh3_64_intdigest
    monkeypatch.setattr(xxhash, "xxh3_64_intdigest", lambda b, *a: sizes.append(memoryview(b).nbytes) or real(b, *a))
    assert encode_headers([bytes.fromhex(k) for k in keys], ns, pages, 4096, sums) == want
    assert [encode_header(k, ns, memoryview(p), c) for k, p, c in zip(keys, pages, sums)] == want
    assert sizes and set(sizes) == {56}
    # a wrong checksum is written as given: the header decodes, the payload then fails verification
    from tierkv.storage_backends.page_format import PageFormatError, verify_payload

    h = encode_header(keys[0], ns, memoryview(pages[0]), sums[0] ^ 1)
    psum = decode_header(h, keys[0], ns, 4096)
    with pytest.raises(PageFormatError, match="payload checksum"):
        verify_payload(memoryview(pages[0]), psum)


def test_check_checksums():
    from tierkv.storage_backends.page_format import check_checksums

    assert check_checksums(None, 3) is None
    assert check_checksums([0, 5, (1 << 64) - 1], 3) == [0, 5, (1 << 64) - 1]
    got = check_checksums(np.array([1, 2], dtype=np.uint64), 2)
    assert got == [1, 2] and all(type(x) is int for x in got)
    for bad, match in (([1, 2], "3 pages but 2 checksums"), ([1, 2, 3, 4], "3 pages but 4 checksums"),
                       (7, "sequence"), ("abc", "sequence"), ([1, 2.0, 3], r"checksums\[1\]"),
                       ([1, True, 3], r"checksums\[1\]"), ([-1, 0, 0], "64-bit"), ([0, 0, 1 << 64], "64-bit")):
        with pytest.raises(ValueError, match=match):
            check_checksums(bad, 3)
    with pytest.raises(ValueError, match="checksums"):
        encode_headers([_rand16()] * 2, _rand16(), [b"x" * 8] * 2, 8, [1])


def test_payload_checksum_of_runs_equals_that_of_the_whole_page():
    """A page given as runs hashes to the value of its bytes in one piece (the header's checksum must not depend
    on how the writer held the page)."""
    page = np.random.default_rng(5).integers(0, 256, 96 * 1024, dtype=np.uint8)
    whole = page_format.payload_checksum(page)
    assert whole == xxhash.xxh3_64_intdigest(page.tobytes())
    for cuts in ([32 * 1024, 64 * 1024], [1], [7, 8, 50000]):
        edges = [0, *cuts, page.nbytes]
        runs = [page[s:e] for s, e in zip(edges, edges[1:])]
        assert page_format.payload_checksum(runs) == whole
        assert page_format.payload_checksum(tuple(runs)) == whole
    assert page_format.payload_checksum([page[:1000], page[1001:]]) != whole  # one byte left out
