"""Configuration: defaults from the field study, YAML and QOS_* overrides, errors that name the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from common.config import load_config
from common.errors import ConfigError


def test_defaults_are_the_field_study_groups() -> None:
    cfg = load_config(env={})
    limits = {name: (g.max_batch, g.max_seq_len) for name, g in cfg.groups.items()}
    assert limits == {"realtime": (1, 1024), "short": (16, 4096), "long": (2, 131072)}
    assert cfg.groups["short"].breaker.window_samples == 10
    assert cfg.groups["short"].breaker.p99_threshold_ms == 500
    assert cfg.groups["short"].breaker.open_batch_cap == 4
    assert [name for name, _ in cfg.groups_by_rank()] == ["realtime", "short", "long"]


def test_yaml_file_overrides_defaults_and_env_overrides_the_file(tmp_path: Path) -> None:
    file = tmp_path / "qos.yaml"
    file.write_text(
        "nats:\n  url: nats://10.0.0.1:4222\n"
        "groups:\n  short:\n    max_batch: 32\n  batch:\n"
        "    max_batch: 64\n    max_seq_len: 8192\n    slo_ttft_ms: 5000\n    slo_e2e_p99_ms: 600000\n"
    )
    cfg = load_config(file, env={"QOS_GROUPS__SHORT__MAX_BATCH": "8", "QOS_REDIS__TTL_S": "60"})
    assert cfg.nats.url == "nats://10.0.0.1:4222"
    assert cfg.groups["short"].max_batch == 8
    assert cfg.groups["short"].max_seq_len == 4096  # untouched default survives the merge
    assert cfg.groups["batch"].max_batch == 64
    assert set(cfg.groups) == {"realtime", "short", "long", "batch"}
    assert cfg.redis.ttl_s == 60


def test_config_file_named_by_environment(tmp_path: Path) -> None:
    file = tmp_path / "c.yaml"
    file.write_text("gateway:\n  port: 9001\n")
    assert load_config(env={"QOS_CONFIG": str(file)}).gateway.port == 9001


def test_groups_can_replace_the_defaults(tmp_path: Path) -> None:
    file = tmp_path / "c.yaml"
    file.write_text(
        "groups_replace_defaults: true\ngroups:\n  only:\n    max_batch: 4\n"
        "    max_seq_len: 2048\n    slo_ttft_ms: 100\n    slo_e2e_p99_ms: 400\n"
    )
    assert list(load_config(file, env={}).groups) == ["only"]


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"QOS_NATS__ULR": "x"}, "nats.ulr"),
        ({"QOS_GROUPS__SHORT__MAX_BATCH": "0"}, "groups.short.max_batch"),
        ({"QOS_GROUPS__SHORT__MAX_BATCH": "many"}, "groups.short.max_batch"),
        ({"QOS_GROUPS__SHORT__POLICY": "fifo"}, "groups.short.policy"),
        ({"QOS_GROUPS__SHORT__FALLBACK": "nowhere"}, "unknown group 'nowhere'"),
        ({"QOS_GATEWAY__PORT": "70000"}, "gateway.port"),
        # Past the request stream's 25 h max_age: dropped while queued, without a word.
        ({"QOS_GATEWAY__DEFAULT_DEADLINE_MS": "200000000"}, "gateway.default_deadline_ms"),
        ({"QOS_NATS__SUBJECT_PREFIX": "a.b"}, "nats.subject_prefix"),
        ({"QOS_NATS____URL": "x"}, "empty key segment"),
        (
            {"QOS_SCHEDULER__LEASE_TTL_S": "2", "QOS_SCHEDULER__LEASE_RENEW_S": "1.6"},
            "scheduler.lease_renew_s",
        ),
    ],
)
def test_bad_setting_fails_naming_it(env: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(env=env)


def test_new_group_missing_required_limits_is_named(tmp_path: Path) -> None:
    file = tmp_path / "c.yaml"
    file.write_text("groups:\n  tiny:\n    max_batch: 2\n")
    with pytest.raises(ConfigError, match=r"groups\.tiny\.max_seq_len"):
        load_config(file, env={})


def test_missing_or_malformed_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml", env={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("nats: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad, env={})
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(scalar, env={})


def test_secrets_in_variables_are_taken_as_given_and_never_quoted_in_errors() -> None:
    env = {"QOS_REDIS__PASSWORD": "p: [x", "QOS_NATS__PASSWORD": "#not-a-comment",
           "QOS_NATS__TOKEN": "null"}  # fmt: skip
    config = load_config(None, env=env)
    assert config.redis.password == "p: [x" and config.nats.password == "#not-a-comment"
    assert config.nats.token == "null"
    with pytest.raises(ConfigError) as bad:
        load_config(None, env={"QOS_REDIS__URL": "hunter2: [x"})
    assert "hunter2" not in str(bad.value) and "redis.url" in str(bad.value)


def test_an_empty_or_short_kv_secret_is_refused_not_taken_as_off() -> None:
    """A secret reference that resolved to "" turned authentication off on that worker
    alone, which then rejected (and overwrote) every value the others wrote."""
    for bad in ("", "short"):
        with pytest.raises(ConfigError) as error:
            load_config(None, env={"QOS_REDIS__KV_MAC_SECRET": bad})
        assert "kv_mac_secret" in str(error.value) and (not bad or bad not in str(error.value))
    secret = "x" * 16
    assert load_config(None, env={"QOS_REDIS__KV_MAC_SECRET": secret}).redis.kv_mac_secret == secret


def test_the_example_secrets_placeholder_is_refused_for_every_secret() -> None:
    """secret.example.yaml's REPLACE-ME stopped only the API keys and the MAC secret: NATS
    and Redis ran on a public password nothing complained about."""
    for key in ("NATS__PASSWORD", "NATS__TOKEN", "REDIS__PASSWORD"):
        with pytest.raises(ConfigError) as error:
            load_config(None, env={f"QOS_{key}": "REPLACE-ME"})
        assert "placeholder" in str(error.value), key
        assert key.lower().replace("__", ".") in str(error.value)
    with pytest.raises(ConfigError, match="kv_mac_secret"):  # under 16 characters too
        load_config(None, env={"QOS_REDIS__KV_MAC_SECRET": "REPLACE-ME"})
    assert load_config(None, env={"QOS_NATS__PASSWORD": "gw-pw-1"}).nats.password == "gw-pw-1"


def test_a_redis_ca_file_needs_a_tls_url() -> None:
    with pytest.raises(ConfigError, match="rediss://"):
        load_config(None, env={"QOS_REDIS__TLS_CA_FILE": "/ca.pem"})
    tls = {"QOS_REDIS__TLS_CA_FILE": "/ca.pem", "QOS_REDIS__URL": "rediss://r:6380/0"}
    assert load_config(None, env=tls).redis.tls_ca_file == "/ca.pem"


def test_nats_tls_settings_need_wss_not_ws_urls() -> None:
    """nats-py never starts TLS on a ws:// link: a CA file or a client certificate there
    was ignored, and the password went in clear."""
    from common.config import NatsConfig

    with pytest.raises(ConfigError, match=r"nats.tls_ca_file.*use wss://") as info:
        load_config(None, env={"QOS_NATS__URL": "ws://svc:s3cret@n:80",
                               "QOS_NATS__TLS_CA_FILE": "/ca.pem"})  # fmt: skip
    assert "s3cret" not in info.value.message
    with pytest.raises(ValueError, match=r"nats\.tls_cert_file, nats\.tls_key_file set"):
        NatsConfig(url="ws://n:80", tls_cert_file="/c.pem", tls_key_file="/k.pem")
    ok = NatsConfig(url="wss://n:443,wss://m:443", tls_ca_file="/ca.pem", tls_handshake_first=True)
    assert ok.tls_ca_file == "/ca.pem"
    assert NatsConfig(url="ws://n:80").plain_websocket_tls() is None  # no TLS asked: fine
    assert NatsConfig(url="nats://n:4222", tls_ca_file="/ca.pem").plain_websocket_tls() is None


def test_group_names_are_ascii_tokens():
    """A Cyrillic name passed isalnum() and then broke every streamed response (its
    X-QoS-Group header is latin-1) after the request had taken its slot."""
    from common.config import Config, default_groups

    group = default_groups()["long"]  # no fallback to name
    with pytest.raises(ValueError, match="ASCII"):
        Config(groups={"быстро": group})
    assert "fast-1_a" in Config(groups={"fast-1_a": group}).groups
    # Longer than a NATS contract token (128): it passed here and failed building subjects.
    with pytest.raises(ValueError, match="1-128"):
        Config(groups={"g" * 129: group})


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"QOS_WORKER__TELEMETRY_INTERVAL_S": "5"}, "worker_silent_s (3) must exceed twice"),
        ({"QOS_WORKER__ORPHAN_AFTER_S": "2"}, "orphan_after_s (2) must be at least three"),
        ({"QOS_GROUPS__SHORT__BREAKER__MIN_SAMPLES": "30",
          "QOS_GROUPS__SHORT__BREAKER__WINDOW_SAMPLES": "40"}, "can never be reached"),
        # Samples every 1.4 s (two ticks span 0.9 reports): 7 fit in 10 s, not 10.
        ({"QOS_SCHEDULER__TICK_INTERVAL_S": "0.7",
          "QOS_GROUPS__SHORT__BREAKER__MIN_SAMPLES": "8"}, "holds at most 7.14286 samples"),
        ({"QOS_SCHEDULER__MIN_REPLICAS": "{shrot: 2}"}, "unknown groups ['shrot']"),
        ({"QOS_GATEWAY__API_KEY_SHA256": "[sk-plain-key]"}, "SHA-256 hex digest"),
        ({"QOS_WORKER__DEVICE": "gpu"}, "worker.device"),
        ({"QOS_WORKER__DTYPE": "fp8"}, "worker.dtype"),
        ({"QOS_GROUPS": "[short]"}, "groups must be a mapping"),
        ({"QOS_NATS__URL": "ws://a:80,nats://b:4222"}, "cannot mix websocket"),
        # nats-py never starts TLS on ws://: the password went in clear.
        ({"QOS_NATS__URL": "wss://a:443,ws://b:80", "QOS_NATS__TLS_CA_FILE": "/ca.pem"},
         "nats.tls_ca_file set with a ws:// URL"),
        ({"QOS_NATS__URL": "ws://a:80", "QOS_NATS__TLS_HANDSHAKE_FIRST": "true"}, "use wss://"),
    ],
)  # fmt: skip
def test_settings_that_cannot_work_together_are_refused_with_one_line(
    env: dict[str, str], says: str
) -> None:
    """Accepted before, each broke a running system: workers read as gone between reports,
    live gateways' requests aborted as orphans, a breaker that could never open, a typo'd
    group ignored, a plain-text key or a bad device failing only once a service started, a
    list of groups a traceback."""
    with pytest.raises(ConfigError, match=re.escape(says)) as info:
        load_config(env=env)
    assert "\n" not in info.value.message and "Value error" not in info.value.message
    assert "sk-plain-key" not in info.value.message


def test_text_settings_from_the_environment_are_taken_as_written() -> None:
    """YAML read QOS_NATS__USER=123 as a number and "no" as false, and refused both."""
    cfg = load_config(env={"QOS_NATS__USER": "123", "QOS_REDIS__USERNAME": "no",
                           "QOS_WORKER__MODEL": "1.0", "QOS_GROUPS__SHORT__FALLBACK": "NULL"})  # fmt: skip
    assert (cfg.nats.user, cfg.redis.username, cfg.worker.model) == ("123", "no", "1.0")
    assert cfg.groups["short"].fallback is None  # null still unsets an optional one
    with pytest.raises(ConfigError, match="quote a string"):
        load_config(env={"QOS_GATEWAY__CORS_ALLOW_ORIGINS": "*"})


def test_a_yaml_error_does_not_quote_the_line(tmp_path: Path) -> None:
    file = tmp_path / "bad.yaml"
    file.write_text('nats:\n  password: "s3cr3t-pa55\n  url: x\n')
    with pytest.raises(ConfigError, match="not valid YAML at line") as info:
        load_config(file, env={})
    assert "s3cr3t" not in info.value.message


def test_a_config_file_that_cannot_be_read_is_one_line_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A UTF-16 file (PowerShell 5.1's ``>``) or one the user may not read raised a raw
    UnicodeDecodeError or PermissionError: a traceback where every other mistake in the
    file is one line."""
    utf16 = tmp_path / "qos.yaml"
    utf16.write_text("gateway: {port: 9000}\n", encoding="utf-16")
    with pytest.raises(ConfigError, match=re.escape("qos.yaml: cannot read it (not UTF-8)")):
        load_config(utf16, env={})
    locked = tmp_path / "locked.yaml"
    locked.write_text("{}")

    def denied(self: Path, *args: object, **kwargs: object) -> str:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_text", denied)
    with pytest.raises(
        ConfigError, match=re.escape("locked.yaml: cannot read it (Permission denied)")
    ):
        load_config(locked, env={})
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="not a file"):
        load_config(tmp_path, env={})


