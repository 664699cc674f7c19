"""The documentation stays short and true: README.md and docs/architecture.md within their line budgets, no
Markdown file links to a path that does not exist, every metric the README and the user guide name exists on
``/metrics`` under that name, every server command in the docs and examples binds loopback, and what the user guide
promises about logging refused request controls is the rate the code applies."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: line budgets (a newcomer reads the README to the end; the architecture is read in one sitting)
BUDGETS = {"README.md": 250, "docs/architecture.md": 500}

_LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")


def markdown_files() -> list[Path]:
    """Every Markdown file of the repository git tracks or would track (ignored folders such as .venv left out)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    return [REPO / p for p in sorted(set(out.split())) if (REPO / p).is_file()]


def relative_links(text: str) -> list[str]:
    """Link targets that name a path in the repository (no scheme, not a bare #anchor), anchor and query cut off,
    outside fenced code blocks."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    out = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        out.append(target.split("#", 1)[0].split("?", 1)[0])
    return out


@pytest.mark.parametrize("name,limit", sorted(BUDGETS.items()))
def test_line_budget(name, limit):
    lines = len((REPO / name).read_text(encoding="utf-8").splitlines())
    assert lines <= limit, f"{name} has {lines} lines, over its budget of {limit}: move detail into docs/"


def test_no_markdown_file_links_to_a_missing_path():
    missing = []
    for md in markdown_files():
        for target in relative_links(md.read_text(encoding="utf-8")):
            if not (md.parent / target).exists():
                missing.append(f"{md.relative_to(REPO)} -> {target}")
    assert not missing, "links to paths that do not exist:\n" + "\n".join(missing)


def test_the_link_check_finds_what_it_should():
    text = ("[a](docs/x.md#part) ![b](img.png) [c](https://example.com) [d](#anchor) [e](mailto:x@y)\n"
            "```\n[f](in/code.md)\n```\n")
    assert relative_links(text) == ["docs/x.md", "img.png"]


def _prometheus_names() -> set[str]:
    from tierkv.connector.vllm.metrics import COUNTERS, GAUGES

    names = {f"vllm:tierkv_{k}_total" for k in COUNTERS} | {f"vllm:tierkv_{k}" for k in GAUGES}
    names |= {"vllm:tierkv_hit_tokens_total", "vllm:tierkv_lookup_outcome_tokens_total",
              "vllm:tierkv_l3_op_seconds", "vllm:tierkv_reuse_distance_seconds"}
    return names


USER_DOCS = ("README.md", "docs/user-guide.md")


def test_every_metric_the_user_docs_name_is_on_metrics():
    """``vllm:tierkv_<name>`` as written in the README and the user guide is a series the connector exports, and a
    bare counter name (``ctl_...``, ``l3_..._pages``) is a key of the exported counters or gauges."""
    from tierkv.connector.vllm.metrics import COUNTERS, GAUGES

    exported = _prometheus_names()
    unknown = []
    for name in USER_DOCS:
        text = (REPO / name).read_text(encoding="utf-8")
        for m in re.findall(r"vllm:tierkv_[a-z0-9_<>]+", text):
            if "<" in m or m.endswith("_"):
                continue   # a pattern such as vllm:tierkv_<counter>_total
            if m not in exported:
                unknown.append(f"{name}: {m}")
        for m in re.findall(r"`((?:ctl|l3|l2|lookup)_[a-z0-9_]+_(?:pages|tokens|bytes|hits|jobs|queries|errors))`", text):
            if m not in COUNTERS and m not in GAUGES:
                unknown.append(f"{name}: {m}")
    assert not unknown, "named in the docs but not exported on /metrics:\n" + "\n".join(unknown)


_SERVER = re.compile(r"(-m (vllm\.entrypoints\.openai\.api_server|sglang\.launch_server|tierkv\.cli_server|"
                     r"lmcache\.v1\.multiprocess\.server)\b|(^|[\s/;&(])tierkv server\b)")


def code_of(path: Path) -> str:
    """The shell a reader may copy: a script whole, a Markdown file's fenced code blocks."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".md":
        text = "\n".join(re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.S | re.M))
    return text


def server_commands(text: str) -> list[str]:
    """Shell commands (continuation lines joined, comments cut) that start a server."""
    joined = re.sub(r"\\\n\s*", " ", text)
    out = []
    for line in joined.splitlines():
        line = " ".join(re.sub(r"\s#\s.*$", "", line).split())
        if line and not line.startswith("#") and _SERVER.search(line):
            out.append(line)
    return out


def test_every_server_command_in_the_docs_and_examples_binds_loopback():
    """A command a reader copies listens on 127.0.0.1; the only exceptions are the commands that show how to
    listen beyond loopback, which carry a token."""
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "examples").glob("*.sh"))]
    open_binds = []
    for f in files:
        for cmd in server_commands(code_of(f)):
            if "api_server ..." in cmd or re.search(r"TOKEN|--token", cmd):
                continue
            if "--host 127.0.0.1" not in cmd:
                open_binds.append(f"{f.relative_to(REPO)}: {cmd[:120]}")
    assert not open_binds, "server commands without --host 127.0.0.1:\n" + "\n".join(open_binds)
    demo = (REPO / "examples" / "demo.py").read_text(encoding="utf-8")
    assert '"--host", "127.0.0.1"' in demo


def test_the_server_command_and_the_tierkv_server_default_bind_loopback():
    import argparse

    from tierkv.cli_server import add_arguments

    assert add_arguments(argparse.ArgumentParser()).parse_args([]).host == "127.0.0.1"
    assert server_commands("x \\\n  --port 1\npython -m sglang.launch_server --model-path M \\\n  --host 127.0.0.1 "
                           "# a comment\n# tierkv server in a comment\nsee `tierkv server` docs") \
        == ["python -m sglang.launch_server --model-path M --host 127.0.0.1"]


def test_refused_controls_are_logged_at_the_rate_the_user_guide_promises(caplog):
    """The guide says a refusal is logged at most once per N s with the count of the ones suppressed; the
    connector's logger of refused controls uses that N, and a burst logs one line."""
    import logging

    from tierkv.connector.vllm import connector as vc

    guide = (REPO / "docs" / "user-guide.md").read_text(encoding="utf-8")
    said = re.search(r"refusal is\s+counted .*? logged as a warning at most once per (\d+) s", guide, re.S)
    assert said, "docs/user-guide.md no longer says how often a refused control is logged"
    assert float(said.group(1)) == vc.PARAMS_LOG_EVERY_S
    log = vc._params_log()
    assert log._every == vc.PARAMS_LOG_EVERY_S
    kind = "params-test"
    with caplog.at_level(logging.WARNING):
        for i in range(3):
            log.warning(kind, "refused %d", i)
    assert [r.getMessage() for r in caplog.records if "refused" in r.getMessage()] == ["refused 0"]
