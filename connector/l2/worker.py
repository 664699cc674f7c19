"""Worker side of the cache: executes each step's plan on the L1 and L2 memory (engine-free).

- Loads (L2 -> L1) start before the forward, all layers at once or, with ``layerwise``, layer by layer on a
  background thread (:class:`tierkv.connector.l2.layer_loader.LayerwiseLoad`) so each layer waits for its own pages.
- Saves (L1 -> L2) run after the forward wrote the KV and complete before the step ends (vLLM may reuse the blocks).
- A copy that fails never reaches the engine as an exception: its blocks are reported failed and vLLM recomputes
  them. A request whose load failed computed later pages on a broken prefix: none of its saves is made until a plan
  confirms the rollback (``StepPlan.recomputed``), and a slot whose save was not made is never loaded nor backed up.
  Loads of one step that read the same slot are copied in rounds (the kernels take a slot once).
- With ``verify`` the XXH3-64 of every saved page is kept per slot, travels into the L3 record header on backup and
  is checked before the page is loaded again; from the first mismatch on, the blocks are reported failed.
- The L3 half (reads, synchronous loads, jobs, reports) is the :class:`tierkv.connector.l2.l3_jobs.L3Jobs` mixin;
  the order of a step's calls is :class:`tierkv.connector.l2.step.WorkerStep`'s.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from tierkv.storage_backends.common import RateLimitedLog

from tierkv import kernels
from .device_pool import DevicePool
from .host_pool import HostPool
from .l3_jobs import L3Jobs
from tierkv.connector.l3.io import L3IO, NoL3
from tierkv.connector.core.page_checksums import SlotChecksums
from tierkv.connector.core.plan import JobReport, PageOrder, StepPlan, group_copies

logger = logging.getLogger("tierkv.worker")
_rate_limited = RateLimitedLog(logger)  # failures that can repeat at traffic rate: one line per kind per 10 s


@dataclass
class WorkerCounters:
    load_pages: int = 0
    load_bytes: int = 0
    load_seconds: float = 0.0
    save_pages: int = 0
    save_bytes: int = 0
    save_seconds: float = 0.0
    verified_pages: int = 0
    checksum_mismatches: int = 0
    failed_load_blocks: int = 0
    steps_with_loads: int = 0
    async_load_pages: int = 0       # pages copied L2 -> L1 at the end of L3 prefetches
    async_load_seconds: float = 0.0
    save_steps: int = 0             # steps with saves (save_seconds / save_steps = mean per step)
    max_save_ms: float = 0.0        # the slowest step's save, milliseconds
    max_load_ms: float = 0.0        # the slowest step's L2 -> L1 load, milliseconds
    unsaved_pages: int = 0          # saves not made: their request's load failed (computed on a broken prefix)
    save_failed_pages: int = 0      # saves whose L1 -> L2 copy raised (never loaded nor backed up)
    hook_errors: int = 0            # exceptions caught at a vLLM hook: each became failed pages
    # wall time inside tierkv's worker-side vLLM hooks (every call, on the model runner's thread), the calls, and
    # the steps (plans bound): hook_seconds / hook_steps is what tierkv adds to each step's forward there
    hook_seconds: float = 0.0
    hook_calls: int = 0
    hook_steps: int = 0
    # L3 reads handed over before a step's forward and still running when the step ended (get_finished): steps that
    # waited for them, the time waited, and the waits that ran out first (those loads end in a later step)
    read_waits: int = 0
    read_wait_seconds: float = 0.0
    read_wait_timeouts: int = 0
    # synchronous L3 loads (Job.sync): their pages copied L2 -> L1 before the forward, the time the forward waited
    # for their reads, and their blocks reported failed (a read or check that did not end by the deadline)
    sync_load_pages: int = 0
    sync_wait_seconds: float = 0.0
    sync_failed_blocks: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _unique_slot_rounds(slots: list[int], blocks: list[int]) -> list[tuple[list[int], list[int]]]:
    """Split a load into rounds in which no slot appears twice (the kernels take each slot once per call); one round
    unless two requests of the step load the same L2 page."""
    rounds: list[tuple[list[int], list[int], set[int]]] = []
    for s, b in zip(slots, blocks):
        for r in rounds:
            if s not in r[2]:
                break
        else:
            r = ([], [], set())
            rounds.append(r)
        r[0].append(s)
        r[1].append(b)
        r[2].add(s)
    return [(r[0], r[1]) for r in rounds]


class MultiBlockPages:
    """Pages of ``blocks_per_page`` engine blocks over a :class:`HostPool` of block rows (``block_pool``, its
    ``num_slots`` a multiple of ``blocks_per_page``): page slot ``s`` is block rows ``s*k .. s*k+k-1``. The kernels
    copy blocks with ``block_pool`` and block rows (:meth:`tierkv.connector.core.plan.PageOrder.block_slots`); L3, the
    checksums and the scheduler side see ``num_slots`` pages of ``page_bytes`` = ``k`` x the block pool's page bytes.

    Page bytes (what :meth:`read_page` returns, L3 stores and :meth:`page_checksum` hashes) are the page's runs in
    the block pool's layout: ``layer_first`` one run per layer holding the ``k`` blocks of that layer in order
    (``[L, k*block_bytes]``), ``page_first`` / ``page_first_direct`` K then V of the ``k`` blocks (MLA: one run).
    Same interface as :class:`HostPool` for everything page-level (``read_page``, ``write_page``, ``page_views``,
    ``page_runs``, ``page_checksum``, ``buffer``, ``layout``, ``kv_layout``).

    Raises:
        ValueError: ``blocks_per_page`` < 1 or not dividing ``block_pool.num_slots``.
    """

    def __init__(self, block_pool: HostPool, blocks_per_page: int):
        k = blocks_per_page
        if not isinstance(k, int) or k < 1 or block_pool.num_slots % k:
            raise ValueError(f"MultiBlockPages: blocks_per_page must be an int >= 1 dividing the pool's "
                             f"{block_pool.num_slots} block rows, got {k!r}")
        self.block_pool, self.blocks_per_page = block_pool, k
        self.num_slots = block_pool.num_slots // k
        self.num_layers, self.layout, self.geometry = block_pool.num_layers, block_pool.layout, block_pool.geometry
        self.block_bytes = block_pool.block_bytes * k
        self.page_bytes = block_pool.page_bytes * k
        self.buffer, self.nbytes, self.pinned = block_pool.buffer, block_pool.nbytes, block_pool.pinned
        self.prefaulted = block_pool.prefaulted
        self.semantic = block_pool.semantic
        S, L = self.num_slots, self.num_layers
        if self.layout == "layer_first":
            self._pages = self.buffer.view(L, S, self.block_bytes).transpose(0, 1)  # [S, L, k*bb]
        elif self.geometry.use_mla:
            self._pages = self.buffer.view(S, 1, self.page_bytes)
        else:
            self._pages = self.buffer.view(2, S, self.page_bytes // 2).transpose(0, 1)  # [S, 2, bytes/2]
        self._np_pages = self._pages.numpy()  # for page_checksum (as HostPool)

    @property
    def kv_layout(self) -> str:
        return self.block_pool.kv_layout

    @property
    def device_tag(self):
        return self.block_pool.device_tag

    def check_compatible(self, dev: DevicePool) -> None:
        self.block_pool.check_compatible(dev)

    _check_slot = HostPool._check_slot
    page_views = HostPool.page_views
    page_runs = HostPool.page_runs
    read_page = HostPool.read_page
    write_page = HostPool.write_page
    page_checksum = HostPool.page_checksum

    def __repr__(self) -> str:
        return f"MultiBlockPages({self.blocks_per_page} blocks per page, {self.num_slots} pages of {self.block_pool!r})"


class CacheWorker(L3Jobs):
    """Executes :class:`StepPlan` loads and saves between ``dev`` (L1) and ``host`` (L2).

    Args:
        dev: the engine's KV tensors (:class:`DevicePool`).
        host: the L2 host pool (:class:`HostPool`, one engine block per page, or :class:`MultiBlockPages` for pages
            of several blocks), ``host.page_bytes`` bytes per page.
        verify: check each page's checksum before loading it (one XXH3 pass per page and direction).
        layerwise: load layer by layer in the background (see module docstring).
        l3: the worker half of the controller (:class:`L3IO`, built on the same ``host`` and ``checksums``), or None
            (no store: :class:`NoL3` answers every job at once with no page done).
        checksums: the per-slot checksum table (made here if not given).
        group_layers: hybrid models (several KV cache groups, vLLM's hybrid KV cache manager on): the indices into
            ``dev.layer_names`` of each group's layers. Every order then carries ``groups`` (block ids per group) and
            each group's live blocks are copied with that group's layers only (:func:`group_copies`). Every load is
            then an asynchronous load in vLLM's sense (vLLM cannot take failed block ids with several groups): a
            request whose load failed is named in :meth:`take_failed_requests` (vLLM's ``failed_recving``) instead
            of its blocks in :meth:`take_failed_blocks`, which stays empty.
    """

    def __init__(self, dev: DevicePool, host: HostPool, verify: bool = False, layerwise: bool = False,
                 l3: Optional[L3IO] = None, checksums: Optional[SlotChecksums] = None,
                 group_layers: Optional[Sequence[Sequence[int]]] = None):
        self.dev = dev
        self.host = host
        # the kernels copy engine blocks to and from the pool's block rows: with pages of several blocks (a
        # :class:`MultiBlockPages` over a pool of block rows) page slot s is block rows s*k .. s*k+k-1
        self.blocks = getattr(host, "block_pool", host)
        self.blocks_per_page = int(getattr(host, "blocks_per_page", 1))
        self._pending_pages = 0
        self._pending_bytes = 0
        self.verify = verify
        self.layerwise = layerwise
        self.l3 = l3 if l3 is not None else NoL3()  # without a store every L3 job is answered at once, none done
        self.layer_index = {name: i for i, name in enumerate(dev.layer_names)}
        self.counters = WorkerCounters()
        self.checksums = checksums if checksums is not None else SlotChecksums(host.num_slots)
        self._closed = False
        self._orphan_reports: list[JobReport] = []   # jobs answered without a store
        self._orphan_finished: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._pending = None  # LayerwiseLoad in flight
        # requests whose load failed and whose rollback the scheduler side has not confirmed yet (a plan
        # built before it knew may still order their saves), and slots whose ordered save was not made (slot -> key)
        self._suspect: set[str] = set()
        self._unwritten: dict[int, bytes] = {}
        self._read_started: set[int] = set()  # jobs of the current plan handed to the readers by start_reads
        self._step_reads: list[int] = []      # prefetches of the current plan handed over by start_reads
        self._sync_jobs: list = []            # synchronous prefetches of the current plan handed over by start_reads
        self._sync_orders: list[PageOrder] = []  # ... as loads of the step (every page), for the failed-load check
        self._sync_served: dict[int, int] = {}   # synchronous prefetch -> leading pages copied into L1 (its report)
        self.group_layers = [list(g) for g in group_layers] if group_layers else None
        for g in self.group_layers or ():
            if not g or min(g) < 0 or max(g) >= dev.num_layers:
                raise ValueError(f"group_layers: {g} is not a non-empty list of layer indices in [0, {dev.num_layers})")
        # hybrid models: every block of each request's load in flight (all groups), the requests whose L2 load ran
        # this step (named ended at the next poll), those whose load failed, and those named failed to vLLM
        self._load_blocks: dict[str, set[int]] = {}
        self._loaded_reqs: set[str] = set()
        self._failed_reqs: set[str] = set()
        self._failed_recving: set[str] = set()

    # ----------------------------------------------------------------- copies
    def _copies(self, orders: Sequence[PageOrder]) -> list[tuple[Optional[list[int]], list[int], list[int]]]:
        """What the kernels copy for ``orders``: ``(layers, L2 block slots, engine blocks)`` triples. One model group:
        one triple with every layer (``layers`` None). Hybrid models: one per KV cache group with live blocks, that
        group's layers and its live blocks only (:func:`tierkv.connector.core.plan.group_copies`).

        Raises:
            ValueError: an order without ``groups`` on a hybrid model's worker."""
        if self.group_layers is None:
            return [(None, [s for o in orders for s in o.block_slots()], [b for o in orders for b in o.block_ids])]
        per: dict[int, tuple[list[int], list[int]]] = {}
        for o in orders:
            if len(o.groups) != len(self.group_layers) and o.block_ids:
                raise ValueError(f"order for {o.req_id}: {len(o.groups)} block id groups for "
                                 f"{len(self.group_layers)} KV cache groups")
            for g, blocks, slots in group_copies(o.groups, o.block_slots()):
                e = per.setdefault(g, ([], []))
                e[0].extend(slots)
                e[1].extend(blocks)
        return [(self.group_layers[g], s, b) for g, (s, b) in sorted(per.items())]

    def _copy_bytes(self, copies) -> int:
        """Bytes the ``copies`` move (every layer of a block, or the group's layers)."""
        layer_block = self.host.page_bytes // self.blocks_per_page // self.dev.num_layers
        return sum(len(b) * layer_block * (self.dev.num_layers if ls is None else len(ls)) for ls, _s, b in copies)

    def _copy_all(self, fn, copies) -> None:
        """Run ``copies`` with ``kernels.load_pages`` or ``kernels.save_pages`` (``fn``), in rounds where a slot
        appears twice (two requests of the step read one L2 page)."""
        for layers, slots, blocks in copies:
            if fn is kernels.save_pages:
                kernels.save_pages(self.dev, self.blocks, blocks, slots, layers)
                continue
            for r_slots, r_blocks in _unique_slot_rounds(slots, blocks):
                kernels.load_pages(self.blocks, self.dev, r_slots, r_blocks, layers)

    def _track_load(self, req_id: Optional[str], block_ids, groups) -> None:
        """Hybrid models: remember every block of a request's load (a failure of any of them fails the request)."""
        if self.group_layers is not None and req_id is not None:
            self._load_blocks.setdefault(req_id, set()).update(block_ids, *groups)

    # ----------------------------------------------------------------- loads
    def start_loads(self, plan: StepPlan, verified: Sequence[PageOrder] = ()) -> None:
        """Start (or, without ``layerwise``, perform) the plan's L2 -> L1 loads, together with ``verified``: orders
        already checked (the leading runs of synchronous L3 loads, :meth:`finish_sync_reads`)."""
        if not plan.loads and not verified:
            return
        t0 = time.perf_counter()
        oks, pages = list(verified), sum(len(o.slots) for o in verified)
        for order in plan.loads:
            self._track_load(order.req_id, order.block_ids, order.groups)
            if self.group_layers is not None:
                self._loaded_reqs.add(order.req_id)
            good = self._verified_prefix(order)
            ok = order.head(good)
            oks.append(ok)
            pages += good
            bad = order.blocks_from(good)
            if bad:
                self._failed_blocks.update(bad)
                self.counters.failed_load_blocks += len(bad)
        self.counters.steps_with_loads += 1
        blocks = [b for o in oks for b in o.block_ids]
        if blocks:
            try:
                copies = self._copies(oks)
                single = all(len(set(s)) == len(s) for _ls, s, _b in copies)
                if self.layerwise and single:
                    from .layer_loader import LayerwiseLoad
                    self._pending = LayerwiseLoad(self.blocks, self.dev, [], [], copies=copies)
                    self._pending_pages = pages
                    self._pending_bytes = self._copy_bytes(copies)
                    self._pending.start()
                else:  # several requests read one page (a shared prefix admitted in one step): one copy per round
                    self._copy_all(kernels.load_pages, copies)
            except Exception:  # never crash the engine: report the blocks, vLLM recomputes them
                logger.exception("tierkv: L2 -> L1 load of %d pages failed; reporting them for recompute",
                                 len(blocks))
                self._pending = None
                self._failed_blocks.update(blocks)
                self.counters.failed_load_blocks += len(blocks)
                return
            if self._pending is None:  # layer-wise: counted once every layer arrived (finish_loads)
                self._count_loaded(pages, self._copy_bytes(copies))
        dt = time.perf_counter() - t0
        self.counters.load_seconds += dt
        self.counters.max_load_ms = max(self.counters.max_load_ms, 1e3 * dt)

    @property
    def loading(self) -> bool:
        """A step's L2 -> L1 load is in flight (what :meth:`wait_layer` and :meth:`finish_loads` would wait for)."""
        return self._pending is not None

    def wait_layer(self, layer_name: str) -> None:
        """Block until this layer's pages of the current step's loads are in L1 (a layer name not among the
        engine's waits for every layer). Never raises for a failed copy: the load's blocks go to
        :meth:`take_failed_blocks` and the later waits of the step return at once."""
        p = self._pending
        if p is None:
            return
        idx = self.layer_index.get(layer_name)
        if idx is None:
            self.finish_loads()
            return
        try:
            p.wait_layer(idx)
        except Exception as e:
            self._layerwise_failed(p, e)

    def finish_loads(self) -> None:
        """Block until every load of the step is done. A failure of the background loader is not raised: the
        load's blocks go to :meth:`take_failed_blocks` (vLLM recomputes them)."""
        p = self._pending
        if p is None:
            return
        t0 = time.perf_counter()
        try:
            p.wait_all()
        except Exception as e:
            self._layerwise_failed(p, e)
            return
        finally:
            self.counters.load_seconds += time.perf_counter() - t0
        self._pending = None
        self._count_loaded(self._pending_pages, self._pending_bytes)

    def _layerwise_failed(self, p, err: BaseException) -> None:
        """The pending layer-wise load ``p`` failed: wait for its thread to end (nothing writes into L1 after
        this), report every block of it as failed (each misses the layers from ``p.failed_layer`` on)."""
        self._pending = None
        try:
            p.wait_all()  # joins the copy thread; raises the same failure again
        except Exception:
            pass
        n = len(p.block_ids)
        self._failed_blocks.update(p.block_ids)
        self.counters.failed_load_blocks += n
        _rate_limited.warning("layerwise", "tierkv: layer-wise L2 -> L1 load of %d pages failed at layer %s (%s); "
                              "reporting them for recompute", n, p.failed_layer, err.__cause__ or err)

    def _count_loaded(self, pages: int, nbytes: int) -> None:
        """``pages`` pages (a first page the engine partly held in L1 counts once) of ``nbytes`` bytes copied
        L2 -> L1 (a hybrid model's sliding-window layers count only their live blocks)."""
        self.counters.load_pages += pages
        self.counters.load_bytes += nbytes

    def _verified_prefix(self, order: PageOrder) -> int:
        if self._unwritten and order.keys:  # a page whose save was not made is never loaded
            for i, (slot, key) in enumerate(zip(order.slots, order.keys)):
                if self._unwritten.get(slot) == key:
                    _rate_limited.warning("unwritten", "tierkv: L2 page %s in slot %d was never written (its "
                                          "request's load failed); recomputing from there", key.hex(), slot)
                    order = order.head(i)
                    break
        if not self.verify or not order.keys:
            return len(order.slots)
        for i, (slot, key) in enumerate(zip(order.slots, order.keys)):
            want = self.checksums.get(slot, key)
            got = self.host.page_checksum(slot)
            if want is None or want != got:
                self.counters.checksum_mismatches += 1
                _rate_limited.warning("checksum", "tierkv: L2 page %s in slot %d fails its checksum; recomputing "
                                      "from there", key.hex(), slot)
                return i
            self.counters.verified_pages += 1
        return len(order.slots)

    # ----------------------------------------------------------------- saves
    def run_saves(self, plan: StepPlan) -> None:
        """Perform the plan's L1 -> L2 saves; complete on return. Call it for every plan (vLLM's ``wait_for_save``),
        with or without saves: it also notes the requests whose load failed in this step.

        A request whose load failed in this step (any block of its load order), or in an earlier step whose rollback
        the plan does not confirm yet (``plan.recomputed``), has its pages computed on a broken prefix: none of its
        saves is made. Their slots are remembered as not written, so no later load or backup reads them
       ."""
        for rid in plan.recomputed:
            self._suspect.discard(rid)
        self.finish_loads()
        sync_orders, self._sync_orders = self._sync_orders, []
        if self._failed_blocks and self.group_layers is None:  # hybrid: loads are asynchronous, nothing computed
            for o in list(plan.loads) + sync_orders:
                if not self._failed_blocks.isdisjoint(o.block_ids):
                    self._suspect.add(o.req_id)
        if not plan.saves:
            return
        t0 = time.perf_counter()
        saves = plan.saves
        if self._suspect:
            saves = []
            for o in plan.saves:
                if o.req_id not in self._suspect:
                    saves.append(o)
                    continue
                self.counters.unsaved_pages += len(o.slots)
                self.forget_saves([o])
        blocks = [b for o in saves for b in o.block_ids]
        if self._unwritten:
            for o in saves:
                for s in o.slots:
                    self._unwritten.pop(s, None)
        nbytes = 0
        if blocks:
            try:
                copies = self._copies(saves)
                nbytes = self._copy_bytes(copies)
                self._copy_all(kernels.save_pages, copies)
            except Exception as e:  # never into vLLM's forward: the pages are simply not in L2
                self.counters.save_failed_pages += len(blocks)
                _rate_limited.warning("save", "tierkv: L1 -> L2 save of %d pages failed (%r); they are never "
                                      "loaded nor backed up, a later hit recomputes them", len(blocks), e)
                self.forget_saves(saves)
                return
        self.counters.save_pages += sum(len(o.slots) for o in saves)
        self.counters.save_bytes += nbytes
        if self.verify:  # a save hashes only for loads that check; otherwise the L3 writer hashes what it backs up
            for o in saves:
                for slot, key in zip(o.slots, o.keys):
                    self.checksums.record(slot, key, self.host.page_checksum(slot))
        dt = time.perf_counter() - t0
        self.counters.save_seconds += dt
        self.counters.save_steps += 1
        self.counters.max_save_ms = max(self.counters.max_save_ms, 1e3 * dt)

    def forget_saves(self, saves: Sequence[PageOrder]) -> None:
        """The slots of ``saves`` were not written (the copy failed or was never made): they are never loaded nor
        backed up under those keys (a load of one is reported failed, so vLLM recomputes it)."""
        for o in saves:
            for slot, key in zip(o.slots, o.keys):
                self._unwritten[slot] = key
                self.checksums.forget(slot)

    def fail_loads(self, plan: StepPlan) -> None:
        """Report every block of the plan's L2 -> L1 loads as failed (vLLM recomputes them; hybrid models: their
        requests, at the next :meth:`poll`)."""
        self._pending = None
        for o in list(plan.loads) + self._sync_orders:
            self._failed_blocks.update(o.block_ids)
            self.counters.failed_load_blocks += len(o.block_ids)
            if self.group_layers is not None:
                self._loaded_reqs.add(o.req_id)
                self._failed_reqs.add(o.req_id)

    def take_plan_failures(self, plan: StepPlan) -> None:
        """Loads the scheduler side promised but could not order (``plan.failed_blocks``, ``plan.failed_requests``):
        their blocks are reported failed and their asynchronous requests named as ended."""
        if plan.failed_blocks:
            self._failed_blocks.update(plan.failed_blocks)
            self.counters.failed_load_blocks += len(plan.failed_blocks)
        self._orphan_finished.update(plan.failed_requests)
        if self.group_layers is not None:  # a hybrid model's loads are all asynchronous: these requests failed
            self._failed_reqs.update(plan.failed_requests)


    def close(self, drain_s: float = 10.0) -> None:
        """Stop the I/O threads (queued backups get ``drain_s`` seconds) and close the store."""
        if not self._closed:
            self._closed = True  # the L3IO stays for its final counters
            self.l3.close(drain_s)
            if self.l3.store is None:  # NoL3
                return
            try:
                self.l3.store.close()
            except Exception:  # pragma: no cover - best effort at shutdown
                logger.exception("tierkv: closing the L3 store failed")

    def take_failed_blocks(self) -> set[int]:
        """Block ids whose load failed since the last call (reported once); always empty for a hybrid model (vLLM
        cannot map block ids of several groups back to requests: :meth:`take_failed_requests`)."""
        if self.group_layers is not None:
            return set()
        out, self._failed_blocks = self._failed_blocks, set()
        return out

    def stats(self) -> dict:
        d = self.counters.as_dict()
        d.update(num_slots=self.host.num_slots, page_bytes=self.host.page_bytes, layout=self.host.layout)
        d.update(self.l3.stats())
        return d
