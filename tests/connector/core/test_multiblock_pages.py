"""Pages of several engine blocks (``page_size`` = k x block size), engine-free.

A stub of vLLM's scheduler drives the real :class:`CacheScheduler` and :class:`CacheWorker` over a real fake-L1
(:class:`DevicePool` over CPU tensors in vLLM's CPU-backend shape) and a real L2 (:class:`HostPool` of block rows
under :class:`MultiBlockPages`), with a real file store as L3. Every engine block of a request is filled with a
fingerprint of (its token prefix, layer) when "computed", so any block read back from L2 or L3 is checked byte for
byte, and blocks the engine already holds in L1 (vLLM's prefix cache) are given to the request as they are.
"""
from __future__ import annotations

import hashlib

import pytest
import torch

from tests.helpers.namespace import make_namespace
from tierkv.connector.l2.device_pool import DevicePool
from tierkv.connector.l2.host_pool import HostPool
from tierkv.connector.l3.io import L3IO, l3_key
from tierkv.connector.core.page_checksums import SlotChecksums
from tierkv.connector.core.page_hash import page_keys, request_root
from tierkv.connector.core.plan import PageOrder, block_slots
from tierkv.connector.core.scheduler import CacheScheduler, check_page_size
from tierkv.connector.l2.worker import CacheWorker, MultiBlockPages
from tierkv.storage_backends.file.store import FileStore

B = 16                       # engine block size, tokens
LAYERS, HEADS, HEAD_DIM = 2, 2, 8


def fingerprint(prefix: list[int], layer: int) -> torch.Tensor:
    """bf16 [H, B, 2D] determined by (token prefix, layer): the right bytes of the block ending the prefix."""
    seed = int.from_bytes(hashlib.blake2b(repr((tuple(prefix), layer)).encode(), digest_size=8).digest(), "little")
    g = torch.Generator().manual_seed(seed & ((1 << 63) - 1))
    return torch.randn(HEADS, B, 2 * HEAD_DIM, generator=g).to(torch.bfloat16)


