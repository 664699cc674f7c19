"""Prefix index benchmark: tierkv's RadixIndex + page hashing against SGLang 0.5.23's RadixCache, and the index at scale.

One process runs both (SGLang is installed in tierkv's venv by .ci/setup_env.sh; its radix tree is built standalone
with ``RadixCache.create_simulated`` and a dummy allocator, as benchmarks/peers does for its storage classes).

Trace (issue 9): R roots x B branches of 1,024-token sequences sharing 512-token prefixes (100 x 100 = 10,000);
inserts, full matches, partial matches (root prefix + an unseen suffix), then one path per root locked and
request-sized evictions (1,024 tokens a call) until nothing unlocked is left; at page sizes 16, 32 and 64.
tierkv is measured twice: from token ids (page hashing included, as SGLang keys by tokens) and with keys given
(the tree alone). Every phase is repeated ``--repeats`` times, alternating SGLang and tierkv; ranges are reported.

Scale: an index of ``--scale-pages`` pages (default 1M) of 128k-token prompts at page size 32, L2 and L3 residency
mixed: index memory per page (tracemalloc), the first lookup of a 128k-token prompt through the scheduler (hashing
included), the repeated lookup of a waiting request, ``match_prefix`` with keys given, hashing alone, evicting
request-sized batches. Start-up: a file store of ``--startup-pages`` records (default 1M) is opened (its own scan)
and the first prompt's existence query is timed; the index is not rebuilt from L3 (docs/architecture.md §9).

    .venv/bin/python -m benchmarks.index                  # full run, ~10-15 min on an idle machine, writes
                                                          # results/index.json and its README table printed
    .venv/bin/python -m benchmarks.index --quick --no-write   # smoke run, about a minute

Targets: tree inserts/s and matches/s >= 2x SGLang at every page size; hashing >= 2M pages/s at page size 16;
eviction time proportional to pages evicted; <= 200 bytes of index memory per page; a 128k-token lookup at page
size 32 < 2 ms including hashing; the repeated lookup O(1) (tests/connector/core/test_index_scale.py counts it).
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
import tracemalloc
from array import array
from pathlib import Path

from benchmarks.harness import results as results_check
from benchmarks.harness.results import code_state

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SECTION = "index"
VOCAB = 128_000

from tierkv.connector.core.page_hash import (ModelNamespace, page_keys, page_keys_reference,  # noqa: E402
                                        request_root, warm_up)
from tierkv.connector.core.radix_index import NO_SLOT, RadixIndex  # noqa: E402
from tierkv.connector.core.scheduler import CacheScheduler  # noqa: E402


def loadavg() -> float:
    return os.getloadavg()[0]


def make_trace(rng: random.Random, roots: int, branches: int, prefix: int, suffix: int):
    rts = [[rng.randrange(VOCAB) for _ in range(prefix)] for _ in range(roots)]
    seqs, partial = [], []
    for r in range(roots):
        for _ in range(branches):
            seqs.append(rts[r] + [rng.randrange(VOCAB) for _ in range(suffix)])
            partial.append(rts[r] + [VOCAB + rng.randrange(VOCAB) for _ in range(suffix)])  # never hits
    order = list(range(len(seqs)))
    rng.shuffle(order)
    return [seqs[i] for i in order], [partial[i] for i in order]


def _freeze_inputs() -> None:
    """Move the inputs (trace, keys, values) out of the collector's reach, as vLLM does with gc.freeze() after start-up:
    otherwise every full collection walks the 20M token ids of the trace and the tree with the most objects pays
    most. Both trees run with the collector on for what they allocate themselves."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


# ---------------------------------------------------------------------------------------------------- SGLang
def sglang_available() -> tuple[bool, str]:
    try:
        from benchmarks.peers import sglang_cpu_shims  # noqa: F401  (before any sglang import: keeps torchvision out)
        import sglang
        from sglang.srt.mem_cache.radix_cache import RadixCache  # noqa: F401
        return True, sglang.__version__
    except Exception as e:  # noqa: BLE001 - reported in the results
        return False, f"{type(e).__name__}: {e}"


