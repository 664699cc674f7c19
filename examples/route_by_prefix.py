"""Route each request to the engine that holds the longest prefix of it, learned from the engines' KV events.

A prefix-aware router (llm-d's KV cache indexer, Dynamo's KV router, SGLang's router) keeps, per engine, which
blocks it holds, from vLLM's KV events (``--kv-events-config``). vLLM announces its own L1 blocks
(``medium="GPU"``); tierkv announces its L2 (``medium="CPU"``) and L3 (``medium="STORAGE"``,
``ownership="L3:<backend>"``) with the same block hashes, parents and token ids (``connector/obs/kv_events.py``). This
example is such a router, written against those events only (no tierkv import):

- **Bookkeeping** (:class:`FleetView`): every ``BlockStored`` block gets a *content key*, the router's own chained
  hash of the token ids, LoRA name and extra keys of the block and of every block before it (:func:`chain_key`). It
  is computed from the tokens, not taken from vLLM's block hash, because two engines give the same tokens the same
  hash only if they share the hash seed (vLLM 0.32 seeds its ``NONE_HASH`` from ``PYTHONHASHSEED`` when set, and
  with a non-cryptographic ``--prefix-caching-hash-algo`` from random bytes per process otherwise); the events
  carry the tokens and the parent hash, which is all the chain needs. Per engine the view keeps
  ``{vLLM block hash: content key}`` and the set of content keys in L1 and in L2; L3 is kept per store
  (``ownership``), shared by every engine that announced that store: a page one engine wrote to a shared Mooncake
  or tierkv server is loadable by the others. ``BlockRemoved`` removes the block from the tier named by its
  ``medium`` (L1 for ``GPU`` or none, L2 for ``CPU``, the ``ownership`` store for ``STORAGE``);
  ``AllBlocksCleared`` empties the engine's L1.
- **Choice** (:class:`PrefixRouter`): for a prompt the router computes the content keys of its full blocks
  (:func:`prompt_keys`) and, per engine, walks them from the first: a block counts in the best tier that holds it on
  that engine (L1, else L2, else a shared L3 store the engine uses); the walk stops at the first block no tier
  holds, and never covers the block holding the prompt's last token (vLLM computes that one). The score is the
  sum over those blocks of ``block_size * weight[tier]``; the highest score wins, ties go to the engine with the
  fewest requests so far (then the first named), which also spreads cold requests. Weights (``--weights``) say
  what fraction of the prefill of a token a hit in that tier saves: L1 1.0 (nothing to move), L2 0.9 (a host
  memory copy; the README's demo serves L2 prefixes at a sixth to a tenth of the recompute TTFT), L3 0.7 (a read over
  the network into L2 and then a copy; benchmarks/README.md's l3_hit_ttft measured file-store hits at about a
  fifth of the recompute TTFT on one host, and a remote store is slower). ``round_robin`` ignores the view.

The command line drives a fleet: ``--engine NAME=HTTP_BASE,EVENTS_ENDPOINT`` per engine (the engine's OpenAI
server and its ZMQ publisher, bound with ``tcp://*:PORT`` and its ``topic`` set to ``NAME``); one SUB socket
connects to every publisher and tells the engines apart by topic. Steps:

1. Warm-up: each engine answers a two-block request until its L1 event reaches the router (a ZMQ subscription
   becomes effective some time after connecting; batches published before that are lost).
2. Cross-host check: a document is answered by the first engine; once the router saw all its full blocks in L3,
   the same request (temperature 0) is sent to the second engine, which must load them from L3 (its
   ``vllm:tierkv_lookup_outcome_tokens_total{outcome="l3"}`` grows by the document's full-block tokens) and answer
   with the same token ids.
3. The same request sequence (``--docs`` documents of ``--doc-blocks`` blocks, each asked ``--repeats`` times with
   a new question, in a seeded order that mixes near and far reuse) is routed by prefix and then round-robin. A
   policy's requests carry their own ``cache_salt``, so neither policy finds the other's pages in any tier (vLLM
   and tierkv both key pages by the salt). Per policy it records per request the engine and the predicted tokens
   per tier, and per engine the change of tierkv's lookup outcome counters (what the engines really served from
   L1, L2 and L3, and recomputed) over the policy's requests.

The result JSON (``--out``) holds all of it; the summary printed at the end gives tokens served per tier, weighted
tokens saved and the difference between the two policies. Errors: a malformed ``--engine`` or ``--weights`` exits
with a message naming the flag and the expected form; an engine that stops answering raises.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from array import array
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

L1, L2, L3 = "L1", "L2", "L3"
TIERS = (L1, L2, L3)
#: fraction of a token's prefill a hit in each tier saves (module docstring: where the numbers come from)
DEFAULT_WEIGHTS = {L1: 1.0, L2: 0.9, L3: 0.7}
#: vLLM event ``medium`` -> tier; None is vLLM's own L1 (``BlockRemoved`` of older publishers)
TIER_OF_MEDIUM = {"GPU": L1, None: L1, "CPU": L2, "STORAGE": L3}
POLICIES = ("prefix", "round_robin")
#: tierkv's lookup outcome labels (``vllm:tierkv_lookup_outcome_tokens_total``) reported per engine
OUTCOMES = ("l1", "l2", "l3", "miss", "declined_slow", "no_room", "late", "failed", "skipped", "aborted")


# --------------------------------------------------------------------------------------------------------------
# bookkeeping (pure: no sockets)
# --------------------------------------------------------------------------------------------------------------

def _norm_extra(extra: Optional[Iterable[Any]]) -> tuple:
    """A block's extra keys as a tuple of str (None and empty are the same: no extra keys)."""
    return tuple(str(x) for x in extra) if extra else ()


