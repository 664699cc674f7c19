"""LMCache's wire framing for the pipelined exchange of :class:`~tierkv.storage_backends.zmq.channel.RequestChannel`.

One ZMQ DEALER socket to the server's ROUTER; a request is the frames ``[msgpack(request uid), msgpack(operation),
msgpack(arg) ...]``, a reply ``[uid, op]`` or ``[uid, op, msgpack(result)]``; replies may come out of order and are
matched by uid. A request the server rejects (a handler that raises) gets no reply at all, so every exchange is
bounded by the channel's ``timeout_s``. Operations go by LMCache's small legacy integer ids where it has one
(:data:`OPS`), else by name.
"""
from __future__ import annotations

from typing import Sequence

import msgpack

from tierkv.storage_backends.zmq.channel import RequestChannel

#: LMCache's operation ids (its small legacy integers); newer operations go by name
OPS = {"lookup": 8, "wait_prefetch_status": 10, "free_lookup_locks": 12, "end_session": 13,
       "register_kv_cache_engine_driven_context": 14, "unregister_kv_cache_engine_driven_context": 15,
       "prepare_store": 16, "commit_store": 17, "prepare_retrieve": 18, "commit_retrieve": 19,
       "get_chunk_size": 21, "ping": 22, "clear": 20, "noop": 24}


def lm_calls(chan: RequestChannel, calls: Sequence[tuple], forget: Sequence[tuple] = ()) -> list:
    """Send ``calls`` (``(op, *args)``) pipelined through ``chan`` in LMCache's framing and return their results in
    order; ``forget`` is sent after them without waiting for replies (their late replies are dropped). Raises
    :class:`ChannelFailed` when a reply does not arrive within the channel's ``timeout_s`` of silence (the clock
    restarts at every reply) or the socket fails."""
    results: list = [None] * len(calls)
    pack = msgpack.packb

    def encode(call, uid):
        return [pack(uid), pack(OPS.get(call[0], call[0]))] + [pack(a, use_bin_type=True) for a in call[1:]]

    def decode(frames):
        return (msgpack.unpackb(frames[0].bytes),
                msgpack.unpackb(frames[2].bytes, raw=False) if len(frames) > 2 else None)

    def on_reply(i, result, frames):
        results[i] = result

    def describe(idx):
        return f"to {', '.join(sorted({calls[i][0] for i in idx}))}; LMCache does not answer a request it rejects"

    chan.exchange(calls, encode, decode, on_reply, forget, describe)
    return results


__all__ = ["OPS", "lm_calls"]
