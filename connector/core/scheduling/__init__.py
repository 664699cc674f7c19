"""The parts of :class:`tierkv.connector.core.scheduler.CacheScheduler`, one seam each.

- :mod:`.state`: per-request state, counters, the empty slot allocator and the page size check;
- :mod:`.lookup`: how many tokens a request can take from L2 or L3, and how its prefix is counted;
- :mod:`.loads`: the load orders of a request the engine allocated blocks for (L2 -> L1, or an L3 prefetch);
- :mod:`.saves`: the save orders (L1 -> L2) of the pages a step fills;
- :mod:`.failures`: what a failed L2 -> L1 load takes out of the index.

Engine-free and tensor-free. ``CacheScheduler`` owns the shared state (index, slot allocator, controller, the plan
being built) and hands each part what it needs; import it from :mod:`tierkv.connector.core.scheduler`.
"""
