"""The plan protocol between the scheduler side and the worker side.

Plain data only (ints and bytes: small and cheap to pickle), in two directions:

- scheduler -> worker: one :class:`StepPlan` per engine step, built by
  :class:`tierkv.connector.core.scheduler.CacheScheduler` and pickled to every worker rank (vLLM sends it inside
  ``SchedulerOutput``). ``loads`` (L2 -> L1) and ``saves`` (L1 -> L2) finish within the step; ``jobs`` (:class:`Job`:
  backup, prefetch, exists) are L3 transfers that outlive it, and what they name stays pinned until their report.
- worker -> scheduler: one :class:`JobReport` per job and rank, sent back with the step's output. The ranks' reports
  of a job merge page by page with AND (:func:`merge_reports`: each rank holds its own shard of each page); a report
  is the only thing that frees a pinned slot or publishes a fetched page into the index.

Hybrid models (several KV cache groups): orders carry ``groups``, one block id list per group shaped like
``block_ids`` (a full-attention group's); :func:`live_blocks` decides what is stored and what a hit copies.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

JOB_BACKUP = "backup"
JOB_PREFETCH = "prefetch"
JOB_EXISTS = "exists"
JOB_KINDS = (JOB_BACKUP, JOB_PREFETCH, JOB_EXISTS)


#: vLLM's null block: a sliding-window group's table entry for a block before the window (freed, or never allocated for
#: a hit); it holds no KV of the request and is never read or written by tierkv
NULL_BLOCK = 0


def live_blocks(block_ids: Sequence[int]) -> list[int]:
    """The positions in ``block_ids`` (one KV cache group's engine block ids) whose block is live, i.e. not vLLM's
    null block (:data:`NULL_BLOCK`). This is tierkv's one rule for hybrid models:

    - save: a page is stored only when all of its blocks in every group are live at the step that orders its save
      (:meth:`tierkv.connector.core.scheduler.CacheScheduler.schedule_saves`); a page is ordered in the step that computes
      it (or fills it), when vLLM still holds every group's block of it, so every page of a prompt is stored with
      every layer, sliding-window layers included (a hit may end at any page, and the window before it is then
      needed). A page whose sliding-window block is already null (an engine prefix-cache hit older than the window)
      is not stored, nor any later page of that request that is not in the index yet.
    - load: a hit copies, per group, exactly the live blocks vLLM allocated for it (the worker,
      :func:`group_copies`): vLLM gives a sliding-window group null blocks before the window of the hit's end, so
      only the window's blocks of those layers are copied; full-attention groups copy every page.

    So a hit never needs a block that was not stored (every stored page holds every layer), and block 0 is never
    touched."""
    return [i for i, b in enumerate(block_ids) if b != NULL_BLOCK]


def group_copies(groups: Sequence[Sequence[int]], slots: Sequence[int]) -> list[tuple[int, list[int], list[int]]]:
    """``(group, block ids, L2 block slots)`` per KV cache group with the null blocks left out (:func:`live_blocks`);
    ``groups[g][i]`` pairs with ``slots[i]``. Groups with no live block are left out.

    Raises:
        ValueError: a group whose length differs from ``slots``."""
    out = []
    for g, ids in enumerate(groups):
        if len(ids) != len(slots):
            raise ValueError(f"group {g}: {len(ids)} block ids for {len(slots)} block slots")
        keep = live_blocks(ids)
        if keep:
            out.append((g, [int(ids[i]) for i in keep], [int(slots[i]) for i in keep]))
    return out


def block_slots(slots: list[int], num_blocks: int, blocks_per_page: int, skip_blocks: int) -> list[int]:
    """The L2 block slots (``page slot * blocks_per_page + block of the page``, the host pool's block rows) of
    ``num_blocks`` engine blocks that start ``skip_blocks`` blocks into the page ``slots[0]`` and run on through the
    pages of ``slots`` in order."""
    k = blocks_per_page
    if k == 1 and skip_blocks == 0:
        return list(slots[:num_blocks])
    return [slots[(skip_blocks + i) // k] * k + (skip_blocks + i) % k for i in range(num_blocks)]


def _check_groups(what: str, groups, n_blocks: int) -> None:
    for g, ids in enumerate(groups):
        if len(ids) != n_blocks:
            raise ValueError(f"{what}: group {g} has {len(ids)} block ids, want {n_blocks} (one per block)")


def _check_blocks(what: str, n_blocks: int, n_pages: int, k: int, skip: int) -> None:
    if not isinstance(k, int) or k < 1 or not 0 <= skip < k:
        raise ValueError(f"{what}: blocks_per_page must be an int >= 1 and skip_blocks in [0, blocks_per_page), got "
                         f"{k!r} and {skip!r}")
    want = max(0, n_pages * k - skip)
    if n_blocks != want:
        raise ValueError(f"{what}: {n_blocks} blocks for {n_pages} pages of {k} blocks less {skip} skipped "
                         f"(want {want})")


@dataclass
class PageOrder:
    """Move pages between L1 blocks and L2 slots for one request, within the step.

    A page spans ``blocks_per_page`` consecutive engine blocks of the request (``page_size`` =
    ``blocks_per_page`` x the engine block size). ``slots[i]`` is page i's L2 host slot and ``keys[i]`` its 16-byte
    page key (checksum verification, L3 backup). ``block_ids`` are the engine block ids, in order, of those pages
    less the first ``skip_blocks`` blocks of the first page (a load whose first page starts in blocks the engine
    already holds in L1): ``len(block_ids) == blocks_per_page * len(slots) - skip_blocks``. With one block per page
    (the default) ``block_ids[i]`` <-> ``slots[i]``. ``groups`` (hybrid models, see the module docstring): one list
    per KV cache group shaped like ``block_ids``, ``block_ids`` being a full-attention group's; empty for one group.

    Raises:
        ValueError: ``block_ids`` (or a group) of another length, ``blocks_per_page`` < 1 or ``skip_blocks`` outside
            ``[0, blocks_per_page)``.
    """

    req_id: str
    block_ids: list[int]
    slots: list[int]
    keys: list[bytes] = field(default_factory=list)
    blocks_per_page: int = 1
    skip_blocks: int = 0
    groups: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_blocks(f"order for {self.req_id}", len(self.block_ids), len(self.slots), self.blocks_per_page,
                      self.skip_blocks if self.slots else 0)
        _check_groups(f"order for {self.req_id}", self.groups, len(self.block_ids))

    def block_slots(self) -> list[int]:
        """One L2 block slot per entry of ``block_ids`` (:func:`block_slots`): what the kernels copy from or to."""
        return block_slots(self.slots, len(self.block_ids), self.blocks_per_page, self.skip_blocks)

    def head(self, n: int) -> "PageOrder":
        """The order of its first ``n`` pages (their blocks, slots and keys)."""
        k, skip = self.blocks_per_page, (self.skip_blocks if n > 0 else 0)
        nb = max(0, n * k - self.skip_blocks)
        return PageOrder(self.req_id, list(self.block_ids[:nb]), list(self.slots[:n]), list(self.keys[:n]), k, skip,
                         [list(g[:nb]) for g in self.groups])

    def blocks_from(self, n: int) -> list[int]:
        """The engine blocks of pages ``n`` and after."""
        return list(self.block_ids[max(0, n * self.blocks_per_page - self.skip_blocks):])


@dataclass
class Job:
    """One L3 transfer. ``keys`` are 16-byte page keys of the scheduler's namespace; each worker rank maps them to
    its own L3 keys (the rank is part of the L3 namespace). Kinds:

    =============  =================================================================================================
    ``backup``     L2 -> L3: store the pages in ``slots`` under ``keys``; ``checksums`` (XXH3-64 taken when the page
                   entered L2) go into the record header, so the payload is not hashed again. ``ok[i]``: page i stored.
    ``prefetch``   L3 -> L2 -> L1 for request ``req_id``: pages with ``fetch[i]`` are read from L3 into ``slots[i]``,
                   the others are already in L2 at ``slots[i]``; then the leading run that is intact is copied into
                   ``block_ids``. ``ok[i]``: page i is in L2 (``slots[i]``) with verified bytes. ``deadline_s`` bounds
                   how long the request waits (seconds after the worker starts the job), moved later by
                   ``deadline_credit_s`` for each read page that extends the leading intact run (at most to
                   ``deadline_max_s``); pages that arrive later
                   still land in L2 and are reported, but the request recomputes them. ``sync``: the read feeds the
                   forward of the step that orders it (the worker waits for it before that forward, and copies its
                   leading run with the step's L2 -> L1 loads); otherwise the request waits asynchronously and is
                   named in ``finished_recving`` once its pages are in L1.
    ``exists``     L3 existence query of ``keys`` (a prefix run): ``ok`` is the leading run present.
    =============  =================================================================================================

    Raises:
        ValueError: unknown ``kind``, or per-page lists whose lengths differ from ``keys``.
    """

    job_id: int
    kind: str
    keys: list[bytes]
    slots: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    fetch: list[bool] = field(default_factory=list)
    req_id: Optional[str] = None
    deadline_s: Optional[float] = None
    #: a prefetch's deadline moves this many seconds later for each page it reads from L3 that extends its leading
    #: run of intact pages (``best_effort``: the estimated time to recompute one page); 0.0 = a fixed deadline
    deadline_credit_s: float = 0.0
    #: the latest the credit can move the deadline to, in seconds from the read's start; None = no cap (the credit is
    #: bounded anyway: at most ``deadline_s`` + ``deadline_credit_s`` x the pages to read)
    deadline_max_s: Optional[float] = None
    #: a prefetch's ``block_ids`` as in :class:`PageOrder`: ``blocks_per_page`` blocks per page, less the first
    #: ``skip_blocks`` of the first page (already in L1)
    blocks_per_page: int = 1
    skip_blocks: int = 0
    #: hybrid models: a prefetch's block ids per KV cache group, each shaped like ``block_ids`` (see PageOrder)
    groups: list[list[int]] = field(default_factory=list)
    #: a prefetch loaded synchronously, before the forward of the step whose plan carries it (see the kinds)
    sync: bool = False

    def __post_init__(self) -> None:
        if self.kind not in JOB_KINDS:
            raise ValueError(f"job {self.job_id}: unknown kind {self.kind!r}; allowed: {', '.join(JOB_KINDS)}")
        n = len(self.keys)
        for name in ("slots", "fetch"):
            v = getattr(self, name)
            if v and len(v) != n:
                raise ValueError(f"job {self.job_id}: {len(v)} {name} for {n} pages")
        if self.block_ids:
            _check_blocks(f"job {self.job_id}", len(self.block_ids), n, self.blocks_per_page, self.skip_blocks)
        _check_groups(f"job {self.job_id}", self.groups, len(self.block_ids))
        if self.kind == JOB_BACKUP and len(self.slots) != n:
            raise ValueError(f"backup job {self.job_id} needs one slot per page")
        if self.kind == JOB_PREFETCH and not (len(self.slots) == len(self.fetch) == n and (self.block_ids or n == 0)):
            raise ValueError(f"prefetch job {self.job_id} needs slots, block_ids and fetch for every page")

    @property
    def num_pages(self) -> int:
        return len(self.keys)

    def page_order(self) -> PageOrder:
        """A prefetch as a :class:`PageOrder` (its blocks, slots and keys); slice it with :meth:`PageOrder.head`."""
        return PageOrder(self.req_id or "", list(self.block_ids), list(self.slots), list(self.keys),
                         self.blocks_per_page, self.skip_blocks if self.keys else 0,
                         [list(g) for g in self.groups])

    def page_of_block(self, i: int) -> int:
        """The page (index into ``keys``) of ``block_ids[i]``."""
        return (self.skip_blocks + i) // self.blocks_per_page


@dataclass
class JobReport:
    """What one worker rank did with one job. ``ok[i]``: page i done (see the kinds); ``seconds``: wall time
    from the start of the job on that rank to its end; ``bytes``: payload bytes moved; ``cancelled``: pages of a
    prefetch never read because its request was released or aborted first (the last ``cancelled`` pages it was to
    read, all ``ok`` False); ``cold``: a prefetch that started before the rank's first prefetch read ended, so its
    ``seconds`` include the store client's set-up in this process (connections, first-touch allocations) and say
    nothing of the store's speed. ``served``: for a synchronous prefetch, the leading pages the rank copied into
    the request's blocks before the forward (at most ``leading``; pages that arrived later are in L2 but were
    recomputed); None for every other job. ``evicted``: for a backup, the page keys the rank's store evicted while
    it ran (or since its last backup), net of the pages the job stored after their eviction."""

    job_id: int
    kind: str
    ok: list[bool]
    rank: int = 0
    seconds: float = 0.0
    bytes: int = 0
    cancelled: int = 0
    cold: bool = False
    served: Optional[int] = None
    evicted: list[bytes] = field(default_factory=list)

    @property
    def leading(self) -> int:
        """Length of the leading run of done pages."""
        for i, v in enumerate(self.ok):
            if not v:
                return i
        return len(self.ok)


def merge_reports(reports: list[JobReport]) -> JobReport:
    """One report from every rank's report of the same job: a page is done only where every rank did it;
    ``seconds`` is the slowest rank's, ``bytes`` the sum, ``cold`` whether any rank's was, ``served`` the least
    (None unless every rank gave one), ``evicted`` every rank's (a page is whole in L3 only while every rank's
    shard is).

    Raises:
        ValueError: empty list, or reports of different jobs or page counts.
    """
    if not reports:
        raise ValueError("merge_reports: no report")
    first = reports[0]
    for r in reports[1:]:
        if r.job_id != first.job_id or len(r.ok) != len(first.ok):
            raise ValueError(f"merge_reports: job {r.job_id} ({len(r.ok)} pages) vs job {first.job_id} "
                             f"({len(first.ok)} pages)")
    ok = [all(col) for col in zip(*(r.ok for r in reports))] if first.ok else []
    return JobReport(first.job_id, first.kind, ok, rank=-1, seconds=max(r.seconds for r in reports),
                     bytes=sum(r.bytes for r in reports), cancelled=max(r.cancelled for r in reports),
                     cold=any(r.cold for r in reports),
                     served=None if any(r.served is None for r in reports) else min(r.served for r in reports),
                     evicted=list(dict.fromkeys(k for r in reports for k in r.evicted)))


@dataclass
class StepPlan:
    """Everything the scheduler side orders for one engine step. ``loads`` run before the forward (L2 -> L1),
    ``saves`` after it (L1 -> L2), both finished within the step; ``jobs`` start after the step's saves (a backup
    may read a slot saved in the same step) and are answered by :class:`JobReport` s in this or a later step."""

    step: int = 0
    loads: list[PageOrder] = field(default_factory=list)
    saves: list[PageOrder] = field(default_factory=list)
    jobs: list[Job] = field(default_factory=list)
    #: requests whose failed load of an earlier step the scheduler side has handled (vLLM rolled them back): the
    #: worker saves their pages again from this plan on (until then it saves none of them)
    recomputed: list[str] = field(default_factory=list)
    #: engine blocks of loads the scheduler side promised but could not order (an error caught at a hook): the
    #: workers report them as failed loads, so vLLM recomputes them
    failed_blocks: list[int] = field(default_factory=list)
    #: requests whose asynchronous (L3) load could not be ordered: the workers name them as ended (finished_recving)
    failed_requests: list[str] = field(default_factory=list)
    #: prompt tokens the engine computes in this step (the workers time the forward of steps with enough of them:
    #: the controller's recompute estimate)
    prefill_tokens: int = 0
    #: the workers hand their counter deltas to vLLM's metrics after this step (the scheduler side sets it about every
    #: ``STATS_EVERY_S`` of :mod:`tierkv.connector.vllm.connector`; False: they accumulate until a plan that says so)
    emit_stats: bool = True

    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.jobs or self.recomputed or self.failed_blocks
                    or self.failed_requests)
