"""How many engine steps an L3 hit waits, counted with vLLM's own scheduler.

vLLM 0.32's ``Scheduler`` (synchronous scheduling) or ``AsyncScheduler`` (``async_scheduling``, vLLM's default) runs
in-process with tierkv's scheduler-role connector, which vLLM builds itself (vLLM's CPU backend turns asynchronous
scheduling off, ``vllm/platforms/cpu.py``; other platforms run it by default); the worker-role connector runs each step's
hooks in the order vLLM's model runner calls them (``bind_connector_metadata``, ``start_load_kv``,
``wait_for_layer_load``, ``wait_for_save``, ``get_finished``, ``get_block_ids_with_load_errors``,
``build_connector_worker_meta``) on CPU KV tensors. The L3 is a real file store. The engine loop is vLLM's: with
synchronous scheduling a step's output is processed before the next schedule (``EngineCore.step``); with asynchronous
scheduling the next step is scheduled before the previous step's output is processed (``step_with_batch_queue``, a
batch queue of 2). The "forward" writes, into every block a step fills, a value determined by the request's tokens up
to that block's end and the layer, and outlasts every L3 read started before it.
"""
from __future__ import annotations

import random
import threading
import time
from collections import deque
from typing import Optional

import pytest
import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from tierkv.connector.core.plan import JOB_PREFETCH
from tests.helpers.vllm_parts import BLOCK, LAYER_NAMES, kv_cache_config, worker_connector, write_model

P = BLOCK          # a page is one block
DOC_PAGES = 8
NUM_BLOCKS = 64


def fill(tokens: list[int], end: int, layer: int) -> float:
    """The value the forward writes into the block ending at token ``end`` (an integer < 256: exact in bf16)."""
    return float((sum(tokens[:end]) * 31 + end + layer) % 251)


