"""The request channel shared by the L3 stores that talk to a ZMQ server (the tierkv cache server's client and the
LMCache store): one DEALER socket and everything around it that does not depend on the server's wire format.

Socket options (``LINGER`` 0, ``IMMEDIATE``, high-water marks, reconnect 20-500 ms, optional ``MAXMSGSIZE``, IPv6
for ``tcp://[...]``, optional disconnect monitor); a fork guard (a forked child makes its own context and socket);
back-off with fast-fail (from the second consecutive failure, calls inside the doubling back-off window fail at
once, counted ``fast_fails``); the pipelined exchange (:meth:`RequestChannel.exchange`: fresh ids, replies matched by
id under ``timeout_s`` of silence, stale or undecodable replies counted and dropped); warnings for the first failure
of a run and one "reachable again" line.

Not thread-safe: a store calls it under its own lock. Counters it adds to: requests, timeouts, errors, fast_fails,
stale_replies, bad_replies, reconnects. Failures raise :class:`ChannelFailed`.
"""
from __future__ import annotations

import math
import itertools
import logging
import os
import random
import time
from typing import Any, Callable, Optional, Sequence

import zmq

__all__ = ["RequestChannel", "ChannelFailed"]

#: request ids are this many bits (unsigned; both wire formats carry them as msgpack ints)
ID_MASK = (1 << 47) - 1


class ChannelFailed(Exception):
    """An exchange did not complete (nothing sent within ``timeout_s``, a send or receive error, no reply within
    ``timeout_s`` of silence); the message says which. The channel's counters already say so; the caller decides
    whether to call :meth:`RequestChannel.failed`."""


