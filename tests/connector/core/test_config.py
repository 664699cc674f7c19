"""Config: shipped defaults validate; errors name the key and the allowed values."""
import pytest

from tierkv.cli import main
from tierkv.cli_common import EXIT_FOUND, EXIT_OK
from tierkv.connector.core.config import (USED_WITHOUT_L3, ConfigError, ControllerConfig, TierKVConfig, config_from_extra, load_config,
                                     shipped_config_path)

WITH_L3 = {"l3.backend": "file", "l3.file.root": "/nonexistent/tierkv-l3"}  # validated only, never created


def test_defaults_serve_with_empty_extra_config():
    cfg = config_from_extra({})
    assert isinstance(cfg, TierKVConfig)
    assert cfg.host_pool.layout == "layer_first" and cfg.l3.backend == "none"
    # automatic size: a share of MemTotal, capped; identical on every call (scheduler and worker agree)
    b1, b2 = cfg.host_pool_bytes(1 << 20), cfg.host_pool_bytes(1 << 20)
    assert b1 == b2 and 0 < b1 <= cfg.host_pool.auto_max_gb * (1 << 30)
    assert cfg.host_pool_bytes(1 << 20, available_bytes=8 << 30) == 2 << 30


def test_sizes():
    assert config_from_extra({"host_pool": {"num_pages": 10}}).host_pool_bytes(4096) == 40960
    assert config_from_extra({"host_pool.size_gb": 0.5}).host_pool_bytes(4096) == 1 << 29


def test_unknown_key_named():
    with pytest.raises(ConfigError, match=r"unknown config key 'host_pool.sise_gb'"):
        config_from_extra({"host_pool": {"sise_gb": 1}})
    with pytest.raises(ConfigError, match=r"unknown config key 'bogus'"):
        config_from_extra({"bogus": 1})
    # the message suggests the nearest key and lists the keys that section accepts, so a typo is fixed without
    # opening the docs
    with pytest.raises(ConfigError, match=r"'controller.write_polcy' \(did you mean 'controller.write_policy'\?\): "
                                          r"allowed keys are .*'write_policy'"):
        config_from_extra({"controller": {"write_polcy": "write_back"}})
    with pytest.raises(ConfigError, match=r"'host_pool.sise_gb' \(did you mean 'host_pool.size_gb'\?\): "
                                          r"allowed keys are .*'size_gb'"):
        config_from_extra({"host_pool": {"sise_gb": 1}})
    with pytest.raises(ConfigError) as e:   # nothing close: no suggestion, still the list
        config_from_extra({"zzzz": 1})
    assert "did you mean" not in str(e.value) and "allowed keys are 'controller'" in str(e.value)


def test_unknown_keys_have_one_format_in_the_connector_and_the_storage_layer():
    """The same message shape whether the top-level schema or a store's own section finds the key."""
    import re

    from tierkv.storage_backends.factory import validate_l3

    with pytest.raises(ConfigError) as top:
        config_from_extra({"host_pool": {"size_gbb": 1}})
    with pytest.raises(ConfigError) as store:
        validate_l3({"backend": "file", "file": {"root": "/tmp/x", "capacity_byte": 5}})
    with pytest.raises(ConfigError) as via_config:
        config_from_extra({"l3": {"backend": "zmq", "zmq": {"endpont": "tcp://127.0.0.1:1"}}})
    shape = re.compile(r"invalid tierkv config: unknown config key '([a-z0-9_.]+)' \(did you mean '([a-z0-9_.]+)'\?\): "
                       r"allowed keys are '")
    got = [shape.match(str(e.value)).groups() for e in (top, store, via_config)]
    assert got == [("host_pool.size_gbb", "host_pool.size_gb"), ("l3.file.capacity_byte", "l3.file.capacity_bytes"),
                   ("l3.zmq.endpont", "l3.zmq.endpoint")]


def test_bad_enum_lists_allowed_values():
    with pytest.raises(ConfigError) as e:
        config_from_extra({"host_pool": {"layout": "row_major"}})
    msg = str(e.value)
    assert "host_pool.layout" in msg and "'layer_first'" in msg and "'page_first_direct'" in msg
    with pytest.raises(ConfigError, match="controller.write_policy"):
        config_from_extra({"controller.write_policy": "sometimes"})
    with pytest.raises(ConfigError, match="l3.backend"):
        config_from_extra({"l3": {"backend": "s3"}})


def test_bad_numbers():
    with pytest.raises(ConfigError, match="host_pool.size_gb"):
        config_from_extra({"host_pool": {"size_gb": -1}})
    with pytest.raises(ConfigError, match="page_size"):
        config_from_extra({"page_size": 0})


def test_config_file_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("host_pool:\n  layout: page_first\n  num_pages: 7\n")
    cfg = config_from_extra({"config_file": str(f), "host_pool": {"num_pages": 9}})
    assert cfg.host_pool.layout == "page_first" and cfg.host_pool.num_pages == 9
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)


def test_shipped_configs_validate():
    import glob, os
    names = [os.path.basename(p) for p in glob.glob(str(shipped_config_path("default.yaml").parent / "*.yaml"))]
    assert "default.yaml" in names
    for n in names:
        load_config(n)


