"""Worker side of the cache: executes each step's plan on the L1 and L2 memory.

Engine-free: :class:`tierkv.connector.vllm.connector.TierKVConnector` calls it from vLLM's worker hooks.

- Loads (L2 -> L1) of a step start in ``start_load_kv`` (before the forward, since tierkv's loads from DRAM
  are synchronous loads in vLLM's sense). With ``layerwise`` they run layer by layer on a background
  thread (:class:`tierkv.connector.l2.layer_loader.LayerwiseLoad`) and each attention layer waits only for its
  own pages (``wait_for_layer_load``), after LMCache's layerwise mode and SGLang HiCache's per-layer
  load_back; otherwise all layers are copied at once. A copy that fails never reaches the engine as an exception:
  the blocks of the load are reported as failed (``get_block_ids_with_load_errors``) and vLLM recomputes them; in
  layer-wise mode that is every block of the step's load (they miss the layers from the failed one on), whether
  the failure surfaces in ``wait_layer``, ``finish_loads`` or ``run_saves``.
- Saves (L1 -> L2) of a step run in ``wait_for_save``, after the forward wrote the KV, and complete before
  it returns: vLLM may hand the blocks to another request from the next step on.
- A request whose load failed computed its later pages on a broken prefix: none of its saves is made in that step,
  nor in later plans until one confirms the scheduler side handled the failure (``StepPlan.recomputed``); a slot
  whose save was not made is never loaded nor backed up (docs/architecture.md §8 R31). Loads of one step that read
  the same slot (requests sharing a prefix, admitted together) are copied in rounds (the kernels take a slot once).
- With ``verify``, the XXH3-64 of every page saved into L2 is kept per slot
  (:class:`tierkv.connector.core.page_checksums.SlotChecksums`, bounded by the pool), travels into the L3 record header
  on backup ("checksum once") and is checked before the page is loaded again; a mismatch (a slot reused too early,
  memory corruption) is never loaded: the blocks from the first bad page on are reported as failed
  (``get_block_ids_with_load_errors``) so vLLM recomputes them. Without ``verify`` a save hashes nothing on the
  forward's thread: the L3 writer hashes a page when it backs it up, and pages never backed up are never hashed.
- With an L3 store, the step's jobs go to :class:`tierkv.connector.l3.io.L3IO` after the saves; :meth:`poll`
  (vLLM's ``get_finished``) copies prefetched pages L2 -> L1 and names the requests whose asynchronous load ended;
  :meth:`take_reports` hands the job reports to the scheduler side.
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
from tierkv.connector.l3.io import L3IO, NoL3
from tierkv.connector.core.page_checksums import SlotChecksums
from tierkv.connector.core.plan import JOB_BACKUP, JOB_PREFETCH, JobReport, PageOrder, StepPlan, group_copies

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
    save_failed_pages: int = 0      # saves whose L1 -> L2 copy raised (never loaded nor backed up; docs §8 R41)
    hook_errors: int = 0            # exceptions caught at a vLLM hook (docs §8 R41): each became failed pages
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


class CacheWorker:
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
        # docs §8 R31: requests whose load failed and whose rollback the scheduler side has not confirmed yet (a plan
        # built before it knew may still order their saves), and slots whose ordered save was not made (slot -> key)
        self._suspect: set[str] = set()
        self._unwritten: dict[int, bytes] = {}
        self._read_started: set[int] = set()  # jobs of the current plan handed to the readers by start_reads
        self._step_reads: list[int] = []      # prefetches of the current plan handed over by start_reads
        self._sync_jobs: list = []            # synchronous prefetches of the current plan handed over by start_reads
        self._sync_orders: list[PageOrder] = []  # ... as loads of the step (every page), for the R31 check
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
        if self._unwritten and order.keys:  # a page whose save was not made is never loaded (docs §8 R31)
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
        (docs/architecture.md §8 R31)."""
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
            except Exception as e:  # never into vLLM's forward (docs §8 R41): the pages are simply not in L2
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
        backed up under those keys (a load of one is reported failed, so vLLM recomputes it; docs §8 R31, R41)."""
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
        """Loads the scheduler side promised but could not order (``plan.failed_blocks``, ``plan.failed_requests``,
        docs §8 R41): their blocks are reported failed and their asynchronous requests named as ended."""
        if plan.failed_blocks:
            self._failed_blocks.update(plan.failed_blocks)
            self.counters.failed_load_blocks += len(plan.failed_blocks)
        self._orphan_finished.update(plan.failed_requests)
        if self.group_layers is not None:  # a hybrid model's loads are all asynchronous: these requests failed
            self._failed_reqs.update(plan.failed_requests)

    def fail_jobs(self, jobs) -> None:
        """Answer ``jobs`` with no page done, at once (no store, or they could not be handed to it)."""
        for job in jobs:
            served = 0 if job.sync else None
            self._orphan_reports.append(JobReport(job.job_id, job.kind, [False] * job.num_pages, served=served))
            if job.kind == JOB_PREFETCH and job.req_id is not None:
                if not job.sync:  # a synchronous load's request is not waiting: it is never named ended
                    self._orphan_finished.add(job.req_id)
                self._failed_blocks.update(job.block_ids)
                self.counters.failed_load_blocks += len(job.block_ids)
                if self.group_layers is not None:
                    self._failed_reqs.add(job.req_id)

    # ----------------------------------------------------------------- L3 jobs
    def start_reads(self, plan: StepPlan) -> None:
        """Hand the plan's prefetches and existence queries to the readers now, before the step's forward (vLLM's
        ``bind_connector_metadata``): they read nothing the step writes, so the read overlaps the forward and a load
        that ends within it is named finished at this step's end (an L3 hit then costs one engine step more than an
        L2 hit).
        Backups wait for :meth:`submit_jobs`, after the step's saves."""
        reads = [j for j in plan.jobs if j.kind != JOB_BACKUP]
        if not reads:
            return
        for j in reads:
            if j.kind == JOB_PREFETCH:
                self._track_load(j.req_id, j.block_ids, j.groups)
        self.l3.submit(reads)
        self._step_reads = [j.job_id for j in reads if j.kind == JOB_PREFETCH and not j.sync]
        self._sync_jobs = [j for j in reads if j.kind == JOB_PREFETCH and j.sync]
        self._read_started.update(j.job_id for j in reads)

    def finish_sync_reads(self) -> list[PageOrder]:
        """Before the forward (vLLM's ``start_load_kv``, which it calls before the forward in a step with
        synchronous loads): wait for the synchronous prefetches :meth:`start_reads` handed over for this step, at most
        until their deadlines (counted from when a reader starts each), then end their request side. Returns the
        leading run of intact, verified pages of each, for :meth:`start_loads` to copy L2 -> L1 with the step's other
        loads; every block after that run is reported failed (:meth:`take_failed_blocks`: vLLM recomputes from there,
        and the request's saves of this step are not made, docs §8 R31). Pages that arrive later still reach L2 and
        are reported by the job."""
        jobs = self._sync_jobs
        if not jobs:
            return []
        t0 = time.perf_counter()
        longest = max((j.deadline_max_s or j.deadline_s or 0.0) for j in jobs)  # the credit moves it at most there
        self.l3.wait_reads([j.job_id for j in jobs], 2.0 * longest + 0.001)  # queued, then read: each bounded
        self.counters.sync_wait_seconds += time.perf_counter() - t0
        out = self._end_sync(jobs, copy=True)
        self._sync_jobs = []  # kept until here: if this raised, end_sync_step fails what was not released
        return out

    def end_sync_step(self, plan: StepPlan) -> None:
        """After the forward, before the step's saves (vLLM's ``wait_for_save``): the plan's synchronous prefetches
        whose request side :meth:`finish_sync_reads` did not end (it was not called before the forward, or raised),
        and those never handed to the readers (:meth:`start_reads` raised), reached no L1 block in time: every
        block of theirs is reported failed and their request's saves of this step are not made (docs §8 R31). The
        ones never handed over are answered at once and not handed over later."""
        jobs, self._sync_jobs = self._sync_jobs, []
        if jobs:
            self._end_sync(jobs, copy=False)
        late = [j for j in plan.jobs if j.kind == JOB_PREFETCH and j.sync and j.job_id not in self._read_started]
        if late:
            self.fail_jobs(late)
            self._sync_orders.extend(j.page_order() for j in late)
            self._read_started.update(j.job_id for j in late)  # answered: submit_jobs does not hand them over

    def _end_sync(self, jobs, copy: bool) -> list[PageOrder]:
        by_id = {j.job_id: j for j in jobs}
        oks, failed = [], set()
        for jid, head, bad in self.l3.release(list(by_id)):
            job = by_id[jid]
            self._sync_orders.append(job.page_order())
            good = self._verified_prefix(head) if copy else 0
            self._sync_served[jid] = good
            if good:
                oks.append(head.head(good))
            failed.update(bad)
            failed.update(head.blocks_from(good))
        if failed:
            self._failed_blocks.update(failed)
            self.counters.failed_load_blocks += len(failed)
            self.counters.sync_failed_blocks += len(failed)
        self.counters.sync_load_pages += sum(len(o.slots) for o in oks)
        return oks

    def wait_step_reads(self, budget_s: float) -> None:
        """At the end of a step (before :meth:`poll`): wait at most ``budget_s`` seconds for the prefetch reads
        :meth:`start_reads` handed over before this step's forward, so that a read ending just after the forward is
        named finished by this step, not the next (an L3 hit then costs one engine step more than an L2 hit, not two).
        Each read is waited for once, in the step that started it; a read already ended costs nothing."""
        ids, self._step_reads = self._step_reads, []
        if not ids:
            return
        t0 = time.perf_counter()
        running, ended = self.l3.wait_reads(ids, budget_s)
        if running:
            c = self.counters
            c.read_waits += 1
            c.read_wait_seconds += time.perf_counter() - t0
            c.read_wait_timeouts += not ended

    def unsubmitted(self, plan: StepPlan) -> list:
        """The plan's jobs :meth:`start_reads` did not hand over (what :meth:`submit_jobs` will)."""
        return [j for j in plan.jobs if j.job_id not in self._read_started]

    def submit_jobs(self, plan: StepPlan) -> None:
        """Hand the plan's L3 jobs not handed over by :meth:`start_reads` to the I/O threads (after
        :meth:`run_saves` of the same plan). Without a store (:class:`NoL3`: none configured, or it could not start)
        every job is answered at once with no page done, so the scheduler side never waits for it: a prefetch's
        blocks are reported as load errors and its request as finished."""
        if not plan.jobs:
            return
        if self._read_started:
            jobs = self.unsubmitted(plan)
            self._read_started.difference_update(j.job_id for j in plan.jobs)
            if len(jobs) < len(plan.jobs):
                plan = StepPlan(step=plan.step, jobs=jobs)
            if not jobs:
                return
        for j in plan.jobs:
            if j.kind == JOB_PREFETCH:
                self._track_load(j.req_id, j.block_ids, j.groups)
        skip = {}
        if self._unwritten:  # a page whose save was not made is never sent to L3 (docs §8 R31)
            for job in plan.jobs:
                if job.kind == JOB_BACKUP:
                    idx = {i for i, (s, k) in enumerate(zip(job.slots, job.keys)) if self._unwritten.get(s) == k}
                    if idx:
                        skip[job.job_id] = idx
        self.l3.submit(plan.jobs, skip=skip)

    def poll(self, finished_req_ids: Sequence[str] = ()) -> set[str]:
        """Finish the request side of ended prefetches: copy their intact leading pages L2 -> L1, remember the
        blocks that failed (:meth:`take_failed_blocks`). Returns the ids of requests whose asynchronous load ended
        (vLLM: ``finished_recving``)."""
        if self._suspect and finished_req_ids:
            self._suspect.difference_update(finished_req_ids)
        if not self._orphan_finished and self.group_layers is None and not self.l3.has_prefetches():
            return set()  # no L3 load in flight nor one to report (most steps): nothing to copy or name
        orphans, self._orphan_finished = self._orphan_finished, set()
        res = self.l3.poll(finished_req_ids)
        res.finished |= orphans
        oks, pages = [], 0
        for order in res.orders:
            # the pages that were already in L2 pass the same checks as a synchronous load's: a slot whose save was
            # not made (R31, R41) or that fails its checksum is never copied; the request recomputes from there
            good = self._verified_prefix(order)
            oks.append(order.head(good))
            pages += good
            res.failed_blocks.update(order.blocks_from(good))
        blocks = [b for o in oks for b in o.block_ids]
        if blocks:
            t0 = time.perf_counter()
            try:
                self._copy_all(kernels.load_pages, self._copies(oks))
                self.counters.async_load_pages += pages
            except Exception:  # never crash the engine: report the blocks, vLLM recomputes them
                logger.exception("tierkv: L2 -> L1 copy of %d prefetched pages failed", len(blocks))
                res.failed_blocks.update(blocks)
            self.counters.async_load_seconds += time.perf_counter() - t0
        if res.failed_blocks:
            self._failed_blocks.update(res.failed_blocks)
            self.counters.failed_load_blocks += len(res.failed_blocks)
        if self.group_layers is None:
            return res.finished
        return self._end_hybrid_loads(res.finished)

    def _end_hybrid_loads(self, finished: set[str]) -> set[str]:
        """Hybrid models: ``finished`` plus the requests whose L2 load ran since the last poll (every load is
        asynchronous); of those, the ones with a failed block or a load that could not be ordered go to
        :meth:`take_failed_requests`. Failed blocks of loads still in flight are kept for their own poll."""
        finished = set(finished) | self._loaded_reqs
        self._loaded_reqs = set()
        bad, self._failed_blocks = self._failed_blocks, set()
        for rid in finished:
            blocks = self._load_blocks.pop(rid, set())
            if rid in self._failed_reqs or not bad.isdisjoint(blocks):
                self._failed_recving.add(rid)
            self._failed_reqs.discard(rid)
        pending = set().union(*self._load_blocks.values()) if self._load_blocks else set()
        self._failed_blocks = bad & pending
        return finished

    def take_failed_requests(self) -> set[str]:
        """Hybrid models: requests named ended by :meth:`poll` whose load failed (vLLM's ``failed_recving``: it
        recomputes them), reported once; always empty for one KV cache group (failed blocks are reported)."""
        out, self._failed_recving = self._failed_recving, set()
        return out

    def has_reports(self) -> bool:
        """Whether a job report waits for :meth:`take_reports`: a job ended, and the I/O thread that ended it moved
        this worker's counters."""
        return bool(self._orphan_reports) or self.l3.has_reports()

    def take_reports(self) -> list[JobReport]:
        out, self._orphan_reports = self._orphan_reports, []
        out.extend(self.l3.take_reports())
        if self._sync_served:
            for r in out:
                served = self._sync_served.pop(r.job_id, None)
                if served is not None:
                    r.served = served
        return out

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
