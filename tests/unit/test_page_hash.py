"""Page keys: deterministic across processes, pinned, and sensitive to every namespace field (R02, R18)."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from tierkv.connector.page_hash import (KEY_HEX_LEN, ModelNamespace, RequestKeys, page_keys, request_root)

NS = ModelNamespace(model_id="tiny-llama", dtype="bfloat16", kv_layout="layer_first/LBHNC", page_size=16,
                    num_layers=4, num_kv_heads=2, head_dim=32, tp_rank=0, tp_size=2)
T = list(range(1, 65))  # R18: T = [1..64], P = 16

# Golden values: computed once and pinned. Any change of the key derivation breaks stored L3 data and must
# bump page_hash.FORMAT_VERSION.
GOLDEN_NS = "6419de4b7e5cfb3670d2bd6af8bc5129"
GOLDEN_KEYS = ["f0cb22dfeb61a15d53cbd7f8e5c4a389", "e2c242c011d9522487ec6e2bffbf9e8d",
               "6d3f5ec19fe22a4c13e68ea3c7cb6a93", "499ace2e16502ef2f8e2d6d7829df20c"]

SCRIPT = r"""
import json, sys
from tierkv.connector.page_hash import ModelNamespace, page_keys, request_root
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