def test_changed_settings_load_back_into_the_same_config(tmp_path: Path) -> None:
    """--changed printed every group in full for one changed key, and dropped
    groups_replace_defaults (set from the environment it did nothing at all)."""
    import yaml

    from common.config import changed_settings

    one_key = load_config(env={"QOS_GROUPS__SHORT__MAX_BATCH": "8"})
    assert changed_settings(one_key) == {"groups": {"short": {"max_batch": 8}}}
    solo = {"QOS_GROUPS_REPLACE_DEFAULTS": "true", "QOS_GROUPS__SOLO__MAX_BATCH": "2",
            "QOS_GROUPS__SOLO__MAX_SEQ_LEN": "512", "QOS_GROUPS__SOLO__SLO_TTFT_MS": "100",
            "QOS_GROUPS__SOLO__SLO_E2E_P99_MS": "500"}  # fmt: skip
    for cfg in (one_key, load_config(env=solo)):
        file = tmp_path / "changed.yaml"
        file.write_text(yaml.safe_dump(changed_settings(cfg)))
        assert load_config(file, env={}) == cfg
    assert list(load_config(env=solo).groups) == ["solo"]


def test_a_bad_flag_value_is_a_config_error_naming_it() -> None:
    from common.config import with_settings

    with pytest.raises(ConfigError, match=r"\(flags\): scheduler.metrics_port"):
        with_settings(load_config(env={}), "flags", scheduler={"metrics_port": 70000})


