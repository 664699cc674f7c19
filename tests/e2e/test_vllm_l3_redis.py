"""vLLM engines on a real Redis as L3 (``l3.backend: redis``): a standalone ``redis-server`` and a Redis Cluster of 3
masters with one replica each, on loopback.

For each: engine 1 runs ``first`` with write_through into Redis, engine 2 (a new process: empty L1 and L2, the same
store: a restarted engine, or a second engine of the deployment) runs ``again`` and loads the documents' pages from
Redis; greedy outputs are bit-identical to a reference engine reusing the same prefixes from its own L1
(``test_vllm_l3_shared._check_pair``: the same checks as for the ZMQ server and Mooncake). A third engine starts with
its Redis down: each of its processes logs one warning naming the server and serves from L1/L2, outputs equal to the
reference's. A fourth is given a wrong password: its start-up stops with a message naming ``l3.redis.password`` (the
server answered and refused: waiting would not help).
"""
import pytest

from tests.helpers.engine import EngineRunError, in_parallel, run_job, stats_by_role
from tests.helpers.redis_servers import RedisClusterServers, RedisServer, free_port
from tests.e2e.test_vllm_l3_shared import ARGS, MAX_TOKENS, STORE_TIMEOUT_S, _check_pair, _config, _engine, _rounds


def _redis_l3(**section):
    return {"backend": "redis", "redis": {"timeout_s": STORE_TIMEOUT_S, "key_prefix": "e2e", **section}}


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory):
    first, again = _rounds()
    ref_wd, down_wd = tmp_path_factory.mktemp("ref"), tmp_path_factory.mktemp("down")
    solo = RedisServer(str(tmp_path_factory.mktemp("redis")))
    locked = RedisServer(str(tmp_path_factory.mktemp("redis-pw")), password="s3cret")
    badpw_wd = tmp_path_factory.mktemp("badpw")

    def badpw():
        try:
            run_job(tiny_model, [{"name": "first", "prompts": first[:1]}], max_tokens=MAX_TOKENS, workdir=badpw_wd,
                    kv_transfer_config=_config(_redis_l3(url=locked.url, password="wrong")),
                    num_gpu_blocks_override=200, extra_engine_args=ARGS, timeout_s=600)
        except EngineRunError as e:
            return str(e) + open(badpw_wd / "engine.log", errors="replace").read()
        return None

    cluster = RedisClusterServers(str(tmp_path_factory.mktemp("redis-cluster")))
    down_l3 = _redis_l3(url=f"redis://127.0.0.1:{free_port()}/0")
    down_l3["redis"]["timeout_s"] = 0.3
    try:
        sl3 = _redis_l3(url=solo.url)
        cl3 = _redis_l3(mode="cluster", nodes=cluster.nodes[:2])
        one = in_parallel(
            ref=lambda: run_job(tiny_model, [{"name": "first", "prompts": first}, {"name": "again", "prompts": again}],
                                kv_transfer_config=None, num_gpu_blocks_override=200, max_tokens=MAX_TOKENS,
                                extra_engine_args=ARGS, workdir=ref_wd),
            solo=_engine(tiny_model, tmp_path_factory, "first", first, sl3),
            cluster=_engine(tiny_model, tmp_path_factory, "first", first, cl3))
        held = {"solo": solo.client().dbsize(),
                "cluster": sum(s.client().dbsize() for s in cluster.masters())}
        two = in_parallel(
            solo=_engine(tiny_model, tmp_path_factory, "again", again, sl3),
            cluster=_engine(tiny_model, tmp_path_factory, "again", again, cl3),
            down=lambda: run_job(tiny_model, [{"name": "first", "prompts": first},
                                              {"name": "again", "prompts": again}],
                                 kv_transfer_config=_config(down_l3), num_gpu_blocks_override=200,
                                 max_tokens=MAX_TOKENS, extra_engine_args=ARGS, workdir=down_wd),
            badpw=badpw)
    finally:
        solo.close()
        locked.close()
        cluster.close()
    return {"ref": one["ref"], "held": held, "down": two["down"], "badpw": two["badpw"], "down_url": down_l3["redis"]["url"],
            **{k: {"e1": one[k], "e2": two[k]} for k in ("solo", "cluster")}}


@pytest.mark.parametrize("kind", ["solo", "cluster"])
def test_two_engines_share_redis_and_the_second_starts_warm(engines, kind):
    e = engines[kind]
    w1, w2 = _check_pair(engines["ref"], e["e1"], e["e2"])
    assert engines["held"][kind] == w1["l3_backup_pages"] > 0   # every page engine 1 stored is one Redis key


def test_engine_with_redis_down_at_start_serves_and_warns_once(engines):
    res, ref = engines["down"], engines["ref"]
    for name in ("first", "again"):
        assert res["workloads"][name]["outputs"] == ref["workloads"][name]["outputs"]
    lines = [ln for ln in open(res["log_path"], errors="replace").read().splitlines() if "redis L3:" in ln]
    # each process that built the store (scheduler, worker) says it once, and nothing more while the server is away
    pids = {ln.split("pid=")[1].split(")")[0] for ln in lines}
    assert len(lines) == len(pids) >= 1, lines
    assert all(f"redis L3: cannot reach {engines['down_url']} at start-up" in ln for ln in lines), lines
    s = stats_by_role(res)
    assert s["scheduler"]["ctl_l3_hit_tokens"] == 0 and s["scheduler"]["locked_pages"] == 0
    assert res["leaked_processes"] == 0


def test_wrong_password_stops_engine_start_up_naming_the_key(engines):
    text = engines["badpw"]
    assert text is not None, "the engine started with a wrong l3.redis.password"
    assert "l3.redis.password" in text and "s3cret" not in text, text[-3000:]