@pytest.mark.parametrize("extra, named, allowed", [
    ({"config_file": "l3_zmq.yaml", "l3.zmq.endpont": "tcp://127.0.0.1:1"}, "l3.zmq.endpont", "endpoint"),
    ({"config_file": "l3_file.yaml", "l3.file.fsnyc": True}, "l3.file.fsnyc", "fsync"),
    ({"l3.mooncake.protocl": "tcp"}, "l3.mooncake.protocl", "protocol"),
    ({"l3.faults.fail_gett": 0.5}, "l3.faults.fail_gett", "fail_get"),
])
def test_unknown_l3_key_stops_start_up_listing_allowed_keys(extra, named, allowed):
    """L3 backend sections are checked when the config loads (what the connector does at engine start), not only
    when a store is built: a typo is named with the keys that are allowed, also in a section not in use."""
    with pytest.raises(ConfigError) as e:
        config_from_extra(extra)
    msg = str(e.value)
    assert named in msg and allowed in msg


@pytest.mark.parametrize("extra, named", [
    ({"config_file": "l3_zmq.yaml", "l3.zmq.timeout_s": -1}, "l3.zmq.timeout_s"),
    ({"config_file": "l3_zmq.yaml", "l3.zmq.endpoint": "http://127.0.0.1:1"}, "l3.zmq.endpoint"),
    ({"config_file": "l3_zmq.yaml", "l3.zmq.max_message_bytes": 10}, "l3.zmq.max_message_bytes"),
    ({"config_file": "l3_file.yaml", "l3.file.capacity_bytes": "lots"}, "l3.file.capacity_bytes"),
    ({"config_file": "l3_file.yaml", "l3.file.scan_verify": "all"}, "l3.file.scan_verify"),
    ({"l3.backend": "file"}, "l3.file.root"),
    ({"config_file": "l3_mooncake.yaml", "l3.mooncake.timeout_s": 0}, "l3.mooncake.timeout_s"),
])
def test_bad_l3_value_stops_start_up(extra, named):
    with pytest.raises(ConfigError) as e:
        config_from_extra(extra)
    msg = str(e.value)
    assert named in msg and msg.startswith("invalid tierkv config") and "Value error" not in msg


def test_l3_sections_validate_without_a_store(tmp_path):
    """Validation alone neither connects nor creates the file store's root."""
    root = tmp_path / "never-created"
    cfg = config_from_extra({"l3.backend": "file", "l3.file.root": str(root), "l3.file.capacity_bytes": "1MiB"})
    assert cfg.l3.backend == "file" and cfg.l3.file["capacity_bytes"] == "1MiB" and not root.exists()
    cfg = config_from_extra({"config_file": "l3_zmq.yaml", "l3.zmq.endpoint": "tcp://127.0.0.1:9"})
    assert cfg.l3.zmq["endpoint"] == "tcp://127.0.0.1:9"


@pytest.mark.parametrize("key, bad, allowed", [
    ("controller.write_policy", "write_around", ("write_through", "write_through_selective", "write_back")),
    ("controller.prefetch_policy", "eager", ("best_effort", "wait_complete", "timeout")),
    ("controller.writer_priority", "low", ("idle", "normal")),
])
def test_unknown_controller_policy_names_key_and_allowed_values(key, bad, allowed):
    """Nested and dotted forms alike: the error names the dotted key, the bad value and every allowed policy."""
    section, name = key.split(".")
    for extra in ({section: {name: bad}}, {key: bad}):
        with pytest.raises(ConfigError) as e:
            config_from_extra(extra)
        msg = str(e.value)
        assert f"'{key}'" in msg and repr(bad) in msg, msg
        for a in allowed:
            assert f"'{a}'" in msg, (a, msg)
    for a in allowed:  # and every allowed value is accepted (with an L3 store: without one the keys do nothing)
        assert getattr(config_from_extra({**WITH_L3, key: a}).controller, name) == a


@pytest.mark.parametrize("value", [0, 0.0, -0.5])
def test_prefetch_timeout_base_must_be_positive(value):
    with pytest.raises(ConfigError) as e:
        config_from_extra({"controller": {"prefetch_timeout_base_s": value}})
    msg = str(e.value)
    assert "'controller.prefetch_timeout_base_s'" in msg and msg.startswith("invalid tierkv config"), msg
    assert config_from_extra({**WITH_L3, "controller.prefetch_timeout_base_s": 0.01}).controller.prefetch_timeout_base_s \
        == 0.01


def test_a_file_that_is_not_a_config_is_not_echoed(tmp_path):
    """A file given by mistake (here shaped like /etc/shadow) fails with a short message that repeats none of its
    lines."""
    f = tmp_path / "shadow"
    f.write_text("".join(f"user{i}:$6$s3cr3tHASH{i}$abcdefgh:20228:0:99999:7:::\n" for i in range(50)))
    with pytest.raises(ConfigError) as e:
        load_config(str(f))
    msg = str(e.value)
    assert "s3cr3t" not in msg and "user1" not in msg and len(msg) < 600, msg
    assert "and 45 more problem(s)" in msg


