"""examples/fleet_two_hosts.py without namespaces or engines: the flags it refuses and the engine configuration it
builds (checked by tierkv's own config validation and vLLM's KV events config class). The two-host run itself is a
script (about 70-100 s with engine start-up: over the suite's budget); its results are benchmarks/results/fleet_*."""
import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tierkv.connector.core.config import config_from_extra

_PATH = Path(__file__).resolve().parents[2] / "examples" / "fleet_two_hosts.py"
_SPEC = importlib.util.spec_from_file_location("fleet_two_hosts", _PATH)
fth = importlib.util.module_from_spec(_SPEC)
sys.modules["fleet_two_hosts"] = fth
_SPEC.loader.exec_module(fth)


def _args(l3):
    return argparse.Namespace(l3=l3, l2_pages=48, l3_bytes="512MiB", block_size=32, max_model_len=480,
                              l1_blocks=16)


class _Stub(fth.Fleet):
    def __init__(self, tmp_path):
        super().__init__(tmp_path, "10.77.0", 5.0)


@pytest.mark.parametrize("subnet", ["8.8.8", "10.77", "10.77.300", "172.32.0", "192.167.1"])
def test_a_subnet_outside_the_private_ranges_is_refused_naming_the_flag(subnet, capsys):
    with pytest.raises(SystemExit) as e:
        fth.main(["--subnet", subnet])
    assert e.value.code == 2
    assert f"--subnet {subnet!r}: three octets of a private range" in capsys.readouterr().err


@pytest.mark.parametrize("l3", ["mooncake", "zmq"])
def test_each_engine_gets_a_valid_tierkv_config_its_own_address_and_an_events_publisher(l3, tmp_path, monkeypatch):
    from vllm.config import KVEventsConfig

    fleet = _Stub(tmp_path)
    a = fleet.addr["hostA"]
    if l3 == "zmq":
        zmq = {"backend": "zmq", "zmq": {"endpoint": f"tcp://{a}:5557", "token": "t0k", "timeout_s": 5.0}}
        store = {"hostA": zmq, "hostB": zmq}
    else:  # what start_store returns for mooncake, without starting a master
        store = {h: {"backend": "mooncake", "mooncake": {
            "master_address": f"{a}:50051", "metadata_server": f"http://{a}:8080/metadata", "protocol": "tcp",
            "local_hostname": fleet.addr[h], "global_segment_size": "512MiB" if h == "hostA" else 0}}
            for h in ("hostA", "hostB")}
    for host, addr, cpu in (("hostA", "10.77.0.1", "0"), ("hostB", "10.77.0.2", "1")):
        cmd, env = fth.engine_command(_args(l3), fleet, host, "/m", store)
        opt = {cmd[i]: cmd[i + 1] for i in range(len(cmd) - 1) if cmd[i].startswith("--")}
        assert opt["--host"] == addr and opt["--max-model-len"] == "480" and opt["--num-gpu-blocks-override"] == "16"
        kv = json.loads(opt["--kv-transfer-config"])
        cfg = config_from_extra(kv["kv_connector_extra_config"])  # raises on a key tierkv does not know
        assert cfg.l3.backend == l3 and cfg.host_pool.num_pages == 48
        assert cfg.controller.prefetch_policy == "wait_complete"
        ev = KVEventsConfig(**json.loads(opt["--kv-events-config"]))
        assert (ev.endpoint, ev.topic, ev.enable_kv_cache_events) == ("tcp://*:5560", host, True)
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == cpu
        assert env.get("MC_TCP_BIND_ADDRESS") == (addr if l3 == "mooncake" else None)
        if l3 == "mooncake":
            assert cfg.l3.mooncake["local_hostname"] == addr
