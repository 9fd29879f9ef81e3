"""NATS plumbing every service shares (DESIGN §2): connect, and the JetStream objects.

``ensure_*`` are idempotent: every gateway, worker and scheduler replica calls them at
start-up, so whoever comes first creates the stream, the per-group durable consumers and
the KV bucket, and the rest verify them. A setting that differs is updated when NATS can
update it in place; when it cannot (retention, storage, ack policy), start-up fails with
a :class:`ConfigError` that says what to do, rather than running against the wrong thing.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import inspect
import logging
import math
import ssl
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from enum import Enum
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue

from common.config import NatsConfig
from common.errors import ConfigError
from common.logging import redact_url
from common.subjects import HEARTBEAT_KEY_PREFIX, Subjects

log = logging.getLogger(__name__)

# Enough in flight for every replica's batch plus prefetch; admission bounds the rest.
DEFAULT_MAX_ACK_PENDING = 1024
DEFAULT_KV_HISTORY = 5


def _show(value: object) -> str:
    """Server responses hold plain strings where our configs hold str enums."""
    return str(value.value if isinstance(value, Enum) else value)


def _tls_context(cfg: NatsConfig) -> ssl.SSLContext | None:
    reason = cfg.plain_websocket_tls()  # a config made by model_copy was never validated
    if reason is not None:
        raise ConfigError(reason)
    if not (cfg.tls_ca_file or cfg.tls_cert_file or cfg.tls_key_file):
        if cfg.tls_handshake_first:  # the system's CAs then
            return ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        return None
    if bool(cfg.tls_cert_file) != bool(cfg.tls_key_file):
        raise ConfigError("nats.tls_cert_file and nats.tls_key_file must be set together")
    try:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cfg.tls_ca_file)
        if cfg.tls_cert_file and cfg.tls_key_file:
            context.load_cert_chain(cfg.tls_cert_file, cfg.tls_key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"nats TLS files: {exc}") from exc
    return context


class _TlsRequiredClient(Client):
    """A client that refuses a server whose greeting does not require TLS.

    nats-py upgrades to TLS only when the server's INFO says ``tls_required``; a man in the
    middle who rewrites that line got the CONNECT, credentials included, in clear although
    the settings named a CA or a client certificate. Checked on every (re)connection, before
    anything is sent.
    """

    async def _process_info(self, info: dict[str, Any], initial_connection: bool = False) -> None:
        if initial_connection and not info.get("tls_required"):
            raise ssl.SSLError(
                "nats server offered no TLS although nats.tls_* is set: not sending "
                "anything in clear (a man in the middle strips TLS that way)"
            )
        await super()._process_info(info, initial_connection)


# nats-py before 2.10 called _process_info without awaiting it: the override above would
# never run (only a "never awaited" warning), and TLS stripping would pass unnoticed.
if not inspect.iscoroutinefunction(Client._process_info):  # pragma: no cover - old nats-py
    raise ImportError("qosserve needs nats-py >= 2.10 (its TLS guard overrides an awaited hook)")


def must_see_tls_required(cfg: NatsConfig, tls: ssl.SSLContext | None) -> bool:
    """Whether the server's greeting must ask for TLS: the settings ask for it (a context,
    or tls://, for which nats-py builds a default one) and nothing encrypts before the
    greeting (handshake first). Not over websockets: nats-py never upgrades a ws:// link
    (TLS settings with one are refused: :func:`_tls_context`), and a wss:// one is TLS
    already while its INFO speaks for the main listener."""
    servers = cfg.servers
    if cfg.tls_handshake_first or servers[0].startswith(("ws://", "wss://")):
        return False  # (a list mixes no websocket URL with others: nats.url refuses it)
    return tls is not None or any(url.startswith("tls://") for url in servers)


def _auth_options(cfg: NatsConfig) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if cfg.user or cfg.password:  # "" is unset: the local stack blanks them (launcher)
        options["user"], options["password"] = cfg.user, cfg.password
    if cfg.token:
        options["token"] = cfg.token
    if cfg.creds_file or cfg.nkey_seed_file:
        # nats-py signs the server nonce with the optional `nkeys` package.
        if importlib.util.find_spec("nkeys") is None:
            key = "nats.creds_file" if cfg.creds_file else "nats.nkey_seed_file"
            raise ConfigError(f"{key} needs the `nkeys` package: pip install nkeys")
        if cfg.creds_file:
            options["user_credentials"] = cfg.creds_file
        if cfg.nkey_seed_file:
            options["nkeys_seed"] = cfg.nkey_seed_file
    return options


def _is_fatal(exc: Exception) -> bool:
    """Errors that retrying cannot fix: bad credentials, a TLS failure."""
    # During the handshake nats-py reports a refusal as a plain Error with the server's text.
    text = str(exc).lower()
    return (
        isinstance(exc, nats.errors.AuthorizationError | ssl.SSLError)
        or "authorization violation" in text
        or "authentication" in text
    )


async def connect(
    cfg: NatsConfig,
    name: str,
    *,
    initial_timeout_s: float | None = None,
    service: str | None = None,
    on_closed: Callable[[], None] | None = None,
) -> Client:
    """Connect with reconnect/backoff, credentials and TLS from ``cfg``; callbacks log.

    ``on_closed`` is told whenever the connection has ended for good -- by ``close()``, or
    because nats-py gave up (an authorization error, say after a credentials rotation, or
    ``max_reconnect_attempts`` spent): a service not stopping then acts on nothing while
    its HTTP endpoints still answer, so it exits, for its supervisor to restart it.

    ``service`` (gateway, worker, scheduler) names the reply inbox, ``_INBOX_<service>``,
    unless ``nats.inbox_prefix`` sets one: NATS delivers a reply to every subscriber whose
    permissions match, so with one shared ``_INBOX`` any service user could subscribe to
    ``_INBOX.>`` and read the requests JetStream hands the workers, prompts included.

    nats-py retries the *first* connection forever when ``max_reconnect_attempts`` is
    -1 (or 0), so the first connection is bounded here by ``initial_timeout_s``
    (default ``cfg.connect_timeout_s``); bad credentials or TLS end it at once.
    Raises :class:`ConnectionError` naming the server and the last error.
    """
    servers = cfg.servers
    url = ", ".join(redact_url(server) for server in servers)
    tls = _tls_context(cfg)
    nc = _TlsRequiredClient() if must_see_tls_required(cfg, tls) else Client()
    refused = asyncio.Event()

    async def on_error(exc: Exception) -> None:
        if isinstance(exc, nats.errors.SlowConsumerError):
            for hook in _SLOW_CONSUMER_HOOKS.get(nc, ()):
                hook(exc)
        if not nc.is_connected and _is_fatal(exc):
            refused.set()
        if "permissions violation" in str(exc).lower():
            _REFUSALS.setdefault(nc, deque(maxlen=32)).append(str(exc))
        log.warning("nats %s (%s): %s", name, url, exc or type(exc).__name__)

    async def on_disconnected() -> None:
        # close() reports a disconnect too; only an unplanned one deserves a warning.
        level = logging.INFO if nc.is_closed else logging.WARNING
        log.log(level, "nats %s: disconnected from %s", name, url)

    async def on_reconnected() -> None:
        where = redact_url(nc.connected_url.geturl()) if nc.connected_url else None
        log.info("nats %s: reconnected to %s", name, where)

    async def closed() -> None:
        log.info("nats %s: connection closed", name)
        if on_closed is not None:
            on_closed()

    connecting = asyncio.ensure_future(
        nc.connect(
            servers=servers,
            name=name,
            error_cb=on_error,
            disconnected_cb=on_disconnected,
            reconnected_cb=on_reconnected,
            closed_cb=closed,
            connect_timeout=math.ceil(cfg.connect_timeout_s),
            reconnect_time_wait=cfg.reconnect_wait_s,  # type: ignore[arg-type]  # a float works
            max_reconnect_attempts=cfg.max_reconnect_attempts,
            ping_interval=cfg.ping_interval_s,  # type: ignore[arg-type]  # a float works
            max_outstanding_pings=cfg.max_outstanding_pings,
            tls=tls,
            tls_handshake_first=cfg.tls_handshake_first,
            inbox_prefix=inbox_prefix(cfg, service),
            **_auth_options(cfg),
        )
    )
    refused_wait = asyncio.ensure_future(refused.wait())
    timeout = cfg.connect_timeout_s if initial_timeout_s is None else initial_timeout_s
    started = time.monotonic()
    try:
        await asyncio.wait(
            {connecting, refused_wait}, timeout=timeout, return_when="FIRST_COMPLETED"
        )
    except BaseException:
        connecting.cancel()  # a cancelled caller must not leave a retry loop behind
        raise
    finally:
        refused_wait.cancel()
    if connecting.done() and connecting.exception() is None:
        return nc
    connecting.cancel()
    try:
        await connecting
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            # Our caller was cancelled meanwhile: not a connection error. Close what the
            # attempt opened first (shielded: this task is being cancelled).
            with contextlib.suppress(BaseException):
                await asyncio.shield(nc.close())
            raise
    except Exception:
        pass  # the attempt's own failure: last_error below says it
    last = nc.last_error
    with contextlib.suppress(Exception):
        await nc.close()
    raise ConnectionError(
        f"cannot connect to NATS at {url} as {name!r} "
        f"(gave up after {time.monotonic() - started:.1f}s): {last or 'no answer'}"
    ) from last


def inbox_prefix(cfg: NatsConfig, service: str | None) -> str:
    """The inbox a connection's replies arrive on (see :func:`connect`)."""
    if cfg.inbox_prefix:
        return cfg.inbox_prefix
    return f"_INBOX_{service}" if service else "_INBOX"


