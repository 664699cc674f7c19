"""How tierkv pages are named as LMCache chunks: key ranges of token ids.

LMCache keys are token ids: the server cuts them into chunks of its ``--chunk-size`` and hashes them as a rolling
prefix hash, so one tierkv page is exactly one chunk (``page_tokens`` = the server's chunk size). A page is named
either by its tokens (:class:`~tierkv.storage_backends.base.PageTokens`: the page's whole prefix is sent, so the chunk
hash is the one LMCache itself gives that prefix; consecutive pages of one prefix travel as one range) or, without
tokens, by its 16-byte tierkv key sent as the first four token ids of a one-chunk sequence under ``cache_salt``
:data:`KEY_SALT` (a key space of its own). The ``cache_salt`` of token-named pages is the request root (hex).
"""
from __future__ import annotations

import struct
import uuid
from typing import Optional, Sequence

from tierkv.storage_backends.base import PageTokens

#: ``cache_salt`` of pages named by their tierkv key only (no tokens): a key space apart from token-named pages
KEY_SALT = "tierkv-key"
#: the largest token id LMCache's hasher accepts (it packs ids as big-endian uint32)
MAX_TOKEN = 2**32 - 1


class KeyRange:
    """Consecutive pages sent as one LMCache key range: ``idx`` (positions in the batch), the token ids, the range."""

    __slots__ = ("idx", "tokens", "start", "end", "salt", "rid")

    def __init__(self, idx: list, tokens: list, start: int, end: int, salt: str):
        self.idx, self.tokens, self.start, self.end, self.salt = idx, tokens, start, end, salt
        self.rid = ""


def range_key(g: KeyRange, lm_model: str, world_size: int, worker: Optional[int]) -> dict:
    """LMCache's key of range ``g`` (``worker``: None for a lookup, the worker id for a transfer)."""
    return {"model_name": lm_model, "world_size": world_size, "worker_id": worker,
            "token_ids": g.tokens, "start": g.start, "end": g.end, "request_id": g.rid, "cache_salt": g.salt,
            "request_configs": None, "num_kv_readers": 1}


def page_ranges(keys: Sequence[str], tokens: Optional[Sequence[PageTokens]], page_tokens: int) -> list:
    """Split a batch into LMCache key ranges (see the module docstring), each with a fresh ``rid``. Raises ValueError
    for bad tokens."""
    C = page_tokens
    groups: list = []
    if tokens is None:
        for i, k in enumerate(keys):
            words = list(struct.unpack(">4I", bytes.fromhex(k)))
            groups.append(KeyRange([i], (words * (C // 4 + 1))[:C], 0, C, KEY_SALT))
    else:
        if len(tokens) != len(keys):
            raise ValueError(f"tokens: {len(tokens)} entries for {len(keys)} keys")
        prev: Optional[KeyRange] = None
        prev_len = 0
        for i, pt in enumerate(tokens):
            if not isinstance(pt, PageTokens):
                raise ValueError(f"tokens[{i}] must be a PageTokens(prefix, root), got {type(pt).__name__}")
            prefix = [int(t) for t in pt.prefix]
            n = len(prefix)
            if n == 0 or n % C:
                raise ValueError(f"tokens[{i}].prefix has {n} token ids; a page's prefix is a positive multiple "
                                 f"of page_tokens={C}")
            if min(prefix) < 0 or max(prefix) > MAX_TOKEN:
                raise ValueError(f"tokens[{i}].prefix holds a token id outside 0..{MAX_TOKEN}")
            root = pt.root
            if not isinstance(root, (bytes, bytearray)) or len(root) != 16:
                raise ValueError(f"tokens[{i}].root must be 16 bytes (the request root), got {root!r:.40}")
            salt = bytes(root).hex()
            if (prev is not None and prev.salt == salt and n == prev_len + C
                    and prefix[:prev_len] == prev.tokens):
                prev.idx.append(i)
                prev.tokens, prev.end = prefix, n
            else:
                prev = KeyRange([i], prefix, n - C, n, salt)
                groups.append(prev)
            prev_len = n
    for g in groups:
        g.rid = f"tierkv-{uuid.uuid4().hex}"
    return groups


__all__ = ["KEY_SALT", "MAX_TOKEN", "KeyRange", "page_ranges", "range_key"]