class Engine:
    """One engine of ``k``-block pages: lookups, allocation, one step per request (loads, forward, saves, jobs)."""

    def __init__(self, k: int, num_slots: int = 16, num_blocks: int = 64, layout: str = "layer_first",
                 store_root=None, layerwise: bool = False):
        self.k, self.ps = k, k * B
        base = torch.zeros(LAYERS, num_blocks, HEADS, B, 2 * HEAD_DIM, dtype=torch.bfloat16)
        self.l1 = {f"model.layers.{i}.self_attn.attn": base[i] for i in range(LAYERS)}
        dev = DevicePool.from_vllm(self.l1, num_blocks=num_blocks, block_size=B, kv_cache_layout="LBHNC",
                                   backend="CPU_ATTN")
        rows = HostPool.for_device(dev, num_slots * k, layout)
        self.host = MultiBlockPages(rows, k) if k > 1 else rows
        self.ns = make_namespace(model_id="mb-model", kv_layout=f"{layout}/LBHNC", page_size=self.ps, num_layers=LAYERS,
                                 num_kv_heads=HEADS, head_dim=HEAD_DIM)
        checksums = SlotChecksums(num_slots)
        l3, ctl = None, None
        if store_root is not None:
            self.rank_ns = self.ns.digest()
            self.store = FileStore(self.rank_ns, self.host.page_bytes, root=str(store_root))
            l3 = L3IO(self.store, self.host, self.rank_ns, checksums, batch_pages=4)
            ctl = {"write_policy": "write_through", "world_size": 1}
        self.worker = CacheWorker(dev, self.host, verify=True, l3=l3, checksums=checksums, layerwise=layerwise)
        self.sched = CacheScheduler(self.ns, self.ps, B, num_slots, controller=ctl)
        self.free = list(range(1, num_blocks))
        self.plans = []

    def lookup(self, rid: str, tokens: list[int], l1_blocks: list[int] = ()) -> int:
        """vLLM's lookup of ``rid`` with ``l1_blocks`` its prefix-cache hit; steps (no forward) while the answer
        is pending. Returns the tokens tierkv adds."""
        self.sched.add_request(rid, tokens)
        for _ in range(100):
            n = self.sched.lookup(rid, len(l1_blocks) * B)
            if n is not None:
                return n
            if self.worker.l3 is not None:
                self.worker.l3.wait_idle(30)
            self.idle_step()
        raise AssertionError("lookup never answered")

    def serve(self, rid: str, tokens: list[int], l1_blocks: list[int] = ()) -> tuple[int, list[int]]:
        """Admit ``rid`` (its first blocks ``l1_blocks``, held in L1), load its hit, compute the rest, save its full
        pages; returns (tokens tierkv added, the request's block table). Checks every block of the prompt."""
        ext = self.lookup(rid, tokens, l1_blocks)
        is_async = self.sched.lookup_is_async(rid)
        n_blocks = (len(tokens) + B - 1) // B
        blocks = list(l1_blocks) + [self.free.pop(0) for _ in range(n_blocks - len(l1_blocks))]
        self.sched.on_alloc(rid, blocks, ext)
        if is_async and ext:
            done = set()
            for _ in range(100):
                self.worker.l3.wait_idle(30)
                done |= self.idle_step()
                if rid in done:
                    break
            assert rid in done, "asynchronous load never ended"
            assert not self.failed, self.failed
            self.sched.on_alloc(rid, blocks, 0)
        c = len(l1_blocks) * B + ext
        self.step(rid, tokens, blocks, c)
        for j in range(len(tokens) // B):
            assert self.block_ok(blocks[j], tokens, j), f"{rid}: block {j} has wrong bytes"
        self.sched.on_finished(rid)
        return ext, blocks

    def step(self, rid, tokens, blocks, computed) -> None:
        self.sched.schedule_saves(rid, len(tokens), blocks)
        plan = self.sched.build_plan()
        self.plans.append(plan)
        self.worker.start_loads(plan)
        self.worker.start_reads(plan)
        for name in self.l1:  # the forward: each attention layer waits for its own pages (layer-wise loads)
            self.worker.wait_layer(name)
        self.worker.finish_loads()
        assert not self.worker._failed_blocks, self.worker._failed_blocks
        for j in range(computed // B, len(tokens) // B):  # the forward: blocks after the hit
            self.write_block(blocks[j], tokens, j)
        self.worker.run_saves(plan)
        self.worker.submit_jobs(plan)
        self._collect(set())

    def idle_step(self) -> set[str]:
        plan = self.sched.build_plan()
        self.plans.append(plan)
        self.worker.start_loads(plan)
        self.worker.start_reads(plan)
        self.worker.run_saves(plan)
        self.worker.submit_jobs(plan)
        return self._collect(set())

    def _collect(self, finished) -> set[str]:
        done = self.worker.poll(finished)
        self.failed = self.worker.take_failed_blocks()
        self.sched.on_finished_recving(done, self.failed)
        self.sched.on_reports(self.worker.take_reports())
        self.sched.on_load_errors(self.failed)
        return done

    def settle(self) -> None:
        for _ in range(100):
            self.worker.l3.wait_idle(30)
            self.idle_step()
            if self.sched.ctl.pending_jobs() == 0:
                return
        raise AssertionError("jobs still pending")

    def write_block(self, b: int, tokens, j: int) -> None:
        for layer, t in enumerate(self.l1.values()):
            t[b].copy_(fingerprint(tokens[: (j + 1) * B], layer))

    def block_ok(self, b: int, tokens, j: int) -> bool:
        return all(torch.equal(t[b], fingerprint(tokens[: (j + 1) * B], layer))
                   for layer, t in enumerate(self.l1.values()))

    def loads(self) -> list[PageOrder]:
        return [o for p in self.plans for o in p.loads]

    def saves(self) -> list[PageOrder]:
        return [o for p in self.plans for o in p.saves]


def toks(a: int, n: int) -> list[int]:
    return list(range(a, a + n))


# ------------------------------------------------------------------ config
def test_page_size_must_be_whole_blocks_and_the_error_names_the_key_and_allowed_values():
    assert check_page_size(32, 32) == 1 and check_page_size(64, 32) == 2 and check_page_size(128, 32) == 4
    for bad in (48, 16, 0, 33, 64.0, True):
        with pytest.raises(ValueError) as e:
            check_page_size(bad, 32)
        assert "'page_size'" in str(e.value) and "allowed: 32, 64, 128" in str(e.value)
    ns = make_namespace(page_size=48, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM)
    with pytest.raises(ValueError, match="'page_size'"):
        CacheScheduler(ns, 48, 32, 4)


def test_block_slots_map_page_slots_to_block_rows_with_a_skipped_start():
    # pages in slots 5 and 2 of 4 blocks each, the first block of slot 5 already in L1
    assert block_slots([5, 2], 7, 4, 1) == [21, 22, 23, 8, 9, 10, 11]
    o = PageOrder("r", [10, 11, 12, 13, 14, 15, 16], [5, 2], [b"a", b"b"], 4, 1)
    assert o.head(1).block_ids == [10, 11, 12] and o.head(1).block_slots() == [21, 22, 23]
    assert o.blocks_from(1) == [13, 14, 15, 16] and o.blocks_from(0) == o.block_ids
    with pytest.raises(ValueError, match="want 7"):
        PageOrder("r", [1] * 8, [5, 2], [b"a", b"b"], 4, 1)


# ------------------------------------------------------------------ L2
@pytest.mark.parametrize("k,layerwise", [(2, False), (4, False), (2, True)])
def test_hits_are_whole_pages_and_load_exactly_the_blocks_of_those_pages(k, layerwise):
    e = Engine(k, layerwise=layerwise)
    ps = k * B
    doc = toks(1000, 3 * ps + (k - 1) * B + 5)  # 3 pages, then a tail of k - 1 blocks and 5 tokens
    ext, a_blocks = e.serve("a", doc)
    assert ext == 0
    (save,) = e.saves()
    assert save.blocks_per_page == k and len(save.slots) == 3  # the tail is never saved
    assert save.block_ids == a_blocks[: 3 * k]
    assert e.worker.counters.save_pages == 3 and e.worker.counters.save_bytes == 3 * e.host.page_bytes
    # the same prompt, nothing in L1: 3 whole pages from L2 into exactly the first 3k blocks
    ext, b_blocks = e.serve("b", doc + [7])
    assert ext == 3 * ps
    (load,) = e.loads()
    assert load.block_ids == b_blocks[: 3 * k] and load.skip_blocks == 0 and load.slots == save.slots
    assert e.worker.counters.load_pages == 3
    assert e.worker.counters.load_bytes == 3 * e.host.page_bytes
    # a prompt of exactly 3 pages: its last page is not loaded (one token is left to compute)
    assert e.lookup("c", doc[: 3 * ps]) == 2 * ps
    e.sched.on_finished("c")
    # a prompt of one page less one token (shorter than a page): nothing to hit, nothing saved
    n_saves = len(e.saves())
    assert e.serve("d", doc[: ps - 1])[0] == 0 and len(e.saves()) == n_saves
    e.sched.check_invariants()


@pytest.mark.parametrize("k", [2, 4])
def test_a_hit_starting_inside_a_page_held_in_l1_loads_only_the_blocks_after_it(k):
    e = Engine(k)
    ps = k * B
    doc = toks(5000, 3 * ps + 3)
    _, a_blocks = e.serve("a", doc)
    # vLLM still holds a's first k + 1 blocks (page 0 and the first block of page 1) in its prefix cache
    held = a_blocks[: k + 1]
    before = [t[held].clone() for t in e.l1.values()]
    ext, b_blocks = e.serve("b", doc + [9], l1_blocks=held)
    assert ext == 3 * ps - (k + 1) * B
    (load,) = e.loads()
    assert load.skip_blocks == 1 and load.block_ids == b_blocks[k + 1: 3 * k]
    assert load.slots == e.saves()[0].slots[1:3]
    assert all(torch.equal(t[held], x) for t, x in zip(e.l1.values(), before))  # blocks in L1 never written
    assert e.worker.counters.load_pages == 2
    assert e.worker.counters.load_bytes == (2 * k - 1) * e.host.page_bytes // k
    # the lookup statistics: L1 tokens, L2 tokens and the rest add up to the prompts' whole pages
    ls = e.sched.lookup_stats.tokens
    assert ls["l1"] == (k + 1) * B and ls["l2"] == ext  # a served nothing from a cache
    # a prompt of one page, one block and a token with vLLM holding k + 1 blocks: its L1 hit counts its one page
    assert e.serve("c", doc[: ps + B + 1], l1_blocks=held)[0] == 0
    assert ls["l1"] == (k + 1) * B + ps
    assert sum(ls.values()) == e.sched.counters.lookup_tokens == 2 * (3 * ps) + ps  # a, b, c
    e.sched.check_invariants()


@pytest.mark.parametrize("k", [2, 4])
def test_eviction_frees_whole_pages_and_reused_slots_load_the_new_pages(k):
    e = Engine(k, num_slots=4)
    ps = k * B
    a, d = toks(100, 3 * ps + 1), toks(90000, 3 * ps + 1)
    e.serve("a", a)
    e.serve("d", d)  # needs 3 slots, 1 free: pages of a go, the last ones first
    evicted = e.sched.counters.evicted_pages
    assert 2 <= evicted <= 3
    a_slots, d_slots = e.saves()[0].slots, e.saves()[1].slots
    assert set(d_slots) & set(a_slots[3 - evicted:]) and not set(d_slots) & set(a_slots[:3 - evicted])
    assert e.serve("d2", d)[0] == 3 * ps                # d's pages, in slots a's pages had, load d's bytes
    assert e.serve("a2", a)[0] == (3 - evicted) * ps    # only a's first pages are left
    e.sched.check_invariants()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_a_page_s_bytes_are_its_blocks_rows_and_write_back_in_place(layout):
    e = Engine(2, num_slots=3, layout=layout)
    rows = e.host.block_pool
    torch.manual_seed(0)
    rows.buffer.copy_(torch.randint(0, 256, rows.buffer.shape, dtype=torch.uint8))
    page = e.host.read_page(1).clone()
    assert page.numel() == 2 * rows.page_bytes == e.host.page_bytes
    # page 1 is block rows 2 and 3: its bytes are theirs, nothing of rows 0, 1, 4, 5
    assert sorted(page.tolist()) == sorted(rows.read_page(2).tolist() + rows.read_page(3).tolist())
    if layout == "layer_first":
        per_layer = [torch.cat([rows.read_page(r).view(LAYERS, -1)[layer] for r in (2, 3)]) for layer in range(LAYERS)]
        assert torch.equal(page, torch.cat(per_layer))
    else:  # K of both blocks, then V of both blocks
        half = rows.page_bytes // 2
        k_part = torch.cat([rows.read_page(r)[:half] for r in (2, 3)])
        v_part = torch.cat([rows.read_page(r)[half:] for r in (2, 3)])
        assert torch.equal(page, torch.cat([k_part, v_part]))
    other = [rows.read_page(r).clone() for r in (0, 1, 4, 5)]
    e.host.write_page(1, torch.zeros_like(page))
    assert not rows.read_page(2).any() and not rows.read_page(3).any()
    assert all(torch.equal(rows.read_page(r), x) for r, x in zip((0, 1, 4, 5), other))
    assert e.host.page_checksum(1) == e.host.page_checksum(1) and e.host.page_checksum(1) != e.host.page_checksum(0)


# ------------------------------------------------------------------ L3
@pytest.mark.parametrize("k", [2, 4])
def test_l3_records_are_whole_pages_and_a_hit_from_l3_loads_exactly_their_blocks(tmp_path, k):
    ps = k * B
    doc = toks(300, 3 * ps + B + 2)
    e = Engine(k, store_root=tmp_path)
    e.serve("a", doc)
    e.settle()
    keys = page_keys(request_root(e.ns.digest()), doc, ps)
    assert len(keys) == 3
    assert e.store.batch_exists([l3_key(e.rank_ns, x) for x in keys]) == 3  # one record per page, not per block
    files = [p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size >= e.host.page_bytes]
    assert len(files) == 3
    e.worker.close()
    # a new engine on the same store, vLLM holding the first block of the request in L1
    e2 = Engine(k, store_root=tmp_path)
    held_tokens = doc[:B]
    _, x_blocks = e2.serve("x", held_tokens + [1])  # puts block 0 of doc into L1 (its one full block)
    ext, blocks = e2.serve("b", doc + [4], l1_blocks=x_blocks[:1])
    assert ext == 3 * ps - B
    jobs = [j for p in e2.plans for j in p.jobs if j.kind == "prefetch"]
    assert len(jobs) == 1 and jobs[0].num_pages == 3 and jobs[0].skip_blocks == 1
    assert jobs[0].block_ids == blocks[1: 3 * k]
    assert e2.sched.ctl.counters.prefetch_loaded_pages == 3
    assert e2.worker.counters.async_load_pages == 3
    e2.settle()
    e2.worker.close()


# ------------------------------------------------------------------ KV events
def test_kv_events_name_each_page_s_blocks_as_vllm_s_own_l1_events():
    """Pages of 2 blocks: tierkv's L2 events carry the block hashes, parents, tokens and extra keys of vLLM's own L1
    ``BlockStored`` for the same blocks (vLLM's BlockPool, block size B), two per page."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from tierkv.connector.obs.kv_events import L2, TierEvents, page_infos
    init_none_hash(sha256)
    tokens = toks(40, 4 * B + 5)
    r = Request("r", tokens, SamplingParams(max_tokens=1), None, cache_salt="tenant-1",
                block_hasher=get_request_block_hasher(B, sha256))
    pool = BlockPool(16, True, B, enable_kv_cache_events=True)
    pool.cache_full_blocks(r, pool.get_new_blocks(4), 0, 4, B, 0)
    l1 = [e for e in pool.take_events() if isinstance(e, BlockStored)]
    hashes = [h for e in l1 for h in e.block_hashes]
    assert len(hashes) == 4
    ev = TierEvents(lambda rid, a, b: page_infos(r, a, b, B, None, 2), block_size=B, l3_backend=None)
    keys = [bytes([i]) * 16 for i in range(2)]
    ev.describe("r", keys, 0, 2)
    ev.stored(L2, keys[1:])  # page 1 alone: blocks 2 and 3, parent block 1
    ev.stored(L2, keys[:1])
    second, first = ev.take_vllm_events()
    assert second.block_hashes == hashes[2:] and second.parent_block_hash == hashes[1]
    assert second.token_ids == tokens[2 * B: 4 * B] and second.block_size == B
    assert first.block_hashes == hashes[:2] and first.parent_block_hash is None
    assert first.extra_keys == [k for e in l1 for k in e.extra_keys][:2] and first.extra_keys[0] == ("tenant-1",)
    ev.removed(L2, keys)
    (gone,) = ev.take_vllm_events()
    assert isinstance(gone, BlockRemoved) and gone.block_hashes == hashes