# Per connection made by connect(): the server's latest permission refusals ("Permissions
# Violation for Publish to ..."), which nats-py reports only to the error callback and in
# last_error, which the next error overwrites.
_REFUSALS: weakref.WeakKeyDictionary[Client, deque[str]] = weakref.WeakKeyDictionary()


# Per connection made by connect(): who is told when nats-py drops messages a subscription
# could not queue (a slow consumer), which it reports only to the error callback.
_SLOW_CONSUMER_HOOKS: weakref.WeakKeyDictionary[
    Client, list[Callable[[nats.errors.SlowConsumerError], None]]
] = weakref.WeakKeyDictionary()


def on_slow_consumer(nc: Client, hook: Callable[[nats.errors.SlowConsumerError], None]) -> None:
    """Call ``hook`` each time ``nc`` (made by :func:`connect`) drops messages of one of its
    subscriptions for being too slow to take them."""
    _SLOW_CONSUMER_HOOKS.setdefault(nc, []).append(hook)


def refused_publishes(nc: Client) -> list[str]:
    """The latest permission refusals the server sent ``nc`` (empty for a connection not
    made by :func:`connect`)."""
    return list(_REFUSALS.get(nc, ()))


async def barrier(nc: Client, timeout_s: float = 2.0) -> None:
    """Return once the server has processed every command ``nc`` sent before this call.

    ``Client.flush()`` is not that barrier in nats-py 2.x: it writes its PING straight to
    the socket, ahead of commands still queued for the flusher task, so a SUB sent just
    before can reach the server after the PONG -- a worker that had "flushed" its control
    subscription missed the first control message published after it started. A request
    the server answers itself goes through the same queue, behind them; every service user
    may send ``$JS.API.INFO`` (deploy/nats/permissions.conf).
    """
    with contextlib.suppress(nats.errors.NoRespondersError):  # no JetStream: still answered
        await nc.request("$JS.API.INFO", b"", timeout=timeout_s)