#: a valid value other than the default for every controller key
NON_DEFAULT = {"write_policy": "write_back", "write_through_threshold": 5, "prefetch_policy": "timeout",
               "prefetch_timeout_base_s": 0.75, "prefetch_timeout_per_page_s": 0.01, "exists_wait_s": 0.25,
               "negative_ttl_s": 3.5, "room_retry_steps": 3, "room_wait_s": 0.25, "probe_interval_s": 2.5,
               "sync_load_max_s": 0.0, "exists_in_scheduler": False, "max_index_pages": 1000, "batch_pages": 8, "read_threads": 3,
               "max_backup_pages": 100, "shutdown_drain_s": 0.5, "gil_switch_interval_s": 0.02,
               "writer_priority": "idle", "write_only_warn_bytes": 5,
               "backup_pause": "prefill"}


@pytest.mark.parametrize("key", sorted(set(ControllerConfig.model_fields) - set(USED_WITHOUT_L3)))
def test_controller_keys_without_an_l3_store_are_refused(key):
    """With l3.backend none nothing reads controller.*: a value other than the default is an error naming the key,
    not a setting that silently does nothing; the default value itself (as default.yaml spells it) is accepted."""
    assert set(NON_DEFAULT) == set(ControllerConfig.model_fields)
    value = NON_DEFAULT[key]
    for extra in ({f"controller.{key}": value}, {"controller": {key: value}}):
        with pytest.raises(ConfigError) as e:
            config_from_extra(extra)
        assert str(e.value) == (f"invalid tierkv config: bad value {value!r} for 'controller.{key}': the controller.* "
                                "keys have no effect without an L3 store (l3.backend is 'none'); remove the key or set "
                                "l3.backend")
    assert getattr(config_from_extra({**WITH_L3, f"controller.{key}": value}).controller, key) == value
    default = getattr(ControllerConfig(), key)
    assert getattr(config_from_extra({f"controller.{key}": default}).controller, key) == default


def test_every_unused_controller_key_is_named(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("controller:\n" + "".join(f"  {k}: {v}\n" for k, v in NON_DEFAULT.items()))
    with pytest.raises(ConfigError) as e:
        load_config(f)
    msg = str(e.value)
    refused = len(set(NON_DEFAULT) - set(USED_WITHOUT_L3))
    assert msg.count("have no effect without an L3 store") == 5 and msg.endswith(f"and {refused - 5} more problem(s)")
    for k in list(NON_DEFAULT)[:5]:
        assert f"'controller.{k}'" in msg


def test_config_check_refuses_controller_keys_without_an_l3_store(tmp_path, capsys):
    f = tmp_path / "c.yaml"
    f.write_text("controller:\n  write_policy: write_back\n")
    assert main(["config", "check", str(f)]) == EXIT_FOUND
    err = capsys.readouterr().err
    assert err.strip().endswith("bad value 'write_back' for 'controller.write_policy': the controller.* keys have no "
                                "effect without an L3 store (l3.backend is 'none'); remove the key or set l3.backend")
    assert main(["config", "check", str(f), "--set", "l3.backend=file", "--set", f"l3.file.root={tmp_path}"]) \
        == EXIT_OK



@pytest.mark.parametrize("key,value,allowed", [
    ("read_threads", 0, "greater than or equal to 1"), ("read_threads", 65, "less than or equal to 64"),
    ("room_wait_s", -1, "greater than or equal to 0"), ("probe_interval_s", 0, "greater than 0"),
    ("sync_load_max_s", -0.01, "greater than or equal to 0"),
    ("gil_switch_interval_s", -0.1, "greater than or equal to 0"), ("gil_switch_interval_s", 2, "less than or equal to 1"),
    ("exists_in_scheduler", "maybe", "valid boolean")])
def test_the_load_keys_refuse_bad_values_naming_the_key_and_the_allowed_range(key, value, allowed):
    """Keys added for serving under concurrent load: a bad value stops start-up naming the key and what is allowed."""
    with pytest.raises(ConfigError) as e:
        config_from_extra({**WITH_L3, f"controller.{key}": value})
    assert f"bad value '{value}' for 'controller.{key}'" in str(e.value) and allowed in str(e.value)


def test_stats_path_must_name_a_file_with_known_placeholders(tmp_path):
    """A directory given as ``stats_path`` was accepted and failed only when the counters were written (at shutdown:
    ``IsADirectoryError`` out of vLLM's engine shutdown); a placeholder other than {role} and {pid} failed in the
    connector's constructor with a bare KeyError. Both now stop start-up naming the key."""
    with pytest.raises(ConfigError, match=r"stats_path.*not a directory.*tierkv-\{role\}-\{pid\}\.json"):
        config_from_extra({"stats_path": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"stats_path.*only placeholders are \{role\} and \{pid\}"):
        config_from_extra({"stats_path": str(tmp_path / "{rank}.json")})
    ok = str(tmp_path / "sub" / "{role}-{pid}.json")
    assert config_from_extra({"stats_path": ok}).stats_path == ok
