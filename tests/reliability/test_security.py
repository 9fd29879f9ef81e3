"""Security: API keys (hashed, constant-time, rate-limited per key), NATS credentials and
TLS, Redis AUTH for the KV tier, no unsafe deserialisation in the product, no secrets or
prompts in logs.

The open gateway's start-up warning is pinned in ``tests/gateway/test_auth_health.py``;
request size limits (413) in ``tests/gateway/test_validation.py`` and
``tests/reliability/test_bad_input.py``.
"""

from __future__ import annotations

import ast
import contextlib
import datetime
import hmac
import ipaddress
import logging
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

import common.nats as qnats
from common.config import NatsConfig, RedisConfig
from common.errors import AuthenticationError
from common.services import NatsServer, RedisServer
from gateway import auth
from gateway.auth import ApiKeys, TokenBucket, key_digest
from kvstore.identity import KVLayout
from kvstore.tiers import KVTiers
from tests.reliability.conftest import StackFactory
from tests.reliability.harness import PROMPT, ROOT, body, completion, group

KEY = "sk-live-51HqVdR7tQ0aTZ3vX9mK2pLsN8wYcE4b"  # looks like a real secret on purpose
OTHER_KEY = "sk-live-other-key-0000000000000000"
PRODUCT = ("common", "gateway", "workers", "scheduler", "kvstore", "bench")


# --- API keys -------------------------------------------------------------------------