def test_a_bad_key_from_the_environment_names_its_variable() -> None:
    """Said as pydantic's "gateway.nope: Extra inputs are not permitted", the user had to
    work out which of their variables that was."""
    with pytest.raises(ConfigError) as info:
        load_config(env={"QOS_GATEWAY__NOPE": "1", "QOS_GROUPS__SHORT__MAX_BATCH": "many"})
    message = str(info.value)
    assert "gateway.nope (set by QOS_GATEWAY__NOPE): unknown key" in message
    assert "groups.short.max_batch (set by QOS_GROUPS__SHORT__MAX_BATCH)" in message
    assert "many" not in message  # values stay out: one may be a secret


def test_redis_url_options_the_tiers_own_client_would_ignore_are_refused() -> None:
    """redis-py honours ?ssl_cert_reqs=none or ?socket_timeout=3, the tier's bulk client
    (kvstore/bulk_io.py) did not: one URL, two behaviours. Refused, naming the settings."""
    with pytest.raises(ConfigError, match="ssl_cert_reqs") as info:
        load_config(env={"QOS_REDIS__URL": "rediss://u:s3cret@h:6380/0?ssl_cert_reqs=none"})
    assert "redis.url" in str(info.value) and "s3cret" not in str(info.value)
    assert load_config(env={"QOS_REDIS__URL": "unix:///tmp/r.sock?db=2"}).redis.url


