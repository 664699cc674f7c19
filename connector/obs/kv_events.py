"""KV events for tierkv's tiers: vLLM's ``BlockStored`` / ``BlockRemoved`` for pages entering and leaving L2 and L3.

vLLM publishes its own L1 blocks (``medium="GPU"``); this module adds tierkv's tiers, so a router still sees a
prefix after it left L1. Fields, as vLLM's own offloading tiers set them:

- L2: ``medium="CPU"``, ``locality="LOCAL"``, ``ownership=None``;
- L3: ``medium="STORAGE"``, ``ownership="L3:<backend>"``, ``locality="LOCAL"`` for the file store, else ``"REMOTE"``;
- block hashes, parent hash, token ids, ``block_size``, LoRA and ``extra_keys`` are vLLM's own for the same tokens (a
  page of k blocks is announced as its k blocks), ``group_idx`` 0; consecutive pages make one ``BlockStored``.

A page is announced once per tier until it leaves it, and removed only from a tier it was announced in: the stream
is exact when applied in order. Between engine steps at most ``max_buffered`` page events wait; the rest is dropped
and counted (``kv_events_dropped``). Engine-free except :func:`page_infos` and :meth:`TierEvents.to_vllm` (they
import vLLM). When a page counts as stored or removed, and why: docs/developer-guide.md.
"""
from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

L2, L3 = 1, 2  # tier bits

#: page events buffered between two engine steps before the rest is dropped (counted)
DEFAULT_MAX_BUFFERED = 100_000
#: described pages not (yet) in the index kept for a later store (oldest forgotten first)
DEFAULT_MAX_PENDING = 65_536

#: L3 backends whose store is on this host only
_LOCAL_STORES = ("file",)


@dataclass(slots=True)
class PageInfo:
    """What an event says about one page: vLLM's block hash of its block and of the block before it (None for the
    first), its token ids (any sequence; :func:`pack_tokens` keeps them in 4 bytes each), LoRA, vLLM's extra keys of
    the block (tagged, as vLLM hashes them), and the tiers it has been announced in (bits :data:`L2`, :data:`L3`).

    A page of several vLLM blocks (``page_size`` = k x the block size): ``block_hash`` and ``extra_keys`` are its
    last block's, ``inner_hashes`` and ``inner_extra`` those of its k - 1 blocks before (in order), ``parent_hash``
    that of the block before its first and ``token_ids`` all its tokens."""

    block_hash: Any
    parent_hash: Any
    token_ids: Sequence[int]
    lora_id: Optional[int] = None
    lora_name: Optional[str] = None
    extra_keys: Optional[tuple] = None
    tiers: int = 0
    inner_hashes: tuple = ()
    inner_extra: tuple = ()

    def block_hashes(self) -> list:
        """vLLM's block hashes of the page's blocks, in order."""
        return [*self.inner_hashes, self.block_hash]

    def block_extra_keys(self) -> list:
        """vLLM's extra keys of the page's blocks, in order."""
        return [*self.inner_extra, self.extra_keys]


def pack_tokens(tokens: Sequence[int]) -> Sequence[int]:
    """The token ids of a page in 4 bytes each (an ``array``; a tuple of ints costs about 36 bytes a token), or as
    a tuple when one does not fit. Kept per indexed page while events are on."""
    try:
        return array("I", tokens)
    except OverflowError:
        return tuple(tokens)


#: ``(request id, first page, end page) -> [PageInfo or None per page]``
Resolver = Callable[[str, int, int], Sequence[Optional[PageInfo]]]