def run_sglang(page_size: int, seqs, partial, roots: int, evict_step: int) -> dict:
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    class Alloc:
        device = "cpu"

        def __init__(self):
            self.freed = 0

        def free_segment(self, value, start_pos=0):
            self.freed += len(value) - start_pos

        def free(self, value):
            self.freed += len(value)

    alloc = Alloc()
    tree = RadixCache.create_simulated(page_size=page_size, mock_allocator=alloc)
    n, L = len(seqs), len(seqs[0])
    values = [torch.arange(i * L, (i + 1) * L, dtype=torch.int64) for i in range(n)]
    keys = [RadixKey(token_ids=array("q", s)) for s in seqs]
    pkeys = [RadixKey(token_ids=array("q", s)) for s in partial]
    _freeze_inputs()
    res = {}
    t = time.perf_counter()
    for k, v in zip(keys, values):
        tree.insert(InsertParams(key=k, value=v))
    res["insert_s"] = time.perf_counter() - t
    t = time.perf_counter()
    hits = sum(tree.match_prefix(MatchPrefixParams(key=k)).device_prefix_len for k in keys)
    res["match_full_s"] = time.perf_counter() - t
    assert hits == n * L, hits
    t = time.perf_counter()
    for k in pkeys:
        tree.match_prefix(MatchPrefixParams(key=k))
    res["match_part_s"] = time.perf_counter() - t
    locked = {}
    for s, k in zip(seqs, keys):
        if s[0] not in locked:
            tree.inc_lock_ref(tree.match_prefix(MatchPrefixParams(key=k)).last_device_node)
            locked[s[0]] = s
    t = time.perf_counter()
    calls = evicted = 0
    while True:
        got = tree.evict(EvictParams(num_tokens=evict_step)).num_tokens_evicted
        calls += 1
        evicted += got
        if got == 0:
            break
    res["evict_s"] = time.perf_counter() - t
    res["evict_calls"], res["evicted_tokens"] = calls, evicted
    assert tree.total_size() == len(locked) * L
    return res


