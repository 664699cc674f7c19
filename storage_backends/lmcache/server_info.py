"""``server_info``: what an LMCache cache server tells a client that names no keys (``tierkv store stats``).

Connects, asks the chunk size and the experimental transfers, registers a probe instance to learn the shared-memory
segment and its size, unregisters it at once; no store and no page is involved.
"""
from __future__ import annotations

import logging
import os
import random

from tierkv.storage_backends.common import Counters
from tierkv.storage_backends.lmcache.wire import lm_calls
from tierkv.storage_backends.zmq.channel import RequestChannel

log = logging.getLogger("tierkv.lmcache")


def server_info(endpoint: str, timeout_s: float = 2.0, shm_dir: str = "/dev/shm") -> dict:
    """What an LMCache server (0.5.6) tells a client that names no keys, for ``tierkv store stats``.

    Such a server cannot list what it holds: its ZMQ protocol has no listing op (a lookup needs the token ids), and its
    HTTP ``/cache/objects`` lists L2 adapters only, not the shared-memory L1 that tierkv uses. So pages, bytes,
    namespaces and ages are unknown; what is known: ``chunk_size`` (tokens per chunk = tierkv's ``page_tokens``),
    ``experimental`` (its enabled experimental transfers, a list of str), ``shm_name`` and ``pool_bytes`` (its L1
    segment and that segment's size: L1 capacity in bytes, from registering a probe instance of model
    ``tierkv-stats-probe``, unregistered at once), and, when the segment is visible under ``shm_dir`` (same host),
    ``shm_resident_bytes``: bytes of the segment backed by memory (pages ever written: a high-water mark of L1 use,
    not what is held now), else None.

    Raises:
        ChannelFailed: the server does not answer within ``timeout_s``.
        ValueError: it answers like no LMCache server (e.g. a chunk size that is not an int).
    """
    counters = Counters("requests", "timeouts", "reconnects", "fast_fails", "stale_replies", "bad_replies")
    chan = RequestChannel(endpoint, timeout_s=timeout_s, backoff_s=0.0, max_backoff_s=0.0, counters=counters, log=log,
                          what="LMCache server", hwm=1000)
    try:
        chunk, experimental = lm_calls(chan, [("get_chunk_size",), ("get_experimental",)])
        if type(chunk) is not int or chunk <= 0:
            raise ValueError(f"{endpoint} answered get_chunk_size with {chunk!r:.60}: not an LMCache server")
        instance = random.getrandbits(62)
        reg = lm_calls(chan, [("register_kv_cache_engine_driven_context", {
            "instance_id": instance, "model_name": "tierkv-stats-probe", "world_size": 1, "block_size": chunk,
            "num_layers": 1, "hidden_dim_size": 1, "dtype_str": "uint8", "use_mla": False,
            "num_physical_slots": chunk})])[0]
        lm_calls(chan, [("unregister_kv_cache_engine_driven_context", instance)])
    finally:
        chan.close()
    shm_name = reg.get("shm_name") if isinstance(reg, dict) else None
    pool = reg.get("pool_size") if isinstance(reg, dict) else None
    resident = None
    if isinstance(shm_name, str) and shm_name and "/" not in shm_name:
        try:
            resident = os.stat(os.path.join(shm_dir, shm_name)).st_blocks * 512
        except OSError:
            pass
    return {"chunk_size": chunk, "experimental": [x for x in experimental or [] if isinstance(x, str)],
            "shm_name": shm_name, "pool_bytes": pool if type(pool) is int else None, "shm_resident_bytes": resident}


__all__ = ["server_info"]
