"""Redis / Valkey as the L3 store (``l3.backend: redis``): :class:`RedisStore`, standalone or cluster.

``config``: the ``l3.redis`` section; ``connect``: clients and pipelined transports (standalone, cluster);
``store``: the page records, counters and fault handling. Needs redis-py >= 5 (``pip install tierkv[redis]``).
"""
from tierkv.storage_backends.redis.config import RedisStoreConfig, check_options
from tierkv.storage_backends.redis.store import RedisStore

__all__ = ["RedisStore", "RedisStoreConfig", "check_options"]
