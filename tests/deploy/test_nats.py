"""deploy/nats/permissions.conf as a file: nats-server loads it with the documented password
variables, those variables can share an env file with the services, and each user may make
the JetStream API calls its client library sends. ``tests/reliability/test_nats_permissions.py``
runs the services against it."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from common.config import load_config
from common.services import find_binary

ROOT = Path(__file__).resolve().parents[2]
NATS_DIR = ROOT / "deploy" / "nats"
PERMISSIONS = NATS_DIR / "permissions.conf"
# The server's password variables: not QOS_*, which the services read as configuration keys.
PASSWORDS = [f"NATS_QOS_{user}_PASSWORD" for user in ("GATEWAY", "WORKER", "SCHEDULER", "ADMIN")]


def password_variables() -> list[str]:
    return re.findall(r"password:\s*\$(\w+)", PERMISSIONS.read_text())


def publish_allowed(user_block: str) -> list[str]:
    """The quoted subjects of ``<user_block> = { publish = { allow = [...] } }``."""
    text = PERMISSIONS.read_text()
    block = re.search(rf"^\s*{user_block} = \{{(.*?)^\s*\}}\n\n", text, re.M | re.S)
    assert block, user_block
    allow = re.search(r"publish = \{\s*allow = \[(.*?)\]", block[1], re.S)
    assert allow, user_block
    return re.findall(r'"([^"]+)"', re.sub(r"#.*", "", allow[1]))


def test_the_password_variables_can_share_an_env_file_with_the_services() -> None:
    """The services refuse any QOS_* variable that is not a configuration key, so NATS's
    own variables must not start with QOS_ (one env file for both would stop every service)."""
    assert password_variables() == PASSWORDS
    load_config(env=dict.fromkeys(PASSWORDS, "secret"))  # raises ConfigError on an unknown key
    readme = (NATS_DIR / "README.md").read_text()
    assert all(f"`{name}`" in readme for name in PASSWORDS)
    assert not re.search(r"QOS_NATS_[A-Z]+_PASSWORD", readme + PERMISSIONS.read_text())


def test_nats_server_loads_the_permissions_with_those_variables(tmp_path: Path) -> None:
    conf = tmp_path / "nats.conf"
    conf.write_text(f"port: -1\ninclude {PERMISSIONS.name}\n")
    (tmp_path / PERMISSIONS.name).write_text(PERMISSIONS.read_text())
    env = {k: v for k, v in os.environ.items() if "PASSWORD" not in k}
    env |= dict.fromkeys(PASSWORDS, "secret")  # and no other: a stray $VAR fails the load
    checked = subprocess.run(
        [str(find_binary("nats-server")), "-c", str(conf), "-t"],
        capture_output=True, text=True, check=False, env=env, timeout=30,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stderr


def test_the_gateway_may_look_up_stream_names_for_kv_watch() -> None:
    """nats-py before 2.15 (pyproject allows 2.9) finds a KV watch's stream by subject through
    $JS.API.STREAM.NAMES; the gateway watches breaker.* in the state bucket."""
    gateway = publish_allowed("GATEWAY")
    assert "$JS.API.STREAM.NAMES" in gateway
    assert "$JS.API.CONSUMER.CREATE.KV_qos_state" in gateway  # the watch's ordered consumer
