"""The L3 storage interface, following SGLang HiCache's ``HiCacheStorage`` so the same classes plug into SGLang.

- keys: page keys in text form (:data:`tierkv.connector.core.page_hash.KEY_HEX_LEN` lowercase hex chars); a key names
  the prefix and the namespace, and every stored page also carries the namespace digest in a header readers check;
- ``batch_exists(keys)``: the number of *leading* keys present (a prefix is only usable up to its first hole);
- ``batch_get(keys, destinations)``: fills each writable ``page_bytes`` buffer; one bool per key; a missing, corrupt,
  truncated or foreign page is ``False`` (a miss), never data;
- ``batch_set(keys, sources, checksums=None)``: one bool per key; a failed set never leaves a visible partial page;
  ``checksums``: each payload's XXH3-64 (:func:`.page_format.payload_checksum`), written into the header as given;
- ``tokens=`` (optional, every store): one :class:`PageTokens` per key, used by stores keyed by token ids (``lmcache``).

No method raises for a per-key failure or a dead/slow medium: errors become ``False``/0, are counted in ``stats()`` and
logged; ``ValueError`` is raised only for caller bugs (bad key text, wrong buffer size, a ``checksums`` sequence of the
wrong length or holding something other than 64-bit unsigned ints), before any I/O.
"""
from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Sequence, Union

from tierkv.storage_backends.common import as_byte_runs, as_byte_view
from tierkv.storage_backends.page_format import check_key

if TYPE_CHECKING:  # no torch import at run time: the cache server process stays small and starts fast
    import torch

Buffer = Union["torch.Tensor", memoryview, bytearray, bytes]


class PageTokens(NamedTuple):
    """The token ids that produced one page, for stores keyed by tokens (the ``tokens`` argument).

    ``prefix``: token ids of the whole prefix up to and including this page (``(page_index + 1) * page_size`` ints,
    each in 0..2**32-1); consecutive pages of one request may share one list (pass slices or the same list object).
    ``root``: the request root the page's key chain starts from (16 bytes,
    :func:`tierkv.connector.core.page_hash.request_root`: namespace, LoRA adapter, cache salt), so pages of different
    salts or adapters never share a name even when their tokens are equal."""

    prefix: Sequence[int]
    root: bytes


class EvictedKeys(NamedTuple):
    """What :meth:`StorageBackend.take_evicted` hands back: the keys the store evicted since the last call, oldest
    first, and ``lost``: evictions left out of ``keys`` because the store's buffer of them overflowed."""

    keys: list[str]
    lost: int = 0


#: evicted keys a store keeps for :meth:`StorageBackend.take_evicted` between two calls (more are counted as lost)
EVICTED_BUFFER_MAX = 1 << 16


