"""Prefetch seam of the controller (L3 -> L2 -> L1).

:meth:`Prefetch.start_prefetch` gives the L3-only pages staging slots (evicting if needed), locks the path, and orders
one job; the worker copies the leading run that arrived intact into the request's blocks and reports the rest as load
errors. The report publishes the fetched pages into the index (slot + L3) and frees the rest; a page that failed to
read is remembered as absent. A page being fetched is not fetched again: another request that needs it waits (lookup
answers None) and then loads it from L2, so one L3 read serves every waiting request. How long a load may take is
the :class:`~tierkv.connector.l3.load_policy.LoadPolicy`'s decision.
"""
from __future__ import annotations

from typing import Optional, Sequence

from tierkv.connector.core.plan import JOB_PREFETCH, Job, JobReport
from tierkv.connector.core.radix_index import NO_SLOT
from tierkv.connector.l3.jobs import _JobState



class Prefetch:
    """Mixin of :class:`~tierkv.connector.l3.controller.Controller`: staging, ordering and ending of L3 loads, and
    the request side of a load (open until the workers name it ended)."""

    def fetch_state(self, keys: Sequence[bytes], req_id: str) -> tuple[int, bool]:
        """``(i, wait)``: ``keys[i]`` is the first key a running prefetch is fetching (``len(keys)`` if none), and
        whether ``req_id`` should wait for that fetch (it belongs to another request and is within its deadline).
        A request never waits for its own earlier fetch (vLLM asks again after the worker released it at its
        deadline) nor for one past its deadline: those pages are simply not offered. "Its deadline" is the job's
        first one (``deadline_s`` from the order): the worker may move it later as pages arrive
        (``deadline_credit_s``), but the scheduler does not see that progress, so a request sharing pages with a
        slow but progressing fetch stops waiting at the first deadline and recomputes them; waiting to the credited
        bound instead would let a stalled fetch hold the second request up to a whole recompute."""
        now = self.clock()
        for i, k in enumerate(keys):
            jid = self._fetching.get(k)
            if jid is None:
                continue
            st = self._jobs.get(jid)
            wait = (st is not None and st.job.req_id != req_id
                    and (st.job.deadline_s is None or now - st.t0 <= st.job.deadline_s))
            return i, wait
        return len(keys), False

    def fetches_for(self, req_id: str, key: bytes) -> bool:
        """Whether the running prefetch of request ``req_id`` reads page ``key`` into a staging slot (published by
        the job's report)."""
        jid = self._fetching.get(key)
        return jid is not None and self._req_prefetch.get(req_id) == jid

    def wait_for_room(self, req_id: str, fetch_pages: int) -> Optional[bool]:
        """Whether a request whose L3 hit needs ``fetch_pages`` staging slots can go ahead (True), should wait a
        step (None), or must give up its L3 hit (False, once it waited ``room_retry_steps`` lookups and
        ``room_wait_s`` seconds: on an engine that loops fast, lookups alone would run out in milliseconds). Under
        ``best_effort`` with a recompute estimate the wait for room is part of the same stall budget as the wait for
        the read (:meth:`deadline_s`): it gives up after one retry once that budget is spent, so a job stuck on a
        stalled store, which keeps its staging slots, does not make every later hit wait ``room_wait_s``."""
        if self.write_policy == "write_back" and self.allocator.num_free < fetch_pages:
            # an L2 copy L3 does not hold yet frees its slot only once its backup is acknowledged: start those
            # backups now (and free what L3 already holds), and go ahead once the slots are really free, so that the
            # prefetch gets a staging slot for every page instead of failing the ones it could not have
            self.make_room(fetch_pages)
            if self.allocator.num_free >= fetch_pages:
                self._room_waits.pop(req_id, None)
                return True
        elif self.room_possible(fetch_pages):
            self._room_waits.pop(req_id, None)
            return True
        now = self.clock()
        n, t0 = self._room_waits.get(req_id, (0, now))
        n += 1
        steps, wait_s = self.load_policy.room_wait_limits(fetch_pages)
        if n > steps and now - t0 >= wait_s:
            self._room_waits.pop(req_id, None)
            self.counters.l3_declined_room_pages += fetch_pages
            return False
        self._room_waits[req_id] = (n, t0)
        return None

    def start_prefetch(self, req_id: str, path: Sequence[bytes], first: int, last: int,
                       block_ids: Sequence[int], blocks_per_page: int = 1, skip_blocks: int = 0,
                       groups: Sequence[Sequence[int]] = (), sync: bool = False) -> Job:
        """Order the load (``sync``: before this step's forward, :meth:`load_sync`; else asynchronous) of pages
        ``path[first:last]`` into ``block_ids`` (``blocks_per_page`` per page, less the first ``skip_blocks`` blocks
        of page ``first``, which the engine holds in L1; ``groups``: the same blocks per KV cache group of a hybrid
        model, :class:`~tierkv.connector.core.plan.Job`). Pages without an L2 copy get staging slots (evicting others if
        needed); the path is locked until the report. Pages for which no slot could be had are in the job with slot
        -1: the worker reports them as load errors."""
        path = list(path[:last])
        m = self.index.match_prefix(path, require_l2=False, split=True, touch=True)
        if m.num_pages < last:
            raise RuntimeError(f"{req_id}: promised {last} pages but only {m.num_pages} are indexed")
        lock = self.index.lock(m.last_node)
        slots = list(m.host_slots[first:last])
        fetch = [s == NO_SLOT for s in slots]
        need = sum(fetch)
        if need:
            self.make_room(need)
            got = self.allocator.alloc(min(need, self.allocator.num_free)) or []
            it = iter(got)
            for i, f in enumerate(fetch):
                if f:
                    slots[i] = next(it, NO_SLOT)
            short = need - len(got)
            if short:
                self.counters.prefetch_no_room_pages += short
        credit = self.load_policy.deadline_credit_s() if need else 0.0
        job = Job(self._new_id(), JOB_PREFETCH, path[first:last], slots=slots, block_ids=list(block_ids),
                  fetch=fetch, req_id=req_id,
                  deadline_s=(self.load_policy.sync_deadline_s(need) if sync
                              else self.load_policy.deadline_s(need)),
                  deadline_credit_s=credit,
                  deadline_max_s=self.load_policy.deadline_max_s(sync, credit),
                  blocks_per_page=blocks_per_page, skip_blocks=skip_blocks, groups=[list(g) for g in groups],
                  sync=sync)
        for k, f, s in zip(job.keys, fetch, slots):
            if f and s != NO_SLOT:
                self._fetching[k] = job.job_id
        self._req_prefetch[req_id] = job.job_id
        if self._probe_req == req_id:
            self._probe_jobs.add(job.job_id)
            self._probe_req = None
        if not sync:  # a synchronous load's request side ends within its step: vLLM never delays its free
            self._recv_open.add(req_id)
        else:  # ... so its read, if it goes on past that step (its blocks failed at the deadline), is overdue
            self._released[job.job_id] = self._plans + 1
        self.lookup_stats.hit_l2([s for s, f in zip(slots, fetch) if not f])
        self.lookup_stats.hit_l3([k for k, f in zip(job.keys, fetch) if f])
        o = self._outcomes.get(req_id)
        if o is not None and o.job is None:
            o.job = job
        self._order(_JobState(job, lock=lock, path=path, idx=list(range(first, last))))
        self.counters.prefetch_jobs += 1
        self.counters.prefetch_sync_jobs += sync
        self.counters.prefetch_ordered_pages += need
        self.counters.l3_hit_tokens += (last - first) * self.page_size
        return job

    def _end_prefetch(self, st: _JobState, r: JobReport) -> None:
        job = st.job
        self._released.pop(job.job_id, None)
        if self._req_prefetch.get(job.req_id) == job.job_id:
            del self._req_prefetch[job.req_id]
        for k in job.keys:
            if self._fetching.get(k) == job.job_id:
                del self._fetching[k]
        fetched = [i for i, f in enumerate(job.fetch) if f and job.slots[i] != NO_SLOT]
        lead = r.leading  # only the leading run of intact pages is published; the rest is released
        ok_idx = [i for i in fetched if i < lead]
        bad_idx = [i for i in fetched if i >= lead]
        probe = job.job_id in self._probe_jobs
        self._probe_jobs.discard(job.job_id)
        if ok_idx and r.seconds > 0 and not r.cold:  # a cold read times the client's set-up, not the store
            if probe:  # a probe measures the store afresh: blended into the stale estimate it could not lift it
                self.fetch_s_per_page.value = None
            self.fetch_s_per_page.add(r.seconds / len(ok_idx))
        self.counters.prefetch_loaded_pages += len(ok_idx)
        # pages a rank never read (its request was released first) are not failures of the store
        self.counters.prefetch_failed_pages += max(0, sum(1 for i in bad_idx if not r.ok[i]) - r.cancelled)
        self.counters.prefetch_cancelled_pages += r.cancelled
        first = st.idx[0] if st.idx else 0
        # publish the pages that arrived intact (the path is locked, so every page is still indexed)
        if ok_idx:
            self.lookup_stats.stored_l2([job.slots[i] for i in ok_idx])
            ok_set = set(ok_idx)
            last = first + max(ok_idx) + 1
            slots = [job.slots[i] if i in ok_set else NO_SLOT for i in range(last - first)]
            _node, dups = self.index.insert(st.path[:last], slots,
                                            in_l3=[i in ok_set for i in range(last - first)], start=first)
            if dups:
                self.allocator.free(dups)
        if bad_idx:
            self.allocator.free([job.slots[i] for i in bad_idx])
        if st.lock is not None:
            self.index.unlock(st.lock)
        failed = [first + i for i in bad_idx if not r.ok[i]]
        if failed:
            # missing or corrupt in L3: not asked for again soon, and no longer taken for stored, so the recomputed
            # page is backed up again (it may already be back in L2, saved by the request that recomputed it)
            for i in bad_idx:
                if not r.ok[i]:
                    self._mark_absent(job.keys[i])
            freed = self.index.clear_l3(st.path, failed)
            if freed:
                self.allocator.free(freed)
            self.after_save(st.path, 0)  # write_through: back up again what is in L2 and no longer in L3
        o = self._outcomes.get(job.req_id)
        if o is not None and o.job is not None and o.job.job_id == job.job_id:
            o.ok, o.cancelled = list(r.ok), r.cancelled
            if job.sync:  # its request side ended before the step's forward: what every rank copied into L1
                o.served = min(r.served or 0, job.num_pages)
            self._resolve(job.req_id)

    def staging_slots(self) -> list[int]:
        """Slots held by running prefetches for pages not yet published into the index."""
        return [s for st in self._jobs.values() if st.job.kind == JOB_PREFETCH
                for s, f in zip(st.job.slots, st.job.fetch) if f and s != NO_SLOT]

    def request_side_open(self, req_id: str) -> bool:
        """Whether the workers have not yet named ``req_id``'s load as ended (vLLM's ``finished_recving``). Only
        then must the engine keep the request's blocks when it finishes: once the load was named ended the workers
        never touch its blocks again (a deadline release copies nothing later), and they will not name it a second
        time, so a delayed free would never end. The I/O side (the job, until its report) pins only L2 staging
        slots, which its report frees."""
        return req_id in self._recv_open

    def on_finished_recving(self, req_ids, invalid_block_ids=(), failed_req_ids=()) -> None:
        """The requests the workers named as having ended their load in a step (every rank agreed), with the blocks
        whose load failed in that step (vLLM's ``invalid_block_ids``, delivered with the same output) and the
        requests whose load failed as a whole (vLLM's ``failed_recving``: a model of several KV cache groups, whose
        failed loads cannot be named by block; vLLM recomputes such a request from its first token)."""
        self._recv_open.difference_update(req_ids)
        for rid in req_ids:
            jid = self._req_prefetch.get(rid)
            if jid is not None:  # released while its read goes on (the job reports separately)
                self._released[jid] = self._plans
        bad = set(invalid_block_ids or ())
        failed = set(failed_req_ids or ())
        for rid in req_ids:
            o = self._outcomes.get(rid)
            if o is not None and o.job is not None and o.served is None:
                if rid in failed:
                    o.served, o.request_failed = 0, True
                else:
                    o.served = next((o.job.page_of_block(i) for i, b in enumerate(o.job.block_ids) if b in bad),
                                    o.job.num_pages)
                self._resolve(rid)

    def forget_request(self, req_id: str) -> None:
        self._room_waits.pop(req_id, None)

    def end_request(self, req_id: str) -> bool:
        """``req_id`` finished (or was aborted): returns whether the engine must keep its blocks until the workers
        name its load as ended (see :meth:`request_side_open`)."""
        self.forget_request(req_id)
        o = self._outcomes.get(req_id)
        # ended before its load did: nothing reached its blocks. A synchronous load ended within its step; its job's
        # report (which may come later, if the read outlived the deadline) says what was served
        if o is not None and o.served is None and not (o.job is not None and o.job.sync):
            del self._outcomes[req_id]
            self.lookup_stats.waiting -= o.tokens
            self.lookup_stats.add("aborted", o.tokens)
        open_ = req_id in self._recv_open
        if open_ and req_id not in self._req_prefetch:  # cannot stay open without a job: never delay for nothing
            self._recv_open.discard(req_id)
            return False
        return open_
