"""Self-describing page records shared by every L3 backend.

A stored page is ``header || payload``. The header (little-endian, :data:`HEADER_BYTES` = 64 bytes):

| offset | size | field |
|---|---|---|
| 0 | 4 | magic ``b"TKVP"`` |
| 4 | 2 | format version (:data:`VERSION`) |
| 6 | 2 | flags (0) |
| 8 | 16 | namespace digest (:meth:`tierkv.connector.page_hash.ModelNamespace.digest`) |
| 24 | 16 | page key (raw 16 bytes of the hex key) |
| 40 | 8 | payload length in bytes |
| 48 | 8 | XXH3-64 of the payload |
| 56 | 8 | XXH3-64 of bytes 0..56 (header checksum) |

A reader checks every field against what it expects (namespace, key, length) and the checksums, so a
truncated, corrupted, foreign (other namespace, other key: e.g. a Mooncake region handed to another key after a
master restart, field scenario R16) or planted (e.g. a pickle stream, R19) record is a miss, never data.
Nothing here ever unpickles or constructs objects from stored bytes.
"""
from __future__ import annotations

import re
import struct
from typing import Any, Sequence, Union

import xxhash

MAGIC = b"TKVP"
VERSION = 1
_FMT = struct.Struct("<4sHH16s16sQQ")
_TAIL = struct.Struct("<Q")
HEADER_BYTES = _FMT.size + 8  # 64
assert HEADER_BYTES == 64
KEY_BYTES = 16
_HEX_RE = re.compile(r"^[0-9a-f]{32}$")


class PageFormatError(ValueError):
    """A stored record is not a valid page for the expected key/namespace/length (a miss, not data)."""


def check_key(key: str) -> bytes:
    """Validate a page key's text form (32 lowercase hex chars) and return its 16 raw bytes.

    Raises:
        ValueError: the key is not a str of 32 lowercase hex chars (so no key can name a path or inject text).
    """
    if not isinstance(key, str) or not _HEX_RE.match(key):
        raise ValueError(f"invalid page key {key!r}: expected {2 * KEY_BYTES} lowercase hex characters")
    return bytes.fromhex(key)


def encode_header(key: str, namespace: bytes, payload: Union[bytes, bytearray, memoryview]) -> bytes:
    """Header for ``payload`` stored under ``key`` (text form) in ``namespace`` (16 bytes)."""
    if len(namespace) != 16:
        raise ValueError(f"namespace digest must be 16 bytes, got {len(namespace)}")
    mv = memoryview(payload).cast("B")
    return _pack_header(namespace, check_key(key), mv.nbytes, xxhash.xxh3_64_intdigest(mv))


def _pack_header(namespace: bytes, key_raw: bytes, nbytes: int, payload_sum: int) -> bytes:
    head = _FMT.pack(MAGIC, VERSION, 0, namespace, key_raw, nbytes, payload_sum)
    return head + _TAIL.pack(xxhash.xxh3_64_intdigest(head))


def encode_headers(keys_raw: Sequence[bytes], namespace: bytes, payloads: Sequence[Any], page_bytes: int) -> list:
    """Headers of many pages at once: the same bytes as :func:`encode_header` per page, for callers that have
    already validated the keys (``keys_raw``: the 16 raw bytes :func:`check_key` returns) and the payload sizes
    (``payloads``: C-contiguous byte buffers of ``page_bytes`` bytes each, e.g. memoryviews or numpy arrays).
    Skips the per-page re-validation, which costs about as much as the XXH3 of a 256 KiB page on a busy core.

    Raises:
        ValueError: ``namespace`` is not 16 bytes, a raw key is not 16 bytes, or the list lengths differ.
    """
    if len(namespace) != 16:
        raise ValueError(f"namespace digest must be 16 bytes, got {len(namespace)}")
    if len(keys_raw) != len(payloads):
        raise ValueError(f"encode_headers: {len(keys_raw)} keys but {len(payloads)} payloads")
    h64 = xxhash.xxh3_64_intdigest
    out = []
    for k, p in zip(keys_raw, payloads):
        if len(k) != KEY_BYTES:
            raise ValueError(f"raw page key must be {KEY_BYTES} bytes, got {len(k)}")
        out.append(_pack_header(namespace, k, page_bytes, h64(p)))
    return out


def decode_header(header: Union[bytes, memoryview], key: str, namespace: bytes, page_bytes: int) -> int:
    """Check a header against the expected key, namespace and payload length.

    Returns the payload's expected XXH3-64 checksum. Raises :class:`PageFormatError` on any mismatch.
    """
    hb = bytes(header[:HEADER_BYTES])
    if len(hb) < HEADER_BYTES:
        raise PageFormatError("truncated header")
    head, (hsum,) = hb[: _FMT.size], struct.unpack("<Q", hb[_FMT.size :])
    if xxhash.xxh3_64_intdigest(head) != hsum:
        raise PageFormatError("header checksum mismatch")
    magic, version, _flags, ns, kraw, length, psum = _FMT.unpack(head)
    if magic != MAGIC:
        raise PageFormatError("bad magic")
    if version != VERSION:
        raise PageFormatError(f"unsupported page format version {version}")
    if ns != namespace:
        raise PageFormatError("page belongs to another namespace")
    if kraw != check_key(key):
        raise PageFormatError("page belongs to another key")
    if length != page_bytes:
        raise PageFormatError(f"payload length {length} != expected {page_bytes}")
    return psum


def verify_payload(payload: Union[bytes, bytearray, memoryview], checksum: int) -> None:
    """Raise :class:`PageFormatError` unless XXH3-64 of ``payload`` equals ``checksum``."""
    if xxhash.xxh3_64_intdigest(memoryview(payload).cast("B")) != checksum:
        raise PageFormatError("payload checksum mismatch")


def encode_record(key: str, namespace: bytes, payload: Union[bytes, bytearray, memoryview]) -> bytes:
    """``header || payload`` as one bytes object (convenience; backends may write the two parts separately)."""
    return encode_header(key, namespace, payload) + bytes(payload)


def decode_record(record: Union[bytes, memoryview], key: str, namespace: bytes, page_bytes: int) -> memoryview:
    """Check a whole record and return a memoryview of its payload. Raises :class:`PageFormatError`."""
    mv = memoryview(record).cast("B")
    if mv.nbytes != HEADER_BYTES + page_bytes:
        raise PageFormatError(f"record of {mv.nbytes} bytes, expected {HEADER_BYTES + page_bytes}")
    psum = decode_header(mv[:HEADER_BYTES], key, namespace, page_bytes)
    payload = mv[HEADER_BYTES:]
    verify_payload(payload, psum)
    return payload
