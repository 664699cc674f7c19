"""Page keys: chained, deterministic content hashes of pages, seeded by a namespace.

``key(page_i) = BLAKE2b-128(key(page_{i-1}) || tokens of page_i || extra keys of page_i)`` with
``key(page_-1)`` = the request root, itself a hash of the model namespace, the LoRA adapter and the cache
salt. So a key names the whole prefix up to its page *and* everything that changes the page's bytes
(docs/architecture.md §2; the chaining follows SGLang HiCache's page hash and vLLM's block hash, but unlike both the
model identity, dtype, layout, page size, geometry and parallel rank are inside the key, cf.
docs/architecture.md §8 R01, R02).

Keys are pure functions of their inputs: no Python ``hash``, no pickle, no process-dependent seed
(docs/architecture.md §8 R18). Tokens are encoded as little-endian int64; structured values (namespace fields, extra keys)
as canonical msgpack with ``None``, empty tuple and absent kept distinct.

A key is 16 bytes; its text form (``.hex()``, 32 lowercase hex chars) is what L3 stores index by.
"""
from __future__ import annotations

import hashlib
import sys
from array import array
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Optional, Sequence

import msgpack

KEY_BYTES = 16
KEY_HEX_LEN = 2 * KEY_BYTES
#: bumped whenever the byte format of pages or keys changes; part of every namespace.
FORMAT_VERSION = 1
_DOMAIN = b"tierkv/page-key/v1"


def _h(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for p in parts:
        h.update(p)
    return h.digest()


def _canonical(value: Any) -> bytes:
    """Canonical msgpack of plain values (str, bytes, int, float, bool, None, lists/tuples, dicts with
    sortable keys). Raises TypeError for anything else (never falls back to repr or pickle)."""

    def norm(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return [norm(x) for x in v]
        if isinstance(v, dict):
            return [[norm(k), norm(v[k])] for k in sorted(v)]
        if v is None or isinstance(v, (str, bytes, int, float, bool)):
            return v
        raise TypeError(f"cannot hash value of type {type(v).__name__} into a page key")

    return msgpack.packb(norm(value), use_bin_type=True)


@dataclass(frozen=True)
class ModelNamespace:
    """Everything that changes the bytes of a page, shared by all requests of one engine rank.

    Fields: ``model_id`` (path or name, plus revision if any), ``dtype`` (KV element type, e.g.
    ``"bfloat16"``, ``"fp8_e4m3"``), ``kv_layout`` (the byte layout pages are stored in: the host-pool layout
    plus the engine's device layout, e.g. ``"layer_first/LBHNC"``), ``page_size`` (tokens), ``num_layers``,
    ``num_kv_heads`` (on this rank), ``head_dim``, ``tp_rank``/``tp_size``, ``pp_rank``/``pp_size``,
    ``use_mla`` (MLA pages are identical across TP ranks, so ``tp_rank`` is ignored for them) and ``extra``
    (any further identity, e.g. a quantisation scheme).
    """

    model_id: str
    dtype: str
    kv_layout: str
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    use_mla: bool = False
    extra: tuple = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size must be > 0 tokens, got {self.page_size}")

    def digest(self) -> bytes:
        """16-byte digest of the namespace (stable across processes, Python versions and machines)."""
        d = asdict(self)
        if self.use_mla:
            d["tp_rank"] = 0  # one copy of MLA pages serves every rank
        d["format_version"] = FORMAT_VERSION
        return _h(_DOMAIN, b"ns", _canonical(d))


def request_root(namespace_digest: bytes, lora: Optional[str] = None, cache_salt: Optional[str] = None) -> bytes:
    """Root of one request's key chain (16 bytes).

    ``lora`` is the LoRA adapter name (``None`` = base model); ``cache_salt`` is vLLM's per-request salt.
    An empty salt is the same as no salt (both mean "shared with every unsalted request"); an empty LoRA name
    is the same as no LoRA.
    """
    return _h(_DOMAIN, b"root", namespace_digest, _canonical([lora or None, cache_salt or None]))


def _token_bytes(tokens: Sequence[int]) -> bytes:
    a = array("q", tokens)
    if sys.byteorder == "big":
        a.byteswap()
    return a.tobytes()


def page_keys(
    root: bytes,
    token_ids: Sequence[int],
    page_size: int,
    extra_keys: Optional[Sequence[Any]] = None,
    parent: Optional[bytes] = None,
    start_page: int = 0,
) -> list[bytes]:
    """Keys of the full pages of ``token_ids`` (a tail shorter than ``page_size`` gets no key).

    Args:
        root: the chain root from :func:`request_root`.
        token_ids: token ids of the whole sequence (ints in int64 range).
        page_size: tokens per page.
        extra_keys: optional per-page extra keys (e.g. multimodal hashes), one entry per page or ``None``;
            ``None``, ``()`` and a missing entry are distinct from any non-empty value, and ``None`` == missing.
        parent: key of page ``start_page - 1`` when resuming a chain (``None`` = start at ``root``).
        start_page: index of the first page to hash.
    Returns:
        list of 16-byte keys for pages ``start_page .. len(token_ids) // page_size - 1``.
    """
    n_pages = len(token_ids) // page_size
    prev = parent if parent is not None else root
    if start_page > 0 and parent is None:
        raise ValueError("resuming a key chain needs the parent key")
    out = []
    tb = _token_bytes(token_ids[start_page * page_size : n_pages * page_size])
    step = 8 * page_size
    for i in range(start_page, n_pages):
        off = (i - start_page) * step
        ek = extra_keys[i] if extra_keys is not None and i < len(extra_keys) else None
        tail = b"" if ek is None else b"\x01" + _canonical(ek)
        prev = _h(prev, tb[off : off + step], tail)
        out.append(prev)
    return out


class RequestKeys:
    """Incrementally extended key chain of one growing sequence (prompt, then generated tokens).

    ``extend(all_token_ids)`` hashes only the pages that became full since the last call; ``keys`` is the list
    of 16-byte keys of all full pages so far.
    """

    __slots__ = ("root", "page_size", "keys")

    def __init__(self, root: bytes, page_size: int):
        self.root = root
        self.page_size = page_size
        self.keys: list[bytes] = []

    def extend(self, token_ids: Sequence[int]) -> list[bytes]:
        n_full = len(token_ids) // self.page_size
        if n_full > len(self.keys):
            start = len(self.keys)
            parent = self.keys[-1] if self.keys else None
            self.keys.extend(page_keys(self.root, token_ids[: n_full * self.page_size], self.page_size,
                                       parent=parent, start_page=start))
        return self.keys


def key_hex(keys: Iterable[bytes]) -> list[str]:
    """Text form of keys (32 lowercase hex chars each), as stored in L3."""
    return [k.hex() for k in keys]
