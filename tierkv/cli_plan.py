"""``tierkv plan TRACE --l2 SIZES --l3 SIZES``: size L2 and L3 by replaying a request trace.

Each request goes through tierkv's own scheduler side (:class:`tierkv.connector.core.scheduler.CacheScheduler`: its
radix index, slot allocator and eviction policy, ``num_slots`` = the L2 size) as the test fake engine drives it: add,
look up, allocate, save full pages, plan, finish; no engine, no page bytes. ``--policy`` takes several policies (or
``all``): each is replayed, for L2 and for the L3 model alike. Modelled, not tierkv's code: L3
(:mod:`tierkv.plan_l3`: the engine's controller over page keys in the file store's eviction order, refreshed by L3
reads and writes only; no L2, no L3); one request at a time in file order; L1 none by default (``--l1 PAGES``: an LRU of blocks, ``--l1 recorded``:
each lookup's recorded L1 hit).

Traces (JSON lines): vLLM's ``timed_trace`` (``hash_ids`` one per chunk, ``input_length``, ``output_length``; the page
size is the chunk size the trace shows, :mod:`tierkv.plan_chunks`; page i's key chains ids 0..i; output pages saved
unless ``--no-output-pages``), or tierkv's lookup trace (``trace_path``, :mod:`tierkv.connector.obs.lookup_trace`).
A malformed line is one error naming the file and line (exit 2, :mod:`tierkv.cli_common`).
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

from tierkv.cli_common import EXIT_OK, EXIT_USAGE, CliError, fail, progress
from tierkv.plan_chunks import ChunkFit, agreeing, detect
from tierkv.storage_backends.eviction import POLICIES

DEFAULT_PAGE_SIZE = 32


@dataclass
class TraceRequest:
    """One request to replay: ``keys`` of every full page it saves, the first ``lookup_pages`` of which its lookup
    offers; the per-request caps and ``keep`` of a recorded trace; the outcome the recording engine saw (recorded
    traces)."""

    keys: list[bytes]
    lookup_pages: int
    load_cap: Optional[int] = None
    save_cap: Optional[int] = None
    recorded: dict = field(default_factory=dict)
    keep: bool = False  # its pages bypass L3 admission (request control ``keep``)


@dataclass
class Trace:
    kind: str                       # "timed_trace" or "tierkv"
    page_size: int
    requests: list[TraceRequest]
    header: dict = field(default_factory=dict)
    page_size_from: str = "given"   # "given" (--page-size), "detected", "default", "recorded" (the trace's header)
    chunks: Optional[ChunkFit] = None  # timed_trace: how well the page size explains input_length vs hash_ids


class _Len:
    """A token sequence of which the scheduler side only reads the length (``len(st.tokens)``)."""

    __slots__ = ("n",)

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


class _GivenKeys:
    """Stands in for :class:`tierkv.connector.core.page_hash.RequestKeys`: the page keys come from the trace, not from
    hashing token ids. ``extend(tokens)`` returns the keys of the full pages of ``len(tokens)`` tokens."""

    __slots__ = ("keys", "page_size")

    def __init__(self, keys: list[bytes], page_size: int):
        self.keys, self.page_size = keys, page_size

    def extend(self, token_ids) -> list[bytes]:
        n = len(token_ids) // self.page_size
        return self.keys if n >= len(self.keys) else self.keys[:n]


# --------------------------------------------------------------------------------------------- reading traces
def _bad(path: str, lineno: int, what: str) -> CliError:
    return CliError(EXIT_USAGE, f"{path}:{lineno}: {what}")


def _int(v, path: str, lineno: int, name: str, minimum: int = 0) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise _bad(path, lineno, f"'{name}' must be an integer >= {minimum}, got {str(v)[:40]!r}")
    return v


_TIMED_ROOT = b"tierkv-plan/timed_trace/root"


def _chain(prev: bytes, item: bytes) -> bytes:
    return hashlib.blake2b(item, digest_size=16, key=prev).digest()


def _lines(f, path: str):
    try:
        yield from f
    except (OSError, EOFError) as e:  # a damaged or truncated .gz
        raise CliError(EXIT_USAGE, f"cannot read trace {path}: {e}") from None


def read_trace(path: str, page_size: Optional[int] = None, output_pages: bool = True) -> Trace:
    """Parse a trace file (either format, see the module docstring; gzip-compressed when its name ends in ``.gz``).

    Raises:
        CliError(EXIT_USAGE): an unreadable or empty file, or a malformed line (the message names its number).
    """
    from tierkv.connector.obs.lookup_trace import FORMAT, HEADER_KEY

    try:
        f = gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")
    except OSError as e:
        raise CliError(EXIT_USAGE, f"cannot read trace {path}: {e.strerror or e}") from None
    kind: Optional[str] = None
    header: dict = {}
    ps = page_size
    reqs: list[TraceRequest] = []
    timed: list[tuple[int, list, int, int]] = []  # (line, hash_ids, input_length, output_length)
    with f:
        for lineno, raw in enumerate(_lines(f, path), 1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as e:
                raise _bad(path, lineno, f"not a JSON line ({str(e)[:80]})") from None
            if not isinstance(rec, dict):
                raise _bad(path, lineno, "expected a JSON object per line")
            if HEADER_KEY in rec:
                if kind is not None:
                    raise _bad(path, lineno, "a tierkv trace header after the first line")
                if rec[HEADER_KEY] != FORMAT:
                    raise _bad(path, lineno, f"tierkv lookup trace format {rec[HEADER_KEY]!r}; this tierkv reads "
                                             f"format {FORMAT}")
                rec_ps = _int(rec.get("page_size"), path, lineno, "page_size", 1)
                if ps is not None and ps != rec_ps:
                    raise _bad(path, lineno, f"the trace was recorded with page_size {rec_ps}, not --page-size {ps}")
                kind, header, ps = "tierkv", rec, rec_ps
                continue
            if "hash_ids" in rec:
                if kind not in (None, "timed_trace"):
                    raise _bad(path, lineno, "a timed_trace line ('hash_ids') in a tierkv lookup trace")
                kind = "timed_trace"
                ids = rec["hash_ids"]
                if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
                    raise _bad(path, lineno, "'hash_ids' must be a list of integers")
                n_in = _int(rec.get("input_length"), path, lineno, "input_length")
                n_out = _int(rec.get("output_length", 0), path, lineno, "output_length")
                timed.append((lineno, ids, n_in, n_out))
                continue
            if "keys" in rec:
                if kind != "tierkv":
                    raise _bad(path, lineno, "a lookup record ('keys') without the tierkv trace header on line 1")
                ks = rec["keys"]
                if not isinstance(ks, list):
                    raise _bad(path, lineno, "'keys' must be a list of hex page keys")
                try:
                    keys = [bytes.fromhex(k) for k in ks]
                except (TypeError, ValueError):
                    keys = []
                if len(keys) != len(ks) or any(len(k) != 16 for k in keys):
                    raise _bad(path, lineno, "'keys' must be page keys of 32 hex characters")
                lp = _int(rec.get("lookup_pages"), path, lineno, "lookup_pages")
                if lp > len(keys):
                    raise _bad(path, lineno, f"'lookup_pages' {lp} exceeds the {len(keys)} keys given")
                caps = [None if rec.get(c) is None else _int(rec[c], path, lineno, c) for c in ("load_cap", "save_cap")]
                out = rec.get("outcome", {})
                if not isinstance(out, dict) or not all(isinstance(v, int) for v in out.values()):
                    raise _bad(path, lineno, "'outcome' must map parts to token counts")
                keep = rec.get("keep", False)
                if not isinstance(keep, bool):
                    raise _bad(path, lineno, "'keep' must be true or false")
                reqs.append(TraceRequest(keys, lp, caps[0], caps[1], out, keep))
                continue
            raise _bad(path, lineno, "neither a timed_trace line ('hash_ids') nor a tierkv lookup record ('keys')")
    source = "recorded" if kind == "tierkv" else "given" if page_size is not None else "default"
    fit = None
    if timed:
        ps, source, fit = timed_page_size(path, [(n_in, len(ids)) for _l, ids, n_in, _o in timed], page_size)
        reqs = [timed_request(ids, n_in, n_out, ps, i, lineno, output_pages)
                for i, (lineno, ids, n_in, n_out) in enumerate(timed)]
    if not reqs:
        raise CliError(EXIT_USAGE, f"{path}: no requests in the trace")
    return Trace(kind or "timed_trace", ps or DEFAULT_PAGE_SIZE, reqs, header, source, fit)


def timed_page_size(path: str, records: list, page_size: Optional[int]):
    """The page size of a timed_trace of ``(input_length, n_ids)`` records: ``page_size`` (``--page-size``) if given
    and it explains most records, else the chunk size the trace shows (:func:`tierkv.plan_chunks.detect`).
    Returns ``(size, "given" | "detected" | "default", ChunkFit)``.

    Raises:
        CliError(EXIT_USAGE): ``--page-size`` given and most records disagree with it, or no size explains most
            records (the message names ``--page-size`` and the size the trace shows, if any).
    """
    fit = detect(records)
    total = len(records)
    if page_size is not None:
        agree = agreeing(records, page_size)
        if 2 * agree > total:
            return page_size, "given", fit
        hint = (f"; the trace's chunks are {fit.size} tokens ({fit.agree} of {total} agree): give --page-size "
                f"{fit.size} or leave it out" if fit.size and 2 * fit.agree > total else
                "; no chunk size explains most of them")
        raise CliError(EXIT_USAGE, f"{path}: --page-size {page_size} disagrees with the trace: {total - agree} of "
                                   f"{total} requests do not have ceil(input_length / {page_size}) hash ids{hint}")
    if fit.size and 2 * fit.agree > total:
        return fit.size, "detected", fit
    if 2 * agreeing(records, DEFAULT_PAGE_SIZE) > total:
        return DEFAULT_PAGE_SIZE, "default", fit
    raise CliError(EXIT_USAGE, f"{path}: cannot tell how many tokens one hash id stands for: no chunk size gives "
                               "ceil(input_length / size) hash ids for most requests; give --page-size")


def timed_request(ids: list, n_in: int, n_out: int, ps: int, i: int, lineno: int, output_pages: bool) -> TraceRequest:
    """Request ``i`` of a timed_trace (line ``lineno``): page keys chained from its hash ids, then keys of its own
    for the pages no other request shares (a cut chunk, pages past the ids, generated tokens)."""
    root = _TIMED_ROOT
    full_in = n_in // ps
    keys: list[bytes] = []
    prev = root
    for h in ids[:full_in]:
        prev = _chain(prev, str(h).encode())
        keys.append(prev)
    computed = n_in + n_out - 1 if (output_pages and n_out > 0) else n_in
    own = _chain(root, f"request {i} line {lineno}".encode())
    for j in range(len(keys), computed // ps):
        keys.append(_chain(own, str(j).encode()))
    return TraceRequest(keys, max(0, (n_in - 1) // ps))


# --------------------------------------------------------------------------------------------- replay
def replay(trace: Trace, l2_pages: int, l3_pages: int = 0, policy: str = "lru", l1=None,
           l3_policy: Optional[str] = None, admission: str = "always") -> dict:
    """Replay ``trace`` through a :class:`CacheScheduler` of ``l2_pages`` slots evicting in ``policy`` order and, with
    ``l3_pages``, its L3 controller (admitting pages by ``admission``) over a store of that many pages evicting in the
    same order, or in ``l3_policy``'s (:mod:`tierkv.plan_l3`).

    ``l1``: None (no L1 model), a number of pages (vLLM's prefix cache as an LRU of blocks: a request hits the
    longest run of its first pages held there, and afterwards holds all of its pages, its first ones freed last), or
    ``"recorded"`` (a recorded trace: each lookup's L1 tokens as the recording engine saw them). tierkv is then asked
    for the pages after the L1 hit, as vLLM asks it.

    Returns the tokens of every lookup per tier: ``lookup_tokens``, ``l1_tokens``, ``l2_tokens``, ``l3_tokens``,
    ``miss_tokens``, ``hit_rate`` ((L1 + L2 + L3) / lookup), and the scheduler's ``evicted_pages`` and
    ``save_skipped_pages``; with L3 also ``l3_written_pages`` (pages backed up, under ``admission``:
    :mod:`tierkv.plan_admission`)."""
    from tierkv.connector.core.page_hash import ModelNamespace
    from tierkv.connector.core.scheduler import CacheScheduler

    from tierkv.plan_l3 import PolicyStore, controller_kwargs, run_jobs

    ps = trace.page_size
    store = PolicyStore(l3_pages, l3_policy or policy) if l3_pages and l2_pages else None  # tierkv reads L3 only through L2: no L2, no L3
    sched = CacheScheduler(ModelNamespace("tierkv-plan", "-", "-", ps, 1, 1, 1), ps, ps, l2_pages, policy,
                           controller=None if store is None else controller_kwargs(store, admission))
    l1_lru: "OrderedDict[bytes, None]" = OrderedDict()
    lookup = 0
    for i, r in enumerate(trace.requests):
        rid = f"r{i}"
        n_keys = len(r.keys)
        # a prompt of k + 1 tokens past its lookup pages: (len - 1) // ps = lookup_pages, len // ps <= its keys
        tokens = _Len(r.lookup_pages * ps + 1 if r.lookup_pages < n_keys else n_keys * ps + 1)
        sched.add_request(rid, tokens)
        st = sched.requests[rid]
        st.keys = _GivenKeys(r.keys, ps)
        st.load_cap, st.save_cap, st.keep = r.load_cap, r.save_cap, r.keep
        n1 = 0  # pages the engine's own cache (L1) serves
        if l1 == "recorded":
            n1 = min(r.lookup_pages, r.recorded.get("l1", 0) // ps)
        elif l1:
            while n1 < r.lookup_pages and r.keys[n1] in l1_lru:
                n1 += 1
        ext = sched.lookup(rid, n1 * ps)
        while ext is None:  # an answer pending (an existence query): the engine steps and asks again
            run_jobs(sched, sched.build_plan(), store)
            ext = sched.lookup(rid, n1 * ps)
        lookup += r.lookup_pages * ps
        blocks = list(range(n_keys + 1))
        reads = store is not None and ext and sched.lookup_is_async(rid)
        sched.on_alloc(rid, blocks, ext)
        if reads:  # the L3 read (an asynchronous load), then the request goes on
            bad = run_jobs(sched, sched.build_plan(), store)
            sched.on_finished_recving({rid}, bad)
            sched.on_load_errors(bad)
            sched.on_alloc(rid, blocks, 0)
        tokens.n = max(tokens.n, n_keys * ps)
        sched.schedule_saves(rid, tokens.n, blocks)
        plan = sched.build_plan()
        sched.on_finished(rid)
        if store is not None:  # the step's backups (write-through), and any a failed read ordered again
            run_jobs(sched, plan, store)
            while sched.ctl.pending_jobs():
                run_jobs(sched, sched.build_plan(), store)
        if l1 and l1 != "recorded":  # vLLM frees a request's blocks last one first: its first pages stay longest
            for k in reversed(r.keys):
                l1_lru[k] = None
                l1_lru.move_to_end(k)
            while len(l1_lru) > l1:
                l1_lru.popitem(last=False)
    c, got = sched.counters, sched.lookup_stats.tokens
    tot = {"lookup_tokens": lookup, "l1_tokens": got["l1"], "l2_tokens": got["l2"], "l3_tokens": got["l3"]}
    tot["miss_tokens"] = lookup - tot["l1_tokens"] - tot["l2_tokens"] - tot["l3_tokens"]
    tot.update(policy=policy, l3_policy=l3_policy or policy, l2_pages=l2_pages, l3_pages=l3_pages,
               hit_rate=(tot["l1_tokens"] + tot["l2_tokens"] + tot["l3_tokens"]) / lookup if lookup else 0.0,
               evicted_pages=c.evicted_pages, save_skipped_pages=c.save_skipped_pages)
    if sched.ctl is not None:
        tot.update(l3_written_pages=sched.ctl.counters.backup_stored_pages, **sched.ctl.admission.stats())
    return tot


def recorded_totals(trace: Trace) -> dict:
    """Tokens per outcome part summed over a recorded trace (what the recording engine saw)."""
    out: dict = {}
    for r in trace.requests:
        for k, v in r.recorded.items():
            out[k] = out.get(k, 0) + v
    return out


# --------------------------------------------------------------------------------------------- output
def parse_sizes(text: str, flag: str, page_bytes: Optional[int] = None, record_overhead: int = 0) -> list[int]:
    """``"256,1024,4096"`` -> ``[256, 1024, 4096]`` (pages, each >= 0, duplicates dropped, order kept). A size with a
    unit (``8GiB``, ``500GB``, ``1.5TiB``; :func:`tierkv.storage_backends.common.parse_bytes`) is bytes: the pages of
    ``page_bytes`` (plus ``record_overhead`` bytes each, L3's record header) that fit in it.

    Raises:
        CliError(EXIT_USAGE): a part that is neither, or bytes without ``page_bytes`` (naming ``flag`` and
            ``--page-bytes``).
    """
    from tierkv.storage_backends.common import parse_bytes

    out: list[int] = []
    for part in text.split(","):
        p = part.strip().replace("_", "")
        if p.isdigit():
            n = int(p)
        else:
            try:
                b = parse_bytes(p) if p[-1:].isalpha() else None
            except ValueError:
                b = None
            if b is None or b < 0:
                raise CliError(EXIT_USAGE, f"{flag} {text!r}: expected page counts or byte sizes separated by "
                                           "commas, e.g. 256,1024 or 8GiB,32GiB")
            if not page_bytes:
                raise CliError(EXIT_USAGE, f"{flag} {part.strip()}: a size in bytes needs --page-bytes (bytes of one "
                                           "page, all layers, as the engine's start-up line 'L2 N pages x B B' shows)")
            n = b // (page_bytes + record_overhead)
        if n not in out:
            out.append(n)
    return out


def parse_page_bytes(text: Optional[str]) -> Optional[int]:
    """``--page-bytes``: an int or a size with a unit (``2MiB``), > 0; None when not given."""
    from tierkv.storage_backends.common import parse_bytes

    if text is None:
        return None
    try:
        v = parse_bytes(text.strip())
    except ValueError:
        v = 0
    if v <= 0:
        raise CliError(EXIT_USAGE, f"--page-bytes {text!r}: bytes of one page, a positive int or a size like 2MiB")
    return v


def parse_policies(text: Optional[str], default: str) -> list[str]:
    """``--policy``: ``"lru"``, ``"lru,slru"`` or ``"all"`` -> the policies to replay (duplicates dropped, order kept);
    ``default`` when not given.

    Raises:
        CliError(EXIT_USAGE): a name that is not a policy (the message lists them).
    """
    if text is None:
        text = default
    names = list(POLICIES) if text.strip() == "all" else [p.strip() for p in text.split(",")]
    bad = [n for n in names if n not in POLICIES]
    if bad or not names:
        raise CliError(EXIT_USAGE, f"--policy {text!r}: eviction policies separated by commas, or all; each one of "
                                   f"{', '.join(POLICIES)}")
    return list(dict.fromkeys(names))


def format_table(rows: list[dict], l1: bool = False) -> str:
    """One line per pair of sizes (and policy, when the rows have several); the L1 tokens column only with an L1
    model."""
    many = len({r.get("policy") for r in rows}) > 1
    head = (f"{'policy':>7} " if many else "") + f"{'L2 pages':>9} {'L3 pages':>9} {'hit rate':>9}" + (
        f" {'L1 tokens':>12}" if l1 else "")
    lines = [head + f" {'L2 tokens':>12} {'L3 tokens':>12} {'miss tokens':>12}"]
    for r in rows:
        lines.append((f"{r['policy']:>7} " if many else "") + f"{r['l2_pages']:>9} {r['l3_pages']:>9} "
                     f"{100 * r['hit_rate']:>8.1f}%"
                     + (f" {r['l1_tokens']:>12,}" if l1 else "")
                     + f" {r['l2_tokens']:>12,} {r['l3_tokens']:>12,} {r['miss_tokens']:>12,}")
    return "\n".join(lines)


def write_chart(rows: list[dict], path: str, title: str) -> None:
    """Hit rate against L2 size, one line per L3 size (and policy: one line style each), plus each pair's tokens per
    tier as stacked bars (of the first policy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    l3s = sorted({r["l3_pages"] for r in rows})
    l2s = sorted({r["l2_pages"] for r in rows})
    pols = list(dict.fromkeys(r.get("policy", "") for r in rows))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = ("-", "--", ":", "-.")
    for li, l3 in enumerate(l3s):
        for pi, pol in enumerate(pols):
            pts = sorted((r["l2_pages"], 100 * r["hit_rate"]) for r in rows
                         if r["l3_pages"] == l3 and r.get("policy", "") == pol)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=f"C{li}",
                    linestyle=styles[pi % len(styles)],
                    label=f"L3 {l3} pages" + (f", {pol}" if len(pols) > 1 else ""))
    if len(l2s) > 1 and min(l2s) > 0 and max(l2s) / min(l2s) >= 10:
        ax.set_xscale("log")
    # one label per planned size, in plain numbers (a log axis labels every minor tick in powers of ten, which
    # overlap), turned so that long sizes do not run into each other
    ax.set_xticks(l2s)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _p: f"{v:,.0f}"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.tick_params(axis="x", labelrotation=45)
    ax.set_xlabel("L2 size (pages)")
    ax.set_ylabel("hit rate (% of lookup tokens)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    rows = [r for r in rows if r.get("policy", "") == pols[0]]
    labels = [f"{r['l2_pages']}/{r['l3_pages']}" for r in rows]
    x = range(len(rows))
    bottom = [0] * len(rows)
    parts = (("l2_tokens", "L2"), ("l3_tokens", "L3"), ("miss_tokens", "miss"))
    if any(r["l1_tokens"] for r in rows):
        parts = (("l1_tokens", "L1"),) + parts
    for key, name in parts:
        vals = [r[key] for r in rows]
        bx.bar(x, vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    bx.set_xticks(list(x))
    bx.set_xticklabels(labels, rotation=45, ha="right")
    bx.set_xlabel("L2 / L3 pages" + (f" ({pols[0]})" if len(pols) > 1 else ""))
    bx.set_ylabel("lookup tokens")
    bx.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def page_size_note(trace: Trace) -> str:
    """Where the page size came from, for the summary line: `` (detected: N of M requests have ceil(input_length /
    size) hash ids)``, `` (--page-size)``, `` (the trace's header)`` or, for the fallback, `` (default)``."""
    c = trace.chunks
    if trace.page_size_from == "detected" and c is not None:
        return f" (detected from the trace: {c.agree:,} of {c.total:,} requests have ceil(input_length / size) hash ids)"
    return {"given": " (--page-size)", "recorded": " (the trace's header)", "default": " (default)"}.get(
        trace.page_size_from, "")


def cmd_plan(args) -> int:
    from tierkv.storage_backends.page_format import HEADER_BYTES

    page_bytes = parse_page_bytes(args.page_bytes)
    l2s = parse_sizes(args.l2, "--l2", page_bytes) if args.l2 is not None else None
    l3s = parse_sizes(args.l3, "--l3", page_bytes, HEADER_BYTES)  # L3 stores hold each page as header + payload
    if args.page_size is not None and args.page_size < 1:
        raise CliError(EXIT_USAGE, f"--page-size {args.page_size}: must be >= 1")
    if args.chart and not os.path.isdir(os.path.dirname(os.path.abspath(args.chart))):  # before the replays
        raise CliError(EXIT_USAGE, f"cannot write chart {args.chart}: No such directory")
    trace = read_trace(args.trace, args.page_size, output_pages=not args.no_output_pages)
    if l2s is None:  # a recorded trace: the recording engine's L2 size, else 1024 pages
        rec_l2 = trace.header.get("l2_pages")
        l2s = [rec_l2 if isinstance(rec_l2, int) and not isinstance(rec_l2, bool) and rec_l2 >= 0 else 1024]
    l1 = None
    if args.l1 == "recorded":
        if trace.kind != "tierkv":
            raise CliError(EXIT_USAGE, "--l1 recorded needs a trace tierkv recorded (trace_path), not a timed_trace")
        l1 = "recorded"
    elif args.l1 is not None:
        if not args.l1.isdigit():
            raise CliError(EXIT_USAGE, f"--l1 {args.l1!r}: a number of pages, or 'recorded'")
        l1 = int(args.l1) or None
    policies = parse_policies(args.policy, trace.header.get("eviction_policy", "lru"))
    policy = ",".join(policies)
    if args.admission is not None:  # one replay per admission mode and pair of sizes (tierkv/plan_admission.py)
        if len(policies) != 1:
            raise CliError(EXIT_USAGE, "--admission compares admission modes under one eviction policy: give one "
                           f"--policy, not {policy!r}")
        from tierkv.plan_admission import cmd_admission
        return cmd_admission(args, trace, l2s, l3s, page_bytes, policy, l1)
    rows = []
    bar = progress(len(l2s) * len(l3s) * len(policies), "replaying", quiet=args.json, unit="replay")
    with bar:
        for pol in policies:
            for l3 in l3s:
                for l2 in l2s:
                    rows.append(replay(trace, l2, l3, pol, l1, args.l3_policy))
                    bar.update(1)
    desc = (f"{args.trace}: {trace.kind}, {len(trace.requests)} requests, page {trace.page_size} tokens"
            f"{page_size_note(trace)}, policy "
            f"{policy}; replayed one request at a time through tierkv's scheduler side and L3 controller (L3 written "
            f"through, evicting in {'the same policy' if not args.l3_policy else args.l3_policy}'s order, refreshed by "
            "L3 reads and writes, not by L2 hits), "
            + ("no L1 model" if l1 is None else "L1 as recorded" if l1 == "recorded" else
               f"L1 an LRU of {l1} pages"))
    if page_bytes:
        desc += (f"\npage {page_bytes:,} bytes: a size in bytes is L2 bytes / page bytes pages, L3 bytes / "
                 f"(page bytes + {HEADER_BYTES}-byte record header) pages")
        for r in rows:
            r.update(l2_bytes=r["l2_pages"] * page_bytes, l3_bytes=r["l3_pages"] * (page_bytes + HEADER_BYTES))
    rec = recorded_totals(trace) if trace.kind == "tierkv" else {}
    if args.chart:
        try:
            write_chart(rows, args.chart, f"tierkv plan: {args.trace} ({policy})")
        except OSError as e:
            raise CliError(EXIT_USAGE, f"cannot write chart {args.chart}: {e.strerror or e}") from None
    if args.json:
        print(json.dumps({"trace": args.trace, "format": trace.kind, "requests": len(trace.requests),
                          "page_size": trace.page_size, "page_size_from": trace.page_size_from,
                          "page_bytes": page_bytes, "policy": policy, "policies": policies,
                          "l3_policy": args.l3_policy, "l1": l1, "recorded": rec or None, "results": rows},
                         indent=1))
        return EXIT_OK
    print(desc)
    print(format_table(rows, l1 is not None))
    if rec:
        hdr = trace.header
        print(f"recorded run (L2 {hdr.get('l2_pages')} pages, {hdr.get('eviction_policy')}): "
              + ", ".join(f"{k} {v:,}" for k, v in sorted(rec.items())) + " tokens")
    if args.chart:
        print(f"chart: {args.chart}")
    return EXIT_OK


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.description = ("Replay a request trace through tierkv's index and eviction code for each pair of L2 and L3 "
                     "sizes and print the hit rate and the tokens served per tier (L2, L3, miss). TRACE: vLLM's "
                     "timed_trace JSONL (hash_ids per request) or a lookup trace tierkv wrote (config trace_path).")
    p.epilog = "exit codes: 0 ok, 2 bad input (missing or malformed trace: the line is named, bad sizes)"
    p.add_argument("trace", metavar="TRACE", help="JSONL trace file")
    p.add_argument("--l2", default=None, metavar="SIZES",
                   help="L2 sizes in pages, comma-separated, e.g. 256,1024,4096, or in bytes with --page-bytes, e.g. "
                        "4GiB,8GiB (default: a recorded trace's own L2 size, else 1024 pages)")
    p.add_argument("--l3", default="0", metavar="SIZES",
                   help="L3 sizes in pages, comma-separated (default 0: no L3), e.g. 0,16384, or in bytes with "
                        "--page-bytes, e.g. 100GiB (each L3 record is the page plus a 64-byte header)")
    p.add_argument("--page-bytes", default=None, metavar="BYTES",
                   help="bytes of one page of the trace's page size, all layers of one rank (vLLM: the engine's "
                        "start-up line 'L2 N pages x B B' for its page size); needed for sizes in bytes")
    p.add_argument("--policy", default=None, metavar="POLICIES",
                   help="eviction policies of L2 and of the L3 model, comma-separated, or all: lru, lfu, slru, s3fifo; "
                        "each is replayed and reported (default: the recorded trace's, else lru)")
    p.add_argument("--l3-policy", default=None, choices=POLICIES,
                   help="eviction policy of the L3 model for every replay (default: each replay's --policy)")
    p.add_argument("--page-size", type=int, default=None,
                   help="tokens per page = per hash id of a timed_trace (default: detected from the trace, the size "
                        "for which each request has ceil(input_length / size) hash ids, e.g. 512 for Mooncake's "
                        "traces; refused when most requests disagree with it; a recorded trace names its own)")
    p.add_argument("--l1", metavar="PAGES|recorded", default=None,
                   help="model vLLM's own prefix cache (L1) as an LRU of PAGES blocks, or take each lookup's L1 hit "
                        "from a recorded trace; default: no L1 model (what L1 would serve counts as L2 or L3 hits)")
    p.add_argument("--no-output-pages", action="store_true",
                   help="timed_trace: do not model the pages of generated tokens (the engine saves them too)")
    p.add_argument("--admission", metavar="LIST", default=None,
                   help="L3 admission modes to compare, comma-separated (always, second_sight, reused_in_l2): per "
                        "mode the hit rate, pages (and with --page-bytes bytes) written to L3 and tokens per tier")
    p.add_argument("--chart", metavar="PATH", default=None, help="write a chart (PNG, matplotlib) to PATH")
    p.add_argument("--json", action="store_true", help="print JSON")
    return p


def run(args: argparse.Namespace) -> int:
    try:
        return cmd_plan(args)
    except CliError as e:
        return fail("tierkv plan", e)
