"""``deploy/nats/permissions.conf`` on a real nats-server: each service works as its own user
and nothing more (a worker cannot publish requests, the scheduler never sees a chunk)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import nats.errors
import pytest

import common.nats as qnats
from common.config import Config, NatsConfig
from common.provision import provision
from common.services import NatsServer
from common.tokenizer import BaseTokenizer
from scheduler.service import SchedulerService
from tests.e2e.stack import Stack
from tests.reliability.harness import ROOT, body, completion, expected_text, group, sim_engine
from tests.reliability.harness import stack_config as build_config
from workers.service import WorkerOptions, WorkerService

PERMISSIONS = ROOT / "deploy" / "nats" / "permissions.conf"
PASSWORDS = {"gateway": "gw-pw-1", "worker": "wk-pw-2", "scheduler": "sc-pw-3", "admin": "ad-pw-4"}


@pytest.fixture
def secured_nats(
    fresh_nats_server: Callable[..., NatsServer], monkeypatch: pytest.MonkeyPatch
) -> NatsServer:
    """A nats-server whose only users are the ones permissions.conf defines."""
    for service, password in PASSWORDS.items():
        monkeypatch.setenv(f"NATS_QOS_{service.upper()}_PASSWORD", password)
    return fresh_nats_server(extra_config=PERMISSIONS.read_text())


def as_user(config: Config, service: str) -> Config:
    nats = config.nats.model_copy(update={"user": f"qos-{service}", "password": PASSWORDS[service]})
    return config.model_copy(update={"nats": nats})


@pytest.fixture
def secured_stack(
    secured_nats: NatsServer, tokenizer: BaseTokenizer, model_dir: Path, tmp_path: Path
) -> Iterator[tuple[Stack, Config]]:
    """Gateway, one sim worker and the scheduler, each connected as its own user."""
    # Default names: the permissions are written for prefix qos, QOS_REQ and qos_state.
    nats = NatsConfig(url=secured_nats.url, connect_timeout_s=2.0, reconnect_wait_s=0.1)
    config = build_config(nats, {"short": group(4)})
    config.scheduler.metrics_port = 0
    # No service may create the stream, consumers or bucket: `qosserve provision` does.
    asyncio.run(provision(as_user(config, "admin")))
    with Stack(as_user(config, "gateway"), tokenizer, str(model_dir), tmp_path) as stack:
        worker = WorkerService(
            as_user(config, "worker"), sim_engine(tokenizer),
            WorkerOptions(group="short", worker_id="w-perm", fetch_timeout_s=0.25),
        )  # fmt: skip
        stack.call(worker.start())
        stack.workers["w-perm"] = worker
        scheduler = SchedulerService(as_user(config, "scheduler"), scheduler_id="s-perm")
        stack.call(scheduler.start())
        stack.wait_live({"short": 1})
        yield stack, config
        stack.call(scheduler.stop())
        # The stack's own cleanup deletes the stream: a right no user here has.
        snoop, stack._nc = stack._nc, None
        if snoop is not None:
            stack.call(snoop.close())


async def test_each_service_works_with_its_own_nats_user(
    secured_stack: tuple[Stack, Config], secured_nats: NatsServer, tokenizer: BaseTokenizer
) -> None:
    stack, _ = secured_stack
    async with httpx.AsyncClient(timeout=30) as http:
        outcomes = await asyncio.gather(
            *(completion(http, f"{stack.base_url}/completions", body(stack.model, s, 12))
              for s in range(4))
        )  # fmt: skip
    for seed, outcome in enumerate(outcomes):
        assert outcome.kind == "complete", outcome
        assert outcome.text == expected_text(tokenizer, 12, seed)
    await asyncio.sleep(1.0)  # a few scheduler ticks and heartbeats
    log = secured_nats.log_tail(400).splitlines()
    assert [line for line in log if "Violation" in line] == []


async def test_a_worker_user_cannot_publish_requests_or_read_chunks(
    secured_stack: tuple[Stack, Config], secured_nats: NatsServer
) -> None:
    _, config = secured_stack
    gateway, worker, scheduler = [
        await qnats.connect(as_user(config, s).nats, f"perm-{s}", service=s)
        for s in ("gateway", "worker", "scheduler")
    ]
    try:
        # No user here may subscribe to qos.req.> (a gateway's subscription there was itself
        # refused, so "it saw nothing" held with or without the worker's rights). What the
        # stream stored says it instead: the gateway's probes, one before and one after the
        # forgeries, are numbered one apart only if nothing was stored between them.
        requests = gateway.jetstream()
        before = await requests.publish("qos.req.perm-probe", b"probe")
        await worker.publish("qos.req.short", b"forged")
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await worker.jetstream().publish("qos.req.short", b"forged", timeout=1)
        await qnats.barrier(worker)  # the server has handled both forgeries
        after = await requests.publish("qos.req.perm-probe", b"probe")
        assert after.seq == before.seq + 1
        # The server's refusal reaches the publisher (its error callback), once per publish;
        # the barrier's answer came after it, on the same connection.
        forged = 'nats: permissions violation for publish to "qos.req.short"'
        assert [r.lower() for r in qnats.refused_publishes(worker)] == [forged, forged]
        # The gateway aborts on qos.abort.<group>; it cannot command a group (drain, caps).
        await gateway.publish("qos.ctl.group.short", b"forged")
        await qnats.barrier(gateway)
        assert [r.lower() for r in qnats.refused_publishes(gateway)] == [
            'nats: permissions violation for publish to "qos.ctl.group.short"'
        ]
        # Nor may a service read another's replies: JetStream hands the workers their
        # requests (prompts) on the worker inbox.
        for client, subject in ((worker, "qos.out.*"), (scheduler, "qos.out.*"),
                                (scheduler, "qos.req.>"), (scheduler, "_INBOX.>"),
                                (scheduler, "_INBOX_worker.>"), (gateway, "_INBOX_worker.>"),
                                (worker, "_INBOX_gateway.>")):  # fmt: skip
            await client.subscribe(subject)
            await qnats.barrier(client)  # the server has the SUB (flush() may overtake it)
            # (The server writes the whole refusal in lower case, the subject too.)
            refused = f'nats: permissions violation for subscription to "{subject.lower()}"'
            assert refused in [r.lower() for r in qnats.refused_publishes(client)], subject
    finally:
        for client in (gateway, worker, scheduler):
            await client.close()
    expected = [
        'user:qos-worker" - Publish Violation - Subject "qos.req.short"',
        'user:qos-worker" - Subscription Violation - Subject "qos.out.*"',
        'user:qos-scheduler" - Subscription Violation - Subject "qos.out.*"',
        'user:qos-scheduler" - Subscription Violation - Subject "qos.req.>"',
        'user:qos-gateway" - Publish Violation - Subject "qos.ctl.group.short"',
        'user:qos-scheduler" - Subscription Violation - Subject "_INBOX.>"',
        'user:qos-scheduler" - Subscription Violation - Subject "_INBOX_worker.>"',
        'user:qos-gateway" - Subscription Violation - Subject "_INBOX_worker.>"',
        'user:qos-worker" - Subscription Violation - Subject "_INBOX_gateway.>"',
    ]
    deadline = time.monotonic() + 5
    while True:  # the server writes its log on its own time
        missing = [line for line in expected if line not in secured_nats.log_tail(400)]
        if not missing or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert missing == []


async def test_the_nats_client_works_as_the_gateway_user_with_its_inbox(
    secured_stack: tuple[Stack, Config], tokenizer: BaseTokenizer
) -> None:
    """A NATS-native caller under permissions.conf: as the gateway's user it gets its
    JetStream publish acks only on the gateway's inbox."""
    from common.client import QosClient
    from common.protocol import RequestParams

    _, config = secured_stack
    async with await QosClient.connect(as_user(config, "gateway"), service="gateway") as client:
        ids, _, final = await client.collect(
            group="short", prompt_token_ids=[1, 2], params=RequestParams(max_tokens=4, seed=3),
            timeout_s=20,
        )  # fmt: skip
    assert len(ids) == 4 and final.finish_reason == "length"


