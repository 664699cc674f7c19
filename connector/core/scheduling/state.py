"""The scheduler side's per-request state, its counters, the slot allocator of an empty L2 and the page size check.

Plain data: :class:`RequestState` is what :class:`tierkv.connector.core.scheduler.CacheScheduler` keeps for each live
request (page keys, lock, lookup answer, load record), :class:`SchedulerCounters` the counters its ``stats`` reports
(tokens unless named otherwise). :func:`check_page_size` raises ValueError for a page that is not whole engine blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from tierkv.connector.core.page_hash import RequestKeys
from tierkv.connector.core.radix_index import MatchCursor, RadixNode

#: steps after its plan during which a load's failure can still be reported (vLLM reports it with that step's output;
#: with asynchronous scheduling one or two later plans are built first)
LOAD_FAILURE_WINDOW = 32


@dataclass
class RequestState:
    req_id: str
    keys: RequestKeys
    tokens: Sequence[int]                 # live view of all token ids (prompt + output)
    lock: Optional[RadixNode] = None      # node locked for this request's loads
    last_num_computed: int = 0            # argument of the last lookup (device prefix hit, tokens)
    num_indexed: int = 0                  # leading pages known to be in the index with an L2 copy
    counted: bool = False                 # prompt counted in hit statistics
    reads: bool = True                    # False: the engine never lets it read a cache (not counted)
    load_cap: Optional[int] = None        # most pages tierkv may load for it (its kv_transfer_params), None = all
    save_cap: Optional[int] = None        # most leading pages tierkv may save for it, None = all
    keep: bool = False                    # the pages it saves go to L3 whatever L3 admission decides
    # why the pages after the last lookup's hit are not a hit: (reason, end page) segments (LookupAnswer.rest)
    rest: list[tuple[str, int]] = field(default_factory=list)
    async_hit: bool = False               # the last lookup's answer needs an L3 read (an asynchronous load)
    sync_hit: bool = False                # ... an L3 read loaded before the forward of the step admitting it
    cursor: Optional[MatchCursor] = None  # where the last lookup's L2 match ended (resumed in O(1) next step)
    # the last L2 -> L1 load (plan step, its engine blocks, the request's block index of the first of them) and the
    # pages [a, b) of each save ordered since, kept until a failure of that load could no longer be reported
    load: Optional[tuple[int, list[int], int]] = None
    saved: list[tuple[int, int]] = field(default_factory=list)
    # the last load was a synchronous L3 load ending at this page: its pages came from L3, not from a computation, so
    # a failure of it drops only what the request saved after them (the job's report settles the loaded pages)
    load_l3_end: Optional[int] = None


def check_page_size(page_size, block_size: int) -> int:
    """Engine blocks per page: ``page_size // block_size``.

    Raises:
        ValueError: ``page_size`` is not a whole multiple (1, 2, 3...) of ``block_size`` (the message names
            ``page_size`` and the allowed values).
    """
    if (isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < block_size
            or page_size % block_size):
        raise ValueError(f"bad value {page_size!r} for 'page_size': a page is k whole engine blocks of {block_size} "
                         f"tokens; allowed: {block_size}, {2 * block_size}, {4 * block_size}, ... (k x {block_size}, "
                         "k an integer >= 1), or null for one block")
    return page_size // block_size


class NoSlots:
    """The slot allocator of an L2 of zero pages (an automatic size on a host with no room): nothing to hand out.
    Same interface as :class:`SlotAllocator`."""

    num_slots = num_free = num_used = 0

    def alloc(self, n: int) -> Optional[list[int]]:
        return [] if n == 0 else None

    def free(self, slots) -> None:
        slots = list(slots)
        if slots:
            raise ValueError(f"free: slot {slots[0]!r} out of range [0, 0)")

    def is_allocated(self, slot: int) -> bool:
        return False


@dataclass
class SchedulerCounters:
    """Counters of the scheduler side (tokens unless named otherwise)."""

    requests: int = 0
    # page-aligned prefix tokens of admitted requests that may read a cache (what could be reused); split by
    # LookupStats into lookup_<part>_tokens
    lookup_tokens: int = 0
    request_params_refused: int = 0  # requests whose kv_transfer_params["tierkv"] was malformed (served without tierkv)
    device_hit_tokens: int = 0      # of those, already in L1 (engine prefix cache)
    l2_hit_tokens: int = 0          # of those, loaded from L2
    load_pages: int = 0
    save_pages: int = 0
    save_skipped_pages: int = 0     # pages not saved for lack of L2 space (all locked)
    evicted_pages: int = 0
    preemptions: int = 0
    load_failed_requests: int = 0   # requests whose L2 -> L1 load failed (their pages of that step were dropped)
    load_failed_dropped_pages: int = 0  # pages those requests had saved or loaded from the failure on, dropped
    lookups: int = 0                # get_num_new_matched_tokens calls (vLLM repeats them for waiting requests)
    lookup_seconds: float = 0.0     # time spent in them
    max_lookup_us: float = 0.0      # the slowest one, microseconds
    hook_errors: int = 0            # exceptions caught at a vLLM hook; each became a miss or failed pages
    # wall time inside tierkv's scheduler-side vLLM hooks (every call, in the engine core's scheduling loop), the
    # calls, and the steps (plans built): hook_seconds / hook_steps is what tierkv adds to each step there
    hook_seconds: float = 0.0
    hook_calls: int = 0
    hook_steps: int = 0
    # L3 hits: engine steps (plans built) from the first lookup that waited for or hit L3 to the step whose output
    # named the load ended. An L2 hit costs 0 (loaded in the step that schedules it); the least an L3 hit costs is 1
    # with synchronous scheduling and 2 with vLLM's asynchronous scheduling (its default except on its CPU backend),
    # whose next plan is built before the output of the step that ended the load is processed
    # (tests/connector/vllm/test_l3_wait_steps_vllm.py)
    l3_hits: int = 0
    l3_hit_wait_steps: int = 0      # summed over the hits
    l3_hit_wait_steps_1: int = 0    # histogram: hits that waited 0-1 steps, 2, 3-4, 5-8, 9 or more
    l3_hit_wait_steps_2: int = 0
    l3_hit_wait_steps_3_4: int = 0
    l3_hit_wait_steps_5_8: int = 0
    l3_hit_wait_steps_9_plus: int = 0

    def note_l3_wait(self, steps: int) -> None:
        """One L3 load ended ``steps`` plans after its request first waited for L3 (a histogram bucket each)."""
        self.l3_hits += 1
        self.l3_hit_wait_steps += steps
        name = ("1" if steps <= 1 else "2" if steps == 2 else "3_4" if steps <= 4 else "5_8" if steps <= 8
                else "9_plus")
        setattr(self, f"l3_hit_wait_steps_{name}", getattr(self, f"l3_hit_wait_steps_{name}") + 1)

    def as_dict(self) -> dict:
        return dict(self.__dict__)
