"""``tierkv config check|docs`` and the user guide's key and exit-code tables generated from the code; ``tierkv bench`` and every
``--help``."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.helpers.cli import one_line_error, tierkv
from tierkv.cli import COMMANDS, main
from tierkv.cli_common import EXIT_FOUND, EXIT_OK, EXIT_USAGE
from tierkv.cli_config import config_keys, markdown_table, readme_section
from tierkv.connector.core.config import ControllerConfig, HostPoolConfig, TierKVConfig
from tierkv.storage_backends.file.store import FileStoreConfig
from tierkv.storage_backends.zmq.client import OPTION_DEFAULTS

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "user-guide.md"


def test_user_guide_key_table_is_the_generated_one():
    section = readme_section(GUIDE.read_text())
    assert section is not None, "docs/user-guide.md lost the config key table markers"
    assert section == markdown_table(), (
        "docs/user-guide.md's config key table is stale: run `tierkv config docs --update-readme docs/user-guide.md`")


def test_user_guide_exit_codes_are_the_generated_ones_and_the_cli_returns_them():
    from tierkv.cli_common import (EXIT_BEGIN, EXIT_CODES, EXIT_END, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_NEWER,
                                   EXIT_REFUSED, EXIT_UNREACHABLE, exit_codes_markdown)

    text = GUIDE.read_text()
    assert EXIT_BEGIN in text and EXIT_END in text, "docs/user-guide.md lost the exit code table markers"
    section = text.split(EXIT_BEGIN, 1)[1].split(EXIT_END, 1)[0].strip()
    assert section == exit_codes_markdown(), (
        "docs/user-guide.md's exit code table is stale: run `tierkv config docs --update-readme docs/user-guide.md`")
    # every code a command can return is in the table, and nothing else is
    assert sorted(EXIT_CODES) == sorted({EXIT_OK, EXIT_FOUND, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_NEWER, EXIT_REFUSED,
                                         EXIT_INTERNAL, EXIT_INTERRUPTED}) == [0, 1, 2, 3, 4, 5, 70, 130]


def test_update_rewrites_both_generated_tables(tmp_path):
    from tierkv.cli_common import EXIT_BEGIN, EXIT_END, exit_codes_markdown
    from tierkv.cli_config import BEGIN, END

    doc = tmp_path / "guide.md"
    doc.write_text(f"intro\n{BEGIN}\nold keys\n{END}\nmiddle\n{EXIT_BEGIN}\nold codes\n{EXIT_END}\nend\n")
    assert main(["config", "docs", "--update-readme", str(doc)]) == EXIT_OK
    text = doc.read_text()
    assert text == (f"intro\n{BEGIN}\n{markdown_table()}\n{END}\nmiddle\n{EXIT_BEGIN}\n{exit_codes_markdown()}\n"
                    f"{EXIT_END}\nend\n")


def test_docs_list_every_schema_key_with_type_default_and_meaning():
    rows = {r["key"]: r for r in config_keys()}
    expected = {f"host_pool.{k}" for k in HostPoolConfig.model_fields}
    expected |= {f"controller.{k}" for k in ControllerConfig.model_fields}
    expected |= {f"l3.file.{k}" for k in FileStoreConfig.model_fields}
    expected |= {f"l3.zmq.{k}" for k in OPTION_DEFAULTS}
    expected |= {k for k, f in TierKVConfig.model_fields.items() if k not in ("host_pool", "controller", "l3")}
    assert expected <= set(rows), sorted(expected - set(rows))
    missing = [k for k, r in rows.items() if not r["meaning"] or not r["type"]]
    assert not missing, f"keys without a meaning or type: {missing}"
    assert rows["controller.batch_pages"]["default"] == ControllerConfig().batch_pages
    assert rows["host_pool.layout"]["type"] == "layer_first | page_first | page_first_direct"
    assert rows["l3.zmq.timeout_s"]["default"] == OPTION_DEFAULTS["timeout_s"]
    assert rows["l3.file.root"]["default"] == "(required)"


def test_config_check_prints_every_default_and_applies_overrides(capsys, tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text("l3:\n  backend: file\n  file:\n    root: /tmp/x\n")
    assert main(["config", "check", str(f), "--set", "controller.batch_pages=32", "--json"]) == EXIT_OK
    d = json.loads(capsys.readouterr().out)
    assert d["controller"]["batch_pages"] == 32
    assert d["controller"]["shutdown_drain_s"] == ControllerConfig().shutdown_drain_s  # a default, not in the file
    assert d["l3"]["file"]["root"] == "/tmp/x" and d["l3"]["file"]["quarantine_max_files"] == 1000
    assert main(["config", "check", "l3_zmq.yaml", "--set", "l3.zmq.token=hunter2"]) == EXIT_OK
    out = capsys.readouterr().out
    d = yaml.safe_load(out)
    assert d["l3"]["zmq"]["token"] == "<hidden>" and "hunter2" not in out
    assert d["l3"]["zmq"]["max_backoff_s"] == OPTION_DEFAULTS["max_backoff_s"]


@pytest.mark.parametrize("content,sets,code,words", [
    ("host_pool:\n  sise_gb: 4\n", [], EXIT_FOUND, "unknown config key 'host_pool.sise_gb'"),
    ("l3:\n  backend: disk\n", [], EXIT_FOUND, "'l3.backend'"),
    ("l3:\n  backend: file\n  file:\n    roots: /x\n", [], EXIT_FOUND, "l3.file"),
    ("host_pool: [1\n", [], EXIT_FOUND, "not valid YAML"),
    ("{}\n", ["controller.write_policy=write_sometimes"], EXIT_FOUND, "write_through"),
    ("{}\n", ["no_equals_sign"], EXIT_USAGE, "key=value"),
])
def test_config_check_bad_input_is_one_line(tmp_path, content, sets, code, words):
    f = tmp_path / "c.yaml"
    f.write_text(content)
    r = tierkv("config", "check", str(f), *[a for s in sets for a in ("--set", s)])
    assert r.returncode == code, r.stderr
    assert words in one_line_error(r)


def test_config_check_missing_file(tmp_path):
    r = tierkv("config", "check", str(tmp_path / "nope.yaml"))
    assert r.returncode == EXIT_USAGE and "no such config file" in one_line_error(r)


def test_every_command_has_help_and_bench_runs_the_script():
    for argv in (["--help"], *[[c, "--help"] for c, _, _ in COMMANDS],
                 *[["store", a, "--help"] for a in ("stats", "verify", "gc", "clear")],
                 *[["config", a, "--help"] for a in ("check", "docs")]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0, argv
    # e2e_cpu.py parses its arguments before importing torch or vLLM (transfer.py imports torch first: ~3 s a run)
    r = tierkv("bench", "e2e", "--", "--help")
    assert r.returncode == 0 and "usage: e2e_cpu.py" in r.stdout
    r = tierkv("bench", "e2e", "--no-such-flag")
    assert r.returncode == 2  # the script's own argparse status comes through
    r = tierkv("bench", "nonsense")
    assert r.returncode == EXIT_USAGE and "invalid choice" in one_line_error(r)


@pytest.mark.parametrize("rule_broken", ["l3.redis.mode=cluster", "l3.redis.tls_cert_file=/x"])
def test_a_rule_between_redis_keys_names_it_without_echoing_the_password(capsys, tmp_path, rule_broken):
    """An error of the whole l3.redis section (cluster mode without nodes, a certificate without its key) once
    printed the section's dict, password included."""
    f = tmp_path / "redis.yaml"
    f.write_text("l3:\n  backend: redis\n  redis:\n    url: redis://127.0.0.1:6390/0\n    password: hunter2\n")
    assert main(["config", "check", str(f), "--set", rule_broken]) == EXIT_FOUND
    err = capsys.readouterr().err
    assert "'l3.redis'" in err and ("nodes" in err or "tls_key_file" in err)
    assert "hunter2" not in err