# How long a service that may not create a JetStream object (deploy/nats/permissions.conf
# leaves that to `qosserve provision`, as qos-admin) waits for it, before it gives up.
MADE_ELSEWHERE_WAIT_S = 60.0
MADE_ELSEWHERE_POLL_S = 1.0


async def _create_or_wait_for(
    what: str,
    create: Callable[[], Any],
    lookup: Callable[[], Any],
    missing: type[Exception],
    wait_s: float | None = None,
) -> Any:
    """``create()``, or, when that gets no answer, ``lookup()`` until it finds what someone
    else made. A NATS server drops a publish the user may not make and answers nothing
    (the API call times out): with the secure permissions no service creates the stream,
    consumers or bucket (``qosserve provision`` does), and a service that started first
    died of a bare timeout and crash-looped until they were made."""
    try:
        return await create()
    except TimeoutError:
        pass
    wait_s = MADE_ELSEWHERE_WAIT_S if wait_s is None else wait_s
    log.warning(
        "%s does not exist and creating it got no answer (this NATS user may not create "
        "it: with deploy/nats/permissions.conf `qosserve provision` does, as qos-admin); "
        "waiting up to %.0f s for it",
        what, wait_s,
    )  # fmt: skip
    deadline = time.monotonic() + wait_s
    while True:
        with contextlib.suppress(missing, TimeoutError):
            return await lookup()
        if time.monotonic() >= deadline:
            raise ConfigError(
                f"{what} does not exist and this NATS user could not create it (waited "
                f"{wait_s:.0f} s): run `qosserve provision` as a user that may "
                "(deploy/nats/permissions.conf: qos-admin)"
            )
        await asyncio.sleep(MADE_ELSEWHERE_POLL_S)


