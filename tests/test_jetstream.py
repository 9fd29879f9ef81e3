"""JetStream plumbing (common.nats) against a real nats-server: DESIGN §2 delivery semantics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import nats.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

import common.nats as qnats
from common.config import NatsConfig
from common.errors import ConfigError
from common.services import NatsServer, free_port
from common.subjects import Subjects

GROUP = "short"


def _subject(cfg: NatsConfig, group: str = GROUP) -> str:
    return Subjects(cfg.subject_prefix).request(group)


async def _setup(js: JetStreamContext, cfg: NatsConfig) -> JetStreamContext.PullSubscription:
    await qnats.ensure_stream(js, cfg, [GROUP])
    await qnats.ensure_group_consumer(js, cfg, GROUP)
    return await qnats.group_pull_subscription(js, cfg, GROUP)


async def _fetch_one(sub: JetStreamContext.PullSubscription, timeout: float) -> Msg:
    (msg,) = await sub.fetch(1, timeout=timeout)
    return msg


async def _assert_empty(sub: JetStreamContext.PullSubscription, timeout: float = 0.3) -> None:
    with pytest.raises(nats.errors.TimeoutError):
        await sub.fetch(1, timeout=timeout)


async def test_duplicate_publish_with_same_msg_id_is_delivered_once(
    js: JetStreamContext, nats_config: NatsConfig
):
    sub = await _setup(js, nats_config)
    first = await js.publish(_subject(nats_config), b"a", headers={"Nats-Msg-Id": "req-1"})
    again = await js.publish(_subject(nats_config), b"a", headers={"Nats-Msg-Id": "req-1"})
    assert not first.duplicate and again.duplicate and again.seq == first.seq

    msg = await _fetch_one(sub, timeout=1)
    assert msg.data == b"a" and msg.headers == {"Nats-Msg-Id": "req-1"}
    await msg.ack_sync()
    await _assert_empty(sub)


async def test_unacked_message_is_redelivered_after_ack_wait_with_count_two(
    js: JetStreamContext, nats_config: NatsConfig
):
    cfg = nats_config.model_copy(update={"ack_wait_s": 1.0})
    sub = await _setup(js, cfg)
    await js.publish(_subject(cfg), b"work")

    first = await _fetch_one(sub, timeout=1)
    assert first.metadata.num_delivered == 1
    started = time.monotonic()  # a worker that dies here never acks
    again = await _fetch_one(sub, timeout=3)
    assert time.monotonic() - started >= 0.8
    assert again.data == b"work"
    assert again.metadata.num_delivered == 2
    assert again.metadata.sequence.stream == first.metadata.sequence.stream
    await again.ack_sync()


async def test_in_progress_postpones_redelivery_until_it_stops(
    js: JetStreamContext, nats_config: NatsConfig
):
    cfg = nats_config.model_copy(update={"ack_wait_s": 1.0})
    worker = await _setup(js, cfg)
    other_replica = await qnats.group_pull_subscription(js, cfg, GROUP)
    await js.publish(_subject(cfg), b"long generation")
    msg = await _fetch_one(worker, timeout=1)

    async def keep_alive(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            await msg.in_progress()
            await asyncio.sleep(0.3)

    # Twice ack_wait passes while the worker reports progress: nobody else gets it.
    heartbeat = asyncio.create_task(keep_alive(1.8))
    await _assert_empty(other_replica, timeout=1.8)
    await heartbeat

    # Progress stops (the worker died): the other replica gets it after ack_wait.
    again = await _fetch_one(other_replica, timeout=3)
    assert again.metadata.num_delivered == 2
    await again.ack_sync()


async def test_two_replicas_on_one_group_consumer_share_messages_without_duplicates(
    nats_config: NatsConfig, js: JetStreamContext
):
    await qnats.ensure_stream(js, nats_config, [GROUP])
    await qnats.ensure_group_consumer(js, nats_config, GROUP)
    sent = {f"req-{i}".encode() for i in range(40)}
    for data in sorted(sent):
        await js.publish(_subject(nats_config), data, headers={"Nats-Msg-Id": data.decode()})

    replicas = [await qnats.connect(nats_config, f"replica-{i}") for i in range(2)]
    try:
        subs = [
            await qnats.group_pull_subscription(nc.jetstream(), nats_config, GROUP)
            for nc in replicas
        ]
        received: list[list[bytes]] = [[], []]
        deadline = time.monotonic() + 10
        while sum(map(len, received)) < len(sent) and time.monotonic() < deadline:
            for i, sub in enumerate(subs):  # take turns, as busy replicas would
                try:
                    batch = await sub.fetch(4, timeout=0.5)
                except nats.errors.TimeoutError:
                    continue
                for msg in batch:
                    await msg.ack_sync()  # the server confirms each ack
                    received[i].append(msg.data)
        everything = received[0] + received[1]
        assert len(everything) == len(set(everything)), "a message went to both replicas"
        assert set(everything) == sent
        assert received[0] and received[1], "one consumer must feed both replicas"
        for sub in subs:
            await _assert_empty(sub)
        info = await subs[0].consumer_info()
        assert info.num_pending == 0 and info.num_ack_pending == 0
        # WorkQueue retention: acked requests leave the stream.
        assert (await js.stream_info(nats_config.stream)).state.messages == 0
    finally:
        for nc in replicas:
            await nc.close()


async def test_max_deliver_bounds_redeliveries(js: JetStreamContext, nats_config: NatsConfig):
    cfg = nats_config.model_copy(update={"max_deliver": 3})
    sub = await _setup(js, cfg)
    await js.publish(_subject(cfg), b"poison")
    deliveries = []
    for _ in range(5):
        try:
            msg = await _fetch_one(sub, timeout=0.5)
        except nats.errors.TimeoutError:
            break
        deliveries.append(msg.metadata.num_delivered)
        await msg.nak()  # a failing worker: redeliver at once
    assert deliveries == [1, 2, 3]


async def test_ensure_calls_are_idempotent_and_update_what_can_change(
    js: JetStreamContext, nats_config: NatsConfig
):
    stream, consumers, _ = await qnats.ensure_jetstream(js, nats_config, ["realtime", GROUP])
    stream2, consumers2, kv = await qnats.ensure_jetstream(js, nats_config, ["realtime", GROUP])
    assert stream2.created == stream.created
    assert stream2.config.subjects == [f"{nats_config.subject_prefix}.req.*"]
    assert stream2.config.retention == api.RetentionPolicy.WORK_QUEUE
    assert stream2.config.storage == api.StorageType.FILE
    assert stream2.config.max_msg_size == nats_config.max_payload_bytes
    # Nothing older than the longest deadline stays: a given-up request was kept for good.
    assert stream2.config.max_age == qnats.REQUEST_MAX_AGE_S
    assert consumers2[GROUP].created == consumers[GROUP].created
    consumer = consumers2[GROUP].config
    assert consumer.durable_name == "grp-short"
    assert consumer.filter_subject == _subject(nats_config)
    assert consumer.ack_policy == api.AckPolicy.EXPLICIT
    assert consumer.ack_wait == nats_config.ack_wait_s
    assert consumer.max_deliver == nats_config.max_deliver
    status = await kv.status()
    assert status.bucket == nats_config.kv_bucket and status.history == qnats.DEFAULT_KV_HISTORY

    changed = nats_config.model_copy(
        update={"ack_wait_s": 7.0, "max_deliver": 2, "duplicate_window_s": 30.0}
    )
    updated = await qnats.ensure_group_consumer(js, changed, GROUP)
    assert updated.created == consumers[GROUP].created
    assert updated.config.ack_wait == 7.0 and updated.config.max_deliver == 2
    assert (await qnats.ensure_stream(js, changed)).config.duplicate_window == 30.0

    # A stream made before max_age was set gets it in place.
    info = await js.stream_info(nats_config.stream)
    await js.update_stream(info.config.evolve(max_age=0.0))
    assert (await qnats.ensure_stream(js, changed)).config.max_age == qnats.REQUEST_MAX_AGE_S


async def test_ensure_stream_refuses_a_stream_it_cannot_fix(
    js: JetStreamContext, nats_config: NatsConfig
):
    await js.add_stream(
        name=nats_config.stream,
        subjects=[f"{nats_config.subject_prefix}.req.*"],
        retention=api.RetentionPolicy.WORK_QUEUE,
        storage=api.StorageType.MEMORY,
    )
    with pytest.raises(ConfigError, match=r"storage is memory, expected file.*cannot change"):
        await qnats.ensure_stream(js, nats_config)


async def test_binding_to_a_missing_group_consumer_fails_clearly(
    js: JetStreamContext, nats_config: NatsConfig
):
    await qnats.ensure_stream(js, nats_config)
    with pytest.raises(ConfigError, match=r"grp-long .*ensure_group_consumer"):
        await qnats.group_pull_subscription(js, nats_config, "long")


async def test_kv_bucket_put_get_watch_and_bounded_history(
    js: JetStreamContext, nats_config: NatsConfig
):
    kv = await qnats.ensure_kv(js, nats_config)
    await qnats.ensure_kv(js, nats_config)  # a second replica starting
    watcher = await kv.watch("breaker.short")
    assert await watcher.updates(timeout=1) is None  # the "no initial values" marker

    for state in (b"closed", b"open", b"half_open", b"closed", b"open", b"half_open"):
        await kv.put("breaker.short", state)
    assert (await kv.get("breaker.short")).value == b"half_open"
    seen = [(await watcher.updates(timeout=1)).value for _ in range(6)]
    assert seen == [b"closed", b"open", b"half_open", b"closed", b"open", b"half_open"]
    assert len(await kv.history("breaker.short")) == 5
    await watcher.stop()

    shorter = await qnats.ensure_kv(js, nats_config, history=2)
    assert (await shorter.status()).history == 2


async def test_nats_crash_keeps_queued_requests_and_clients_reconnect(
    fresh_nats_server: Callable[..., NatsServer], nats_config: NatsConfig
):
    server = fresh_nats_server()
    cfg = nats_config.model_copy(update={"url": server.url})
    nc = await qnats.connect(cfg, "survivor")
    try:
        js = nc.jetstream()
        sub = await _setup(js, cfg)
        for i in range(3):
            await js.publish(_subject(cfg), f"req-{i}".encode())

        reconnects = nc.stats["reconnects"]
        server.restart(hard=True)  # SIGKILL: only what reached the file store survives
        # restart() blocked the loop, so the client has not even seen the EOF yet:
        # is_connected alone would still say True. Wait for the reconnect itself.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if nc.stats["reconnects"] > reconnects and nc.is_connected:
                break
            await asyncio.sleep(0.02)
        assert nc.stats["reconnects"] > reconnects and nc.is_connected

        await js.publish(_subject(cfg), b"req-3")
        got = []
        while len(got) < 4:
            for msg in await sub.fetch(4, timeout=3):
                await msg.ack_sync()
                got.append(msg.data)
        assert got == [b"req-0", b"req-1", b"req-2", b"req-3"]
    finally:
        await nc.close()


async def test_connect_to_nothing_fails_within_the_timeout(nats_config: NatsConfig):
    cfg = nats_config.model_copy(update={"url": f"nats://127.0.0.1:{free_port()}"})
    started = time.monotonic()
    with pytest.raises(ConnectionError, match="cannot connect to NATS"):
        await qnats.connect(cfg, "nobody-home", initial_timeout_s=0.5)
    assert time.monotonic() - started < 2


async def test_credentials_are_sent_and_a_wrong_password_fails_fast(
    fresh_nats_server: Callable[..., NatsServer], nats_config: NatsConfig
):
    server = fresh_nats_server(extra_config='authorization { user: "svc", password: "pw1" }')
    good = nats_config.model_copy(update={"url": server.url, "user": "svc", "password": "pw1"})
    nc: Client = await qnats.connect(good, "authed")
    try:
        await qnats.ensure_stream(nc.jetstream(), good)
    finally:
        await nc.close()

    bad = good.model_copy(update={"password": "nope"})
    started = time.monotonic()
    with pytest.raises(ConnectionError, match=r"(?i)authorization"):
        await qnats.connect(bad, "intruder", initial_timeout_s=5)
    assert time.monotonic() - started < 2


@pytest.mark.parametrize(
    "tls", [{"tls_ca_file": "/ca.pem"}, {"tls_cert_file": "/c.pem", "tls_key_file": "/k.pem"},
            {"tls_handshake_first": True}],
)  # fmt: skip
async def test_tls_settings_with_a_ws_url_are_refused_before_anything_is_sent(
    nats_config: NatsConfig, tls: dict[str, object]
):
    """nats-py never starts TLS on a ws:// link: the settings were ignored and the password
    went in clear. A config made by model_copy (no validation) is refused at connect too."""
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        url = f"ws://127.0.0.1:{port + 1}, ws://127.0.0.1:{port}"  # any ws:// URL in the list
        cfg = nats_config.model_copy(update={"url": url, "user": "svc", "password": "pw", **tls})
        with pytest.raises(ConfigError, match="use wss://") as info:
            await qnats.connect(cfg, "ws-tls", initial_timeout_s=1)
        assert "pw" not in info.value.message
        with pytest.raises(BlockingIOError):  # no connection was attempted
            listener.accept()


async def test_each_service_gets_replies_on_its_own_inbox_unless_one_is_configured(
    nats_config: NatsConfig,
):
    """deploy/nats/permissions.conf lets each service user read its own inbox only."""
    inboxes = {}
    for service, cfg in (("worker", nats_config), (None, nats_config),
                         ("worker", nats_config.model_copy(update={"inbox_prefix": "_IN.w1"}))):  # fmt: skip
        nc = await qnats.connect(cfg, "inboxes", service=service)
        try:
            await qnats.barrier(nc)  # a request's reply reaches the prefixed inbox
            inboxes[service, cfg.inbox_prefix] = nc.new_inbox()
        finally:
            await nc.close()
    assert inboxes["worker", None].startswith("_INBOX_worker.")
    assert inboxes[None, None].startswith("_INBOX.")  # a client of its own: nats-py's default
    assert inboxes["worker", "_IN.w1"].startswith("_IN.w1.")


async def test_several_servers_in_nats_url_are_tried_in_turn(nats_config: NatsConfig):
    """A cluster's seeds, comma-separated: one down, the next answers."""
    import socket

    with socket.socket() as dead:  # bound, never listening: connections are refused
        dead.bind(("127.0.0.1", 0))
        seeds = f"nats://127.0.0.1:{dead.getsockname()[1]}, {nats_config.url}"
        nc = await qnats.connect(nats_config.model_copy(update={"url": seeds}), "seeds")
        try:
            await qnats.barrier(nc)
            assert nc.is_connected
        finally:
            await nc.close()


def test_redact_url_hides_passwords_and_tokens():
    assert qnats.redact_url("nats://svc:pw@h:4222") == "nats://svc:***@h:4222"
    assert qnats.redact_url("nats://tok@h:4222") == "nats://***@h:4222"
    assert qnats.redact_url("nats://h:4222") == "nats://h:4222"


def test_the_stream_and_the_bucket_take_the_configured_replicas() -> None:
    """A 3-server cluster keeps its requests and breakers through the loss of one only if
    they are created with 3 replicas (``nats.replicas``)."""
    from common.config import NatsConfig
    from common.nats import _stream_config

    assert _stream_config(NatsConfig()).num_replicas == 1
    assert _stream_config(NatsConfig(replicas=3)).num_replicas == 3


async def test_a_stream_with_other_replicas_than_configured_is_left_with_a_warning(
    js, nats_config, caplog
) -> None:
    from common.nats import ensure_stream

    await ensure_stream(js, nats_config)
    with caplog.at_level("WARNING", logger="common.nats"):
        # A single test server cannot hold 3 copies: asked for them, the stream stays as is.
        await ensure_stream(js, nats_config.model_copy(update={"replicas": 3}))
    assert "nats.replicas says 3" in caplog.text
