"""vLLM's OpenAI API server with tierkv and a file L3: ``/metrics`` counts what a known workload did, the start-up
line is in the server's log, and the Grafana dashboard (examples/grafana_tierkv.json) names only scraped metrics.

Workload (one server, requests one at a time; ``DOC`` is 5 pages of 32 tokens, each request adds its own 10-token
question and generates 4 tokens, so every request computes the KV of exactly 5 full pages of ``DOC``):

1. ``A1`` computes everything; its 5 full pages are saved to L2 and written through to L3.
2. ``POST /reset_prefix_cache`` (L1 only), then ``A2``: the 5 pages come from L2 (160 tokens).
3. ``POST /reset_prefix_cache?reset_external=true`` (L1 and tierkv's L2 index), then ``A3``: the 5 pages come from
   L3 (160 tokens, one existence query, one read batch).

The server validates tierkv's request controls at entry (``--logits-processors`` with
:class:`tierkv.connector.vllm.params_check.TierKVParamsCheck`): one request with ``{"tierkv": {"save": false}}``, and
malformed ones answered 400.
"""
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.engine import DEFAULT_ENV, REPO_ROOT, TIERKV_CONNECTOR, TIERKV_MODULE
from tests.helpers.servers import unused_loopback_ports

P = 32
DOC_PAGES = 5
DASHBOARD = REPO_ROOT / "examples" / "grafana_tierkv.json"
STARTUP_S = 600


def _prompts():
    rng = random.Random(12)
    doc = [rng.randrange(10, 1000) for _ in range(DOC_PAGES * P)]
    return [doc + [rng.randrange(10, 1000) for _ in range(10)] for _ in range(3)]


def _scrape(base) -> dict:
    """{(sample name, frozenset(labels without model_name/engine)): value} of every tierkv / prefix-cache sample."""
    text = requests.get(f"{base}/metrics", timeout=30).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine"))
            out[(s.name, labels)] = s.value
    return out


def _v(m, name, **labels) -> float:
    return m[(name, frozenset(labels.items()))]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("metrics_server")
    port = unused_loopback_ports(1)[0]
    kv = {"kv_connector": TIERKV_CONNECTOR, "kv_connector_module_path": TIERKV_MODULE, "kv_role": "kv_both",
          "kv_load_failure_policy": "recompute",
          "kv_connector_extra_config": {
              "host_pool": {"num_pages": 32},
              "l3": {"backend": "file", "file": {"root": str(tmp / "l3")}},
              "controller": {"write_policy": "write_through", "prefetch_policy": "wait_complete"},
              "stats_path": str(tmp / "stats" / "{role}-{pid}.json")}}
    env = dict(os.environ, **DEFAULT_ENV, VLLM_SERVER_DEV_MODE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO_ROOT), env.get("PYTHONPATH")] if p)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model, "--host", "127.0.0.1",
           "--port", str(port), "--block-size", str(P), "--enable-prefix-caching", "--enforce-eager",
           "--dtype", "bfloat16", "--max-model-len", "512", "--num-gpu-blocks-override", "20", "--max-num-seqs", "4",
           "--seed", "0", "--kv-transfer-config", json.dumps(kv),
           "--logits-processors", "tierkv.connector.vllm.params_check:TierKVParamsCheck"]
    log_path = tmp / "server.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(tmp), start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:  # readiness: the server answers /health (polled; the engine needs tens of seconds to start)
            if proc.poll() is not None:
                raise RuntimeError(f"API server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if requests.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"API server not ready after {STARTUP_S} s:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.25)
        yield base, tiny_model, log_path, proc, tmp / "stats"
    finally:
        try:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)   # the server's own session: API server, EngineCore
            proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()


