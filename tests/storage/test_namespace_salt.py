"""The operator's namespace salt (``namespace_salt`` / ``$TIERKV_NAMESPACE_SALT``): two deployments that share a
store (the file store, the tierkv server) never share pages unless they set the same salt; the salt is validated,
never echoed, and never written into a store's namespace description; without it keys are what they always were."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import fixtures_zmq as FZ
from tests.helpers.namespace import make_namespace
from tierkv.connector.core.config import ConfigError, load_config
from tierkv.connector.l3.io import l3_key
from tierkv.connector.core.page_hash import NAMESPACE_SALT_ENV, page_keys, request_root
from tierkv.storage_backends.file.store import FileStore

PB = 4096
TOKENS = list(range(1, 65))


def deployment(salt):
    """(namespace digest, the L3 keys of TOKENS) of a deployment of one model with ``salt`` (vLLM's request
    cache_salt unset)."""
    ns = make_namespace(page_size=16, head_dim=32, salt=salt)
    d = ns.digest()
    return d, [l3_key(d, k) for k in page_keys(request_root(d), TOKENS, 16)]


def pages(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (PB,), dtype=torch.uint8, generator=g) for _ in range(n)]


def _share_check(make):
    """Deployment A (salt s1) writes; B (salt s2) and U (no salt) find nothing, even asking with A's key text;
    C (salt s1) finds A's pages, bit for bit."""
    da, ka = deployment("salt-one")
    src = pages(len(ka), 1)
    a = make(da)
    assert a.batch_set(ka, src) == [True] * len(ka)
    for other in ("salt-two", None):
        d, k = deployment(other)
        assert d != da and not set(k) & set(ka)
        s = make(d)
        assert s.batch_exists(k) == 0 and s.batch_exists(ka) == 0  # A's key text under B's namespace: a miss
        dst = [torch.zeros(PB, dtype=torch.uint8) for _ in ka]
        assert s.batch_get(ka, dst) == [False] * len(ka)
    dc, kc = deployment("salt-one")
    assert dc == da and kc == ka
    c = make(dc)
    dst = [torch.zeros(PB, dtype=torch.uint8) for _ in kc]
    assert c.batch_get(kc, dst) == [True] * len(kc) and all(torch.equal(x, y) for x, y in zip(dst, src))


def test_file_store_shares_pages_only_under_the_same_salt(tmp_path):
    stores = []
    try:
        _share_check(lambda d: stores.append(FileStore(d, PB, root=str(tmp_path))) or stores[-1])
    finally:
        for s in stores:
            s.close()


def test_server_shares_pages_only_under_the_same_salt(tmp_path):
    with FZ.make_backend(tmp_path, PB, deployment(None)[0]) as h:
        _share_check(lambda d: h.new_client(namespace=d))


def test_no_salt_keeps_the_digest_and_the_salt_is_never_shown():
    plain = make_namespace()
    salted = make_namespace(salt="s3cr3t-value")
    assert make_namespace(salt=None).digest() == plain.digest()
    assert salted.digest() != plain.digest()
    assert "s3cr3t" not in repr(salted) and "s3cr3t" not in str(salted.describe())
    assert salted.describe()["namespace_salt"] == "set" and "namespace_salt" not in plain.describe()


def test_config_key_and_environment_variable(monkeypatch):
    monkeypatch.delenv(NAMESPACE_SALT_ENV, raising=False)
    assert load_config(overrides={"namespace_salt": "abc"}).namespace_salt == "abc"
    assert load_config().namespace_salt is None
    monkeypatch.setenv(NAMESPACE_SALT_ENV, "from-env")
    assert load_config().namespace_salt == "from-env"
    assert load_config(overrides={"namespace_salt": "from-env"}).namespace_salt == "from-env"
    with pytest.raises(ConfigError, match="both set and differ"):
        load_config(overrides={"namespace_salt": "other"})
    monkeypatch.setenv(NAMESPACE_SALT_ENV, "")
    assert load_config().namespace_salt is None  # an empty variable is unset
    for bad in ("", " padded-secret ", "x" * 1025, 42, "new\nline"):
        with pytest.raises(ConfigError, match="namespace_salt") as e:
            load_config(overrides={"namespace_salt": bad})
        assert "padded-secret" not in str(e.value) and "new\\nline" not in str(e.value)
