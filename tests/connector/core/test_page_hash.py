"""Page keys: deterministic across processes, pinned, and sensitive to every namespace field."""
import dataclasses
import json
import os
import subprocess
import sys

import hashlib
import random
import struct

import pytest

from tierkv.connector.core import page_hash
from tierkv.connector.core.page_hash import (KEY_HEX_LEN, ModelNamespace, RequestKeys, page_keys, page_keys_reference,
                                        request_root)

NS = ModelNamespace(model_id="tiny-llama", dtype="bfloat16", kv_layout="layer_first/LBHNC", page_size=16,
                    num_layers=4, num_kv_heads=2, head_dim=32, tp_rank=0, tp_size=2)
T = list(range(1, 65))  # T = [1..64], P = 16

# Golden values: computed once and pinned. Any change of the key derivation breaks stored L3 data and must
# bump page_hash.FORMAT_VERSION.
# FORMAT_VERSION 2 (BLAKE2b with the parent key as salt, uint32 tokens; docs/architecture.md, "The structures").
GOLDEN_NS = "bcb5938b46a2e6356a9a5226012ea5de"
GOLDEN_KEYS = ["6ce9b292b484b2540201e8629d95e3ad", "9a3bb33bfcf309eaff2f0973bf73304a",
               "c558dbdb02a590dad985912eb457897a", "3025916a515e2e3043fcce3d9aff5631"]

SCRIPT = r"""
import json, sys
from tierkv.connector.core.page_hash import ModelNamespace, page_keys, request_root
ns = ModelNamespace(model_id="tiny-llama", dtype="bfloat16", kv_layout="layer_first/LBHNC", page_size=16,
                    num_layers=4, num_kv_heads=2, head_dim=32, tp_rank=0, tp_size=2)
root = request_root(ns.digest())
T = list(range(1, 65))
out = {"ns": ns.digest().hex()}
for name, ek in [("absent", None), ("none", [None] * 4), ("empty", [()] * 4), ("mixed", [("img", b"\x00\x01")] * 4)]:
    out[name] = [k.hex() for k in page_keys(root, T, 16, extra_keys=ek)]
print(json.dumps(out))
"""


def _keys(ns=NS, tokens=T, lora=None, salt=None, extra=None):
    return page_keys(request_root(ns.digest(), lora, salt), tokens, ns.page_size, extra_keys=extra)


def test_golden_values_pinned():
    ks = [k.hex() for k in _keys()]
    assert len(ks) == 4 and all(len(k) == KEY_HEX_LEN for k in ks)
    assert NS.digest().hex() == GOLDEN_NS
    assert ks == GOLDEN_KEYS


@pytest.mark.parametrize("seeds", [("0", "1", None)])
def test_identical_across_processes_and_hash_seeds(seeds):
    outs = []
    for seed in seeds:
        env = dict(os.environ)
        env.pop("PYTHONHASHSEED", None)
        if seed is not None:
            env["PYTHONHASHSEED"] = seed
        r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
        outs.append(json.loads(r.stdout))
    assert outs[0] == outs[1] == outs[2]
    assert outs[0]["absent"] == GOLDEN_KEYS
    # None per page is the same as absent; an empty tuple and a real extra key are distinct from both
    assert outs[0]["none"] == outs[0]["absent"]
    assert outs[0]["empty"] != outs[0]["absent"]
    assert outs[0]["mixed"] != outs[0]["empty"]


@pytest.mark.parametrize("field,value", [
    ("model_id", "tiny-llama-v2"), ("dtype", "fp8_e4m3"), ("kv_layout", "page_first/LBHNC"),
    ("page_size", 32), ("num_layers", 5), ("num_kv_heads", 4), ("head_dim", 64), ("tp_rank", 1),
    ("tp_size", 4), ("pp_rank", 1), ("pp_size", 2), ("use_mla", True), ("extra", ("awq",)),
])
def test_every_namespace_field_changes_every_key(field, value):
    other = dataclasses.replace(NS, **{field: value})
    base = _keys()
    changed = _keys(ns=other)
    n = min(len(base), len(changed))
    assert n > 0
    assert not set(base) & set(changed)


def test_mla_pages_shared_across_tp_ranks():
    a = dataclasses.replace(NS, use_mla=True, tp_rank=0)
    b = dataclasses.replace(NS, use_mla=True, tp_rank=1)
    assert a.digest() == b.digest()


