"""One pipelined exchange of a :class:`.client.ZmqStore` with its server: stamp each request header (id, protocol
version, token), send the batch through the store's :class:`~.channel.RequestChannel`, and match the replies.

A reply is applied only when its id, ``op`` and version are those of a request of this exchange and it says
``ok``; an error reply or a malformed one is counted (``error_replies``, ``bad_replies``) and logged (rate
limited), never raised. Network faults (timeout, closed store, back-off window) leave the messages unanswered and
return ``False`` for them; the channel's back-off then spaces the next tries.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from tierkv.storage_backends.zmq import protocol as P
from tierkv.storage_backends.zmq.channel import ChannelFailed

if TYPE_CHECKING:
    from tierkv.storage_backends.zmq.client import ZmqStore


def exchange(store: "ZmqStore", msgs: list, on_reply: Callable[[int, dict, list], None],
             errors: Optional[dict] = None) -> list:
    """Send ``msgs`` (``(header dict, payload buffers)``, or a callable returning one, called just before its
    message is sent) through the request channel, pipelined, and hand each matched, well-formed,
    ``ok`` reply to ``on_reply(index, header, frames)``. Returns one bool per message (answered ok).
    A header may carry its own ``v`` (default :data:`zmq_protocol.PROTOCOL_VERSION`); ``errors`` (a dict), when
    given, receives ``index -> code`` of every error reply. Never raises for network faults."""
    done = [False] * len(msgs)
    if not msgs:
        return done
    with store._lock:
        if store._closed:
            store.counters["errors"] += len(msgs)
            return done
        if store._chan.backing_off(len(msgs)):
            return done
        sent: dict[int, tuple] = {}

        def encode(m, rid):
            h, payloads = m() if callable(m) else m  # built lazily: overlaps the previous send
            h = dict(h, id=rid)
            h.setdefault("v", P.PROTOCOL_VERSION)
            if store.token is not None:
                h["token"] = store.token
            sent[rid] = (h["op"], h["v"])
            return [P.pack(h)] + list(payloads)

        def decode(frames):
            rh = P.unpack_header(frames[0].buffer, max_map_len=256)
            return rh.get("id"), rh

        def apply(i, rh, frames):
            op, ver = sent[rh["id"]]
            if rh.get("v") != ver or rh.get("op") != op or not isinstance(rh.get("ok"), bool):
                store.counters["bad_replies"] += 1
                return
            if not rh["ok"]:
                store.counters["error_replies"] += 1
                err = rh.get("err")
                if errors is not None:
                    errors[i] = rh.get("code")
                    if rh.get("code") in ("shm_unknown", "shm", "version"):
                        return  # the shared-memory path handles these (re-attach or fall back)
                store._warn.warning("refused", "tierkv zmq server refused %s: %s: %s", op, P.brief(rh.get("code")),
                                    err[:200] if isinstance(err, str) else P.brief(err))
                return
            try:
                on_reply(i, rh, frames[1:])
            except (P.ProtocolError, TypeError, ValueError, KeyError, IndexError) as e:
                store.counters["bad_replies"] += 1
                store._warn.warning("malformed", "malformed %s reply from %s discarded: %s", op, store.endpoint, e)
                return
            done[i] = True

        try:
            store._chan.exchange(msgs, encode, decode, apply)
        except ChannelFailed as e:
            store._chan.failed(str(e))
            return done
        store._chan.ok()
        return done