def test_a_whole_section_variable_merges_with_its_keys_variables_in_any_order() -> None:
    """Assigned, QOS_GROUPS__BATCH replaced the {rank: 5} of QOS_GROUPS__BATCH__RANK read
    before it: the environment's order (docker's, the shell's) decided the config."""
    section = "{max_batch: 4, max_seq_len: 2048, slo_ttft_ms: 100, slo_e2e_p99_ms: 500}"
    for env in (
        {"QOS_GROUPS__BATCH__RANK": "5", "QOS_GROUPS__BATCH": section},
        {"QOS_GROUPS__BATCH": section, "QOS_GROUPS__BATCH__RANK": "5"},
    ):
        config = load_config(None, env=env)
        assert config.groups["batch"].rank == 5 and config.groups["batch"].max_batch == 4


@pytest.mark.parametrize(
    ("env", "named"),
    [
        # Requests finished between two reports reached no p99: the breakers missed them.
        (
            {
                "QOS_WORKER__TELEMETRY_INTERVAL_S": "5",
                "QOS_SCHEDULER__WORKER_SILENT_S": "11",
                "QOS_SCHEDULER__WINDOW_S": "30",
            },
            "latency_window_s",
        ),
        # Loaded, then lost at the first incident (urllib refused it in a thread).
        ({"QOS_SCHEDULER__ALERT_WEBHOOK_URL": "hooks.example/T/B/secret-9"}, "alert_webhook_url"),
        ({"QOS_SCHEDULER__ALERT_WEBHOOK_URL": "null"}, "alert_webhook_url"),
        # Meaningless, and silently read as 0.
        ({"QOS_SCHEDULER__MIN_REPLICAS": '{"short": -1}'}, "min_replicas"),
        # Truthy strings replaced the default groups whatever they said.
        (
            {"QOS_GROUPS_REPLACE_DEFAULTS": '"false"', "QOS_GROUPS__BATCH": "{}"},
            "groups_replace_defaults must be true or false",
        ),
        # A bare ZeroDivisionError naming no key (and a busy loop of reports before).
        ({"QOS_WORKER__TELEMETRY_INTERVAL_S": "1e-10"}, "telemetry_interval_s"),
        ({"QOS_SCHEDULER__TICK_INTERVAL_S": "1e300"}, "min_samples"),
    ],
)
def test_settings_that_would_fail_later_are_refused_at_load(
    env: dict[str, str], named: str
) -> None:
    with pytest.raises(ConfigError, match=named) as info:
        load_config(None, env=env)
    assert "secret-9" not in str(info.value)


def test_api_key_names_must_name_configured_keys_once_each_in_label_characters() -> None:
    a, b = "a" * 64, "b" * 64
    ok = {"QOS_GATEWAY__API_KEY_SHA256": f'["{a}", "{b}"]'}
    named = load_config(None, env={**ok, "QOS_GATEWAY__API_KEY_NAMES": f'{{"{a}": "team-a"}}'})
    assert named.gateway.api_key_names == {a: "team-a"}
    for names, says in (
        (f'{{"{"c" * 64}": "x"}}', "not in gateway.api_key_sha256"),
        (f'{{"{a}": "team a"}}', "must be 1-64"),
        (f'{{"{a}": "t", "{b}": "t"}}', "share a label"),
        (f'{{"{a}": "bbbbbbbb"}}', "share a label"),
    ):
        with pytest.raises(ConfigError, match=says):
            load_config(None, env={**ok, "QOS_GATEWAY__API_KEY_NAMES": names})
