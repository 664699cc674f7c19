"""TierKVConnector built in-process from vLLM's own config objects (``vllm_parts``): the start-up checks, one test
per config key whose effect nothing else exercised, and layer-wise load failures through the worker hooks."""
import logging
import sys

import pytest
import torch

from tests.helpers.fake_engine import inject_copy_fault
from tierkv.connector.core.config import ConfigError, ControllerConfig
from tierkv.connector.core.page_hash import page_keys, request_root
from tierkv.connector.core.plan import PageOrder
from tierkv.connector.vllm.connector import ConnectorPlan
from tests.helpers.vllm_parts import (BLOCK, NUM_LAYERS, SCHEDULER, WORKER, TierkvLoggerState, connector, run_step,
                        vllm_config, worker_connector, write_model)

PAGE_BYTES = NUM_LAYERS * 2 * BLOCK * 2 * 8 * 2   # layers x H x N x 2D x bf16


@pytest.fixture
def model(tmp_path, monkeypatch, caplog):
    """A model directory; the test's own host-memory ledger; the tierkv logger recorded by caplog and restored."""
    monkeypatch.setenv("TIERKV_LEDGER_DIR", str(tmp_path))
    state = TierkvLoggerState()
    tk = logging.getLogger("tierkv")  # recorded at the tierkv logger itself: the connector may turn propagation off
    tk.addHandler(caplog.handler)
    tk.propagate = False
    yield write_model(tmp_path / "model")
    state.restore()


def tierkv_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("tierkv") and r.levelno == logging.WARNING]




# ------------------------------------------------------------------ layer-wise load failure through the hooks
@pytest.mark.parametrize("k", range(NUM_LAYERS))
def test_layerwise_copy_failure_reaches_vllm_as_load_errors(model, monkeypatch, k):
    c, l1 = worker_connector(model, {"host_pool.num_pages": 8, "layerwise_load": True, "verify_checksums": False})
    g = torch.Generator().manual_seed(k)
    for t in l1.values():  # the "forward" computed blocks 3 and 4
        t[3:5].copy_(torch.randn(2, *t.shape[1:], generator=g).to(torch.bfloat16))
    assert run_step(c, ConnectorPlan(step=1, saves=[PageOrder("a", [3, 4], [1, 2], [])])) == set()
    inject_copy_fault(monkeypatch, k)
    assert run_step(c, ConnectorPlan(step=2, loads=[PageOrder("b", [6, 7], [1, 2], [])])) == {6, 7}
    assert c.get_block_ids_with_load_errors() == set()  # reported once
    for li, t in enumerate(l1.values()):  # layers before k arrived, the others not
        assert torch.equal(t[6:8], t[3:5]) == (li < k), li
    assert c._worker.counters.failed_load_blocks == 2
    monkeypatch.undo()
    assert run_step(c, ConnectorPlan(step=3, loads=[PageOrder("c", [9, 10], [1, 2], [])])) == set()
    assert all(torch.equal(t[9:11], t[3:5]) for t in l1.values())


# ------------------------------------------------------------------ start-up errors
def test_page_size_not_whole_engine_blocks_stops_start_up(model):
    for role in (SCHEDULER, WORKER):
        for bad in (16, 48):
            with pytest.raises(ConfigError) as e:
                connector(model, role, {"page_size": bad})
            assert str(e.value) == (f"bad value {bad} for 'page_size': a page is k whole engine blocks of 32 tokens; "
                                    "allowed: 32, 64, 128, ... (k x 32, k an integer >= 1), or null for one block")
    assert connector(model, SCHEDULER, {"page_size": BLOCK, "host_pool.num_pages": 4}).page_size == BLOCK
    s = connector(model, SCHEDULER, {"page_size": 2 * BLOCK, "host_pool.num_pages": 4})
    assert s._sched.blocks_per_page == 2 and s.page_bytes == 2 * PAGE_BYTES and s.namespace.page_size == 2 * BLOCK


