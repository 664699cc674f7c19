"""CacheWorker with ``layerwise=True``: the same bytes as the all-at-once load, one layer at a time, and a copy that
fails at one layer ends in failed blocks (vLLM recomputes them), never in an exception into vLLM's forward.

Real parts throughout: CPU KV tensors wrapped by the real :class:`DevicePool`, the real :class:`HostPool` in each
layout, the real kernels. The one stand-in is the copy fault: ``load_pages`` of one layer is made to raise, a fault
a real part cannot produce on demand (the copies of the other layers are the real kernel's).
"""
import logging
import threading

import pytest
import torch

from tierkv.connector.l2 import layer_loader

from tierkv.connector.l2 import worker as worker_mod
from tierkv.connector.l2.device_pool import DevicePool
from tierkv.connector.l2.host_pool import HostPool
from tierkv.connector.core.plan import PageOrder, StepPlan
from tierkv.connector.l2.worker import CacheWorker
from tierkv.storage_backends.common import RateLimitedLog

from tests.helpers.fake_engine import REAL_LOAD_PAGES, inject_copy_fault

LAYERS, BLOCKS, SLOTS, P, H, D = 4, 12, 10, 32, 2, 8
LAYOUTS = ("layer_first", "page_first", "page_first_direct")
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
SLOTS_OF_LOAD = [7, 2, 9, 4]
BLOCKS_OF_LOAD = [3, 5, 6, 10]


def make_pools(layout: str, seed: int = 0):
    """(L1 tensors by layer, DevicePool, HostPool) with every L2 slot full of seeded random bytes and L1 zero."""
    base = torch.zeros(LAYERS, BLOCKS, H, P, 2 * D, dtype=torch.bfloat16)
    l1 = {n: base[i] for i, n in enumerate(NAMES)}
    dev = DevicePool.from_vllm(l1, num_blocks=BLOCKS, block_size=P, kv_cache_layout="LBHNC", backend="CPU_ATTN")
    host = HostPool.for_device(dev, SLOTS, layout)
    g = torch.Generator().manual_seed(seed)
    for s in range(SLOTS):
        host.write_page(s, torch.randint(0, 256, (host.page_bytes,), generator=g, dtype=torch.uint8))
    return l1, dev, host


def load_plan() -> StepPlan:
    return StepPlan(step=1, loads=[PageOrder("r", BLOCKS_OF_LOAD[:2], SLOTS_OF_LOAD[:2], []),
                                   PageOrder("q", BLOCKS_OF_LOAD[2:], SLOTS_OF_LOAD[2:], [])])


def l1_bytes(l1) -> list[torch.Tensor]:
    return [t.contiguous().view(torch.uint8).clone() for t in l1.values()]


def reference_load(layout: str) -> list[torch.Tensor]:
    """L1 after the non-layer-wise worker ran :func:`load_plan` (the reference the layer-wise load must equal)."""
    l1, dev, host = make_pools(layout)
    w = CacheWorker(dev, host, layerwise=False)
    w.start_loads(load_plan())
    w.finish_loads()
    assert w.take_failed_blocks() == set()
    return l1_bytes(l1)