class RequestChannel:
    """One DEALER socket to ``endpoint`` with back-off, fork guard and pipelined exchanges (see the module docstring).

    Args:
        endpoint: ``tcp://HOST:PORT`` or ``ipc://PATH``.
        timeout_s: seconds of silence after which an exchange fails (> 0); may be changed between calls.
        backoff_s: first back-off in seconds (>= 0). ``max_backoff_s``: longest (>= backoff_s).
        counters: the store's counters (a dict holding the names listed in the module docstring).
        log: the store's logger (failures and "reachable again" go there).
        what: how log lines name the server (``"tierkv zmq server"``, ``"LMCache server"``).
        hwm: send and receive high-water marks (messages).
        max_message_bytes: ``MAXMSGSIZE`` of the socket, or None.
        monitor: watch for disconnections (:meth:`disconnected`).
        on_fork: called when the channel finds itself in a forked child (before the new socket is made).
    """

    def __init__(self, endpoint: str, *, timeout_s: float, backoff_s: float, max_backoff_s: float, counters: dict,
                 log: logging.Logger, what: str, hwm: int, max_message_bytes: Optional[int] = None,
                 monitor: bool = False, on_fork: Optional[Callable[[], None]] = None):
        self.endpoint, self.timeout_s = endpoint, timeout_s
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.counters, self.log, self.what = counters, log, what
        self._hwm, self._max_message_bytes, self._monitor, self._on_fork = hwm, max_message_bytes, monitor, on_fork
        self._ctx: Optional[zmq.Context] = zmq.Context()
        self._sock: Optional[zmq.Socket] = None
        self._mon: Optional[zmq.Socket] = None
        self._pid = os.getpid()
        self._ever_connected = False
        self._ids = itertools.count(random.getrandbits(40))
        self._forget: set = set()
        #: consecutive failed exchanges; requests awaiting a reply now; the most ever awaited at once
        self.fails = 0
        self.pending = 0
        self.max_pending = 0
        self._retry_at = -math.inf

    # ------------------------------------------------------------------------------------------- socket
    @property
    def connected(self) -> bool:
        """A socket is open (not a statement about the server)."""
        return self._sock is not None

    def socket(self) -> zmq.Socket:
        """The socket, made (and connected) when there is none. Raises ChannelFailed after :meth:`close`."""
        if os.getpid() != self._pid:  # forked: the parent's context and socket are not usable here
            self._ctx, self._sock, self._mon, self._pid = zmq.Context(), None, None, os.getpid()
            self._forget.clear()
            if self._on_fork is not None:
                self._on_fork()
        if self._sock is None:
            if self._ctx is None:
                raise ChannelFailed("closed")
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing while disconnected
            if self._max_message_bytes is not None:
                s.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
            s.setsockopt(zmq.SNDHWM, self._hwm)
            s.setsockopt(zmq.RCVHWM, self._hwm)
            s.setsockopt(zmq.RECONNECT_IVL, 20)
            s.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
            if self.endpoint.startswith("tcp://["):
                s.setsockopt(zmq.IPV6, 1)
            if self._monitor:
                self._mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            s.connect(self.endpoint)
            if self._ever_connected and not self._monitor:
                self.counters["reconnects"] += 1
            self._ever_connected = True
            self._sock = s
        return self._sock

    def discard(self) -> None:
        """Close the socket (and everything still queued on it); the next call opens a new one."""
        if self._sock is not None:
            if self._mon is not None:
                try:
                    self._sock.disable_monitor()
                except zmq.ZMQError:
                    pass
            self._sock.close(0)
            self._sock = None
        if self._mon is not None:
            self._mon.close(0)
            self._mon = None
        self._forget.clear()
        self.pending = 0

    def disconnected(self) -> bool:
        """True when the connection dropped since the last look (``monitor`` only: the server restarted or went
        away)."""
        if self._mon is None:
            return False
        seen = False
        while True:
            try:
                self._mon.recv_multipart(zmq.NOBLOCK)
                seen = True
            except zmq.Again:
                return seen

    def close(self) -> None:
        """Close the socket and the context. Idempotent."""
        self.discard()
        if self._ctx is not None and os.getpid() == self._pid:
            self._ctx.term()
        self._ctx = None

    # ------------------------------------------------------------------------------------------- back-off
    def backing_off(self, n: int = 1) -> bool:
        """True (and ``fast_fails`` += ``n``) while a back-off window after failures lasts."""
        if time.monotonic() < self._retry_at:
            self.counters["fast_fails"] += n
            return True
        return False

    def failed(self, why: str) -> float:
        """Record a failed exchange: drop the socket, start the back-off window, log (a warning for the first failure
        of a run, debug for the next ones). Returns the back-off in seconds."""
        self.discard()
        self.fails += 1
        back = 0.0 if self.fails < 2 else min(self.backoff_s * 2 ** (self.fails - 2), self.max_backoff_s)
        self._retry_at = time.monotonic() + back
        if self.fails == 1:
            self.log.warning("%s %s: %s; pages count as misses, reconnecting with back-off", self.what, self.endpoint,
                             why)
        else:
            self.log.debug("%s %s: %s (failure %d, back-off %.3fs)", self.what, self.endpoint, why, self.fails, back)
        return back

    def ok(self) -> None:
        """Record a completed exchange (logs "reachable again" after failures)."""
        if self.fails:
            self.log.info("%s %s reachable again", self.what, self.endpoint)
        self.fails = 0

    # ------------------------------------------------------------------------------------------- exchange
    def exchange(self, msgs: Sequence[Any], encode: Callable[[Any, int], list],
                 decode: Callable[[list], tuple[Any, Any]], on_reply: Callable[[int, Any, list], None],
                 forget: Sequence[Any] = (), describe: Optional[Callable[[list], str]] = None) -> None:
        """Send ``msgs`` then ``forget``, pipelined, and hand each reply to a message of ``msgs`` to
        ``on_reply(index, decoded, frames)``; replies to ``forget`` are dropped when they come.

        ``encode(msg, id)`` returns the frames of one message (called just before it is sent, so building the next
        message overlaps sending the previous one); ``decode(frames)`` returns ``(id, decoded)`` of a reply or raises
        (counted ``bad_replies``, discarded); a reply whose id is not awaited is counted ``stale_replies``. The
        deadline is ``timeout_s`` of silence, restarted by every awaited reply; past it, the socket is still read once
        without waiting (a reply that arrived while this process was not running is an answer). ``describe(indexes)``
        names the unanswered messages in the timeout's message.

        Raises:
            ChannelFailed: nothing could be sent, a socket error, or no reply in time (counted ``timeouts`` or
                ``errors``); the exception of ``encode``, ``decode`` errors aside, or of ``on_reply`` propagates.
        """
        sock = self.socket()
        deadline = time.monotonic() + self.timeout_s
        waiting: dict[int, int] = {}
        n = len(msgs)
        for i, m in enumerate(list(msgs) + list(forget)):
            rid = next(self._ids) & ID_MASK
            frames = encode(m, rid)
            if not sock.poll(max(0, int((deadline - time.monotonic()) * 1000)), zmq.POLLOUT):
                self.counters["timeouts"] += 1
                raise ChannelFailed(f"not connected (nothing could be sent within {self.timeout_s}s)")
            try:
                sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.ZMQError as e:
                self.counters["errors"] += 1
                raise ChannelFailed(f"send failed: {e}") from None
            self.counters["requests"] += 1
            if i < n:
                waiting[rid] = i
                self.pending = len(waiting)
                self.max_pending = max(self.max_pending, self.pending)
            else:
                self._forget.add(rid)
        while waiting:
            left = deadline - time.monotonic()
            if not sock.poll(max(1, int(left * 1000)) if left > 0 else 0, zmq.POLLIN):
                if time.monotonic() < deadline:
                    continue
                self.counters["timeouts"] += 1
                note = f" ({describe(sorted(waiting.values()))})" if describe is not None else ""
                raise ChannelFailed(f"no reply within {self.timeout_s}s{note}")
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                continue
            except zmq.ZMQError as e:
                self.counters["errors"] += 1
                raise ChannelFailed(f"receive failed: {e}") from None
            try:
                rid, decoded = decode(frames)
            except Exception as e:  # noqa: BLE001 - any undecodable reply is discarded, never applied
                self.counters["bad_replies"] += 1
                self.log.debug("discarding undecodable reply from %s: %s", self.endpoint, e)
                continue
            if type(rid) is int and rid in self._forget:
                self._forget.discard(rid)
                continue
            i = waiting.pop(rid, None) if type(rid) is int else None
            if i is None:
                self.counters["stale_replies"] += 1  # an older request's reply, or one never asked for
                continue
            self.pending = len(waiting)
            deadline = time.monotonic() + self.timeout_s  # progress: restart the silence clock
            on_reply(i, decoded, frames)
        self.pending = 0
