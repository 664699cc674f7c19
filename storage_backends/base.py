"""The L3 storage interface (design §5).

Semantics follow SGLang HiCache's ``HiCacheStorage`` so the same classes plug into SGLang:

- keys are page keys in text form (:data:`tierkv.connector.page_hash.KEY_HEX_LEN` lowercase hex chars);
  the key already names the prefix and the namespace, and every stored page additionally carries the
  namespace digest in a header that readers check;
- ``batch_exists(keys)`` returns the number of *leading* keys present (a prefix is only usable up to its first
  hole);
- ``batch_get(keys, destinations)`` fills each destination buffer (a writable contiguous ``torch.uint8`` tensor
  or memoryview of exactly ``page_bytes`` bytes, e.g. one host-pool page) and returns one bool per key;
  a missing, corrupt, truncated or foreign page is ``False`` (a miss), never data;
- ``batch_set(keys, sources)`` stores each source buffer (``page_bytes`` bytes) and returns one bool per key;
  a failed set never leaves a visible partial page.

No method raises for a per-key failure or a dead/slow medium: errors become ``False``/0, are counted in
``stats()`` and logged; ``ValueError`` is raised only for caller bugs (bad key text, wrong buffer size).
"""
from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Sequence, Union

if TYPE_CHECKING:  # no torch import at run time: the cache server process stays small and starts fast
    import torch

Buffer = Union["torch.Tensor", memoryview, bytearray, bytes]


class StorageBackend(abc.ABC):
    """One L3 store. Attributes: ``page_bytes`` (bytes of one page payload), ``namespace`` (16-byte digest
    written into and checked against every stored page's header)."""

    page_bytes: int
    namespace: bytes

    @abc.abstractmethod
    def batch_exists(self, keys: Sequence[str]) -> int:
        """Number of leading ``keys`` present (0..len(keys))."""

    @abc.abstractmethod
    def batch_get(self, keys: Sequence[str], destinations: Sequence[Buffer]) -> list[bool]:
        """Read pages into ``destinations`` (one writable buffer of ``page_bytes`` per key)."""

    @abc.abstractmethod
    def batch_set(self, keys: Sequence[str], sources: Sequence[Buffer]) -> list[bool]:
        """Write pages from ``sources`` (one buffer of ``page_bytes`` per key)."""

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