@pytest.fixture(autouse=True)
def fresh_rate_limit(monkeypatch):
    """A fresh rate-limited logger per test (the module's one remembers kinds for 10 s across tests)."""
    monkeypatch.setattr(worker_mod, "_rate_limited", RateLimitedLog(worker_mod.logger))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layerwise_load_equals_the_all_at_once_load_bit_for_bit(layout):
    want = reference_load(layout)
    for li in range(LAYERS):  # the reference moved exactly the planned pages: the other blocks stay zero
        rows = want[li].view(BLOCKS, -1)
        assert [b for b in range(BLOCKS) if rows[b].any()] == sorted(BLOCKS_OF_LOAD), (layout, li)
    l1, dev, host = make_pools(layout)
    w = CacheWorker(dev, host, layerwise=True)
    w.start_loads(load_plan())
    for name in NAMES:
        w.wait_layer(name)
    w.finish_loads()
    got = l1_bytes(l1)
    for li in range(LAYERS):
        assert torch.equal(got[li], want[li]), (layout, li)
    assert w.take_failed_blocks() == set()
    c = w.counters
    assert (c.load_pages, c.load_bytes, c.failed_load_blocks) == (4, 4 * host.page_bytes, 0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_wait_layer_returns_once_its_own_layer_is_in_l1(monkeypatch, layout):
    """Each layer's copy is held until the test lets it go: ``wait_layer(l)`` returns with layer ``l`` complete and
    layer ``l + 1`` not yet copied (the load really runs layer by layer, behind the waits)."""
    want = reference_load(layout)
    l1, dev, host = make_pools(layout)
    gates = [threading.Event() for _ in range(LAYERS)]
    real = layer_loader.load_pages

    def gated(host_, dev_, slots, block_ids, layers=None, **kw):
        (layer,) = layers
        assert gates[layer].wait(30), f"layer {layer} never released"
        return real(host_, dev_, slots, block_ids, layers, **kw)

    monkeypatch.setattr(layer_loader, "load_pages", gated)
    w = CacheWorker(dev, host, layerwise=True)
    w.start_loads(load_plan())
    for li, name in enumerate(NAMES):
        gates[li].set()
        w.wait_layer(name)
        got = l1_bytes(l1)
        assert torch.equal(got[li], want[li]), (layout, li)
        for later in range(li + 1, LAYERS):
            assert not got[later].any(), f"layer {later} copied before its gate opened"
    w.finish_loads()
    assert w.take_failed_blocks() == set() and w.counters.load_pages == 4


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("k", range(LAYERS))
@pytest.mark.parametrize("surfaces_in", ["wait_layer", "finish_loads", "run_saves"])
def test_copy_failure_at_layer_k_becomes_failed_blocks_never_an_exception(monkeypatch, caplog, layout, k,
                                                                          surfaces_in):
    want = reference_load(layout)
    l1, dev, host = make_pools(layout)
    asked = inject_copy_fault(monkeypatch, k)
    w = CacheWorker(dev, host, layerwise=True)
    plan = load_plan()
    save_block, save_slot = 1, 0
    l1[NAMES[0]][save_block].fill_(3.0)  # a page the "forward" computed, saved L1 -> L2 in the same step
    plan.saves = [PageOrder("s", [save_block], [save_slot], [])]
    with caplog.at_level(logging.WARNING, logger="tierkv.worker"):
        w.start_loads(plan)
        if surfaces_in == "wait_layer":
            for name in NAMES:   # the forward: no wait raises, the ones after the failure return at once
                w.wait_layer(name)
            w.wait_layer(NAMES[k])
            w.finish_loads()
        elif surfaces_in == "finish_loads":
            w.finish_loads()
            w.finish_loads()
        w.run_saves(plan)     # wait_for_save: ends the loads first, then saves
        for name in NAMES:    # a wait after the step's loads ended is a no-op
            w.wait_layer(name)
    assert asked == [[x] for x in range(k + 1)]  # one layer at a time, nothing after the failed one
    assert w.take_failed_blocks() == set(BLOCKS_OF_LOAD)  # every block misses the layers from k on
    assert w.take_failed_blocks() == set()                # reported once
    c = w.counters
    assert (c.failed_load_blocks, c.load_pages, c.load_bytes) == (4, 0, 0)
    assert (c.save_pages, c.save_steps) == (1, 1)          # the saves of the step still ran
    got = l1_bytes(l1)
    for li in range(k):   # the layers before the failed one were copied, and copied right
        assert torch.equal(got[li].view(BLOCKS, -1)[BLOCKS_OF_LOAD], want[li].view(BLOCKS, -1)[BLOCKS_OF_LOAD])
    for li in range(k, LAYERS):
        assert not got[li].view(BLOCKS, -1)[BLOCKS_OF_LOAD].any()
    warnings = [r.getMessage() for r in caplog.records if r.name == "tierkv.worker"]
    assert warnings == [f"tierkv: layer-wise L2 -> L1 load of 4 pages failed at layer {k} (injected copy fault at "
                        f"layer {k}); reporting them for recompute"]
    # the next step loads normally: nothing of the failed load is left pending
    monkeypatch.setattr(layer_loader, "load_pages", REAL_LOAD_PAGES)
    w.start_loads(load_plan())
    for name in NAMES:
        w.wait_layer(name)
    w.finish_loads()
    assert w.take_failed_blocks() == set() and w.counters.load_pages == 4
    assert torch.equal(l1_bytes(l1)[LAYERS - 1], want[LAYERS - 1])