class Engine:
    """vLLM's scheduler + tierkv's two connector roles, stepped as vLLM's engine core steps them."""

    def __init__(self, tmp_path, async_scheduling: bool, extra_config: Optional[dict] = None):
        model = write_model(tmp_path / "model")
        extra = {"host_pool.num_pages": 64, "l3.backend": "file", "l3.file.root": str(tmp_path / "l3"),
                 **(extra_config or {})}
        kt = KVTransferConfig(kv_connector="TierKVConnector", kv_connector_module_path="tierkv.connector.vllm.connector",
                              kv_role="kv_both", kv_connector_extra_config=extra)
        cfg = VllmConfig(model_config=ModelConfig(model=model, skip_tokenizer_init=True, dtype="bfloat16",
                                                  max_model_len=1024),
                         cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
                         scheduler_config=SchedulerConfig(max_model_len=1024, is_encoder_decoder=False,
                                                          async_scheduling=async_scheduling),
                         kv_transfer_config=kt)
        cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
        self.async_scheduling = async_scheduling
        cls = AsyncScheduler if async_scheduling else Scheduler
        self.sched = cls(cfg, kv_cache_config(NUM_BLOCKS), StructuredOutputManager(cfg), block_size=BLOCK)
        self.conn = self.sched.connector
        self.w, self.caches = worker_connector(model, config=cfg, num_blocks=NUM_BLOCKS)
        self.tokens: dict[str, list[int]] = {}
        self.queue: deque = deque()
        self.step_no = 0
        self.first_scheduled: dict[str, int] = {}   # request -> the step that first computed tokens of it
        self.jobs: dict[int, list] = {}             # step -> the jobs its plan handed to the workers
        self.recv: dict[int, set] = {}              # step -> requests its get_finished named (finished_recving)
        self.forward = None                         # what the forward does besides writing KV (default: outlast reads)

    def add(self, rid: str, tokens: list[int], max_tokens: int = 4) -> None:
        self.tokens[rid] = tokens
        self.sched.add_request(Request(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), None))

    def _execute(self, so) -> ModelRunnerOutput:
        w, n = self.w, self.step_no
        w.bind_connector_metadata(so.kv_connector_metadata)
        sync_loads = bool(so.has_sync_kv_loads)
        if sync_loads:
            w.start_load_kv(None)
        for name in LAYER_NAMES:
            w.wait_for_layer_load(name)
        for nr in so.scheduled_new_reqs:   # the forward: the blocks this step fills
            toks, done = self.tokens[nr.req_id], nr.num_computed_tokens
            for b in range(done // BLOCK, (done + so.num_scheduled_tokens[nr.req_id]) // BLOCK):
                for layer, name in enumerate(LAYER_NAMES):
                    self.caches[name][nr.block_ids[0][b]].fill_(fill(toks, (b + 1) * BLOCK, layer))
        if self.forward is not None:
            self.forward(so)
        elif so.total_num_scheduled_tokens:
            assert w._worker.l3.wait_idle(30)   # the forward outlasts the reads handed over at bind
        if not sync_loads:
            w.start_load_kv(None)
        w.wait_for_save()
        _sending, recving = w.get_finished(so.finished_req_ids)
        self.recv[n] = set(recving or ())
        errors = w.get_block_ids_with_load_errors()
        meta = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        ids = list(so.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=[[7] for _ in ids],
                                 kv_connector_output=KVConnectorOutput(finished_recving=recving,
                                                                       invalid_block_ids=errors,
                                                                       kv_connector_worker_meta=meta))

    def step(self) -> None:
        """One call of vLLM's engine-core step function (``step`` or, with async scheduling, ``step_with_batch_queue``)."""
        so = self.sched.schedule()
        self.step_no += 1
        self.jobs[self.step_no] = list(so.kv_connector_metadata.jobs)
        for rid in [nr.req_id for nr in so.scheduled_new_reqs] + list(so.scheduled_cached_reqs.req_ids):
            self.first_scheduled.setdefault(rid, self.step_no)
        out = self._execute(so)
        if not self.async_scheduling:
            self.sched.update_from_output(so, out)
            return
        self.queue.appendleft((so, out))
        if len(self.queue) < 2 and (so.total_num_scheduled_tokens > 0 or self.sched.has_requests()):
            return      # the next schedule comes before this step's output
        self.sched.update_from_output(*self.queue.pop())

    def run(self, n: int) -> None:
        for _ in range(n):
            self.step()

    def loaded_ok(self, rid: str, pages: int) -> bool:
        blocks = self.sched.kv_cache_manager.get_block_ids(rid)[0]
        toks = self.tokens[rid]
        return all(torch.equal(self.caches[name][blocks[b]],
                               torch.full_like(self.caches[name][blocks[b]], fill(toks, (b + 1) * BLOCK, layer)))
                   for b in range(pages) for layer, name in enumerate(LAYER_NAMES))

    def close(self) -> None:
        self.w._worker.l3.wait_idle(30)
        self.conn.shutdown()
        self.w.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_an_l3_hit_is_loaded_in_its_lookup_step_and_waits_one_step_plus_vllms_pipeline(tmp_path, monkeypatch,
                                                                                       async_scheduling):
    """An L3 hit found in the lookup of step n (a restarted engine: existence answered in the scheduler) has its
    prefetch in step n's plan, handed to the readers before step n's forward, and is named finished by step n's
    ``get_finished``; the copy L2 -> L1 is part of that call, so nothing is left for a later plan. vLLM schedules it
    once it has processed step n's output: step n + 1 with synchronous scheduling (one step more than an L2 hit, the
    least an asynchronous load can cost), step n + 2 with asynchronous scheduling, whose step n + 1 was scheduled
    before step n's output existed. ``l3_hit_wait_steps`` counts the same. The pages arrive bit-identical."""
    monkeypatch.setenv("TIERKV_LEDGER_DIR", str(tmp_path))
    rng = random.Random(19)
    doc = [rng.randrange(1, 250) for _ in range(DOC_PAGES * P)]
    e = Engine(tmp_path, async_scheduling)
    e.add("a", doc + [1])
    e.run(4)
    e.close()
    assert e.conn._sched.stats()["ctl_backup_stored_pages"] == DOC_PAGES   # in L3 now

    e = Engine(tmp_path, async_scheduling)        # restart: empty L1, L2 and index; the file L3 keeps the pages
    e.add("busy", [rng.randrange(1, 250) for _ in range(2 * P + 5)], max_tokens=40)   # keeps forwards running
    e.run(3)
    n = e.step_no + 1
    e.add("h", doc + [2])
    e.step()
    assert [(j.kind, j.req_id, len(j.keys)) for j in e.jobs[n]] == [(JOB_PREFETCH, "h", DOC_PAGES)]  # plan of step n
    assert "h" in e.recv[n]                                            # named finished by step n's get_finished
    assert "h" not in e.first_scheduled
    e.run(3)
    extra = 2 if async_scheduling else 1
    assert e.first_scheduled["h"] == n + extra
    assert e.loaded_ok("h", DOC_PAGES)
    c = e.conn._sched.counters
    assert (c.l3_hits, c.l3_hit_wait_steps) == (1, extra)
    assert [j for s in range(n + 1, e.step_no + 1) for j in e.jobs[s] if j.kind == JOB_PREFETCH] == []

    m = e.step_no + 1
    e.add("l2", doc + [3])                        # the same pages, now in L2: loaded in the step that looks them up
    e.run(2)
    assert e.first_scheduled["l2"] == m and e.loaded_ok("l2", DOC_PAGES)
    s = e.conn._sched.stats()
    assert (s["l2_hit_tokens"], s["ctl_l3_hit_tokens"], s["ctl_lookups_deferred"]) == (DOC_PAGES * P,) * 2 + (0,)
    e.run(40)                                     # every request finishes; nothing stays locked or pinned
    assert not e.sched.requests and e.conn._sched.index.locked_pages == 0
    assert e.sched.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1
    e.close()


def compute(seconds: float) -> None:
    """The forward's compute: matrix products for ``seconds`` of wall time."""
    a = torch.ones(128, 128)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.mm(a, a).clamp_(max=1.0)


def test_a_read_that_ends_just_after_the_forward_is_named_finished_by_the_step_that_started_it(tmp_path, monkeypatch):
    """In the real engine under load the forward of a step is often a short decode and the read it overlaps ends a
    little after it: before, ``get_finished`` of that step did not see it, and the hit was scheduled two steps after
    its lookup (``l3_hit_wait_steps_2``). Now the step waits for a read it started at most as long as the step has
    lasted: a read held back by a slow store (fault: its ``batch_get`` waits until the forward's end) is named
    finished by its own step and the hit costs one step; a read that does not end within that wait (the store held
    until the next step's forward) ends the step anyway, and its load ends in the next step."""
    from tierkv.storage_backends.file.store import FileStore
    monkeypatch.setenv("TIERKV_LEDGER_DIR", str(tmp_path))
    gate = threading.Event()
    real_get = FileStore.batch_get

    def held_get(self, *a, **kw):   # the fault: reads wait for the gate
        assert gate.wait(30)
        return real_get(self, *a, **kw)

    monkeypatch.setattr(FileStore, "batch_get", held_get)
    rng = random.Random(20)
    docs = [[rng.randrange(1, 250) for _ in range(DOC_PAGES * P)] for _ in range(2)]
    e = Engine(tmp_path, False)
    e.add("a", docs[0] + [1])
    e.add("b", docs[1] + [1])
    e.run(4)
    e.close()
    # the held read makes L3 look slower than recomputing: a probe interval of 1 us keeps the next hit a hit, and
    # wait_complete releases no request at a deadline
    e = Engine(tmp_path, False, {"controller.probe_interval_s": 1e-6, "controller.prefetch_policy": "wait_complete"})
    e.add("busy", [rng.randrange(1, 250) for _ in range(2 * P + 5)], max_tokens=40)
    e.run(2)

    def forward_then_open(so):      # the read can only end after the forward
        # a forward of 0.6 s gives the read a quarter of that (STEP_READ_WAIT_FRACTION) to end after it: 0.2 s (a 50 ms
        # window) once ran out while the full suite loaded both cores
        compute(0.6)
        gate.set()

    e.forward = forward_then_open
    n = e.step_no + 1
    e.add("h", docs[0] + [2])
    e.step()
    assert "h" in e.recv[n]                          # named finished by the step that started its read
    e.run(2)
    assert e.first_scheduled["h"] == n + 1 and e.loaded_ok("h", DOC_PAGES)
    c, wc = e.conn._sched.counters, e.w._worker.counters
    assert (c.l3_hits, c.l3_hit_wait_steps, wc.read_waits, wc.read_wait_timeouts) == (1, 1, 1, 0)

    gate.clear()                                     # now the store holds the read past the step's end

    def forward_open_next(so):
        if e.step_no > n2:
            gate.set()
        compute(0.05)

    e.forward = forward_open_next
    n2 = e.step_no + 1
    e.add("h2", docs[1] + [2])
    t0 = time.perf_counter()
    e.step()
    assert "h2" not in e.recv[n2] and time.perf_counter() - t0 < 5
    assert (wc.read_waits, wc.read_wait_timeouts) == (2, 1)
    e.run(3)
    assert "h2" in e.recv[n2 + 1] and e.first_scheduled["h2"] == n2 + 2 and e.loaded_ok("h2", DOC_PAGES)
    e.forward = None
    e.run(40)
    assert not e.sched.requests and e.conn._sched.index.locked_pages == 0
    assert e.sched.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1
    e.close()


def test_the_end_of_step_wait_for_a_read_ends_at_the_reads_deadline(tmp_path, monkeypatch):
    """A stalled read (fault: ``batch_get`` held) with a deadline (policy ``timeout``, 0.05 s) is waited for at most
    until that deadline, however long the step lasted: the step is not held for a read its request stops waiting for.
    Then the request is released at its deadline (its blocks reported failed, recomputed) and nothing stays pinned."""
    from tests.helpers.fake_engine import FakeEngine, Req
    from tests.connector.l3.test_controller import file_store, write_to_l3
    from tierkv.storage_backends.file.store import FileStore
    doc = list(range(7, 7 + DOC_PAGES * P))
    write_to_l3(tmp_path, doc)
    gate = threading.Event()
    real_get = FileStore.batch_get

    def held_get(self, *a, **kw):   # the fault: reads wait for the gate
        assert gate.wait(30)
        return real_get(self, *a, **kw)

    monkeypatch.setattr(FileStore, "batch_get", held_get)
    e = FakeEngine(store=file_store(tmp_path), scheduler_exists=True,
                   controller={"prefetch_policy": "timeout", "prefetch_timeout_base_s": 0.05,
                               "prefetch_timeout_per_page_s": 0.0})
    req = Req("h", doc + [2])
    e.sched.add_request("h", req.tokens)
    ext = e.sched.lookup("h", 0)
    assert ext == DOC_PAGES * P and e.sched.lookup_is_async("h")
    req.blocks = [e.free_blocks.pop(0) for _ in range(DOC_PAGES + 1)]
    e.sched.on_alloc("h", req.blocks, ext)
    plan = e.sched.build_plan()
    e.worker.start_reads(plan)
    t0 = time.perf_counter()
    e.worker.wait_step_reads(10.0)                 # a step that lasted 10 s would allow 10 s
    waited = time.perf_counter() - t0
    wc = e.worker.counters
    assert (wc.read_waits, wc.read_wait_timeouts) == (1, 1) and waited < 2.0, waited
    assert e.worker.poll() == {"h"}                # released at its deadline: every block reported failed
    failed = e.worker.take_failed_blocks()
    assert failed == set(req.blocks[:DOC_PAGES])
    e.sched.on_finished_recving({"h"}, failed)     # what vLLM hands the scheduler side with that step's output
    e.sched.on_load_errors(failed)
    gate.set()
    e.running["h"] = req
    e.finish(req)
    e.settle()
    e.idle_check()
    e.close()


def test_the_time_inside_tierkvs_hooks_is_counted_per_role_and_per_step(tmp_path, monkeypatch):
    """``hook_seconds`` / ``hook_calls`` / ``hook_steps`` (both roles): every hook call that does work counted, one
    step per plan built (scheduler) and per plan bound (worker), the time within the wall time of the steps; what
    tierkv adds to an engine step is ``hook_seconds / hook_steps`` (benchmarks/README, serve_cpu). The per-layer
    ``wait_for_layer_load`` is timed only while a load is in flight (none here: a new prompt, nothing to load), and
    ``save_kv_layer`` never (it does nothing): timing them cost more than the calls."""
    monkeypatch.setenv("TIERKV_LEDGER_DIR", str(tmp_path))
    rng = random.Random(7)
    e = Engine(tmp_path, async_scheduling=False)
    e.add("a", [rng.randrange(1, 250) for _ in range(DOC_PAGES * P + 3)])
    t0 = time.perf_counter()
    e.run(5)
    wall = time.perf_counter() - t0
    sc, wc = e.conn._sched.counters, e.w._worker.counters
    e.close()
    assert sc.hook_steps == 5 and wc.hook_steps == 5
    # each step of Engine._execute calls 6 timed worker hooks; wait_for_layer_load (once per layer) had no load
    assert wc.hook_calls == 5 * 6
    assert sc.hook_calls > sc.hook_steps          # lookups, allocation, output and stats hooks besides the plans
    assert 0 < sc.hook_seconds < wall and 0 < wc.hook_seconds < wall


def test_the_layer_waits_are_timed_in_a_step_with_a_layerwise_load(tmp_path, monkeypatch):
    """With ``layerwise_load`` an L2 hit's copies run while the layers wait for them: in the step that loads it,
    every ``wait_for_layer_load`` is timed (one call more per layer than the 6 of every step); in the steps around
    it, none is."""
    monkeypatch.setenv("TIERKV_LEDGER_DIR", str(tmp_path))
    rng = random.Random(8)
    doc = [rng.randrange(1, 250) for _ in range(DOC_PAGES * P)]
    e = Engine(tmp_path, async_scheduling=False, extra_config={"layerwise_load": True})
    e.add("a", doc + [1])
    e.run(6)                                      # computed, finished, its pages in L2
    wc = e.w._worker.counters
    calls, steps = wc.hook_calls, wc.hook_steps
    e.add("b", doc + [2])                         # the same pages: an L2 hit, loaded layer by layer in its first step
    e.run(3)
    assert e.loaded_ok("b", DOC_PAGES) and wc.steps_with_loads == 1
    assert wc.hook_calls - calls == 6 * (wc.hook_steps - steps) + len(LAYER_NAMES)
    e.close()