def test_pages_of_two_blocks_through_the_worker_hooks(model):
    """page_size = 2 blocks: the worker's L2 holds 4 pages of 2 block rows each; a save names 2 blocks per slot and a
    load whose first block is already in L1 (``skip_blocks``) copies only the blocks after it."""
    c, l1 = worker_connector(model, {"page_size": 2 * BLOCK, "host_pool.num_pages": 4})
    host = c._worker.host
    assert host.num_slots == 4 and host.page_bytes == 2 * PAGE_BYTES and host.block_pool.num_slots == 8
    g = torch.Generator().manual_seed(3)
    for t in l1.values():  # the "forward" computed blocks 3 to 6
        t[3:7].copy_(torch.randn(4, *t.shape[1:], generator=g).to(torch.bfloat16))
    assert run_step(c, ConnectorPlan(step=1, saves=[PageOrder("a", [3, 4, 5, 6], [2, 0], [], 2)])) == set()
    rows = host.block_pool.layer_view()  # [L, block rows, bytes]: slot 2 = rows 4, 5; slot 0 = rows 0, 1
    for li, t in enumerate(l1.values()):
        for row, b in ((4, 3), (5, 4), (0, 5), (1, 6)):
            assert torch.equal(rows[li, row], t[b].contiguous().view(torch.uint8).reshape(-1)), (li, row)
    before = [t[8].clone() for t in l1.values()]
    assert run_step(c, ConnectorPlan(step=2, loads=[PageOrder("b", [9, 10, 11], [2, 0], [], 2, 1)])) == set()
    for t, b8 in zip(l1.values(), before):
        assert torch.equal(t[9:12], t[4:7]) and torch.equal(t[8], b8)  # block 8 (first of page 0, in L1) untouched
    assert c._worker.counters.load_pages == 2 and c._worker.counters.save_pages == 2


@pytest.mark.parametrize("groups", [2, 3])
def test_several_full_attention_groups_are_served_per_group(model, groups):
    """Several KV cache groups (vLLM's hybrid KV cache manager on, tierkv is ``SupportsHMA``): served in both roles,
    each page holding every layer, each group's blocks copied with its own layers (sliding-window groups and refused
    kinds: test_hybrid_geometry.py, pages: test_hma_pages.py)."""
    for role in (SCHEDULER, WORKER):
        c = connector(model, role, {"host_pool.num_pages": 4}, groups=groups)
        assert c.hybrid and c.ref_group == 0 and len(c.group_names) == groups
        assert sorted(c.layer_names) == sorted(n for g in c.group_names for n in g) and c.page_bytes == PAGE_BYTES


# ------------------------------------------------------------------ keys
@pytest.mark.parametrize("value", ["auto", "true", "false"])
def test_pin_memory(model, caplog, value):
    """Pinned only when asked for ("true") or, with "auto", for CUDA KV tensors; "true" without CUDA is pageable
    memory and one warning (the L1 tensors here are CPU tensors, so "auto" never pins)."""
    c, _l1 = worker_connector(model, {"host_pool.num_pages": 4, "host_pool.pin_memory": value})
    cuda = torch.cuda.is_available()
    assert c._worker.host.pinned is (value == "true" and cuda)
    assert c._worker.host.buffer.is_pinned() is (value == "true" and cuda)
    pin_warnings = [w for w in tierkv_warnings(caplog) if "pin_memory" in w]
    assert pin_warnings == (["HostPool: pin_memory requested but CUDA is not available; using pageable memory"]
                            if value == "true" and not cuda else [])


def test_model_id_sets_the_namespace(model):
    """Pages are keyed under the model identity: another model_id gives other keys for the same tokens, so pages
    of one model are never matched by another; null = the engine's model path and revision."""
    T = list(range(1, 3 * BLOCK + 2))
    conns = {mid: connector(model, SCHEDULER, {"model_id": mid, "host_pool.num_pages": 8})
             for mid in ("team-a/llama", "team-b/llama", None)}
    assert conns["team-a/llama"].namespace.model_id == "team-a/llama"
    assert conns[None].namespace.model_id == f"{model}@"
    assert len({c.namespace.digest() for c in conns.values()}) == 3
    keys = {mid: page_keys(request_root(c._sched.ns_digest), T, BLOCK) for mid, c in conns.items()}
    assert all(len(k) == 3 for k in keys.values()) and len({k for ks in keys.values() for k in ks}) == 9
    # model A caches the prompt; model B's lookup of the same tokens finds nothing
    a = conns["team-a/llama"]._sched
    a.add_request("r", T)
    assert a.lookup("r", 0) == 0
    a.schedule_saves("r", len(T), [1, 2, 3, 4])
    assert len(a.build_plan().saves[0].block_ids) == 3
    a.on_finished("r")
    again = connector(model, SCHEDULER, {"model_id": "team-a/llama", "host_pool.num_pages": 8})
    assert again.namespace.digest() == conns["team-a/llama"].namespace.digest()
    assert a.index.match_prefix(keys["team-a/llama"]).num_pages == 3
    assert a.index.match_prefix(keys["team-b/llama"]).num_pages == 0
    assert a.index.match_prefix(keys[None]).num_pages == 0