def test_lora_and_salt_change_keys_empty_salt_equals_no_salt():
    base = _keys()
    assert not set(base) & set(_keys(lora="adapter-a"))
    assert not set(base) & set(_keys(salt="tenantA"))
    assert not set(_keys(salt="tenantA")) & set(_keys(salt="tenantB"))
    assert _keys(salt="") == base
    assert _keys(lora="") == base


def test_one_token_changes_that_page_and_all_later_pages_only():
    t2 = list(T)
    t2[20] += 1  # page 1 (tokens 16..31)
    a, b = _keys(), _keys(tokens=t2)
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:]))


def test_earlier_page_changes_later_keys():
    t2 = list(T)
    t2[0] = 999
    a, b = _keys(), _keys(tokens=t2)
    assert all(x != y for x, y in zip(a, b))


def test_tail_shorter_than_page_has_no_key():
    assert _keys(tokens=T[:15]) == []
    assert len(_keys(tokens=T[:31])) == 1
    assert _keys(tokens=T[:31]) == _keys(tokens=T[:16])


def test_request_keys_incremental_equals_one_shot():
    rk = RequestKeys(request_root(NS.digest()), 16)
    seq = []
    for t in T + [7, 8, 9]:
        seq.append(t)
        rk.extend(seq)
    assert rk.keys == _keys(tokens=T + [7, 8, 9])


def test_large_token_ids_and_unhashable_extra_rejected():
    big = [2**40 + i for i in range(16)]
    assert len(_keys(tokens=big)) == 1
    with pytest.raises(TypeError):
        _keys(extra=[object()])


def test_derivation_is_plain_blake2b_with_parent_as_salt():
    # written out with hashlib alone: a reader can re-derive stored keys without tierkv
    root = request_root(NS.digest())
    k0 = hashlib.blake2b(struct.pack("<16I", *T[:16]), digest_size=16, salt=root,
                         person=b"tierkv/pk2/u32\x00\x00").digest()
    k1 = hashlib.blake2b(struct.pack("<16I", *T[16:32]), digest_size=16, salt=k0,
                         person=b"tierkv/pk2/u32\x00\x00").digest()
    assert _keys()[:2] == [k0, k1]


def test_compiled_loop_is_in_use_and_equals_hashlib():
    assert page_hash.warm_up(), "numba is installed in CI: the compiled BLAKE2b loop must be used"
    rng = random.Random(7)
    root = bytes(range(16))
    for p in (1, 3, 8, 16, 31, 32, 33, 64, 100):
        n = page_hash.KERNEL_MIN_PAGES + rng.randrange(20)
        toks = [rng.randrange(2**32) for _ in range(p * n + rng.randrange(p))]
        got = page_keys(root, toks, p)
        assert len(got) == n
        assert got == page_keys_reference(root, toks, p), p
        # resuming in the middle of the chain gives the same keys
        assert page_keys(root, toks, p, parent=got[1], start_page=2) == got[2:]


def test_encoding_is_chosen_per_page_not_per_call():
    # a token beyond uint32 in page 5 switches that page to int64 but leaves every other page's bytes alone
    base = list(range(1, 16 * 8 + 1))
    big = list(base)
    big[5 * 16 + 3] = 2**40
    a, b = _keys(tokens=base), _keys(tokens=big)
    assert a[:5] == b[:5] and all(x != y for x, y in zip(a[5:], b[5:]))
    assert _keys(tokens=big[:16 * 5]) == a[:5]  # hashed alone (below the kernel threshold) or in one call: same
    neg = list(base)
    neg[0] = -1
    assert _keys(tokens=neg)[0] != a[0]
    # a page with an extra key goes through hashlib; the pages around it keep the compiled loop's values
    ek = [None] * 8
    ek[6] = ("img", b"\x01")
    c = _keys(tokens=base, extra=ek)
    assert c[:6] == a[:6] and c[6] != a[6]
    assert c == page_keys_reference(request_root(NS.digest()), base, 16, extra_keys=ek)


def test_machine_integer_inputs_give_the_same_keys():
    from array import array

    import numpy as np

    rng = random.Random(3)
    root = request_root(NS.digest())
    toks = [rng.randrange(2**31) for _ in range(16 * 9 + 5)]
    ref = page_keys_reference(root, toks, 16)
    for form in (array("q", toks), np.array(toks, np.int64), np.array(toks, np.int32), tuple(toks)):
        assert page_keys(root, form, 16) == ref
        assert page_keys(root, form, 16, parent=ref[3], start_page=4) == ref[4:]
    toks[40] = -5  # page 2 falls back to int64, through hashlib; the same for every input form
    ref = page_keys_reference(root, toks, 16)
    assert page_keys(root, array("q", toks), 16) == page_keys(root, toks, 16) == ref