# ---------------------------------------------------------------------------------------------------- tierkv
def run_tierkv(page_size: int, seqs, partial, roots: int, evict_step: int, hashed: bool) -> dict:
    """``hashed``: every insert and match starts from token ids (page_keys per call, as a new request would), given
    as array('q') like SGLang's RadixKey; otherwise the keys are computed before the timed loops and only the tree is
    measured."""
    root = request_root(bytes(16))
    n, L = len(seqs), len(seqs[0])
    pages = L // page_size
    keys = pkeys = None
    if hashed:  # the same input SGLang gets: RadixKey(token_ids=array("q", ...)) built before its timed loops
        seqs = [array("q", s) for s in seqs]
        partial = [array("q", s) for s in partial]
    else:
        keys = [page_keys(root, s, page_size) for s in seqs]
        pkeys = [page_keys(root, s, page_size) for s in partial]
    idx = RadixIndex()
    _freeze_inputs()
    res = {}
    t = time.perf_counter()
    for i in range(n):
        k = page_keys(root, seqs[i], page_size) if hashed else keys[i]
        idx.insert(k, range(i * pages, (i + 1) * pages))
    res["insert_s"] = time.perf_counter() - t
    # what the engine would free: the slots passed for pages already indexed (duplicates) are not counted here
    t = time.perf_counter()
    hits = 0
    for i in range(n):
        hits += idx.match_prefix(page_keys(root, seqs[i], page_size) if hashed else keys[i]).num_pages
    res["match_full_s"] = time.perf_counter() - t
    assert hits == n * pages, hits
    if not hashed:
        t = time.perf_counter()
        for i in range(n):
            idx.match_prefix(keys[i], split=True, touch=True)
        res["match_touch_s"] = time.perf_counter() - t
    t = time.perf_counter()
    phits = 0
    for i in range(n):
        phits += idx.match_prefix(page_keys(root, partial[i], page_size) if hashed else pkeys[i]).num_pages
    res["match_part_s"] = time.perf_counter() - t
    assert phits == n * ((L // 2) // page_size), phits
    locked = {}
    for i, s in enumerate(seqs):
        if s[0] not in locked:
            k = keys[i] if keys is not None else page_keys(root, s, page_size)
            locked[s[0]] = idx.lock(idx.match_prefix(k, split=True).last_node)
    step = max(1, evict_step // page_size)
    t = time.perf_counter()
    calls = evicted = 0
    while True:
        got = len(idx.evict(step))
        calls += 1
        evicted += got
        if got == 0:
            break
    res["evict_s"] = time.perf_counter() - t
    res["evict_calls"], res["evicted_tokens"] = calls, evicted * page_size
    assert idx.total_pages == len(locked) * pages, (idx.total_pages, len(locked) * pages)
    return res


def _rate(n: int, s: float) -> float:
    return n / s if s > 0 else float("inf")


def hash_rates(page_size: int, reps: int) -> dict:
    """Pages/s of page_keys on one 128k-token prompt (one call), of the hashlib reference (same keys), and of the
    FORMAT_VERSION 1 derivation (BLAKE2b over parent || int64 tokens, one hashlib call per page: 'before')."""
    rng = random.Random(3)
    toks = [rng.randrange(VOCAB) for _ in range(131072)]
    root = request_root(bytes(16))
    n = len(toks) // page_size

    def v1():
        prev = root
        tb = array("q", toks).tobytes()
        step = 8 * page_size
        for off in range(0, n * step, step):
            h = hashlib.blake2b(digest_size=16)
            h.update(prev)
            h.update(tb[off:off + step])
            prev = h.digest()

    out = {}
    for name, fn in (("tierkv", lambda: page_keys(root, toks, page_size)),
                     ("hashlib_reference", lambda: page_keys_reference(root, toks, page_size)),
                     ("v1_per_page_hashlib", v1)):
        ts = []
        for _ in range(reps if name == "tierkv" else max(1, reps // 3)):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        out[name + "_pages_per_s"] = [_rate(n, x) for x in ts]
    out["prompt_128k_ms"] = [1e3 * n / r for r in out["tierkv_pages_per_s"]]
    return out


def bench_trace(args) -> dict:
    rng = random.Random(0)
    seqs, partial = make_trace(rng, args.roots, args.branches, 512, 512)
    ok, ver = sglang_available()
    rows = []
    for ps in args.page_sizes:
        runs = {"sglang": [], "tierkv_hashed": [], "tierkv_keys": []}
        for _ in range(args.repeats):
            if ok:
                runs["sglang"].append(run_sglang(ps, seqs, partial, args.roots, 1024))
            runs["tierkv_hashed"].append(run_tierkv(ps, seqs, partial, args.roots, 1024, hashed=True))
            runs["tierkv_keys"].append(run_tierkv(ps, seqs, partial, args.roots, 1024, hashed=False))
        n = len(seqs)
        row = {"page_size": ps, "n": n, "runs": runs}
        for who, rs in runs.items():
            if not rs:
                continue
            row[who] = {
                "insert_per_s": [_rate(n, r["insert_s"]) for r in rs],
                "match_full_per_s": [_rate(n, r["match_full_s"]) for r in rs],
                "match_part_per_s": [_rate(n, r["match_part_s"]) for r in rs],
                "evict_s": [r["evict_s"] for r in rs],
                "evict_calls": rs[0]["evict_calls"],
            }
            if "match_touch_s" in rs[0]:
                row[who]["match_touch_per_s"] = [_rate(n, r["match_touch_s"]) for r in rs]
        if ok:
            s, k = row["sglang"], row["tierkv_keys"]
            row["ratio_keys_vs_sglang"] = {m: [a / b for a, b in zip(k[m], s[m])]
                                           for m in ("insert_per_s", "match_full_per_s", "match_part_per_s")}
            row["ratio_keys_vs_sglang"]["match_touch_per_s"] = [a / b for a, b in
                                                                zip(k["match_touch_per_s"], s["match_full_per_s"])]
            h = row["tierkv_hashed"]
            row["ratio_hashed_vs_sglang"] = {m: [a / b for a, b in zip(h[m], s[m])]
                                             for m in ("insert_per_s", "match_full_per_s", "match_part_per_s")}
        row["hash"] = hash_rates(ps, args.repeats * 3)
        rows.append(row)
        print(f"page {ps}: done (load {loadavg():.2f})", flush=True)
    return {"sglang": ver if ok else None, "sglang_error": None if ok else ver, "rows": rows}


# ---------------------------------------------------------------------------------------------------- scale
def bench_scale(args) -> dict:
    ps = 32
    prompt_tokens = 131072
    ppp = prompt_tokens // ps  # 4096 pages a prompt
    n_prompts = max(1, args.scale_pages // ppp)
    rng = random.Random(11)
    ns = ModelNamespace(model_id="bench", dtype="bfloat16", kv_layout="layer_first/LBHNC", page_size=ps,
                        num_layers=32, num_kv_heads=8, head_dim=128)
    sched = CacheScheduler(ns, ps, ps, num_slots=n_prompts * ppp)
    root = request_root(sched.ns_digest)
    shared = [rng.randrange(VOCAB) for _ in range(2048)]  # 16 groups share a 2k-token system prompt
    systems = [[g] + shared[1:] for g in range(16)]
    prompts = []
    for i in range(n_prompts):
        prompts.append(systems[i % 16] + [rng.randrange(VOCAB) for _ in range(prompt_tokens - 2048)])
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    idx = sched.index
    slot = 0
    t = time.perf_counter()
    for i, p in enumerate(prompts):
        keys = page_keys(root, p, ps)
        m = idx.match_prefix(keys, require_l2=False, split=True)
        new = len(keys) - m.num_pages
        # residency mixed: runs of 512 pages L2-only, L2+L3 and L3-only; every 4th prompt has no L3-only run (the
        # lookups below use those: a full L2 hit is the longest walk)
        slots, l3 = [], []
        for j in range(new):
            kind = ((m.num_pages + j) // 512 + i) % (2 if i % 4 == 0 else 3)
            slots.append(NO_SLOT if kind == 2 else slot)
            slot += kind != 2
            l3.append(kind != 0)
        idx.insert(keys, slots, in_l3=l3, start=m.num_pages)
        del keys, m, slots, l3
    build_s = time.perf_counter() - t
    gc.collect()
    mem = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    pages = idx.total_pages
    out = {"pages": pages, "l2_pages": idx.l2_pages, "l3_pages": idx.l3_pages, "nodes": idx.num_nodes,
           "prompts": n_prompts, "page_size": ps, "prompt_tokens": prompt_tokens,
           "index_bytes": mem, "bytes_per_page": mem / pages, "build_s": build_s}
    # the first lookup of a 128k-token prompt (hash + match) through the scheduler, and the repeats of a waiting one
    firsts, repeats, match_keys, hash_ms = [], [], [], []
    for r in range(args.repeats * 3):
        p = prompts[(4 * r) % n_prompts] + [1]
        rid = f"w{r}"
        sched.add_request(rid, p)
        t = time.perf_counter()
        got = sched.lookup(rid, 0)
        firsts.append(1e3 * (time.perf_counter() - t))
        assert got == (len(p) - 1) // ps * ps, got
        steps0 = idx.match_steps
        t = time.perf_counter()
        for _ in range(1000):
            sched.lookup(rid, 0)
        repeats.append(1e6 * (time.perf_counter() - t) / 1000)
        out.setdefault("repeat_match_steps_per_lookup", (idx.match_steps - steps0) / 1000)
        keys = sched.requests[rid].keys.keys
        t = time.perf_counter()
        idx.match_prefix(keys, require_l2=False)
        match_keys.append(1e3 * (time.perf_counter() - t))
        t = time.perf_counter()
        page_keys(root, p, ps)
        hash_ms.append(1e3 * (time.perf_counter() - t))
        sched.on_finished(rid)
    out.update(first_lookup_ms=firsts, repeat_lookup_us=repeats, match_prefix_keys_given_ms=match_keys,
               hash_128k_ms=hash_ms)
    # request-sized evictions (4096 pages = one prompt) until L2 is empty: time per evicted page stays flat
    t = time.perf_counter()
    freed = 0
    per_call = []
    while True:
        t1 = time.perf_counter()
        got = len(idx.evict(ppp))
        per_call.append(time.perf_counter() - t1)
        if not got:
            break
        freed += got
    ev_s = time.perf_counter() - t
    out.update(evict_l2_pages=freed, evict_l2_s=ev_s, evict_us_per_page=1e6 * ev_s / max(1, freed),
               evict_call_ms_first_last=[1e3 * per_call[0], 1e3 * per_call[-2] if len(per_call) > 1 else None])
    t = time.perf_counter()
    removed = idx.evict_l3_only(pages)
    out.update(evict_l3_only_pages=removed, evict_l3_only_s=time.perf_counter() - t)
    return out


def bench_startup(args) -> dict:
    """A file store of N records: its own start-up scan, and the existence query of one 128k-token prompt on it."""
    from tierkv.storage_backends.file.store import FileStore
    from tierkv.storage_backends.page_format import encode_record

    n = args.startup_pages
    ns = bytes(range(16))
    page_bytes = 64
    d = tempfile.mkdtemp(prefix="tierkv-index-bench-", dir=args.tmp)
    try:
        root = request_root(ns)
        rng = random.Random(5)
        prompt = [rng.randrange(VOCAB) for _ in range(131072)]
        pkeys = page_keys(root, prompt, 32)
        t = time.perf_counter()
        store = FileStore(ns, page_bytes, root=d, capacity_bytes=1 << 40)
        payload = bytes(page_bytes)
        # the prompt's own pages, then filler records (written directly in the store's layout, for speed)
        keys = [k.hex() for k in pkeys] + [hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).hexdigest()
                                           for i in range(max(0, n - len(pkeys)))]
        made = set()
        for k in keys:
            sub = os.path.join(d, ns.hex(), k[:2])
            if sub not in made:
                os.makedirs(sub, exist_ok=True)
                made.add(sub)
            with open(os.path.join(sub, k + ".page"), "wb") as f:
                f.write(encode_record(k, ns, payload))
        store.close()
        write_s = time.perf_counter() - t
        t = time.perf_counter()
        store = FileStore(ns, page_bytes, root=d, capacity_bytes=1 << 40)
        open_s = time.perf_counter() - t
        files = store.stats().get("scan_files")
        t = time.perf_counter()
        found = store.batch_exists([k.hex() for k in pkeys])
        exists_ms = 1e3 * (time.perf_counter() - t)
        store.close()
        return {"records": n, "files_scanned": files, "write_s": write_s, "store_open_s": open_s,
                "exists_128k_prompt_ms": exists_ms, "exists_found_pages": found, "index_rebuilt_at_start": False}
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------- report
def _rng(v, fmt="{:,.0f}") -> str:
    if v is None:
        return "-"
    if isinstance(v, (int, float)):
        return fmt.format(v)
    lo, hi = min(v), max(v)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}–{fmt.format(hi)}"


def table(res: dict) -> str:
    tr = res["trace"]
    out = [f"Measured {res['time']} (load average {res['loadavg_start']:.2f} -> {res['loadavg_end']:.2f}), "
           f"{res['repeats']} repeats alternating SGLang and tierkv, ranges; SGLang {tr['sglang'] or 'not measured'}.",
           "", "| page | who | inserts/s | full matches/s | partial matches/s | split+touch matches/s | "
           "evict until empty (s) | insert ratio | full match ratio | partial match ratio |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for row in tr["rows"]:
        for who, label in (("sglang", "SGLang RadixCache"), ("tierkv_hashed", "tierkv, from tokens"),
                           ("tierkv_keys", "tierkv, keys given")):
            r = row.get(who)
            if r is None:
                continue
            rat = row.get("ratio_keys_vs_sglang" if who == "tierkv_keys" else "ratio_hashed_vs_sglang")
            ratio = (["-"] * 3 if who == "sglang" or rat is None else
                     [_rng(rat[m], "{:.1f}x") for m in ("insert_per_s", "match_full_per_s", "match_part_per_s")])
            out.append(f"| {row['page_size']} | {label} | {_rng(r['insert_per_s'])} | {_rng(r['match_full_per_s'])} | "
                       f"{_rng(r['match_part_per_s'])} | {_rng(r.get('match_touch_per_s'))} | "
                       f"{_rng(r['evict_s'], '{:.2f}')} | " + " | ".join(ratio) + " |")
    out += ["", "Targets: with keys given, inserts and matches >= 2.0x SGLang at every page size; eviction proportional "
            "to the pages evicted. 'From tokens' includes hashing every page of every call (SGLang compares token ids "
            "and has no cross-process keys to compute).",
            "", "Page hashing, one 128k-token prompt per call (pages/s, target >= 2,000,000 at page 16 on one core; "
            "v1 = the former per-page hashlib derivation):",
            "", "| page | tierkv (compiled BLAKE2b) | hashlib, same keys | v1 | 128k prompt (ms) |", "|---|---|---|---|---|"]
    for row in tr["rows"]:
        h = row["hash"]
        out.append(f"| {row['page_size']} | {_rng(h['tierkv_pages_per_s'])} | {_rng(h['hashlib_reference_pages_per_s'])} "
                   f"| {_rng(h['v1_per_page_hashlib_pages_per_s'])} | {_rng(h['prompt_128k_ms'], '{:.2f}')} |")
    sc = res.get("scale")
    if sc:
        out += ["", f"Scale: {sc['pages']:,} pages ({sc['l2_pages']:,} in L2, {sc['l3_pages']:,} in L3, {sc['nodes']:,} "
                f"nodes) of {sc['prompts']} prompts of {sc['prompt_tokens']:,} tokens at page size {sc['page_size']}.", "",
                "| quantity | value | target |", "|---|---|---|",
                f"| index memory per page (tracemalloc) | {sc['bytes_per_page']:.0f} B | <= 200 B |",
                f"| first lookup of a 128k-token prompt (hash + match, scheduler) | {_rng(sc['first_lookup_ms'], '{:.2f}')} ms | < 2 ms |",
                f"| repeated lookup of a waiting request | {_rng(sc['repeat_lookup_us'], '{:.1f}')} µs "
                f"({sc['repeat_match_steps_per_lookup']:.0f} match steps) | O(1) |",
                f"| match_prefix, keys given, 4,096 pages | {_rng(sc['match_prefix_keys_given_ms'], '{:.3f}')} ms | |",
                f"| hashing a 128k-token prompt | {_rng(sc['hash_128k_ms'], '{:.2f}')} ms | |",
                f"| evicting all L2 pages in prompt-sized calls | {sc['evict_us_per_page']:.2f} µs/page "
                f"(first/last call {_rng(sc['evict_call_ms_first_last'][0], '{:.1f}')}/"
                f"{_rng(sc['evict_call_ms_first_last'][1], '{:.1f}')} ms) | proportional to pages |",
                f"| evicting every L3-only page | {sc['evict_l3_only_s']:.2f} s for {sc['evict_l3_only_pages']:,} | |"]
    st = res.get("startup")
    if st:
        out += ["", f"Start-up with a file store of {st['records']:,} records: the store's own scan "
                f"{st['store_open_s']:.1f} s; the index is not rebuilt (0 s); the first 128k-token prompt's existence "
                f"query {st['exists_128k_prompt_ms']:.1f} ms ({st['exists_found_pages']} pages found). A record names "
                f"its page but not the page before it, so the tree cannot be rebuilt from the store; requests find "
                f"their stored prefixes through that query (docs/architecture.md §9)."]
    return "\n".join(out)


def replace_section(body: str) -> None:
    results_check.print_section(body)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--page-sizes", default="16,32,64")
    ap.add_argument("--roots", type=int, default=100)
    ap.add_argument("--branches", type=int, default=100)
    ap.add_argument("--scale-pages", type=int, default=1 << 20)
    ap.add_argument("--startup-pages", type=int, default=1_000_000)
    ap.add_argument("--tmp", default=None, help="directory for the start-up file store (default: the temp dir)")
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: trace,scale,startup")
    ap.add_argument("--no-write", action="store_true", help="print only; no results/index.json, no README")
    args = ap.parse_args(argv)
    if args.quick:
        args.roots, args.branches, args.repeats = min(args.roots, 20), min(args.branches, 20), 1
        args.scale_pages, args.startup_pages = 65536, 20000
    args.page_sizes = [int(x) for x in args.page_sizes.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    warm_up()
    res = {"time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "loadavg_start": loadavg(),
           "repeats": args.repeats, "python": sys.version.split()[0],
           "params": {k: v for k, v in vars(args).items() if k not in ("tmp",)}}
    if "trace" not in skip:
        res["trace"] = bench_trace(args)
    if "scale" not in skip:
        res["scale"] = bench_scale(args)
        print(f"scale: done (load {loadavg():.2f})", flush=True)
    if "startup" not in skip:
        res["startup"] = bench_startup(args)
    res["loadavg_end"] = loadavg()
    res["code"] = code_state()
    body = table(res) if "trace" in res else json.dumps(res, indent=1, default=str)
    print(body)
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "index.json").write_text(json.dumps(res, indent=1))
        replace_section(f"## {SECTION}\n\n`benchmarks/index.py` (issue 9): tierkv's prefix index and page hashing "
                        f"against SGLang's RadixCache in one process, and the index at scale "
                        f"(docs/architecture.md §9). Results: `results/index.json`.\n\n{body}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