async def _created_meanwhile(
    js: JetStreamContext, stream: str, exc: nats.js.errors.APIError
) -> api.StreamInfo:
    """After a failed create: the stream another replica made, or the create's error."""
    try:
        return await js.stream_info(stream)
    except nats.js.errors.NotFoundError:
        raise ConfigError(f"cannot create stream {stream}: {exc}") from exc


# The request stream's max_age: a day (the longest deadline a caller may set) and an hour.
REQUEST_MAX_AGE_S = 25 * 3600.0


def _stream_config(cfg: NatsConfig, first_seq: int | None = None) -> api.StreamConfig:
    return api.StreamConfig(
        first_seq=first_seq,
        name=cfg.stream,
        description="qosserve requests, one subject per instance group",
        subjects=[Subjects(cfg.subject_prefix).request_wildcard],
        retention=api.RetentionPolicy.WORK_QUEUE,
        storage=api.StorageType.FILE,
        duplicate_window=cfg.duplicate_window_s,
        max_msg_size=cfg.max_payload_bytes,
        # No request outlives the longest deadline a caller may ask: what JetStream keeps past
        # that (one given up on every delivery, one nobody acked) is refuse, not work.
        max_age=REQUEST_MAX_AGE_S,
        num_replicas=cfg.replicas,
    )


async def ensure_stream(
    js: JetStreamContext,
    cfg: NatsConfig,
    groups: Iterable[str] = (),
    first_seq: int | None = None,
    wait_s: float | None = None,
    strict: bool = False,
) -> api.StreamInfo:
    """Create or verify the request stream (``QOS_REQ``: ``<prefix>.req.*``, WorkQueue, file).
    ``first_seq``: where a stream created here starts numbering (one recreated after a
    deletion continues past its predecessor's: see ``gateway/stream_keeper.py``).

    ``groups`` are checked to be valid subject tokens. Subjects, the dedupe window and
    the message size limit are updated in place when they differ; a different retention
    or storage cannot be, and raises :class:`ConfigError`.
    """
    subjects = Subjects(cfg.subject_prefix)
    for group in groups:
        subjects.request(group)  # raises ValueError naming a bad group
    want = _stream_config(cfg)
    try:
        info = await js.stream_info(cfg.stream)
    except nats.js.errors.NotFoundError:
        try:
            return await _create_or_wait_for(
                f"stream {cfg.stream}",
                lambda: js.add_stream(_stream_config(cfg, first_seq)),
                lambda: js.stream_info(cfg.stream),
                nats.js.errors.NotFoundError,
                wait_s,
            )
        except nats.js.errors.BadRequestError as exc:
            info = await _created_meanwhile(js, cfg.stream, exc)
    have = info.config
    if have.num_replicas != want.num_replicas:
        # JetStream can change it in place, but not without the operator's say: a wrong
        # replica count in a config must not reshuffle a live stream.
        log.warning("stream %s has %s replicas, nats.replicas says %d: left as it is "
                    "(`nats stream edit %s --replicas %d` to change it)", cfg.stream,
                    have.num_replicas, want.num_replicas, cfg.stream,
                    want.num_replicas)  # fmt: skip
    problems = [
        f"{field} is {_show(getattr(have, field))}, expected {_show(getattr(want, field))}"
        for field in ("retention", "storage")
        if getattr(have, field) != getattr(want, field)
    ]
    if problems:
        raise ConfigError(
            f"stream {cfg.stream} exists with incompatible settings ({'; '.join(problems)}); "
            f"these cannot change in place: delete it (nats stream rm {cfg.stream}) "
            "or set nats.stream to another name"
        )
    if (
        sorted(have.subjects or []) != sorted(want.subjects or [])
        or not math.isclose(have.duplicate_window, want.duplicate_window)
        or have.max_msg_size != want.max_msg_size
        or not math.isclose(have.max_age or 0.0, want.max_age or 0.0)
    ):
        log.info("stream %s: updating subjects/duplicate_window/max_msg_size/max_age", cfg.stream)
        updated = have.evolve(
            subjects=want.subjects,
            duplicate_window=want.duplicate_window,
            max_msg_size=want.max_msg_size,
            max_age=want.max_age,
        )
        try:
            return await js.update_stream(updated)
        except nats.js.errors.APIError as exc:
            raise ConfigError(f"stream {cfg.stream}: cannot update it: {exc}") from exc
        except TimeoutError:
            # Denied (no service may change it under the secure permissions): served as it
            # is; `qosserve provision` with this configuration updates it (``strict``: it
            # must, so it says it could not).
            if strict:
                raise _unanswered(f"updating stream {cfg.stream}") from None
            log.warning("stream %s: no answer to updating it to this service's settings "
                        "(this NATS user may not change it?): left as it is", cfg.stream)  # fmt: skip
    return info