async def test_the_scheduler_user_may_sweep_heartbeats_of_workers_gone(
    secured_stack: tuple[Stack, Config], secured_nats: NatsServer
) -> None:
    import json
    import time

    from scheduler.heartbeat_sweep import sweep_heartbeats

    _, config = secured_stack
    bucket = config.nats.kv_bucket
    worker = await qnats.connect(as_user(config, "worker").nats, "perm-w", service="worker")
    scheduler = await qnats.connect(
        as_user(config, "scheduler").nats, "perm-s", service="scheduler"
    )
    try:
        old = json.dumps({"worker": "gone-1", "ts_ms": time.time() * 1000 - 3.6e6}).encode()
        await (await worker.jetstream().key_value(bucket)).put("workers.gone-1", old)
        js = scheduler.jetstream()
        removed = await sweep_heartbeats(js, await js.key_value(bucket), bucket, 600.0,
                                         time.time() * 1000)  # fmt: skip
        assert removed == ["workers.gone-1"]
    finally:
        await worker.close()
        await scheduler.close()
    assert "Violation" not in secured_nats.log_tail(200)


async def test_no_service_may_create_the_jetstream_objects_and_each_waits_for_provision(
    secured_nats: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only qos-admin (`qosserve provision`) creates the stream, consumers and bucket. A
    service that starts first waits for them (it died of a bare 5 s timeout and
    crash-looped), and past the wait says what to run."""
    nats = NatsConfig(url=secured_nats.url, connect_timeout_s=2.0, reconnect_wait_s=0.1)
    config = build_config(nats, {"short": group(4)})
    services = {
        s: await qnats.connect(as_user(config, s).nats, f"{s}-first", service=s)
        for s in ("gateway", "scheduler")
    }
    monkeypatch.setattr(qnats, "MADE_ELSEWHERE_POLL_S", 0.05)
    try:
        for nc in services.values():
            js = nc.jetstream(timeout=0.5)
            with pytest.raises(qnats.ConfigError, match="qosserve provision"):
                await qnats.ensure_jetstream(js, config.nats, ["short"], wait_s=0.3)
        js = services["scheduler"].jetstream(timeout=0.5)
        waiting = asyncio.create_task(qnats.ensure_jetstream(js, config.nats, ["short"], 30.0))
        await asyncio.sleep(1.0)  # its create went unanswered: it waits
        assert not waiting.done()
        made = await provision(as_user(config, "admin"))
        assert made == ["stream QOS_REQ (qos.req.*)", "consumer grp-short (short)",
                        "KV bucket qos_state"]  # fmt: skip
        stream, consumers, kv = await asyncio.wait_for(waiting, 20)
        assert stream.config.name == config.nats.stream and list(consumers) == ["short"]
        assert (await kv.status()).bucket == config.nats.kv_bucket
    finally:
        for nc in services.values():
            await nc.close()


async def test_the_gateway_user_cannot_cap_park_or_read_a_groups_queue(
    secured_stack: tuple[Stack, Config],
) -> None:
    """The gateway's user could create and update consumers on the request stream: cap a
    group at one request (max_ack_pending 1), park it (another filter), or read every
    prompt through a push consumer of its own; and seal the stream for good."""
    from nats.js import api

    _, config = secured_stack
    gateway = await qnats.connect(as_user(config, "gateway").nats, "gw-evil", service="gateway")
    try:
        js = gateway.jetstream(timeout=0.5)
        have = (await js.consumer_info(config.nats.stream, "grp-short")).config
        for attempt in (
            js.add_consumer(config.nats.stream, have.evolve(max_ack_pending=1)),
            js.add_consumer(config.nats.stream, have.evolve(filter_subject="qos.req.parked")),
            js.add_consumer(config.nats.stream, api.ConsumerConfig(
                durable_name="steal", deliver_subject="_INBOX_gateway.steal",
                filter_subject="qos.req.short")),
        ):  # fmt: skip
            with pytest.raises(nats.errors.TimeoutError):
                await attempt
        info = await js.stream_info(config.nats.stream)
        with pytest.raises(nats.errors.TimeoutError):
            await js.update_stream(info.config.evolve(sealed=True))
        after = (await js.consumer_info(config.nats.stream, "grp-short")).config
        assert (after.max_ack_pending, after.filter_subject) == (
            have.max_ack_pending,
            have.filter_subject,
        )
    finally:
        await gateway.close()


async def test_provision_fails_when_it_cannot_make_a_change_a_service_would_leave(
    secured_stack: tuple[Stack, Config],
) -> None:
    """A service leaves a consumer it may not update as it is; `qosserve provision`, whose
    job the update is, printed "ok" and exited 0 run as the wrong user."""
    _, config = secured_stack
    changed = config.model_copy(
        update={"nats": config.nats.model_copy(update={"ack_wait_s": config.nats.ack_wait_s + 7})}
    )
    gateway = as_user(changed, "gateway")
    with pytest.raises(qnats.ConfigError, match="did not answer user qos-gateway"):
        await provision(gateway)  # its replies are not for _INBOX_admin
    own_inbox = gateway.nats.model_copy(update={"inbox_prefix": "_INBOX_gateway"})
    with pytest.raises(qnats.ConfigError, match="updating consumer grp-short got no answer"):
        await provision(gateway.model_copy(update={"nats": own_inbox}))
    made = await provision(as_user(changed, "admin"))  # qos-admin may: it is updated
    assert "consumer grp-short (short)" in made