class TierEvents:
    """Per-page tier changes of one engine's index, turned into vLLM KV events.

    The radix index calls :meth:`stored`, :meth:`removed` and :meth:`forgotten` (it holds this object as
    ``RadixIndex.events``); the scheduler calls :meth:`describe` with a request's page keys before pages of that
    request can enter the index, so each page's vLLM block hash is known when it does, and still known when it
    leaves (the request may be gone by then). vLLM's ``take_events`` drains the buffer once per step
    (:meth:`take_vllm_events`).

    Args:
        resolve: gives the :class:`PageInfo` of pages of a live request (:func:`page_infos` in the connector).
        block_size: tokens per page (vLLM's block size).
        l3_backend: the L3 store's backend name, or None without L3.
        max_buffered: page events kept between two :meth:`take` calls; later ones are dropped and counted.
        max_pending: described pages not in the index kept (oldest forgotten first).
        spec_kind: vLLM's ``kv_cache_spec_kind`` of the engine's KV cache group (e.g. ``"full_attention"``), put on
            every ``BlockStored`` as vLLM puts it on its own.
    """

    def __init__(self, resolve: Resolver, *, block_size: int, l3_backend: Optional[str] = None,
                 max_buffered: int = DEFAULT_MAX_BUFFERED, max_pending: int = DEFAULT_MAX_PENDING,
                 spec_kind: Optional[str] = None):
        self.resolve = resolve
        self.block_size = int(block_size)
        self.l3_backend = l3_backend
        self.spec_kind = spec_kind
        self.max_buffered = int(max_buffered)
        self.max_pending = int(max_pending)
        self._known: dict[bytes, PageInfo] = {}                    # pages in the index
        self._pending: OrderedDict[bytes, PageInfo] = OrderedDict()  # described, not in the index yet
        self._out: list[tuple[bool, int, PageInfo]] = []           # (stored?, tier, page) since the last take
        self.counters = {"kv_events_stored_pages": 0, "kv_events_removed_pages": 0, "kv_events_dropped": 0,
                         "kv_events_undescribed_pages": 0}

    # ------------------------------------------------------------------ scheduler side
    def describe(self, req_id: str, keys: Sequence[bytes], start: int, end: int) -> None:
        """Pages ``keys[start:end]`` of request ``req_id`` may enter the index: remember their vLLM block hashes.
        Pages already known are skipped (O(1) when the last one is known)."""
        end = min(end, len(keys))
        if start >= end or keys[end - 1] in self._known or keys[end - 1] in self._pending:
            return
        todo = [i for i in range(start, end) if keys[i] not in self._known and keys[i] not in self._pending]
        if not todo:
            return
        infos = self.resolve(req_id, todo[0], todo[-1] + 1)
        for i in todo:
            info = infos[i - todo[0]] if i - todo[0] < len(infos) else None
            if info is not None:
                self._pending[keys[i]] = info
        while len(self._pending) > self.max_pending:
            self._pending.popitem(last=False)

    # ------------------------------------------------------------------ index observer
    def _info(self, key: bytes) -> Optional[PageInfo]:
        info = self._known.get(key)
        if info is None:
            info = self._pending.pop(key, None)
            if info is not None:
                self._known[key] = info
        return info

    def _emit(self, stored: bool, tier: int, info: PageInfo) -> None:
        if len(self._out) >= self.max_buffered:
            self.counters["kv_events_dropped"] += 1
            return
        self._out.append((stored, tier, info))
        self.counters["kv_events_stored_pages" if stored else "kv_events_removed_pages"] += 1

    def stored(self, tier: int, keys: Sequence[bytes]) -> None:
        """The pages ``keys`` now have a copy in ``tier`` (:data:`L2` or :data:`L3`)."""
        for k in keys:
            info = self._info(k)
            if info is None:
                self.counters["kv_events_undescribed_pages"] += 1
            else:
                info.tiers |= tier
                self._emit(True, tier, info)

    def removed(self, tier: int, keys: Sequence[bytes]) -> None:
        """The pages ``keys`` lost their copy in ``tier``."""
        for k in keys:
            info = self._known.get(k)
            if info is not None and info.tiers & tier:
                info.tiers &= ~tier
                self._emit(False, tier, info)

    def forgotten(self, keys: Sequence[bytes]) -> None:
        """The pages ``keys`` left the index (after :meth:`removed` for the copies that went)."""
        for k in keys:
            self._known.pop(k, None)

    # ------------------------------------------------------------------ publishing
    def take(self) -> list[tuple[bool, int, PageInfo]]:
        """The page events since the last call, in order: ``(stored?, tier, page)``."""
        out, self._out = self._out, []
        return out

    def stats(self) -> dict:
        return dict(self.counters)

    def take_vllm_events(self) -> list:
        """The page events since the last call as vLLM events (:meth:`to_vllm` of :meth:`take`)."""
        return self.to_vllm(self.take())

    def to_vllm(self, records: Sequence[tuple[bool, int, PageInfo]]) -> list:
        """Page events as vLLM ``BlockStored`` / ``BlockRemoved`` events: consecutive stores of one tier whose pages
        chain (each page's parent is the page before it, same LoRA) form one ``BlockStored``; consecutive removals of
        one tier form one ``BlockRemoved``."""
        if not records:
            return []
        from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored
        from vllm.v1.core.kv_cache_utils import to_event_extra_keys

        l3 = self.l3_backend
        tier_fields = {L2: dict(medium=MEDIUM_CPU, locality="LOCAL", ownership=None),
                       L3: dict(medium=MEDIUM_STORAGE, locality="LOCAL" if l3 in _LOCAL_STORES else "REMOTE",
                                ownership=f"L3:{l3}")}
        events = []
        i, n = 0, len(records)
        while i < n:
            stored, tier, first = records[i]
            run = [first]
            j = i + 1
            while j < n and records[j][0] == stored and records[j][1] == tier:
                nxt = records[j][2]
                if stored and (nxt.parent_hash != run[-1].block_hash or nxt.lora_name != first.lora_name):
                    break
                run.append(nxt)
                j += 1
            if stored:
                events.append(BlockStored(
                    block_hashes=[h for p in run for h in p.block_hashes()], parent_block_hash=first.parent_hash,
                    token_ids=[t for p in run for t in p.token_ids], block_size=self.block_size,
                    lora_id=first.lora_id, lora_name=first.lora_name,
                    extra_keys=to_event_extra_keys([e for p in run for e in p.block_extra_keys()]), group_idx=0,
                    kv_cache_spec_kind=self.spec_kind, **tier_fields[tier]))
            else:
                events.append(BlockRemoved(block_hashes=[h for p in run for h in p.block_hashes()], group_idx=0,
                                           **tier_fields[tier]))
            i = j
        return events