def _consumer_config(cfg: NatsConfig, group: str, max_ack_pending: int) -> api.ConsumerConfig:
    name = Subjects.consumer(group)
    return api.ConsumerConfig(
        name=name,
        durable_name=name,
        description=f"qosserve workers of group {group}",
        deliver_policy=api.DeliverPolicy.ALL,
        ack_policy=api.AckPolicy.EXPLICIT,
        filter_subject=Subjects(cfg.subject_prefix).request(group),
        ack_wait=cfg.ack_wait_s,
        max_deliver=cfg.max_deliver,
        max_ack_pending=max_ack_pending,
    )


async def ensure_group_consumer(
    js: JetStreamContext,
    cfg: NatsConfig,
    group: str,
    *,
    max_ack_pending: int = DEFAULT_MAX_ACK_PENDING,
    wait_s: float | None = None,
    strict: bool = False,
) -> api.ConsumerInfo:
    """Create or verify ``grp-<group>``, the durable pull consumer all replicas share.

    Filter ``<prefix>.req.<group>``, explicit ack, ``ack_wait``/``max_deliver`` from
    ``cfg``. Those and ``max_ack_pending`` are updated in place when they differ; a
    different ack or deliver policy raises :class:`ConfigError`.
    """
    want = _consumer_config(cfg, group, max_ack_pending)
    name = Subjects.consumer(group)
    try:
        info = await js.consumer_info(cfg.stream, name)
    except nats.js.errors.NotFoundError:
        info = None
    if info is not None:
        have = info.config
        fixed = [
            f"{field} is {_show(getattr(have, field))}, expected {_show(getattr(want, field))}"
            for field in ("ack_policy", "deliver_policy")
            if getattr(have, field) != getattr(want, field)
        ]
        if fixed:
            raise ConfigError(
                f"consumer {name} on stream {cfg.stream} exists with incompatible settings "
                f"({'; '.join(fixed)}); delete it (nats consumer rm {cfg.stream} {name})"
            )
        if (
            have.filter_subject == want.filter_subject
            and have.ack_wait is not None
            and math.isclose(have.ack_wait, cfg.ack_wait_s)
            and have.max_deliver == want.max_deliver
            and have.max_ack_pending == want.max_ack_pending
        ):
            return info
        log.info("consumer %s: updating filter/ack_wait/max_deliver/max_ack_pending", name)
    try:
        # The server's create is create-or-update, and a no-op for an identical config.
        if info is not None:
            return await js.add_consumer(cfg.stream, want)
        return await _create_or_wait_for(
            f"consumer {name} on stream {cfg.stream}",
            lambda: js.add_consumer(cfg.stream, want),
            lambda: js.consumer_info(cfg.stream, name),
            nats.js.errors.NotFoundError,
            wait_s,
        )
    except nats.js.errors.APIError as exc:
        raise ConfigError(f"consumer {name} on stream {cfg.stream}: {exc}") from exc
    except TimeoutError:
        # An update this user may not make (the secure permissions leave it to
        # `qosserve provision`): served as it is, said once.
        if strict:
            raise _unanswered(f"updating consumer {name}") from None
        log.warning("consumer %s: no answer to updating it to this service's settings "
                    "(this NATS user may not change it?): left as it is", name)  # fmt: skip
        return info


