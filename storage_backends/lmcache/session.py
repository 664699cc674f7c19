"""The LMCache store's session with the server: connect, check the chunk size, register, refresh, recover.

The store registers itself as an "engine-driven" (non-GPU) worker instance and maps the shared-memory segment the
registration names. An instance quiet for :data:`REFRESH_S` registers again first (LMCache reaps silent workers).
After a failure the next data call registers a fresh instance and unregisters the old one (which frees the slots a
lost reply left reserved); consecutive failures back off exponentially (the channel's job). A server restart is
noticed from the socket's connection events; a vanished or replaced segment is unmapped and registration redone.
A server of another chunk size, or one without a segment, disables the store for good (``_refused``).
"""
from __future__ import annotations

import math
import os
import random
import time
from typing import Sequence

from tierkv.storage_backends.lmcache.wire import lm_calls
from tierkv.storage_backends.shm_segment import Segment
from tierkv.storage_backends.zmq.channel import ChannelFailed

#: a registered instance that has been quiet this long re-registers first (LMCache reaps silent workers)
REFRESH_S = 30.0


class ServerSession:
    """Session methods of :class:`~tierkv.storage_backends.lmcache.store.LMCacheStore` (a mixin: the state lives on
    the store, set by its ``__init__``: ``_chan``, ``_instance``, ``_registered_at``, ``_checked``, ``_refused``,
    ``_seg``, ``_shm_view``, ``_closed``, ``counters``, ``_warn``, ``cfg`` and the store's identity). The store calls
    them under its lock, except ``_forked`` (the channel's fork hook); those that talk to the server raise
    :class:`ChannelFailed`."""

    # ------------------------------------------------------------------------------------------- wire
    def _forked(self) -> None:
        """In a forked child: the parent's mapping and registration are not this process's."""
        self._seg = self._shm_view = None  # the parent's mapping stays with the parent's object
        self._instance = None

    def _failed(self, why: str) -> None:
        self._chan.failed(why)
        self._registered_at = -math.inf  # register (a fresh instance) before the next data call

    def _calls(self, calls: Sequence[tuple], forget: Sequence[tuple] = ()) -> list:
        """:func:`~.wire.lm_calls` on this store's channel. Raises :class:`ChannelFailed`."""
        return lm_calls(self._chan, calls, forget)

    # ------------------------------------------------------------------------------------------- session
    def _unmap_shm(self) -> None:
        if self._seg is not None:
            self._seg.close()
            self._seg = None
        self._shm_view = None

    def _register(self) -> None:
        old, self._instance = self._instance, random.getrandbits(62)
        calls = []
        if old is not None:  # frees the slots a lost reply may have left reserved for the old instance
            calls.append(("unregister_kv_cache_engine_driven_context", old))
        calls.append(("register_kv_cache_engine_driven_context", {
            "instance_id": self._instance, "model_name": self.lm_model, "world_size": self.cfg.world_size,
            "block_size": self.page_tokens, "num_layers": 1, "hidden_dim_size": self._hidden, "dtype_str": "uint8",
            "use_mla": False, "num_physical_slots": self.page_tokens}))
        reg = self._calls(calls)[-1]
        self.counters["registrations"] += 1
        if not isinstance(reg, dict) or not reg.get("shm_name") or not isinstance(reg.get("pool_size"), int):
            self._refused = (f"LMCache server {self.endpoint} offers no shared-memory segment (got {reg!r:.120}); "
                             "start it with --shm-name (tierkv never uses LMCache's pickle transfer)")
            return
        if self._seg is None or reg["shm_name"] != self._seg.name or not self._seg.intact():
            self._unmap_shm()
            try:
                # LMCache's pool is large: mapped without faulting it in (pages are touched as slots are used)
                self._seg = Segment.open(os.path.join(self.cfg.shm_dir, reg["shm_name"]), reg["pool_size"],
                                         populate=False)
                self._shm_view = self._seg.mv
            except (OSError, ValueError) as e:
                self.counters["shm_lost"] += 1
                self._registered_at = -math.inf
                raise ChannelFailed(f"cannot map the server's shared memory {reg['shm_name']!r}: {e}") from None
        self._registered_at = time.monotonic()

    def _ensure_ready(self) -> None:
        """Connect, check the chunk size once, register when needed. Raises :class:`ChannelFailed`."""
        self._chan.socket()
        if self._chan.disconnected():
            self._registered_at = -math.inf
            self.counters["reconnects"] += 1
        if not self._checked:
            size = self._calls([("get_chunk_size",)])[0]
            if size != self.page_tokens:
                self._refused = (f"invalid tierkv config: LMCache server {self.endpoint} has chunk size {size!r} "
                                 f"but 'l3.lmcache.page_tokens' is {self.page_tokens}: one tierkv page must be one "
                                 f"LMCache chunk (set l3.lmcache.page_tokens and tierkv's page size to {size!r}, or "
                                 f"start the server with --chunk-size {self.page_tokens})")
                return
            self._checked = True
        if self._seg is not None and not self._seg.intact():
            self.counters["shm_lost"] += 1
            self._warn.warning("shm", "LMCache shared memory %s disappeared or was replaced; registering again",
                               self._seg.path)
            self._unmap_shm()
            self._registered_at = -math.inf
        if time.monotonic() - self._registered_at > REFRESH_S:
            self._register()

    def _begin(self, n_calls: int) -> bool:
        """Under the lock: may this call talk to the server? Counts the reason when not."""
        if self._closed or self._refused:
            if self._refused:
                self.counters["refused"] += n_calls
                self._warn.warning("refused", "LMCache store disabled: %s", self._refused)
            else:
                self.counters["errors"] += n_calls
            return False
        if self._chan.backing_off(n_calls):
            return False
        try:
            self._ensure_ready()
        except ChannelFailed as e:
            self._failed(str(e))
            return False
        if self._refused:
            return self._begin(n_calls)
        return True

    def _ok(self) -> None:
        self._chan.ok()


__all__ = ["REFRESH_S", "ServerSession"]