class StorageBackend(abc.ABC):
    """One L3 store. Attributes: ``page_bytes`` (bytes of one page payload), ``namespace`` (16-byte digest
    written into and checked against every stored page's header)."""

    page_bytes: int
    namespace: bytes
    #: reads the connector keeps in flight at once against this store by default (``controller.read_threads``):
    #: calls of different threads must be safe and, to gain anything, able to proceed in parallel
    default_read_threads: int = 2
    #: ``batch_exists`` is a local, bounded operation (no network round trip, or one to a server on this machine under
    #: a short timeout) that the engine's scheduler process may call in its own loop (``controller.exists_in_scheduler``)
    local_exists: bool = False
    #: ``batch_set`` also takes a page as a list or tuple of byte runs that add up to ``page_bytes`` (vectored
    #: writes: the connector passes the runs of an L2 slot, e.g. one per layer, instead of first copying them into
    #: one contiguous staging page); :meth:`_source_views` validates such sources
    vectored_sources: bool = False
    #: ``batch_get`` also takes a destination as a list or tuple of writable byte runs that add up to ``page_bytes``
    #: (vectored reads: the connector reads a page straight into the runs of its L2 slot instead of into a staging
    #: page it then copies); :meth:`_dest_views` validates such destinations
    vectored_destinations: bool = False
    #: ``batch_get`` takes ``checksums=``, a list of ``len(keys)`` it fills with the XXH3-64 of each page it read
    #: (the payload checksum it verified against the record; None for a miss), so the caller need not hash the page
    #: again
    verified_checksums: bool = False
    #: :meth:`take_evicted` names the pages this store object evicted (stores that manage their capacity in the
    #: caller's process); the others, whose server evicts by itself (zmq, redis, mooncake, lmcache), keep False
    reports_evictions: bool = False

    @abc.abstractmethod
    def batch_exists(self, keys: Sequence[str], tokens: Optional[Sequence[PageTokens]] = None) -> int:
        """Number of leading ``keys`` present (0..len(keys)). ``tokens``: see :class:`PageTokens`."""

    @abc.abstractmethod
    def batch_get(self, keys: Sequence[str], destinations: Sequence[Buffer],
                  tokens: Optional[Sequence[PageTokens]] = None) -> list[bool]:
        """Read pages into ``destinations`` (one writable buffer of ``page_bytes`` per key). ``tokens``: see
        :class:`PageTokens`."""

    @abc.abstractmethod
    def batch_set(self, keys: Sequence[str], sources: Sequence[Buffer],
                  checksums: Optional[Sequence[int]] = None,
                  tokens: Optional[Sequence[PageTokens]] = None) -> list[bool]:
        """Write pages from ``sources`` (one buffer of ``page_bytes`` per key; a store with
        :attr:`vectored_sources` also takes a list or tuple of runs adding up to ``page_bytes``). ``checksums``: ``None`` (the store
        hashes each payload) or one XXH3-64 per source (an int in 0..2**64-1, the ``xxhash.xxh3_64_intdigest`` of
        its ``page_bytes`` bytes), written into the record headers without hashing the payloads; a wrong value
        makes that page a miss when read. Raises ValueError for a bad key, a buffer of the wrong size or a
        ``checksums`` of the wrong length or type (:func:`~tierkv.storage_backends.page_format.check_checksums`).
        ``tokens``: see :class:`PageTokens`."""

    @staticmethod
    def _keys(keys: Sequence[str]) -> list[bytes]:
        """The key check every batch method starts with: a sequence (not one string) of page keys in text form, each
        valid (:func:`~tierkv.storage_backends.page_format.check_key`). Returns their 16 raw bytes each.

        Raises:
            ValueError: naming the first bad key.
        """
        if isinstance(keys, (str, bytes)):
            raise ValueError("keys must be a sequence of key strings, not a single string")
        return [check_key(k) for k in keys]

    def _views(self, keys: Sequence[str], buffers: Sequence[Buffer], writable: bool, what: str) -> list[memoryview]:
        """The buffer checks every ``batch_get`` (``writable``, ``what="destinations"``) and ``batch_set``
        (``what="sources"``) starts with: one buffer per key, each a contiguous CPU buffer of ``page_bytes`` bytes.
        Returns their flat byte views (:func:`~tierkv.storage_backends.common.as_byte_view`, no copy).

        Raises:
            ValueError: a length mismatch or a bad buffer (named ``<what>[i]``).
        """
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} {what}")
        return [as_byte_view(b, self.page_bytes, writable, f"{what}[{i}]") for i, b in enumerate(buffers)]

    def _source_views(self, keys: Sequence[str], sources: Sequence[Any]) -> list:
        """:meth:`_views` of ``batch_set``'s ``sources`` for a store with :attr:`vectored_sources`: per key either
        one flat view (a page given whole) or a list of flat views (a page given as a list or tuple of runs,
        :func:`~tierkv.storage_backends.common.as_byte_runs`). No copy.

        Raises:
            ValueError: a length mismatch or a bad buffer or run (named ``sources[i]``).
        """
        if len(keys) != len(sources):
            raise ValueError(f"{len(keys)} keys but {len(sources)} sources")
        pb = self.page_bytes
        return [as_byte_runs(b, pb, f"sources[{i}]") if isinstance(b, (list, tuple))
                else as_byte_view(b, pb, False, f"sources[{i}]") for i, b in enumerate(sources)]

    def _dest_views(self, keys: Sequence[str], destinations: Sequence[Any]) -> list:
        """:meth:`_views` of ``batch_get``'s ``destinations`` for a store with :attr:`vectored_destinations`: per key
        either one flat writable view (a whole page) or a list of flat writable views (a list or tuple of runs,
        :func:`~tierkv.storage_backends.common.as_byte_runs`). No copy.

        Raises:
            ValueError: a length mismatch or a bad or read-only buffer or run (named ``destinations[i]``).
        """
        if len(keys) != len(destinations):
            raise ValueError(f"{len(keys)} keys but {len(destinations)} destinations")
        pb = self.page_bytes
        return [as_byte_runs(b, pb, f"destinations[{i}]", writable=True) if isinstance(b, (list, tuple))
                else as_byte_view(b, pb, True, f"destinations[{i}]") for i, b in enumerate(destinations)]

    @staticmethod
    def _checksums_out(checksums: Optional[list], n: int) -> list:
        """The list a ``batch_get`` of ``n`` keys fills with verified checksums (:attr:`verified_checksums`): the
        caller's ``checksums``, reset to ``n`` Nones, or a list of its own when the caller asked for none.

        Raises:
            ValueError: ``checksums`` is not ``n`` long.
        """
        if checksums is None:
            return [None] * n
        if len(checksums) != n:
            raise ValueError(f"{n} keys but a checksums list of {len(checksums)}")
        checksums[:] = [None] * n
        return checksums

    def register_host_buffer(self, buffer: Buffer) -> bool:
        """Declare ``buffer`` (e.g. the whole host pool: a contiguous CPU ``torch.uint8`` tensor of any size) as
        memory that stays allocated and mapped until :meth:`unregister_host_buffer` (or :meth:`close`), so the
        backend may read pages lying inside it directly instead of staging them (zero-copy sets, the way SGLang
        HiCache's Mooncake store registers its host pool). Optional: the default does nothing and returns
        ``False``; a backend that uses it returns ``True``. Pages outside every registered buffer keep working
        through the backend's ordinary path.

        Raises:
            ValueError: ``buffer`` is not a contiguous CPU buffer (a caller bug).
        """
        return False

    def unregister_host_buffer(self, buffer: Buffer) -> None:
        """Undo :meth:`register_host_buffer` (a no-op for a buffer never registered). Call it only when no
        ``batch_set`` of pages inside ``buffer`` is running."""

    def describe_namespace(self, info: dict[str, Any]) -> bool:
        """Record what this store's 16-byte namespace digest stands for (``info``: plain JSON-able values, e.g.
        ``dataclasses.asdict(ModelNamespace)``: model_id, dtype, kv_layout, page_size, ranks), for operators'
        tools such as ``tierkv store stats``; the digest itself cannot be decoded. Never read back by the store,
        so it cannot change what matches. Optional: the default records nothing and returns ``False``."""
        return False

    def take_evicted(self) -> EvictedKeys:
        """The keys this store object evicted to stay within its capacity since the last call (then forgotten), at
        most :data:`EVICTED_BUFFER_MAX` of them (``lost`` counts the rest). Optional: the default names none. A store
        whose server evicts by itself (zmq, redis, mooncake, lmcache) keeps it: its evictions are found by a read
        that misses."""
        return EvictedKeys([], 0)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def clear(self) -> None:
        """Drop every page of this store (optional)."""
        raise NotImplementedError

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters: hits, misses, sets, set failures, corrupt pages, errors, bytes in/out, evictions..."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release sockets, threads and files. Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