async def ensure_kv(
    js: JetStreamContext,
    cfg: NatsConfig,
    *,
    history: int = DEFAULT_KV_HISTORY,
    wait_s: float | None = None,
    strict: bool = False,
) -> KeyValue:
    """Create or verify the state bucket (``qos_state``: file storage, ``history`` 1..5)."""
    if not 1 <= history <= 5:
        raise ValueError(f"KV history must be in 1..5, got {history}")
    try:
        kv = await js.key_value(cfg.kv_bucket)
    except nats.js.errors.BucketNotFoundError:
        return await _create_or_wait_for(
            f"KV bucket {cfg.kv_bucket}",
            lambda: js.create_key_value(
                bucket=cfg.kv_bucket,
                description="qosserve breakers, worker registry, assignments",
                history=history,
                storage=api.StorageType.FILE,
                replicas=cfg.replicas,
            ),
            lambda: js.key_value(cfg.kv_bucket),
            nats.js.errors.BucketNotFoundError,
            wait_s,
        )
    have = (await kv.status()).stream_info.config
    if (have.num_replicas or 1) != cfg.replicas:
        log.warning("KV bucket %s has %s replicas, nats.replicas says %d: left as it is",
                    cfg.kv_bucket, have.num_replicas, cfg.replicas)  # fmt: skip
    if have.storage != api.StorageType.FILE:
        raise ConfigError(
            f"KV bucket {cfg.kv_bucket} uses {have.storage} storage, expected file; "
            f"delete it (nats kv del {cfg.kv_bucket}) or set nats.kv_bucket to another name"
        )
    if have.max_msgs_per_subject != history:
        try:
            await js.update_stream(have.evolve(max_msgs_per_subject=history))
        except TimeoutError:  # denied: as ensure_stream's update
            if strict:
                raise _unanswered(f"setting KV bucket {cfg.kv_bucket}'s history") from None
            log.warning("KV bucket %s: no answer to setting its history to %d (this NATS "
                        "user may not change it?): left as it is", cfg.kv_bucket, history)  # fmt: skip
    return kv


async def group_pull_subscription(
    js: JetStreamContext, cfg: NatsConfig, group: str
) -> JetStreamContext.PullSubscription:
    """Bind to the group's durable consumer, which every replica of the group shares.

    The consumer must exist (:func:`ensure_group_consumer`): binding does not create one,
    so a replica never makes a second, competing consumer by accident.
    """
    name = Subjects.consumer(group)
    try:
        await js.consumer_info(cfg.stream, name)
    except nats.js.errors.NotFoundError as exc:
        raise ConfigError(
            f"consumer {name} on stream {cfg.stream} does not exist; "
            "call ensure_group_consumer first"
        ) from exc
    # pull_subscribe_bind does not check the consumer; the lookup above does.
    return await js.pull_subscribe_bind(consumer=name, stream=cfg.stream)


async def ensure_jetstream(
    js: JetStreamContext,
    cfg: NatsConfig,
    groups: Iterable[str],
    wait_s: float | None = None,
    strict: bool = False,
) -> tuple[api.StreamInfo, dict[str, api.ConsumerInfo], KeyValue]:
    """Everything a deployment needs: the stream, one consumer per group, the KV bucket.
    ``wait_s``: how long to wait for one this user may not create (None: the default);
    ``strict``: an update that gets no answer is an error, not left as it is."""
    groups = list(groups)
    stream = await ensure_stream(js, cfg, groups, wait_s=wait_s, strict=strict)
    consumers = {
        group: await ensure_group_consumer(js, cfg, group, wait_s=wait_s, strict=strict)
        for group in groups
    }
    kv = await ensure_kv(js, cfg, wait_s=wait_s, strict=strict)
    return stream, consumers, kv


def _unanswered(what: str) -> ConfigError:
    return ConfigError(
        f"{what} got no answer: this NATS user may not (run as qos-admin, "
        "deploy/nats/permissions.conf), or JetStream is too slow to answer"
    )


async def heartbeat_keys(js: JetStreamContext, bucket: str) -> list[str]:
    """Every worker heartbeat key the state bucket's stream holds a subject for, sorted
    (deleted and purged ones too: only their markers are left). One API call, rather than
    ``KeyValue.keys()``, whose watcher could end its listing empty on a loaded server."""
    prefix = f"$KV.{bucket}."
    info = await js.stream_info(f"KV_{bucket}", subjects_filter=f"{prefix}{HEARTBEAT_KEY_PREFIX}>")
    return sorted(subject[len(prefix) :] for subject in (info.state.subjects or {}))
