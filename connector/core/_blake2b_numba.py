"""Standard BLAKE2b (RFC 7693), compiled with numba, over a chain of equal-length page messages.

The twelve rounds are written out with the message schedule (RFC 7693 SIGMA) as constant word indices, so the
message words stay in registers; ``_SIGMA`` is kept for the tests and for reading.

Used by :func:`tierkv.connector.core.page_hash.page_keys`; it must return exactly what :mod:`hashlib` returns for
``blake2b(message, digest_size=16, salt=previous key, person=tag)`` (tests/connector/core/test_page_hash.py checks it on
random inputs at several page sizes). One call hashes every page of a request, so the per-page cost is the
compression itself. Import fails with ImportError when numba is missing.
"""
from __future__ import annotations

import numpy as np
from numba import njit, uint64

_IV = np.array([0x6A09E667F3BCC908, 0xBB67AE8584CAA73B, 0x3C6EF372FE94F82B, 0xA54FF53A5F1D36F1,
                0x510E527FADE682D1, 0x9B05688C2B3E6C1F, 0x1F83D9ABFB41BD6B, 0x5BE0CD19137E2179], dtype=np.uint64)
_SIGMA = np.array([
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3],
    [11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4], [7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8],
    [9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13], [2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9],
    [12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11], [13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10],
    [6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5], [10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0],
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3],
], dtype=np.int64)
#: parameter block word 0 for digest length 16, no key, fanout 1, depth 1
_P0 = 0x01010010


@njit(cache=True)
def _g(a, b, c, d, x, y):
    a = a + b + x
    d = d ^ a
    d = (d >> uint64(32)) | (d << uint64(32))
    c = c + d
    b = b ^ c
    b = (b >> uint64(24)) | (b << uint64(40))
    a = a + b + y
    d = d ^ a
    d = (d >> uint64(16)) | (d << uint64(48))
    c = c + d
    b = b ^ c
    b = (b >> uint64(63)) | (b << uint64(1))
    return a, b, c, d