def page_infos(request, start: int, end: int, block_size: int, hash_block_size: Optional[int] = None,
               blocks_per_page: int = 1) -> list:
    """:class:`PageInfo` of pages ``[start, end)`` of a vLLM ``Request`` (None for a page one of whose block hashes
    vLLM has not computed yet), with the hashes, tokens, LoRA and extra keys vLLM puts in its own ``BlockStored`` for
    the same blocks. A page is ``blocks_per_page`` blocks of ``block_size`` tokens (vLLM's block size)."""
    if request is None:
        return []
    k = blocks_per_page
    if k > 1:
        blocks = page_infos(request, start * k, end * k, block_size, hash_block_size)
        out = []
        for p in range(end - start):
            part = blocks[p * k:(p + 1) * k]
            if len(part) < k or any(b is None for b in part):
                out.append(None)
                continue
            last = part[-1]
            out.append(PageInfo(block_hash=last.block_hash, parent_hash=part[0].parent_hash,
                                token_ids=pack_tokens([t for b in part for t in b.token_ids]),
                                lora_id=last.lora_id, lora_name=last.lora_name, extra_keys=last.extra_keys,
                                inner_hashes=tuple(b.block_hash for b in part[:-1]),
                                inner_extra=tuple(b.extra_keys for b in part[:-1])))
        return out
    from vllm.v1.core.kv_cache_utils import (generate_block_hash_extra_keys, maybe_convert_block_hash,
                                             resolve_block_hashes)
    hashes = resolve_block_hashes(request.block_hashes, hash_block_size or block_size, block_size)
    tokens = request.all_token_ids
    lora = getattr(request, "lora_request", None)
    lora_id = lora.adapter_id if lora is not None else None
    lora_name = lora.name if lora is not None else None
    out: list[Optional[PageInfo]] = []
    mm_idx = 0
    for i in range(start, end):
        if i >= len(hashes) or (i + 1) * block_size > len(tokens):
            out.append(None)
            continue
        extra, mm_idx = generate_block_hash_extra_keys(request, i * block_size, (i + 1) * block_size, mm_idx)
        out.append(PageInfo(block_hash=maybe_convert_block_hash(hashes[i]),
                            parent_hash=maybe_convert_block_hash(hashes[i - 1]) if i > 0 else None,
                            token_ids=pack_tokens(tokens[i * block_size:(i + 1) * block_size]),
                            lora_id=lora_id, lora_name=lora_name, extra_keys=extra))
    return out