@pytest.mark.parametrize("level", ["debug", "info", "warning", "error"])
def test_log_level_sets_the_tierkv_logger_level(model, level):
    connector(model, SCHEDULER, {"log_level": level, "host_pool.num_pages": 4})
    want = getattr(logging, level.upper())
    assert logging.getLogger("tierkv").level == want
    assert logging.getLogger("tierkv.worker").getEffectiveLevel() == want
    assert logging.getLogger("tierkv.worker").isEnabledFor(logging.WARNING) is (want <= logging.WARNING)


def test_eviction_policy_reaches_the_index(model):
    for policy in ("lru", "lfu"):
        assert connector(model, SCHEDULER, {"eviction_policy": policy, "host_pool.num_pages": 4})._sched.index.policy \
            == policy


def test_reset_cache_empties_l2_and_the_index(model):
    c = connector(model, SCHEDULER, {"host_pool.num_pages": 8})
    T = list(range(1, 3 * BLOCK + 2))
    s = c._sched
    s.add_request("r", T)
    s.lookup("r", 0)
    s.schedule_saves("r", len(T), [1, 2, 3, 4])
    s.build_plan()
    s.on_finished("r")
    s.add_request("q", T)
    assert s.lookup("q", 0) == 3 * BLOCK and s.allocator.num_free == 5
    assert c.reset_cache() is True
    assert s.lookup("q", 0) == 0 and s.index.total_pages == 0 and s.allocator.num_free == 8
    w, _l1 = worker_connector(model, {"host_pool.num_pages": 8})
    assert w.reset_cache() is None  # the worker side holds no index


def test_size_gb_below_one_page_stops_start_up(model):
    for role in (SCHEDULER, WORKER):
        with pytest.raises(ConfigError) as e:
            connector(model, role, {"host_pool.size_gb": 1e-6})
        assert str(e.value) == (f"bad value 1e-06 for 'host_pool.size_gb': 1073 bytes hold no page of {PAGE_BYTES} "
                                f"bytes (3 layers x 32 tokens); give at least 5.72e-06 GiB, or host_pool.num_pages")


def test_automatic_l2_of_zero_pages_serves_without_l2(model, caplog):
    """An automatic size on a host with no room (here host_pool.reserve_gb above the host's memory): start-up goes
    on without L2, saying so with the keys; every lookup answers 0, nothing is saved, the worker hooks are no-ops."""
    cfg = vllm_config(model, {"host_pool.reserve_gb": 1e9})
    w, _l1 = worker_connector(model, config=cfg)          # vLLM builds the workers first; they reserve 0 bytes
    s = connector(model, SCHEDULER, config=cfg)           # the scheduler sizes its index from their reservation
    assert s.num_slots == 0 and s._sched.num_slots == 0 and w._worker is None
    T = list(range(1, 3 * BLOCK + 2))
    s._sched.add_request("r", T)
    assert s._sched.lookup("r", 0) == 0
    s._sched.on_alloc("r", [1, 2, 3, 4], 0)
    s._sched.schedule_saves("r", len(T), [1, 2, 3, 4])
    assert s._sched.build_plan().saves == [] and s._sched.counters.save_pages == 0
    assert s.reset_cache() is True
    s._sched.on_finished("r")
    s._sched.check_invariants()
    assert run_step(w, ConnectorPlan(step=1)) == set()
    assert w.get_finished(set()) == (None, None) and w.build_connector_worker_meta() is None
    assert [m for m in tierkv_warnings(caplog) if "page" in m] == [
        "tierkv worker: host pool of 0 pages (host_pool.auto_fraction/auto_max_gb/reserve_gb); caching disabled",
        f"tierkv: host pool of 0 bytes (host_pool.auto_fraction/auto_max_gb/reserve_gb) holds no page of {PAGE_BYTES} "
        "bytes; serving without L2"]


def test_a_pool_the_operator_sized_is_mapped_at_start_up_and_an_automatic_one_is_not(model):
    """``host_pool.num_pages`` / ``size_gb``: the worker's pool is prefaulted (HostPool ``prefault``); the automatic
    size (a share of the host's memory) is left to be mapped as L2 fills."""
    sized, _ = worker_connector(model, {"host_pool.num_pages": 8})
    auto, _ = worker_connector(model, {})
    try:
        assert sized._worker.host.prefaulted is True
        assert auto._worker.host.prefaulted is False
    finally:
        sized.shutdown()
        auto.shutdown()


