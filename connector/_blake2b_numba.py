"""Standard BLAKE2b (RFC 7693), compiled with numba, over a chain of equal-length page messages.

Used by :func:`tierkv.connector.page_hash.page_keys`; it must return exactly what :mod:`hashlib` returns for
``blake2b(message, digest_size=16, salt=previous key, person=tag)`` (tests/unit/test_page_hash.py checks it on
random inputs at several page sizes). One call hashes every page of a request, so the per-page cost is the
compression itself (docs/architecture.md §9). Import fails with ImportError when numba is missing.
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


@njit(inline="always")
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
    sg = _SIGMA
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
            m = words[pg, blk * 16:(blk + 1) * 16]
            v0, v1, v2, v3, v4, v5, v6, v7 = h0, h1, h2, h3, h4, h5, h6, h7
            v8, v9, v10, v11, v12, v13, v14, v15 = iv[0], iv[1], iv[2], iv[3], iv[4], iv[5], iv[6], iv[7]
            if blk == nblocks - 1:
                v12 = v12 ^ uint64(msglen)
                v14 = ~v14
            else:
                v12 = v12 ^ uint64((blk + 1) * 128)
            for r in range(12):
                s = sg[r]
                v0, v4, v8, v12 = _g(v0, v4, v8, v12, m[s[0]], m[s[1]])
                v1, v5, v9, v13 = _g(v1, v5, v9, v13, m[s[2]], m[s[3]])
                v2, v6, v10, v14 = _g(v2, v6, v10, v14, m[s[4]], m[s[5]])
                v3, v7, v11, v15 = _g(v3, v7, v11, v15, m[s[6]], m[s[7]])
                v0, v5, v10, v15 = _g(v0, v5, v10, v15, m[s[8]], m[s[9]])
                v1, v6, v11, v12 = _g(v1, v6, v11, v12, m[s[10]], m[s[11]])
                v2, v7, v8, v13 = _g(v2, v7, v8, v13, m[s[12]], m[s[13]])
                v3, v4, v9, v14 = _g(v3, v4, v9, v14, m[s[14]], m[s[15]])
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
