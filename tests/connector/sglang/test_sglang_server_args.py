"""examples/sglang_hicache_tierkv.sh: every ``sglang.launch_server`` line parses with SGLang's own server argument
parser, its extra config goes through SGLang's own extra-config parsing, and SGLang's factory builds tierkv's
backend from it (file: a real directory; ZMQ: a real server; Mooncake and LMCache: config and class only)."""
from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest
import torch

from tests.helpers import sgl as _sgl  # noqa: F401
from tests.helpers.sgl import fill_pages, keys, mha_pool, page_bytes_of, storage_config
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.server_args import ServerArgs

from tierkv.connector.sglang.hicache import TierKVHiCacheStorage, parse_extra_config

SCRIPT = Path(__file__).resolve().parents[3] / "examples" / "sglang_hicache_tierkv.sh"


def launch_lines() -> dict[str, list[str]]:
    """backend case -> argv after ``python -m sglang.launch_server`` (``$MODEL`` replaced by a model name)."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    out, case = {}, None
    for line in text.splitlines():
        m = re.match(r"^(\w+)\)$", line.strip())
        if m:
            case = m.group(1)
        if "sglang.launch_server" in line:
            argv = shlex.split(line.strip())
            argv = argv[argv.index("sglang.launch_server") + 1:]
            out[case] = [a.replace("$MODEL", "Qwen/Qwen3-8B") for a in argv]
    return out


def parse(argv):
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    args = p.parse_args(argv)
    extra = HybridCacheController.parse_storage_backend_extra_config(args.hicache_storage_backend_extra_config)[0]
    return args, extra


def test_script_has_one_launch_line_per_backend():
    assert sorted(launch_lines()) == ["file", "lmcache", "mooncake", "zmq"]


def round_trip(args, extra):
    pool = mha_pool(args.hicache_mem_layout, page_size=args.page_size, pages=4)
    b = StorageBackendFactory.create_backend(args.hicache_storage_backend,
                                             storage_config(extra, model=args.model_path), pool)
    assert isinstance(b, TierKVHiCacheStorage)
    b.register_mem_pool_host(pool)
    try:
        idx = fill_pages(pool, 2, seed=9)
        want = [page_bytes_of(pool, i) for i in range(2)]
        ks = keys(2, "args")
        assert b.batch_set_v1(ks, idx) == [True, True]
        pool2 = mha_pool(args.hicache_mem_layout, page_size=args.page_size, pages=4)
        assert b.batch_exists(ks) == 2
        flat = b.batch_get(ks, [pool2.get_dummy_flat_data_page() for _ in ks])
        assert all(torch.equal(f.view(torch.uint8), w) for f, w in zip(flat, want))
    finally:
        b.close()


@pytest.mark.parametrize("case", ["file", "zmq", "mooncake", "lmcache"])
def test_launch_line_parses_and_factory_builds_tierkv(case, tmp_path):
    args, extra = parse(launch_lines()[case])
    assert args.enable_hierarchical_cache and args.hicache_storage_backend == "dynamic"
    assert extra["module_path"] == "tierkv.connector.sglang.hicache" and extra["interface_v1"] == 1
    cls = StorageBackendFactory._load_backend_class(extra["module_path"], extra["class_name"], extra["backend_name"])
    assert cls is TierKVHiCacheStorage
    cfg = parse_extra_config(extra)
    assert cfg.l3["backend"] == case
    if case == "file":
        extra["l3"]["file"]["root"] = str(tmp_path / "l3")
        round_trip(args, extra)
    elif case == "zmq":
        from tests.helpers import fixtures_zmq as _fixtures_zmq

        proc, endpoint = _fixtures_zmq.start_server(0, test_ops=False)
        try:
            extra["l3"]["zmq"]["endpoint"] = endpoint
            round_trip(args, extra)
        finally:
            _fixtures_zmq._stop_proc(proc)