def _complete(base, model, prompt):
    r = requests.post(f"{base}/v1/completions", timeout=300, json={
        "model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    return r.json()


def _reset(base, external):
    r = requests.post(f"{base}/reset_prefix_cache", params={"reset_external": str(external).lower()}, timeout=60)
    r.raise_for_status()
    assert r.json()["success"] is True


@pytest.fixture(scope="module")
def scrapes(server):
    base, model = server[0], server[1]
    a1, a2, a3 = _prompts()
    before = _scrape(base)
    _complete(base, model, a1)
    _reset(base, external=False)
    _complete(base, model, a2)
    after_l2 = _scrape(base)
    _reset(base, external=True)
    _complete(base, model, a3)
    return before, after_l2, _scrape(base)


def test_counters_match_the_workload(scrapes):
    before, after_l2, m = scrapes
    pages, tokens = DOC_PAGES, DOC_PAGES * P
    assert _v(before, "vllm:tierkv_hit_tokens_total", tier="L2") == 0
    assert _v(after_l2, "vllm:tierkv_hit_tokens_total", tier="L2") == tokens
    assert _v(after_l2, "vllm:tierkv_l3_backup_pages_total") == pages      # A1's pages, written through
    assert _v(m, "vllm:tierkv_hit_tokens_total", tier="L2") == tokens
    assert _v(m, "vllm:tierkv_hit_tokens_total", tier="L3") == tokens
    assert _v(m, "vllm:tierkv_l2_hit_tokens_total") == tokens and _v(m, "vllm:tierkv_ctl_l3_hit_tokens_total") == tokens
    assert _v(m, "vllm:tierkv_lookup_tokens_total") == 3 * tokens
    # counted once per engine (the scheduler's count), not once more per worker
    assert _v(m, "vllm:tierkv_save_pages_total") == pages                  # A2 and A3 computed no new full page
    assert _v(m, "vllm:tierkv_load_pages_total") == 2 * pages              # A2 from L2, A3 from L3 via L2
    assert _v(m, "vllm:tierkv_l3_prefetch_pages_total") == pages
    assert _v(m, "vllm:tierkv_l3_backup_pages_total") == pages             # prefetched pages are not written again
    # vLLM's own counter of tokens supplied by the connector agrees
    assert _v(m, "vllm:external_prefix_cache_hits_total") == 2 * tokens
    assert _v(m, "vllm:tierkv_l3_errors_total") == 0 and _v(m, "vllm:tierkv_l3_timeouts_total") == 0


def test_latency_histogram_and_gauges(scrapes):
    _before, after_l2, m = scrapes
    # one write-through batch (5 pages < batch_pages) after A1, one read batch (A3)
    assert _v(after_l2, "vllm:tierkv_l3_op_seconds_count", op="set") == 1
    assert _v(after_l2, "vllm:tierkv_l3_op_seconds_count", op="get") == 0
    assert _v(m, "vllm:tierkv_l3_op_seconds_count", op="get") == 1
    # existence queries: A1 (L3 empty: none found) and A3 (L2 index reset: 5 found); A2 found every page in L2
    assert _v(m, "vllm:tierkv_l3_op_seconds_count", op="exists") == 2 == _v(m, "vllm:tierkv_ctl_exists_queries_total")
    assert 0 < _v(m, "vllm:tierkv_l3_op_seconds_sum", op="get") < 10
    assert _v(m, "vllm:tierkv_l3_op_seconds_bucket", op="get", le="+Inf") == 1
    assert _v(m, "vllm:tierkv_l2_capacity_pages") == 32
    assert _v(after_l2, "vllm:tierkv_l2_used_pages") == DOC_PAGES
    assert _v(m, "vllm:tierkv_l2_used_pages") == DOC_PAGES          # reset emptied L2, A3's prefetch refilled it
    assert _v(m, "vllm:tierkv_pending_backup_pages") == 0 and _v(m, "vllm:tierkv_pending_prefetch_pages") == 0


def test_dashboard_names_only_scraped_metrics(scrapes):
    _before, _after, m = scrapes
    scraped = {name for name, _ in m}
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    names = {n for e in exprs for n in re.findall(r"vllm:[a-z0-9_:]+", e)}
    assert len(names) >= 8, names
    assert not names - scraped, sorted(names - scraped)


def _outcomes(m) -> dict:
    return {dict(lab)["outcome"]: v for (name, lab), v in m.items()
            if name == "vllm:tierkv_lookup_outcome_tokens_total" and v}


def test_request_controls_and_malformed_ones(server, scrapes):
    """After the workload: a new document with ``{"tierkv": {"save": false}}`` is computed and none of its pages is
    saved (nothing reaches L2 or L3: the stats-file test below still finds A1's pages only); every counted lookup
    token is served from a tier or has a reason, and the parts sum to the lookup total; a mistyped and an unknown
    field are answered 400 naming the field, and the server goes on serving."""
    base, model = server[0], server[1]
    _before, _after_l2, m0 = scrapes
    tokens = DOC_PAGES * P
    rng = random.Random(99)
    doc = [rng.randrange(10, 1000) for _ in range(DOC_PAGES * P + 10)]
    r = requests.post(f"{base}/v1/completions", timeout=300, json={
        "model": model, "prompt": doc, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
        "kv_transfer_params": {"tierkv": {"save": False}}})
    assert r.status_code == 200, r.text
    m = _scrape(base)
    assert _v(m, "vllm:tierkv_save_pages_total") == _v(m0, "vllm:tierkv_save_pages_total") == DOC_PAGES
    assert _v(m, "vllm:tierkv_lookup_tokens_total") == 4 * tokens
    assert _outcomes(m) == {"l2": tokens, "l3": tokens, "miss": 2 * tokens}     # A2, A3; A1 and this request
    assert _v(m, "vllm:tierkv_lookup_waiting_tokens") == 0
    assert sum(_outcomes(m).values()) == _v(m, "vllm:tierkv_lookup_tokens_total")
    assert _v(m, "vllm:tierkv_reuse_distance_seconds_count", tier="L2") == DOC_PAGES        # A2's hit
    # vLLM never lets a request with prompt logprobs read a cache: it is not counted (nor saved: it asks not to be)
    r = requests.post(f"{base}/v1/completions", timeout=300, json={
        "model": model, "prompt": doc, "max_tokens": 1, "prompt_logprobs": 1,
        "kv_transfer_params": {"tierkv": {"save": False}}})
    assert r.status_code == 200, r.text
    m2 = _scrape(base)
    assert _v(m2, "vllm:tierkv_lookup_tokens_total") == 4 * tokens and _outcomes(m2) == _outcomes(m)
    for bad, field in (({"save": "no"}, "kv_transfer_params.tierkv.save"),
                       ({"keep": "yes"}, "kv_transfer_params.tierkv.keep"),
                       ({"load_max_token": 64}, "kv_transfer_params.tierkv.load_max_token")):
        r = requests.post(f"{base}/v1/completions", timeout=60, json={
            "model": model, "prompt": doc, "max_tokens": 4, "kv_transfer_params": {"tierkv": bad}})
        assert r.status_code == 400, r.text
        assert field in r.json()["error"]["message"], r.text
    assert requests.get(f"{base}/health", timeout=10).status_code == 200


def test_startup_line_in_server_log(server, scrapes):
    text = Path(server[2]).read_text()
    lines = [ln for ln in text.splitlines() if "tierkv: L1 20 blocks" in ln]
    assert len(lines) == 1, lines
    line = lines[0]
    assert "INFO" in line and "L2 32 pages" in line and "(num_pages, host budget" in line
    assert "L3 file(" in line and "write_policy=write_through" in line and "prefetch_policy=wait_complete" in line


def test_stats_files_hold_the_final_counters_after_a_graceful_stop(server, scrapes):
    """SIGTERM to the API server (as ``systemctl stop`` or Ctrl-C does): vLLM shuts the engine down, the connector's
    ``shutdown`` writes each process's stats file once more, so it holds the same totals as ``/metrics`` even though
    the engine was idle (no step wrote it) since the last request."""
    _base, _model, _log, proc, stats_dir = server
    _before, _after, m = scrapes

    def files_hold_totals() -> bool:
        try:
            got = {f.name.split("-")[0]: json.loads(f.read_text()) for f in stats_dir.glob("*.json")}
        except (OSError, ValueError):  # a file being replaced
            return False
        return (got.get("worker", {}).get("l3_prefetch_pages") == DOC_PAGES
                and got.get("scheduler", {}).get("l2_hit_tokens") == DOC_PAGES * P)

    # the files lag the counters by at most the write interval (docs/architecture.md, "Configuration and
    # observability"): wait for that bound (polled, 10 s deadline), so the stop below tests what survives the stop,
    # not a kill inside the interval
    deadline = time.monotonic() + 10.0
    while not files_hold_totals() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) is not None
    files = {f.name.split("-")[0]: json.loads(f.read_text()) for f in stats_dir.glob("*.json")}
    sched, worker = files["scheduler"], files["worker"]
    tokens = DOC_PAGES * P
    assert sched["l2_hit_tokens"] == tokens == _v(m, "vllm:tierkv_l2_hit_tokens_total")
    assert sched["ctl_l3_hit_tokens"] == tokens == _v(m, "vllm:tierkv_ctl_l3_hit_tokens_total")
    assert sched["ctl_pending_jobs"] == 0 and sched["l2_pages"] == DOC_PAGES
    assert worker["l3_prefetch_pages"] == DOC_PAGES == _v(m, "vllm:tierkv_l3_prefetch_pages_total")
    assert worker["l3_backup_pages"] == DOC_PAGES