@njit(cache=True, nogil=True)
def blake2b_chain(words, nblocks, msglen, s0, s1, p0, p1, out):
    """Hash page after page: page i is ``words[i]`` (``uint64 [n, 16 * nblocks]``, its ``msglen`` message bytes
    zero-padded to whole 128-byte blocks) under BLAKE2b-128 with salt = (s0, s1), the previous page's digest (the
    chain's root for page 0), and personalisation (p0, p1). Writes digests into ``out`` (``uint64 [n, 2]``)."""
    iv = _IV
    for pg in range(words.shape[0]):
        h0 = iv[0] ^ uint64(_P0)
        h1 = iv[1]
        h2 = iv[2]
        h3 = iv[3]
        h4 = iv[4] ^ s0
        h5 = iv[5] ^ s1
        h6 = iv[6] ^ p0
        h7 = iv[7] ^ p1
        for blk in range(nblocks):
            base = blk * 16
            m0 = words[pg, base + 0]
            m1 = words[pg, base + 1]
            m2 = words[pg, base + 2]
            m3 = words[pg, base + 3]
            m4 = words[pg, base + 4]
            m5 = words[pg, base + 5]
            m6 = words[pg, base + 6]
            m7 = words[pg, base + 7]
            m8 = words[pg, base + 8]
            m9 = words[pg, base + 9]
            m10 = words[pg, base + 10]
            m11 = words[pg, base + 11]
            m12 = words[pg, base + 12]
            m13 = words[pg, base + 13]
            m14 = words[pg, base + 14]
            m15 = words[pg, base + 15]
            v0, v1, v2, v3, v4, v5, v6, v7 = h0, h1, h2, h3, h4, h5, h6, h7
            v8, v9, v10, v11, v12, v13, v14, v15 = iv[0], iv[1], iv[2], iv[3], iv[4], iv[5], iv[6], iv[7]
            if blk == nblocks - 1:
                v12 = v12 ^ uint64(msglen)
                v14 = ~v14
            else:
                v12 = v12 ^ uint64((blk + 1) * 128)
            # round 0
            v0, v4, v8, v12 = _g(v0, v4, v8, v12, m0, m1)
            v1, v5, v9, v13 = _g(v1, v5, v9, v13, m2, m3)
            v2, v6, v10, v14 = _g(v2, v6, v10, v14, m4, m5)
            v3, v7, v11, v15 = _g(v3, v7, v11, v15, m6, m7)
            v0, v5, v10, v15 = _g(v0, v5, v10, v15, m8, m9)
            v1, v6, v11, v12 = _g(v1, v6, v11, v12, m10, m11)
            v2, v7, v8, v13 = _g(v2, v7, v8, v13, m12, m13)
            v3, v4, v9, v14 = _g(v3, v4, v9, v14, m14, m15)
            # round 1
            v0, v4, v8, v12 = _g(v0, v4, v8, v12, m14, m10)
            v1, v5, v9, v13 = _g(v1, v5, v9, v13, m4, m8)
            v2, v6, v10, v14 = _g(v2, v6, v10, v14, m9, m15)
            v3, v7, v11, v15 = _g(v3, v7, v11, v15, m13, m6)
            v0, v5, v10, v15 = _g(v0, v5, v10, v15, m1, m12)
            v1, v6, v11, v12 = _g(v1, v6, v11, v12, m0, m2)
            v2, v7, v8, v13 = _g(v2, v7, v8, v13, m11, m7)
            v3, v4, v9, v14 = _g(v3, v4, v9, v14, m5, m3)
            # round 2
            v0, v4, v8, v12 = _g(v0, v4, v8, v12, m11, m8)
            v1, v5, v9, v13 = _g(v1, v5, v9, v13, m12, m0)
            v2, v6, v10, v14 = _g(v2, v6, v10, v14, m5, m2)
            v3, v7, v11, v15 = _g(v3, v7, v11, v15, m15, m13)
            v0, v5, v10, v15 = _g(v0, v5, v10, v15, m10, m14)
            v1, v6, v11, v12 = _g(v1, v6, v11, v12, m3, m6)
            v2, v7, v8, v13 = _g(v2, v7, v8, v13, m7, m1)
            v3, v4, v9, v14 = _g(v3, v4, v9, v14, m9, m4)
            # round 3
            v0, v4, v8, v12 = _g(v0, v4, v8, v12, m7, m9)
            v1, v5, v9, v13 = _g(v1, v5, v9, v13, m3, m1)
            v2, v6, v10, v14 = _g(v2, v6, v10, v14, m13, m12)
            v3, v7, v11, v15 = _g(v3, v7, v11, v15, m11, m14)
            v0, v5, v10, v15 = _g(v0, v5, v10, v15, m2, m6)
            v1, v6, v11, v12 = _g(v1, v6, v11, v12, m5, m10)
            v2, v7, v8, v13 = _g(v2, v7, v8, v13, m4, m0)
            v3, v4, v9, v14 = _g(v3, v4, v9, v14, m15, m8)
            # round 4
            v0, v4, v8, v12 = _g(v0, v4, v8, v12, m9, m0)
            v1, v5, v9, v13 = _g(v1, v5, v9, v13, m5, m7)
            v2, v6, v10, v14 = _g(v2, v6, v10, v14, m2, m4)
            v3, v7, v11, v15 = _g(v3, v7, v11, v15, m10, m15)
            v0, v5, v10, v15 = _g(v0, v5, v10, v15, m14, m1)
            v1, v6, v11, v12 = _g(v1, v6, v11, v12, m11, m12)
            v2, v7, v8, v13 = _g(v2, v7, v8, v13, m6, m8)
            v3, v4, v9, v14 = _g(v3, v4, v9, v14, m3, m13)
            # round 5
            v0, v4, v8, v12 = _g(v0, v4, v8, v12, m2, m12)
            v1, v5, v9, v13 = _g(v1, v5, v9, v13, m6, m10)
            v2, v6, v10, v14 = _g(v2, v6, v10, v14, m0, m11)
            v3, v7, v11, v15 = _g(v3, v7, v11, v15, m8, m3)
            v0, v5, v10, v15 = _g(v0, v5, v10, v15, m4, m13)
            v1, v6, v11, v12 = _g(v1, v6, v11, v12, m7, m5)
            v2, v7, v8, v13 = _g(v2, v7, v8, v13, m15, m14)
            v3, v4, v9, v14 = _g(v3, v4, v9, v14, m1, m9)
            # round 6
            v0, v4, v8, v12 = _g(v0, v4, v8, v12, m12, m5)
            v1, v5, v9, v13 = _g(v1, v5, v9, v13, m1, m15)
            v2, v6, v10, v14 = _g(v2, v6, v10, v14, m14, m13)
            v3, v7, v11, v15 = _g(v3, v7, v11, v15, m4, m10)
            v0, v5, v10, v15 = _g(v0, v5, v10, v15, m0, m7)
            v1, v6, v11, v12 = _g(v1, v6, v11, v12, m6, m3)
            v2, v7, v8, v13 = _g(v2, v7, v8, v13, m9, m2)
            v3, v4, v9, v14 = _g(v3, v4, v9, v14, m8, m11)
            # round 7
            v0, v4, v8, v12 = _g(v0, v4, v8, v12, m13, m11)
            v1, v5, v9, v13 = _g(v1, v5, v9, v13, m7, m14)
            v2, v6, v10, v14 = _g(v2, v6, v10, v14, m12, m1)
            v3, v7, v11, v15 = _g(v3, v7, v11, v15, m3, m9)
            v0, v5, v10, v15 = _g(v0, v5, v10, v15, m5, m0)
            v1, v6, v11, v12 = _g(v1, v6, v11, v12, m15, m4)
            v2, v7, v8, v13 = _g(v2, v7, v8, v13, m8, m6)
            v3, v4, v9, v14 = _g(v3, v4, v9, v14, m2, m10)
            # round 8
            v0, v4, v8, v12 = _g(v0, v4, v8, v12, m6, m15)
            v1, v5, v9, v13 = _g(v1, v5, v9, v13, m14, m9)
            v2, v6, v10, v14 = _g(v2, v6, v10, v14, m11, m3)
            v3, v7, v11, v15 = _g(v3, v7, v11, v15, m0, m8)
            v0, v5, v10, v15 = _g(v0, v5, v10, v15, m12, m2)
            v1, v6, v11, v12 = _g(v1, v6, v11, v12, m13, m7)
            v2, v7, v8, v13 = _g(v2, v7, v8, v13, m1, m4)
            v3, v4, v9, v14 = _g(v3, v4, v9, v14, m10, m5)
            # round 9
            v0, v4, v8, v12 = _g(v0, v4, v8, v12, m10, m2)
            v1, v5, v9, v13 = _g(v1, v5, v9, v13, m8, m4)
            v2, v6, v10, v14 = _g(v2, v6, v10, v14, m7, m6)
            v3, v7, v11, v15 = _g(v3, v7, v11, v15, m1, m5)
            v0, v5, v10, v15 = _g(v0, v5, v10, v15, m15, m11)
            v1, v6, v11, v12 = _g(v1, v6, v11, v12, m9, m14)
            v2, v7, v8, v13 = _g(v2, v7, v8, v13, m3, m12)
            v3, v4, v9, v14 = _g(v3, v4, v9, v14, m13, m0)
            # round 10
            v0, v4, v8, v12 = _g(v0, v4, v8, v12, m0, m1)
            v1, v5, v9, v13 = _g(v1, v5, v9, v13, m2, m3)
            v2, v6, v10, v14 = _g(v2, v6, v10, v14, m4, m5)
            v3, v7, v11, v15 = _g(v3, v7, v11, v15, m6, m7)
            v0, v5, v10, v15 = _g(v0, v5, v10, v15, m8, m9)
            v1, v6, v11, v12 = _g(v1, v6, v11, v12, m10, m11)
            v2, v7, v8, v13 = _g(v2, v7, v8, v13, m12, m13)
            v3, v4, v9, v14 = _g(v3, v4, v9, v14, m14, m15)
            # round 11
            v0, v4, v8, v12 = _g(v0, v4, v8, v12, m14, m10)
            v1, v5, v9, v13 = _g(v1, v5, v9, v13, m4, m8)
            v2, v6, v10, v14 = _g(v2, v6, v10, v14, m9, m15)
            v3, v7, v11, v15 = _g(v3, v7, v11, v15, m13, m6)
            v0, v5, v10, v15 = _g(v0, v5, v10, v15, m1, m12)
            v1, v6, v11, v12 = _g(v1, v6, v11, v12, m0, m2)
            v2, v7, v8, v13 = _g(v2, v7, v8, v13, m11, m7)
            v3, v4, v9, v14 = _g(v3, v4, v9, v14, m5, m3)
            h0 ^= v0 ^ v8
            h1 ^= v1 ^ v9
            h2 ^= v2 ^ v10
            h3 ^= v3 ^ v11
            h4 ^= v4 ^ v12
            h5 ^= v5 ^ v13
            h6 ^= v6 ^ v14
            h7 ^= v7 ^ v15
        out[pg, 0] = h0
        out[pg, 1] = h1
        s0 = h0
        s1 = h1
