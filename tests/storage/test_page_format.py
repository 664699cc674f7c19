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