# ------------------------------------------------------------------ controller keys reach what reads them
NON_DEFAULT = {"write_policy": "write_back", "write_through_threshold": 5, "prefetch_policy": "timeout",
               "prefetch_timeout_base_s": 0.75, "prefetch_timeout_per_page_s": 0.01, "exists_wait_s": 0.25,
               "negative_ttl_s": 3.5, "room_retry_steps": 3, "room_wait_s": 0.25, "probe_interval_s": 2.5,
               "sync_load_max_s": 0.05, "exists_in_scheduler": False, "max_index_pages": 1000, "batch_pages": 8, "read_threads": 3,
               "max_backup_pages": 100, "shutdown_drain_s": 0.5, "gil_switch_interval_s": 0.02,
               "writer_priority": "idle", "write_only_warn_bytes": 5, "backup_pause": "prefill"}
# where each key ends up: the scheduler's Controller, the worker's L3IO or the worker's process (the GIL switch interval
# while the worker runs; shutdown_drain_s: also the worker's shutdown, checked below)
READ_BY = {"write_policy": ("ctl", "write_policy"), "write_through_threshold": ("ctl", "threshold"),
           "prefetch_policy": ("ctl", "prefetch_policy"), "prefetch_timeout_base_s": ("ctl", "timeout_base_s"),
           "prefetch_timeout_per_page_s": ("ctl", "timeout_per_page_s"), "exists_wait_s": ("ctl", "exists_wait_s"),
           "negative_ttl_s": ("ctl", "negative_ttl_s"), "room_retry_steps": ("ctl", "room_retry_steps"),
           "room_wait_s": ("ctl", "room_wait_s"), "probe_interval_s": ("ctl", "probe_interval_s"),
           "sync_load_max_s": ("ctl", "sync_load_max_s"),
           "exists_in_scheduler": ("ctl", "exists_in_scheduler"),
           "max_index_pages": ("ctl", "max_index_pages"), "batch_pages": ("l3io", "batch_pages"),
           "read_threads": ("l3io", "read_threads"),
           "max_backup_pages": ("l3io", "max_backup_pages"), "shutdown_drain_s": ("ctl", "shutdown_drain_s"),
           "gil_switch_interval_s": ("process", "switchinterval"), "writer_priority": ("l3io", "writer_priority"),
           "write_only_warn_bytes": ("tier_bytes", "warn_bytes"), "backup_pause": ("step", "backup_pause")}


def test_every_controller_key_reaches_what_reads_it(model, tmp_path, monkeypatch):
    assert set(NON_DEFAULT) == set(READ_BY) == set(ControllerConfig.model_fields)
    defaults = ControllerConfig()
    assert all(getattr(defaults, k) != v for k, v in NON_DEFAULT.items())
    extra = {"host_pool.num_pages": 8, "l3.backend": "file", "l3.file.root": str(tmp_path / "l3"),
             "l3.admission": "reused_in_l2", "l3.admission_window_pages": 77,
             **{f"controller.{k}": v for k, v in NON_DEFAULT.items()}}
    s = connector(model, SCHEDULER, extra)
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)    # the interpreter's default, whatever an earlier test in this process left
    try:
        w, _l1 = worker_connector(model, extra)
        running = {"switchinterval": sys.getswitchinterval()}
        ctl, l3io = s._sched.ctl, w._worker.l3
        assert ctl is not None and l3io is not None
        drains = []
        real_close = l3io.close
        monkeypatch.setattr(l3io, "close", lambda drain_s=10.0: drains.append(drain_s) or real_close(drain_s))
        w.shutdown()
        assert sys.getswitchinterval() == pytest.approx(0.005)   # given back at shutdown
    finally:
        sys.setswitchinterval(before)
    for key, (where, attr) in READ_BY.items():
        got = {"ctl": lambda: getattr(ctl, attr), "l3io": lambda: getattr(l3io, attr), "process": lambda: running[attr],
               "tier_bytes": lambda: getattr(s._sched.tier_bytes, attr), "step": lambda: getattr(w._step, attr)}
        want = NON_DEFAULT[key]
        assert got[where]() == (pytest.approx(want) if where == "process" else want), key
    assert drains == [0.5]
    assert (ctl.admission.mode, ctl.admission.window_pages) == ("reused_in_l2", 77)
