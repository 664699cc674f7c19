"""Read what a run did from the servers' own counters: vLLM's ``/metrics`` (Prometheus text, tierkv's
``vllm:tierkv_*`` included) and tierkv's stats files (``stats_path``: one JSON file per connector process).

Values are floats summed over engines; a metrics dict is ``{name or name{label=value,...}: value}``; a stats dict is
``{role: {counter: value}}`` (roles ``scheduler`` and ``worker``). Hook seconds are wall seconds.
"""
from __future__ import annotations

import contextlib
import json
import re
import time
from pathlib import Path


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+([-+0-9.eEnaNifI]+)')


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


_DROP_LABELS = {"engine", "model_name"}


#: vLLM's per-request phase histograms whose ``_sum`` and ``_count`` :func:`parse_metrics` keeps (seconds): where a
#: request's time went (:func:`phase_means_ms`)
PHASE_HISTOGRAMS = {"queue": "vllm:request_queue_time_seconds", "prefill": "vllm:request_prefill_time_seconds",
                    "decode": "vllm:request_decode_time_seconds", "ttft": "vllm:time_to_first_token_seconds"}


def parse_metrics(text: str) -> dict[str, float]:
    """vLLM's Prometheus text -> {name or name{label=value,...}: value}, summed over engines/models. Keeps the
    counters (``*_total``), tierkv's gauges and the ``_sum`` / ``_count`` of :data:`PHASE_HISTOGRAMS`; other
    histograms' samples and ``*_created`` are left out."""
    out: dict[str, float] = {}
    phases = {h + suffix for h in PHASE_HISTOGRAMS.values() for suffix in ("_sum", "_count")}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(3) or "", m.group(4)
        if name in phases:
            out[name] = out.get(name, 0.0) + float(value)
            continue
        if not name.startswith("vllm:") or name.endswith(("_bucket", "_created", "_sum", "_count")):
            continue
        if not (name.endswith("_total") or name.startswith("vllm:tierkv_")):
            continue
        kept = [(k, v) for k, v in _LABEL.findall(labels) if k not in _DROP_LABELS]
        key = name + ("{" + ",".join(f"{k}={v}" for k, v in kept) + "}" if kept else "")
        try:
            out[key] = out.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return out


def phase_means_ms(delta: dict) -> dict[str, float]:
    """Mean milliseconds per request of each of :data:`PHASE_HISTOGRAMS` over a run (its metrics delta: sums over
    counts); a phase without samples is left out. vLLM's queue time runs from arrival to the first scheduling, its
    prefill time from there to the first token, its TTFT as its front end sees it."""
    out = {}
    for phase, h in PHASE_HISTOGRAMS.items():
        n = delta.get(h + "_count", 0.0)
        if n:
            out[phase] = round(1e3 * delta.get(h + "_sum", 0.0) / n, 1)
    return out


def metric(d: dict, name: str) -> float:
    """Sum of every sample of ``name`` (whatever its labels)."""
    return sum(v for k, v in d.items() if k == name or k.startswith(name + "{"))


def deltas(after: dict, before: dict) -> dict:
    out = {}
    for k, v in after.items():
        gauge = k.startswith("vllm:tierkv_") and not k.split("{", 1)[0].endswith("_total")
        d = v if gauge else v - before.get(k, 0.0)
        if d:
            out[k] = round(d, 6)
    return out


def raw_samples(text: str, name: str) -> list[float]:
    """Every sample of the metric ``name`` (any labels) in Prometheus text."""
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) == name:
            with contextlib.suppress(ValueError):
                out.append(float(m.group(4)))
    return out


def read_stats(stats_dir: Path) -> dict[str, dict]:
    """The connector's stats files, summed per role (scheduler, worker)."""
    merged: dict[str, dict] = {}
    for p in sorted(stats_dir.glob("*.json")):
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        role = d.get("role") or p.stem.rsplit("-", 1)[0]
        acc = merged.setdefault(role, {})
        for k, v in d.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "pid":
                acc[k] = acc.get(k, 0) + v
    return merged


def settled_stats(stats_dir: Path, quiet_s: float = 0.5, timeout_s: float = 5.0) -> dict[str, dict]:
    """:func:`read_stats` once the files stopped changing for ``quiet_s`` (more than two write intervals of the
    connector's stats writers, 0.2 s; bounded by ``timeout_s``): the counters of every step so far, including the
    run's last one, whose write may trail its response."""
    t0 = time.monotonic()
    last, since = read_stats(stats_dir), time.monotonic()
    while time.monotonic() - since < quiet_s and time.monotonic() - t0 < timeout_s:
        time.sleep(0.1)  # polling interval for a condition on the files, not a synchronisation
        now = read_stats(stats_dir)
        if now != last:
            last, since = now, time.monotonic()
    return last


def hook_delta(after: dict[str, dict], before: dict[str, dict]) -> dict[str, float]:
    """Seconds tierkv's hooks took on vLLM's threads between two :func:`settled_stats`: ``scheduler`` (EngineCore's
    scheduler thread: lookups, plans) and ``worker`` (the forward's thread: copies between L1 and L2, job
    submission), wall time (``hook_seconds``) summed over the role's processes; empty without stats files."""
    return {role: round(after[role].get("hook_seconds", 0.0) - before.get(role, {}).get("hook_seconds", 0.0), 4)
            for role in ("scheduler", "worker") if role in after}
