"""``python -m benchmarks.gpu_check --quick`` on this machine's CPU under ``TRITON_INTERPRET=1`` (the interpreter is picked
when triton is imported, hence a subprocess): the one command prepared for a CUDA machine keeps running between GPU
runs. Its JSON must hold every correctness case passed (Triton = torch, bit for bit), the controller round trip
through a file L3 passed for every host layout, and the CUDA-only parts reported as not measured, not failed; its
``--readme-from`` renders a README section from a result file alone."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import gpu_check as gc

ROOT = Path(__file__).resolve().parents[2]
#: run as on the GPU machine: from the checkout's root, the module form
COMMAND = [sys.executable, "-m", "benchmarks.gpu_check"]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """(result dict, stdout, seconds) of one quick run."""
    out = tmp_path_factory.mktemp("gpu_check") / "quick.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    t0 = time.perf_counter()
    r = subprocess.run([*COMMAND, "--quick", "--out", str(out)], env=env, capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    took = time.perf_counter() - t0
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(out.read_text()), r.stdout, took


def test_quick_run_passes_every_correctness_case_and_the_round_trip(quick):
    res, stdout, took = quick
    assert took < 60, f"quick mode took {took:.0f} s"
    assert res["mode"] == "quick" and res["passed"] is True
    m = res["machine"]
    assert m["triton_interpret"] is True and m["device"] == "cpu"
    for key in ("torch", "triton", "cuda", "gpu", "driver", "python"):
        assert key in m
    c = res["parts"]["correctness"]
    assert c["passed"] is True and c["n_failed"] == 0 and c["n_not_run"] == 0
    cases = c["cases"]
    assert all(x["passed"] and x["save_equal"] and x["load_equal"] and x["round_trip_restored"] for x in cases)
    # every host layout x GPU KV layout x dtype, all layers and a subset, one and two kernel blocks per page
    assert {x["host_layout"] for x in cases} == {"layer_first", "page_first", "page_first_direct"}
    assert {x["device_layout"] for x in cases} == {"flash_attn_nhd", "flashinfer_hnd", "mla"}
    assert {x["dtype"] for x in cases} == {"bf16", "fp8_e4m3", "fp8_as_uint8"}
    assert {str(x["layers"]) for x in cases} == {"all", "[1]"}
    assert {x["kernel_blocks_per_page"] for x in cases} == {1, 2}
    assert len(cases) == 3 * 3 * 3 * 2 * 2
    for x in cases:  # random non-contiguous block ids
        assert sorted(x["blocks"]) != list(range(min(x["blocks"]), min(x["blocks"]) + len(x["blocks"]))) \
            or sorted(x["load_blocks"]) != list(range(min(x["load_blocks"]), min(x["load_blocks"]) + 3))
    rt = res["parts"]["round_trip"]
    assert rt["status"] == "measured" and rt["passed"] is True
    assert [r["host_layout"] for r in rt["runs"]] == ["layer_first", "page_first", "page_first_direct"]
    for r in rt["runs"]:
        assert r["passed"] and r["l1_empty_before_load"]
        assert r["backed_up_pages"] == r["prefetch_loaded_pages"] == r["pages"]
        assert r["l1"].endswith("flash/LBNHC")
    for part in ("bandwidth", "overlap", "pinned"):
        assert res["parts"][part]["status"] == "cpu: not measured" and res["parts"][part]["passed"] is None
    assert "correctness  PASS: 108/108" in stdout and "overall      PASS" in stdout


def _head_code_files() -> tuple[str, dict[str, str]]:
    """HEAD's commit and its code files as ``gpu_check.code_files`` records them, read from git (not the tree)."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    ls = subprocess.run(["git", "ls-tree", "-r", "HEAD", "--", *gc.CODE_DIRS], cwd=ROOT, capture_output=True,
                        text=True, check=True).stdout
    files = {}
    for line in ls.splitlines():
        meta, _, path = line.partition("\t")
        if path.endswith((".py", ".yaml")):
            files[path] = meta.split()[2]
    return head, files


def _readme(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*COMMAND, "--readme-from", str(path)], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)