def chain_key(parent: Optional[bytes], tokens: Sequence[int], lora_name: Optional[str] = None,
              extra: Optional[Iterable[Any]] = None) -> bytes:
    """The router's content key of a block (16 bytes, BLAKE2b): the parent block's key (None for the first block),
    the block's token ids (as signed 32-bit ints), its LoRA name and its extra keys as vLLM publishes them
    (``extra_keys[i]`` of a ``BlockStored``: LoRA name, cache salt on the first block, multimodal identifiers).
    Equal keys mean the same tokens after the same prefix under the same adapter and salt, on any engine."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if parent is not None else b"\0" * 16)
    h.update(array("i", tokens).tobytes())
    h.update(repr((lora_name, _norm_extra(extra))).encode())
    return h.digest()


def prompt_keys(tokens: Sequence[int], block_size: int, lora_name: Optional[str] = None,
                cache_salt: Optional[str] = None) -> list[bytes]:
    """Content keys of the full blocks of a prompt (``len(tokens) // block_size`` keys), with the extra keys vLLM
    gives them: the LoRA name on every block when there is one, then the cache salt on the first block only."""
    keys: list[bytes] = []
    parent = None
    for i in range(len(tokens) // block_size):
        extra = ([lora_name] if lora_name else []) + ([cache_salt] if i == 0 and cache_salt else [])
        parent = chain_key(parent, tokens[i * block_size:(i + 1) * block_size], lora_name, extra)
        keys.append(parent)
    return keys


@dataclass
class EngineState:
    """What one engine holds, by content key: ``l1`` and ``l2`` sets, ``l3_stores`` (the ``ownership`` names of the
    L3 stores it announced), ``by_hash`` ({vLLM block hash: content key} of every block it announced), counts of
    events applied and of events naming a parent hash it never announced (``orphans``: their blocks are skipped)."""
    name: str
    l1: set = field(default_factory=set)
    l2: set = field(default_factory=set)
    l3_stores: set = field(default_factory=set)
    by_hash: dict = field(default_factory=dict)
    events: int = 0
    orphans: int = 0
    block_size: Optional[int] = None


class FleetView:
    """Per engine, which blocks (content keys) are in L1 and L2, and per L3 store which are there (shared by every
    engine that announced the store). Fed with vLLM event objects (``BlockStored``, ``BlockRemoved``,
    ``AllBlocksCleared``; anything with the same attributes) through :meth:`apply`."""

    def __init__(self, engines: Sequence[str]):
        self.engines = {n: EngineState(n) for n in engines}
        self.l3: dict[str, set] = {}

    def apply(self, engine: str, event: Any) -> None:
        """Apply one event published by ``engine`` (KeyError for an engine not named at construction)."""
        st = self.engines[engine]
        st.events += 1
        kind = type(event).__name__
        if kind == "AllBlocksCleared":
            st.l1.clear()
            return
        tier = TIER_OF_MEDIUM.get(getattr(event, "medium", None))
        if tier is None:
            return  # a medium this router does not model
        store = (getattr(event, "ownership", None) or "L3") if tier == L3 else None
        if kind == "BlockStored":
            self._stored(st, tier, store, event)
        elif kind == "BlockRemoved":
            target = self._target(st, tier, store)
            for h in event.block_hashes:
                key = st.by_hash.get(h)
                if key is not None:
                    target.discard(key)

    def apply_batch(self, engine: str, batch: Any) -> None:
        """Apply every event of a ``KVEventBatch`` in order."""
        for e in batch.events:
            self.apply(engine, e)

    def _target(self, st: EngineState, tier: str, store: Optional[str]) -> set:
        if tier == L1:
            return st.l1
        if tier == L2:
            return st.l2
        st.l3_stores.add(store)
        return self.l3.setdefault(store, set())

    def _stored(self, st: EngineState, tier: str, store: Optional[str], ev: Any) -> None:
        bs = int(ev.block_size)
        st.block_size = bs
        if ev.parent_block_hash is None:
            parent = None
        else:
            parent = st.by_hash.get(ev.parent_block_hash)
            if parent is None:
                st.orphans += 1
                return
        target = self._target(st, tier, store)
        extras = ev.extra_keys or [None] * len(ev.block_hashes)
        for i, h in enumerate(ev.block_hashes):
            parent = chain_key(parent, ev.token_ids[i * bs:(i + 1) * bs], ev.lora_name, extras[i])
            st.by_hash[h] = parent
            target.add(parent)

    def tier_of(self, engine: str, key: bytes) -> Optional[str]:
        """The best tier holding ``key`` for ``engine`` (L1, L2, L3 through any store it announced) or None."""
        st = self.engines[engine]
        if key in st.l1:
            return L1
        if key in st.l2:
            return L2
        if any(key in self.l3.get(s, ()) for s in st.l3_stores):
            return L3
        return None

    def match(self, engine: str, keys: Sequence[bytes]) -> list[str]:
        """Tiers of the leading blocks of ``keys`` that ``engine`` can serve, stopping at the first it cannot."""
        out = []
        for k in keys:
            t = self.tier_of(engine, k)
            if t is None:
                break
            out.append(t)
        return out


@dataclass
class Choice:
    """A routing decision: the engine, the predicted tier of each leading block it will not recompute, the score
    (weighted tokens) and the predicted tokens per tier."""
    engine: str
    tiers: list
    score: float
    tokens: dict


class PrefixRouter:
    """Chooses an engine per request from a :class:`FleetView` (``policy="prefix"``) or in turn
    (``policy="round_robin"``); ``weights`` maps L1/L2/L3 to the fraction of a token's prefill a hit saves.
    Raises ValueError for an unknown policy or a weights dict that does not name exactly L1, L2 and L3."""

    def __init__(self, view: FleetView, block_size: int, policy: str = "prefix",
                 weights: Optional[dict] = None):
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r}: allowed values are {', '.join(POLICIES)}")
        weights = dict(DEFAULT_WEIGHTS if weights is None else weights)
        if set(weights) != set(TIERS):
            raise ValueError(f"weights {weights}: give exactly {', '.join(TIERS)}")
        self.view, self.block_size, self.policy, self.weights = view, int(block_size), policy, weights
        self.names = list(view.engines)
        self.assigned = {n: 0 for n in self.names}
        self._next = 0

    def predict(self, engine: str, keys: Sequence[bytes], prompt_len: int) -> Choice:
        """What ``engine`` would serve from its tiers for a prompt of ``prompt_len`` tokens with full-block
        ``keys``: never the block holding the last token (vLLM recomputes at least that one)."""
        usable = keys[:max(0, (prompt_len - 1) // self.block_size)]
        tiers = self.view.match(engine, usable)
        tokens = {t: self.block_size * tiers.count(t) for t in TIERS}
        return Choice(engine, tiers, sum(self.weights[t] * n for t, n in tokens.items()), tokens)

    def choose(self, tokens: Sequence[int], cache_salt: Optional[str] = None,
               lora_name: Optional[str] = None) -> Choice:
        """The engine for a prompt of token ids ``tokens`` (counted as assigned to it)."""
        keys = prompt_keys(tokens, self.block_size, lora_name, cache_salt)
        if self.policy == "round_robin":
            c = self.predict(self.names[self._next % len(self.names)], keys, len(tokens))
            self._next += 1
        else:
            cands = [self.predict(n, keys, len(tokens)) for n in self.names]
            c = max(cands, key=lambda x: (x.score, -self.assigned[x.engine], -self.names.index(x.engine)))
        self.assigned[c.engine] += 1
        return c


# --------------------------------------------------------------------------------------------------------------
# the fleet (sockets, HTTP)
# --------------------------------------------------------------------------------------------------------------

class Subscriber:
    """One ZMQ SUB socket connected to every engine's publisher (``{topic: endpoint}``); each batch is decoded
    with vLLM's ``KVEventBatch`` and applied to ``view`` under the engine its topic names. Gaps in a publisher's
    sequence numbers (batches it dropped or we missed) are counted in ``gaps``."""

    def __init__(self, endpoints: dict, view: FleetView):
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.zmq, self.view = zmq, view
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        for ep in endpoints.values():
            self.sock.connect(ep)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.last_seq: dict = {}
        self.gaps = {n: 0 for n in endpoints}
        self.batches = {n: 0 for n in endpoints}

    def pump(self, wait_s: float = 0.0) -> int:
        """Apply every batch that has arrived, the first waiting at most ``wait_s`` seconds; returns how many."""
        n = 0
        while self.sock.poll(int(wait_s * 1000) if n == 0 else 0):
            topic, seq, payload = self.sock.recv_multipart()
            name = topic.decode()
            if name not in self.view.engines:
                continue
            s = int.from_bytes(seq, "big")
            if name in self.last_seq and s != self.last_seq[name] + 1:
                self.gaps[name] += 1
            self.last_seq[name] = s
            self.batches[name] += 1
            self.view.apply_batch(name, self.decoder.decode(payload))
            n += 1
        return n

    def until(self, pred, timeout_s: float, what: str) -> None:
        """Apply batches as they arrive until ``pred()`` holds; TimeoutError naming ``what`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not pred():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{what}: not seen in the KV events within {timeout_s} s")
            self.pump(min(left, 1.0))

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def complete(base: str, model: str, tokens: Sequence[int], *, cache_salt: Optional[str], max_tokens: int) -> dict:
    """One greedy completion (temperature 0, ``ignore_eos``) of a token-id prompt: ``{"token_ids": [...],
    "text": str}``. Raises ``requests.HTTPError`` for an error answer."""
    import requests

    body = {"model": model, "prompt": list(tokens), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    if cache_salt:
        body["cache_salt"] = cache_salt
    r = requests.post(f"{base}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    ch = r.json()["choices"][0]
    return {"token_ids": ch.get("token_ids"), "text": ch["text"]}


def lookup_outcomes(base: str) -> dict:
    """tierkv's ``vllm:tierkv_lookup_outcome_tokens_total`` of one engine by outcome label (tokens)."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    out = {o: 0.0 for o in OUTCOMES}
    for fam in text_string_to_metric_families(requests.get(f"{base}/metrics", timeout=60).text):
        for s in fam.samples:
            if s.name == "vllm:tierkv_lookup_outcome_tokens_total":
                o = s.labels.get("outcome")
                out[o] = out.get(o, 0.0) + s.value
    return out


def _delta(after: dict, before: dict) -> dict:
    return {k: int(after.get(k, 0) - before.get(k, 0)) for k in after}


def make_sequence(docs: int, doc_blocks: int, repeats: int, block_size: int, question_tokens: int,
                  seed: int, vocab: tuple = (10, 1000)) -> list[dict]:
    """The request sequence: ``docs`` random documents of ``doc_blocks * block_size`` token ids, each asked
    ``repeats`` times with its own ``question_tokens``-token question. Order: a document's first ask comes in
    document order; each later ask is placed at a seeded distance (1 to ``docs`` requests) after the previous one,
    so some reuses are near (still in L1) and some far. Returns ``[{"doc": i, "prompt": [ids]}]``."""
    rng = random.Random(seed)
    lo, hi = vocab
    texts = [[rng.randrange(lo, hi) for _ in range(doc_blocks * block_size)] for _ in range(docs)]
    slots: list[tuple[float, int]] = []
    for d in range(docs):
        t = float(d)
        for _r in range(repeats):
            slots.append((t + rng.random() * 1e-3, d))
            t += rng.randint(1, docs)
    seq = []
    for _t, d in sorted(slots):
        seq.append({"doc": d, "prompt": texts[d] + [rng.randrange(lo, hi) for _ in range(question_tokens)]})
    return seq


@dataclass
class Engine:
    name: str
    base: str
    events: str


def parse_engine(text: str) -> Engine:
    """``NAME=HTTP_BASE,EVENTS_ENDPOINT`` -> :class:`Engine`; ValueError naming the expected form otherwise."""
    try:
        name, rest = text.split("=", 1)
        base, ev = rest.split(",", 1)
    except ValueError:
        raise ValueError(f"--engine {text!r}: expected NAME=HTTP_BASE,EVENTS_ENDPOINT "
                         "(e.g. hostA=http://10.77.0.1:8000,tcp://10.77.0.1:5557)") from None
    if not name or not base.startswith("http") or not ev.startswith("tcp://"):
        raise ValueError(f"--engine {text!r}: expected NAME=HTTP_BASE,EVENTS_ENDPOINT "
                         "(e.g. hostA=http://10.77.0.1:8000,tcp://10.77.0.1:5557)")
    return Engine(name, base.rstrip("/"), ev)


def parse_weights(text: str) -> dict:
    """``L1=1,L2=0.9,L3=0.7`` -> dict; ValueError naming the flag and the allowed keys otherwise."""
    out = {}
    for part in text.split(","):
        k, _, v = part.partition("=")
        k = k.strip().upper()
        if k not in TIERS:
            raise ValueError(f"--weights {text!r}: keys must be {', '.join(TIERS)}")
        try:
            out[k] = float(v)
        except ValueError:
            raise ValueError(f"--weights {text!r}: {k} needs a number") from None
    if set(out) != set(TIERS):
        raise ValueError(f"--weights {text!r}: give all of {', '.join(TIERS)}")
    return out


class Fleet:
    """The engines, one subscriber over all their publishers and the view it feeds."""

    def __init__(self, engines: Sequence[Engine], model: str, block_size: int, event_timeout_s: float):
        self.engines = {e.name: e for e in engines}
        self.model, self.block_size, self.event_timeout_s = model, block_size, event_timeout_s
        self.view = FleetView(list(self.engines))
        self.sub = Subscriber({e.name: e.events for e in engines}, self.view)

    def send(self, engine: str, prompt: Sequence[int], salt: Optional[str], max_tokens: int) -> dict:
        """Complete on ``engine`` and wait until the router saw that engine announce the prompt's full blocks in
        L1 (so the next decision sees this request's pages, as a router that is not behind would)."""
        out = complete(self.engines[engine].base, self.model, prompt, cache_salt=salt, max_tokens=max_tokens)
        keys = prompt_keys(prompt, self.block_size, cache_salt=salt)
        st = self.view.engines[engine]
        self.sub.until(lambda: all(k in st.l1 for k in keys), self.event_timeout_s,
                       f"{engine}'s L1 blocks of a {len(prompt)}-token prompt")
        return out

    def wait_ready(self, timeout_s: float) -> float:
        """Poll every engine's ``/health`` until all answer 200, applying event batches meanwhile (a subscription
        only takes effect inside calls on the socket); returns the seconds waited, TimeoutError after
        ``timeout_s``."""
        import requests

        t0 = time.monotonic()
        pending = set(self.engines)
        while pending:
            for n in sorted(pending):
                try:
                    if requests.get(f"{self.engines[n].base}/health", timeout=2).status_code == 200:
                        pending.discard(n)
                except requests.RequestException:
                    pass
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"engines {sorted(pending)} not ready after {timeout_s} s")
            if pending:
                self.sub.pump(0.5)
        return time.monotonic() - t0

    def warm_up(self, seed: int, tries: int = 20) -> dict:
        """Per engine, a 2-block prompt (new salt per try) until its L1 event arrives; returns tries per engine."""
        rng = random.Random(seed)
        used = {}
        for name in self.engines:
            for t in range(tries):
                prompt = [rng.randrange(10, 1000) for _ in range(2 * self.block_size + 3)]
                try:
                    self.send(name, prompt, f"warmup-{seed}-{name}-{t}", 1)
                    used[name] = t + 1
                    break
                except TimeoutError:
                    continue
            else:
                raise TimeoutError(f"no KV events from {name} ({self.engines[name].events}) after {tries} requests")
        return used

    def outcomes(self) -> dict:
        return {n: lookup_outcomes(e.base) for n, e in self.engines.items()}

    def cross_host(self, seed: int, doc_blocks: int, max_tokens: int) -> dict:
        """Answer a new document on the first engine, wait for its full blocks in L3 (the router's view), send it
        to the second engine: the L3 tokens it loaded, both answers, and whether they are equal."""
        a, b = list(self.engines)[:2]
        rng = random.Random(seed + 1)
        prompt = [rng.randrange(10, 1000) for _ in range(doc_blocks * self.block_size + 7)]
        salt = f"cross-host-{seed}"
        out_a = self.send(a, prompt, salt, max_tokens)
        keys = prompt_keys(prompt, self.block_size, cache_salt=salt)
        self.sub.until(lambda: all(self.view.tier_of(b, k) == L3 for k in keys) and not
                       any(k in self.view.engines[b].l1 | self.view.engines[b].l2 for k in keys),
                       self.event_timeout_s, f"{a}'s blocks in an L3 store {b} uses")
        before = lookup_outcomes(self.engines[b].base)
        out_b = self.send(b, prompt, salt, max_tokens)
        loaded = _delta(lookup_outcomes(self.engines[b].base), before)
        return {"computed_on": a, "loaded_on": b, "prompt_tokens": len(prompt), "full_block_tokens":
                len(keys) * self.block_size, "outcome_tokens_on_loader": loaded,
                "token_ids_computed": out_a["token_ids"], "token_ids_loaded": out_b["token_ids"],
                "identical": out_a["token_ids"] == out_b["token_ids"] and out_a["text"] == out_b["text"]}

    def run_policy(self, policy: str, seq: list, weights: dict, salt: str, max_tokens: int) -> dict:
        """Route ``seq`` under ``policy`` (requests one at a time); predicted and measured tokens per tier."""
        router = PrefixRouter(self.view, self.block_size, policy, weights)
        before = self.outcomes()
        t0 = time.monotonic()
        reqs = []
        for i, r in enumerate(seq):
            self.sub.pump()
            c = router.choose(r["prompt"], cache_salt=salt)
            self.send(c.engine, r["prompt"], salt, max_tokens)
            reqs.append({"i": i, "doc": r["doc"], "engine": c.engine, "predicted": c.tokens,
                         "score": round(c.score, 3)})
        measured = {n: _delta(v, before[n]) for n, v in self.outcomes().items()}
        total = {o: sum(m[o] for m in measured.values()) for o in OUTCOMES}
        predicted = {t: sum(r["predicted"][t] for r in reqs) for t in TIERS}
        return {"policy": policy, "cache_salt": salt, "requests": reqs, "wall_s": round(time.monotonic() - t0, 2),
                "assigned": router.assigned, "predicted_tokens": predicted,
                "predicted_weighted_saved": round(sum(weights[t] * predicted[t] for t in TIERS), 1),
                "measured_per_engine": measured, "measured_tokens": total,
                "measured_weighted_saved": round(weights[L1] * total["l1"] + weights[L2] * total["l2"]
                                                 + weights[L3] * total["l3"], 1)}

    def close(self) -> None:
        self.sub.close()


def summary(result: dict) -> str:
    """The printed table: per policy, measured tokens per tier, recomputed, weighted saved; then the gain."""
    lines = [f"{'policy':<12} {'L1':>7} {'L2':>7} {'L3':>7} {'miss':>7} {'saved (weighted)':>17} "
             f"{'predicted L1/L2/L3':>20}"]
    pol = result["policies"]
    for p in pol.values():
        m, pr = p["measured_tokens"], p["predicted_tokens"]
        lines.append(f"{p['policy']:<12} {m['l1']:>7} {m['l2']:>7} {m['l3']:>7} {m['miss']:>7} "
                     f"{p['measured_weighted_saved']:>17} {pr[L1]:>6}/{pr[L2]}/{pr[L3]}")
    if set(pol) == set(POLICIES):
        a, b = pol["prefix"], pol["round_robin"]
        raw = sum(a["measured_tokens"][t] for t in ("l1", "l2", "l3")) - \
            sum(b["measured_tokens"][t] for t in ("l1", "l2", "l3"))
        lines.append(f"prefix routing vs round-robin: {raw:+d} tokens not recomputed, "
                     f"{a['measured_weighted_saved'] - b['measured_weighted_saved']:+.1f} weighted "
                     f"(weights {result['weights']})")
    x = result.get("cross_host")
    if x:
        lines.append(f"cross-host: {x['loaded_on']} loaded {x['outcome_tokens_on_loader']['l3']} of "
                     f"{x['full_block_tokens']} full-block tokens from L3 that {x['computed_on']} computed; "
                     f"outputs identical: {x['identical']}")
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", action="append", required=True,
                    help="NAME=HTTP_BASE,EVENTS_ENDPOINT, once per engine (topic NAME on its publisher)")
    ap.add_argument("--model", required=True, help="the served model name (as given to --model of the servers)")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--doc-blocks", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--question-tokens", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--weights", default="L1=1.0,L2=0.9,L3=0.7", help="fraction of prefill saved per tier")
    ap.add_argument("--event-timeout-s", type=float, default=60.0)
    ap.add_argument("--skip-cross-host", action="store_true")
    ap.add_argument("--wait-ready-s", type=float, default=0.0,
                    help="first wait up to this long for every engine's /health (0: expect them ready)")
    ap.add_argument("--out", default=None, help="write the result JSON here")
    args = ap.parse_args(argv)
    try:
        engines = [parse_engine(e) for e in args.engine]
        weights = parse_weights(args.weights)
    except ValueError as e:
        ap.error(str(e))
    if len(engines) < 2 and not args.skip_cross_host:
        ap.error("--engine: the cross-host check needs two engines (or give --skip-cross-host)")
    fleet = Fleet(engines, args.model, args.block_size, args.event_timeout_s)
    result: dict = {"engines": [e.__dict__ for e in engines], "model": args.model, "weights": weights,
                    "workload": {k: getattr(args, k) for k in ("docs", "doc_blocks", "repeats", "question_tokens",
                                                              "max_tokens", "seed", "block_size")}}
    try:
        if args.wait_ready_s > 0:
            result["ready_wait_s"] = round(fleet.wait_ready(args.wait_ready_s), 1)
        result["warm_up_tries"] = fleet.warm_up(args.seed)
        if not args.skip_cross_host:
            result["cross_host"] = fleet.cross_host(args.seed, args.doc_blocks, args.max_tokens)
        seq = make_sequence(args.docs, args.doc_blocks, args.repeats, args.block_size, args.question_tokens,
                            args.seed)
        result["sequence_docs"] = [r["doc"] for r in seq]
        result["policies"] = {}
        for policy in POLICIES:
            result["policies"][policy] = fleet.run_policy(policy, seq, weights, f"{policy}-{args.seed}",
                                                          args.max_tokens)
        fleet.sub.pump()
        result["event_batches"] = fleet.sub.batches
        result["event_gaps"] = fleet.sub.gaps
        result["orphan_events"] = {n: s.orphans for n, s in fleet.view.engines.items()}
    finally:
        fleet.close()
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    print(summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