def test_api_keys_are_configured_as_digests_and_every_digest_is_compared(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ValueError, match="sha256 hex digests"):
        ApiKeys([KEY])  # a plaintext key in the config is refused
    digests = [key_digest(f"k{i}") for i in range(5)]
    keys = ApiKeys([*digests, key_digest(KEY)])
    assert KEY not in repr(vars(keys))  # only digests are held
    calls: list[bytes] = []
    compare = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(b)
        return compare(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    for key in ("k0", KEY):  # the first and the last digest: both accepted
        calls.clear()
        keys.check(f"Bearer {key}")
        assert len(calls) == 6, key  # the same work wherever the match is
    calls.clear()
    with pytest.raises(AuthenticationError) as refused:
        keys.check("Bearer wrong")
    assert refused.value.http_status == 401
    assert len(calls) == 6  # and for no match at all


def test_token_bucket_refills_at_its_rate_up_to_its_burst() -> None:
    now = [0.0]
    bucket = TokenBucket(rate=2.0, burst=3, clock=lambda: now[0])
    assert [bucket.take() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take() == pytest.approx(0.5)
    now[0] += 0.5
    assert bucket.take() == 0.0
    now[0] += 100.0  # a long pause saves up only the burst
    assert [bucket.take() == 0.0 for _ in range(4)] == [True, True, True, False]


async def test_each_api_key_over_its_rate_gets_429_with_retry_after_and_others_are_unaffected(
    private_nats: NatsServer, make_stack: StackFactory
) -> None:
    stack = make_stack(
        private_nats.url,
        workers={},
        api_key_sha256=[key_digest(KEY), key_digest(OTHER_KEY)],
        api_key_rate_limit_rps=0.2,  # a token each 5 s: none comes back during the test
        api_key_rate_limit_burst=2,
    )
    mine = {"Authorization": f"Bearer {KEY}"}
    hi = {"prompt": "hi"}
    async with httpx.AsyncClient(base_url=stack.url, timeout=10) as http:
        listed = (await http.get("/v1/models", headers=mine)).status_code
        burst = [(await http.post("/tokenize", json=hi, headers=mine)).status_code for _ in "ab"]
        over = await http.post("/tokenize", json=hi, headers=mine)
        other = await http.post(
            "/tokenize", json=hi, headers={"Authorization": f"Bearer {OTHER_KEY}"}
        )
        also_over = await http.post(
            f"{stack.base_url}/completions", json=body(stack.model, 1), headers=mine
        )
        # Listing the models takes nothing from the bucket: a UI polling it does not spend
        # the key's generations (the list above did not, or the burst would have failed).
        listed_over = (await http.get("/v1/models", headers=mine)).status_code
        unknown = await http.get("/v1/models", headers={"Authorization": "Bearer sk-unknown"})
    assert listed == listed_over == 200
    assert burst == [200, 200]
    assert over.status_code == 429 and also_over.status_code == 429
    assert over.json()["error"]["code"] == "rate_limit_exceeded"
    assert over.json()["error"]["type"] == "rate_limit_error"
    assert int(over.headers["retry-after"]) >= 1
    assert other.status_code == 200
    assert unknown.status_code == 401  # a wrong key is refused before any bucket is touched


# --- NATS credentials and TLS --------------------------------------------------------


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def make_ca(folder: Path, name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, Path]:
    """A self-signed CA; (certificate, key, path of its PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    path = folder / f"{name}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert, key, path


def make_server_cert(
    folder: Path, ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey
) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 / localhost signed by ``ca``; (cert PEM, key PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    san = x509.SubjectAlternativeName(
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("qos-nats"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(san, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = folder / "server.pem", folder / "server-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, key_path)
    return cert_path, key_path


@pytest.fixture
def tls_nats(
    tmp_path: Path, fresh_nats_server: Callable[..., NatsServer]
) -> tuple[NatsServer, Path, Path]:
    """A nats-server that requires TLS and user/password; (server, its CA, a foreign CA)."""
    ca, ca_key, ca_path = make_ca(tmp_path, "qos-ca")
    _, _, foreign = make_ca(tmp_path, "foreign-ca")
    cert, key = make_server_cert(tmp_path, ca, ca_key)
    config = f"""
tls {{
  cert_file: "{cert}"
  key_file: "{key}"
  timeout: 2
}}
authorization {{
  users = [ {{ user: "svc", password: "s3cret-pw" }} ]
}}
"""
    return fresh_nats_server(extra_config=config), ca_path, foreign


async def _round_trip(config: NatsConfig, name: str) -> None:
    """Connect with ``config`` and get a message back through the server."""
    nc = await qnats.connect(config, name)
    try:
        sub = await nc.subscribe("qos.ping")
        await nc.publish("qos.ping", b"pong")
        assert (await sub.next_msg(timeout=2)).data == b"pong"
    finally:
        await nc.close()


async def test_nats_connect_needs_the_right_password_and_the_servers_ca(
    tls_nats: tuple[NatsServer, Path, Path],
) -> None:
    server, ca, foreign = tls_nats
    good = NatsConfig(
        url=server.url, user="svc", password="s3cret-pw", tls_ca_file=str(ca), connect_timeout_s=3
    )
    await _round_trip(good, "tls-ok")
    refused = {
        "wrong password": good.model_copy(update={"password": "guess"}),
        "no credentials": good.model_copy(update={"user": None, "password": None}),
        "foreign CA": good.model_copy(update={"tls_ca_file": str(foreign)}),
        "no TLS": good.model_copy(update={"tls_ca_file": None}),
    }
    for why, cfg in refused.items():
        with pytest.raises(ConnectionError) as info:
            await qnats.connect(cfg, f"tls-{why.replace(' ', '-')}")
        assert "s3cret-pw" not in str(info.value) and "guess" not in str(info.value), why


async def test_nats_tls_can_start_before_any_protocol_byte(
    tmp_path: Path, fresh_nats_server: Callable[..., NatsServer]
) -> None:
    """nats.tls_handshake_first against a server that wants TLS first: nothing travels in
    clear for a man in the middle to strip (the INFO's tls_required), and a client that
    waits for that INFO cannot connect to such a server at all."""
    ca, ca_key, ca_path = make_ca(tmp_path, "qos-ca")
    cert, key = make_server_cert(tmp_path, ca, ca_key)
    server = fresh_nats_server(
        extra_config=f"""
tls {{
  cert_file: "{cert}"
  key_file: "{key}"
  handshake_first: true
  timeout: 2
}}
"""
    )
    first = NatsConfig(url=server.url, tls_ca_file=str(ca_path), tls_handshake_first=True,
                       connect_timeout_s=3)  # fmt: skip
    await _round_trip(first, "tls-first")
    with pytest.raises(ConnectionError):
        await qnats.connect(first.model_copy(update={"tls_handshake_first": False}), "tls-late")


async def test_nats_settings_that_ask_for_tls_refuse_a_server_that_offers_none(
    tmp_path: Path, fresh_nats_server: Callable[..., NatsServer]
) -> None:
    """What a man in the middle does to strip TLS: a greeting without tls_required. nats-py
    then sent the CONNECT, password included, in clear although a CA was configured."""
    _, _, ca_path = make_ca(tmp_path, "qos-ca")
    plain = fresh_nats_server(extra_config='authorization { user: "svc", password: "pw-9" }')
    asks = NatsConfig(url=plain.url, user="svc", password="pw-9", tls_ca_file=str(ca_path),
                      connect_timeout_s=3)  # fmt: skip
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match="offered no TLS"):
        await qnats.connect(asks, "tls-stripped")
    assert time.monotonic() - t0 < 2  # refused at once, not retried until the timeout
    await _round_trip(asks.model_copy(update={"tls_ca_file": None}), "plain-ok")
    context = ssl.create_default_context()
    assert qnats.must_see_tls_required(NatsConfig(url="tls://h:4222"), None)
    assert qnats.must_see_tls_required(NatsConfig(url="nats://h:4222"), context)
    assert not qnats.must_see_tls_required(NatsConfig(url="nats://h:4222"), None)
    # Any tls:// seed asks for TLS: a plain first seed left the others unguarded.
    assert qnats.must_see_tls_required(NatsConfig(url="nats://a:4222,tls://b:4222"), None)
    for first in (NatsConfig(url="nats://h:4222", tls_handshake_first=True),
                  NatsConfig(url="wss://h:443"), NatsConfig(url="ws://h:80")):  # fmt: skip
        assert not qnats.must_see_tls_required(first, context)


# --- Redis AUTH ----------------------------------------------------------------------

LAYOUT = KVLayout(block_size=4, dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8)
HASHES = [bytes([i]) * 16 for i in range(3)]


def test_the_kv_tier_authenticates_to_redis_and_a_wrong_password_only_costs_hits(
    fresh_redis_server: Callable[..., RedisServer],
) -> None:
    server = fresh_redis_server(password="r3dis-pw")
    data = np.random.default_rng(0).integers(0, 256, (3, LAYOUT.block_bytes), dtype=np.uint8)
    with KVTiers(RedisConfig(url=server.url, password="r3dis-pw")) as tiers:
        tiers.bind("dummy:tiny", 0, LAYOUT)
        tiers.store_async(HASHES, data)
        assert tiers.flush()
        assert tiers.lookup(HASHES) == 3
        assert [bytes(v) for v in tiers.load(HASHES)] == [bytes(r) for r in data]
    for password in ("wrong", None):
        with KVTiers(RedisConfig(url=server.url, password=password, socket_timeout_s=0.2)) as t:
            t.bind("dummy:tiny", 0, LAYOUT)
            assert t.lookup(HASHES) == 0  # refused by the server: a miss, never an exception
            assert t.stats().redis.errors >= 1


def test_the_kv_tier_logs_in_as_an_acl_user_that_has_no_password(
    fresh_redis_server: Callable[..., RedisServer],
) -> None:
    """Redis ACL's ``nopass`` user, with the default user switched off: both of the tier's
    clients must log in as it (redis-py sends AUTH with an empty password; the bulk reader
    sent nothing and every load was refused)."""
    import redis

    server = fresh_redis_server()
    admin = redis.Redis.from_url(server.url)
    admin.execute_command("ACL", "SETUSER", "qos-kv", "on", "nopass", "~*", "&*", "+@all")
    admin.execute_command("ACL", "SETUSER", "default", "off")
    admin.close()
    data = np.random.default_rng(1).integers(0, 256, (3, LAYOUT.block_bytes), dtype=np.uint8)
    with KVTiers(RedisConfig(url=server.url, username="qos-kv")) as tiers:
        tiers.bind("dummy:tiny", 0, LAYOUT)
        tiers.store_async(HASHES, data)
        assert tiers.flush()
        assert tiers.lookup(HASHES) == 3
        assert [bytes(v) for v in tiers.load(HASHES)] == [bytes(r) for r in data]
        assert tiers.stats().redis.errors == 0


class _TlsTerminator:
    """TLS in front of a plain redis-server (the bundled one is built without TLS), asking
    each client for a certificate its CA signed, as redis-server's own TLS does by default
    (tls-auth-clients yes)."""

    def __init__(self, target_port: int, cert: Path, key: Path, client_ca: Path) -> None:
        import socket
        import threading

        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(client_ca))
        self.context.load_cert_chain(cert, key)
        self.context.verify_mode = ssl.CERT_REQUIRED
        self.target = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.refused = 0
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                raw, _ = self.listener.accept()
            except OSError:
                return
            try:
                conn = self.context.wrap_socket(raw, server_side=True)
            except (ssl.SSLError, OSError):
                self.refused += 1
                raw.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target))
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: Any, dst: Any) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()

    def close(self) -> None:
        import socket

        with contextlib.suppress(OSError):  # wakes the blocked accept() (close alone does not)
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self._thread.join(5)


def test_the_kv_tier_presents_a_client_certificate_to_a_redis_that_asks_for_one(
    tmp_path: Path, fresh_redis_server: Callable[..., RedisServer]
) -> None:
    """redis-server's TLS refuses clients without a certificate by default; the tier had no
    setting for one, so against such a Redis it was off for good (misses, quietly)."""
    ca, ca_key, ca_path = make_ca(tmp_path, "qos-ca")
    cert, key = make_server_cert(tmp_path, ca, ca_key)
    client_dir = tmp_path / "client"
    client_dir.mkdir()
    client_cert, client_key = make_server_cert(client_dir, ca, ca_key)
    server = fresh_redis_server()
    port = int(server.url.rsplit(":", 1)[1].split("/")[0])
    front = _TlsTerminator(port, cert, key, ca_path)
    url = f"rediss://127.0.0.1:{front.port}/0"
    data = np.random.default_rng(1).integers(0, 256, (3, LAYOUT.block_bytes), dtype=np.uint8)
    try:
        config = RedisConfig(url=url, tls_ca_file=str(ca_path), tls_cert_file=str(client_cert),
                             tls_key_file=str(client_key))  # fmt: skip
        with KVTiers(config) as tiers:
            tiers.bind("dummy:tiny", 0, LAYOUT)
            tiers.store_async(HASHES, data)
            assert tiers.flush()
            assert tiers.lookup(HASHES) == 3
            assert [bytes(v) for v in tiers.load(HASHES)] == [bytes(r) for r in data]
        anonymous = RedisConfig(url=url, tls_ca_file=str(ca_path), socket_timeout_s=2.0)
        with KVTiers(anonymous) as tiers:
            tiers.bind("dummy:tiny", 0, LAYOUT)
            assert tiers.lookup(HASHES) == 0  # refused at the handshake: a miss
            assert tiers.stats().redis.errors >= 1
        for _ in range(100):  # counted after its alert went out (TLS 1.3: read after)
            if front.refused:
                break
            time.sleep(0.05)
        assert front.refused >= 1
    finally:
        front.close()
    with pytest.raises(ValueError, match="set together"):
        RedisConfig(url=url, tls_cert_file=str(client_cert))
    with pytest.raises(ValueError, match="rediss://"):
        RedisConfig(tls_cert_file=str(client_cert), tls_key_file=str(client_key))


# --- the product tree ----------------------------------------------------------------

UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle"}


def unsafe_calls(source: str) -> list[str]:
    """Deserialisation or code execution of untrusted data in ``source``, by line."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
            )
            found += [
                f"{node.lineno}: import {n}" for n in names if n.split(".")[0] in UNSAFE_MODULES
            ]
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = (
            func.id
            if isinstance(func, ast.Name)
            else func.attr
            if isinstance(func, ast.Attribute)
            else ""
        )
        owner = (
            func.value.id
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
            else ""
        )
        keywords = {k.arg: k.value for k in node.keywords}
        if isinstance(func, ast.Name) and name in ("eval", "exec"):
            found.append(f"{node.lineno}: {name}(")
        elif owner == "yaml" and name in ("load", "load_all", "unsafe_load", "full_load"):
            loader = keywords.get("Loader")
            safe = isinstance(loader, ast.Attribute) and loader.attr in (
                "SafeLoader",
                "CSafeLoader",
            )
            if not safe:
                found.append(f"{node.lineno}: yaml.{name}(")
        elif owner == "torch" and name == "load":
            weights_only = keywords.get("weights_only")
            if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                found.append(f"{node.lineno}: torch.load( without weights_only=True")
    return found


def test_the_scan_finds_what_it_looks_for() -> None:
    bad = (
        "import pickle\neval('1')\nyaml.load(s)\nyaml.load(s, Loader=yaml.Loader)\ntorch.load(f)\n"
    )
    assert len(unsafe_calls(bad)) == 5
    ok = "yaml.safe_load(s)\nyaml.load(s, Loader=yaml.SafeLoader)\ntorch.load(f, weights_only=True)\n"
    assert unsafe_calls(ok) == []


def test_no_pickle_eval_exec_marshal_or_unsafe_yaml_anywhere_in_the_product() -> None:
    problems = {}
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            found = unsafe_calls(path.read_text())
            if found:
                problems[str(path.relative_to(ROOT))] = found
    assert problems == {}


# --- logs ----------------------------------------------------------------------------


async def test_no_api_key_or_prompt_reaches_the_logs_at_info(
    private_nats: NatsServer, make_stack: StackFactory, caplog: pytest.LogCaptureFixture
) -> None:
    prompt = "zebra-umbrella-4711 tell me the launch codes"
    caplog.set_level(logging.INFO)
    stack = make_stack(
        private_nats.url, {"short": group(4)}, {"short": 1}, api_key_sha256=[key_digest(KEY)]
    )
    url = f"{stack.base_url}/completions"
    async with httpx.AsyncClient(timeout=30) as http:
        ok = await completion(
            http,
            url,
            {**body(stack.model, 3), "prompt": prompt},
            {"Authorization": f"Bearer {KEY}"},
        )
        wrong = await completion(
            http, url, body(stack.model, 4), {"Authorization": f"Bearer {KEY[:-4]}XXXX"}
        )
        failed = await completion(  # a worker-side error path logs too
            http, url, {**body(stack.model, 5), "prompt": prompt, "max_tokens": 10_000},
            {"Authorization": f"Bearer {KEY}"},
        )  # fmt: skip
    assert ok.kind == "complete" and wrong.status == 401 and failed.kind == "error"
    lines = [record.getMessage() for record in caplog.records]
    lines += [caplog.text]
    assert len(caplog.records) > 3  # the services did log at INFO
    for secret in (KEY, KEY[:-4], "zebra-umbrella", "launch codes", PROMPT):
        leaked = [line for line in lines if secret in line]
        assert not leaked, f"{secret!r} in the logs: {leaked[:2]}"


def test_the_kv_tiers_redis_pool_checks_the_servers_name_under_tls() -> None:
    """redis-py before 6.0 (which pyproject allowed) did not check the certificate's host
    name by default: any certificate a trusted CA issued, for any host, passed. The bulk
    client checks it; the pool now asks for it whatever the installed version's default."""
    from kvstore.redis_tier import connection_pool

    tls = connection_pool(RedisConfig(url="rediss://redis.internal:6380/0"), 1 << 20)
    plain = connection_pool(RedisConfig(url="redis://redis.internal:6379/0"), 1 << 20)
    assert tls.connection_kwargs.get("ssl_check_hostname") is True
    assert "ssl_check_hostname" not in plain.connection_kwargs