def test_readme_section_renders_from_the_result_file(quick, tmp_path):
    res = quick[0]
    assert res["code"]["files"]["kernels/triton_impl.py"]  # the run records its code files' blob hashes
    # a CUDA-shaped full result from a machine without .git: the measured parts' fields as the script writes them
    # (values made up for the render), code files those of HEAD
    head, files = _head_code_files()
    gpu = copy.deepcopy(res)
    gpu.update(mode="full", quick=False, code={"commit": None, "dirty": ["(not a git checkout)"], "files": files})
    gpu["machine"].update(gpu="NVIDIA H200", driver="580.159.04", cuda="13.0")
    row = {"device_layout": "flash_attn_nhd", "host_layout": "layer_first", "page_bytes": 65536, "passed": False,
           "save": {"kernel_gbps": 40.0, "copy_gbps": 50.0, "ratio": 0.8, "passed": True},
           "load": {"kernel_gbps": 30.0, "copy_gbps": 50.0, "ratio": 0.6, "passed": False}}
    gpu["parts"]["bandwidth"] = {"status": "measured", "passed": False, "rows": [row], "n_failed": 1}
    gpu["parts"]["overlap"] = {"status": "measured", "passed": True, "slowdown": 0.012, "transfer_hidden": 0.97}
    gpu["parts"]["pinned"] = {"status": "measured", "passed": False, "rows": [
        {"gib": 5, "how": "hostpool", "taken_bytes": 8 * 2**30, "taken_over_requested": 1.6, "passed": False}]}
    gpu["passed"] = False
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps(gpu))
    r = _readme(path)
    assert r.returncode == 0, r.stderr[-2000:]
    md = r.stdout
    assert md.startswith("## gpu_check\n")
    assert f"commit {head[:10]}" in md    # named from the code files' hashes
    assert "NVIDIA H200 (driver 580.159.04" in md and "Overall: **FAIL**" in md
    assert "| correctness | Triton = torch reference, bit for bit | PASS: 108/108 cases, 0 not run |" in md
    assert "| 64 KiB | flash_attn_nhd | layer_first | 40.0 | 50.0 | 0.8 | 30.0 | 50.0 | 0.6 |" in md
    assert "slowdown 1.2%, transfer hidden 97%" in md
    assert "| 5 GiB | hostpool | 8.00 GiB | 1.6 | FAIL |" in md
    # a CPU full result renders too, its CUDA-only parts named as not measured
    cpu = dict(gpu, parts=res["parts"], passed=True)
    path.write_text(json.dumps(cpu))
    r = _readme(path)
    assert r.returncode == 0 and "| bandwidth | >= 0.8 of a contiguous pinned copy | cpu: not measured |" in r.stdout


def test_readme_refuses_uncommitted_code_quick_runs_and_missing_keys(quick, tmp_path):
    res = quick[0]
    head, files = _head_code_files()
    full = dict(copy.deepcopy(res), mode="full", quick=False)
    path = tmp_path / "r.json"
    changed = dict(files, **{"kernels/triton_impl.py": "0" * 40})   # code that no commit holds
    path.write_text(json.dumps(dict(full, code={"commit": None, "dirty": ["(not a git checkout)"],
                                                "files": changed})))
    r = _readme(path)
    assert r.returncode == 2 and "match no recent commit" in r.stderr and not r.stdout
    path.write_text(json.dumps(dict(res, code={"commit": None, "dirty": [], "files": files})))  # the quick run
    r = _readme(path)
    assert r.returncode == 2 and "--quick smoke run" in r.stderr
    broken = copy.deepcopy(full)
    broken["code"] = {"commit": head, "dirty": []}
    del broken["parts"]["overlap"]
    path.write_text(json.dumps(broken))
    r = _readme(path)
    assert r.returncode == 2 and "parts.overlap" in r.stderr


def test_a_part_that_broke_is_reported_not_lost(quick):
    """summary() and the README section name a part that raised (its error) or was skipped (its reason) and keep
    the others."""
    res = copy.deepcopy(quick[0])
    res["parts"]["correctness"] = {"status": "error", "passed": False, "error": "RuntimeError: a | b"}
    res["parts"]["round_trip"] = {"status": "skipped", "passed": None, "reason": gc.NEEDS_PYDANTIC}
    res["passed"] = False
    text = gc.summary(res)
    assert "correctness  error: RuntimeError: a | b" in text and "overall      FAIL" in text
    assert "round trip   skipped: needs pydantic: not on the GPU machine" in text
    md = gc.readme_section(res)
    assert "| correctness | Triton = torch reference, bit for bit | error: RuntimeError: a / b |" in md
    assert "| round trip | pages loaded back bit-identical | skipped: needs pydantic" in md
