"""Page record headers: the batch encoder writes exactly the bytes of the per-page one, and a reader accepts both."""
import os

import numpy as np
import pytest
import xxhash

from tierkv.storage_backends.page_format import decode_header, encode_header, encode_headers


def test_encode_headers_equals_encode_header_per_page():
    ns = os.urandom(16)
    keys = [os.urandom(16).hex() for _ in range(5)]
    pages = [np.random.default_rng(i).integers(0, 256, 4096, dtype=np.uint8) for i in range(5)]
    batch = encode_headers([bytes.fromhex(k) for k in keys], ns, pages, 4096)
    assert batch == [encode_header(k, ns, memoryview(p)) for k, p in zip(keys, pages)]
    for k, p, h in zip(keys, pages, batch):
        assert decode_header(h, k, ns, 4096) == xxhash.xxh3_64_intdigest(p)
    assert len(set(batch)) == 5  # key and payload are in every header


def test_encode_headers_refuses_bad_input():
    ns = os.urandom(16)
    with pytest.raises(ValueError, match="16 bytes"):
        encode_headers([b"short"], ns, [b"x" * 8], 8)
    with pytest.raises(ValueError, match="2 keys but 1 payloads"):
        encode_headers([os.urandom(16)] * 2, ns, [b"x" * 8], 8)
    with pytest.raises(ValueError, match="namespace"):
        encode_headers([os.urandom(16)], b"ns", [b"x" * 8], 8)


def test_given_checksums_give_the_same_headers_without_hashing_payloads(monkeypatch):
    """"Checksum once": headers built from precomputed payload checksums are byte-identical to computed ones, and
    only the 56 header bytes are hashed."""
    from tierkv.storage_backends.page_format import payload_checksum

    ns = os.urandom(16)
    keys = [os.urandom(16).hex() for _ in range(4)]
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
        encode_headers([os.urandom(16)] * 2, os.urandom(16), [b"x" * 8] * 2, 8, [1])
