"""API keys, /health, /metrics, and a non-streaming client that gives up."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import openai
import pytest

from common.config import NatsConfig
from common.protocol import Control
from common.subjects import Subjects
from gateway.auth import ApiKeys, key_digest
from gateway.generate import DEADLINE_HEADER
from tests.gateway.conftest import MODEL, gateway_config, serve
from tests.gateway.fake_worker import (
    Job,
    alphabet_tokens,
    fail_with,
    never_answer,
    running_worker,
)

BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 3}
KEY = "sk-test-0123456789"


async def test_api_keys_missing_or_wrong_is_401_right_is_200(nats_config: NatsConfig):
    config = gateway_config(nats_config, api_key_sha256=[key_digest("other"), key_digest(KEY)])
    async with (
        serve(config) as gw,
        running_worker(nats_config, "short"),
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        missing = await http.post("/v1/completions", json=BODY)
        wrong = await http.post(
            "/v1/completions", json=BODY, headers={"Authorization": "Bearer sk-nope"}
        )
        models = await http.get("/v1/models")
        health = await http.get("/health")  # probes stay open
        right = await openai.AsyncOpenAI(
            base_url=gw.base_url, api_key=KEY, max_retries=0
        ).completions.create(model=MODEL, prompt="hi", max_tokens=3)
        metrics = (await http.get("/metrics")).text
    for response in (missing, wrong, models):
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    assert health.status_code == 200
    assert right.choices[0].text == "abc"
    # Refused generations count too (Requests/s under-counted them), before any group.
    assert 'qos_gateway_requests_total{group="-",status="401"} 2.0' in metrics


async def test_no_keys_configured_is_open_and_warns(
    nats_config: NatsConfig, caplog: pytest.LogCaptureFixture
):
    with caplog.at_level(logging.WARNING, logger="gateway.auth"):
        async with (
            serve(gateway_config(nats_config)) as gw,
            httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
        ):
            response = await http.get("/v1/models", headers={"Authorization": "Bearer anything"})
    assert response.status_code == 200
    assert any("no API keys configured" in r.message for r in caplog.records)


def test_malformed_authorization_header_is_401():
    keys = ApiKeys([key_digest(KEY)])
    keys.check(f"Bearer {KEY}")
    for header in ("", KEY, f"Basic {KEY}", "Bearer "):
        with pytest.raises(Exception) as info:
            keys.check(header)
        assert getattr(info.value, "http_status", None) == 401


async def test_health_and_metrics_report_groups_and_requests(nats_config: NatsConfig):
    async with (
        serve(gateway_config(nats_config)) as gw,
        running_worker(nats_config, "short"),
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        ok = await http.post("/v1/completions", json=BODY)
        streamed = await http.post("/v1/completions", json={**BODY, "stream": True})
        bad = await http.post("/v1/completions", json={**BODY, "top_p": 7})
        health = (await http.get("/health")).json()
        metrics = (await http.get("/metrics")).text
    assert (ok.status_code, streamed.status_code, bad.status_code) == (200, 200, 400)
    assert health["status"] == "ok" and health["nats"] is True
    assert health["groups"]["short"] == {"live_workers": 1, "breaker": "closed", "in_flight": 0}
    assert health["groups"]["long"]["live_workers"] == 0
    assert 'qos_gateway_requests_total{group="short",status="200"} 2.0' in metrics
    assert 'qos_gateway_requests_total{group="-",status="400"} 1.0' in metrics
    assert (
        'qos_gateway_time_to_first_token_seconds_count{group="short",model="dummy:tiny"} 2.0'
        in metrics
    )
    assert (
        'qos_gateway_e2e_request_latency_seconds_count{group="short",model="dummy:tiny"} 2.0'
        in metrics
    )
    assert 'qos_gateway_requests_in_flight{group="short"} 0.0' in metrics
    assert 'qos_gateway_live_workers{group="short"} 1.0' in metrics


async def test_health_is_503_naming_a_loop_the_gateway_needs_that_died(
    nats_config: NatsConfig,
):
    """The abort loop (or the heartbeat, the breaker watch, the deletes) dying by a bug left
    a gateway answering 200 that no longer told workers of disconnects."""
    async with (
        serve(gateway_config(nats_config)) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        assert (await http.get("/health")).status_code == 200
        broken: list[str] = []  # what the server (GatewayServer) is told: it exits 1
        gw.app.state.gateway.dispatch.on_broken = broken.append
        dispatcher = gw.app.state.gateway.dispatch.dispatcher
        dispatcher._aborts.put_nowait(None)  # not a (group, id, reason, seq): the loop raises
        for _ in range(100):
            health = await http.get("/health")
            if health.status_code != 200:
                break
            await asyncio.sleep(0.02)
    assert health.status_code == 503 and health.json()["status"] == "broken"
    assert health.json()["failed"] == [
        "task gateway-aborts died: TypeError('cannot unpack non-iterable NoneType object')"
    ]
    assert broken == health.json()["failed"]


def test_a_gateway_server_told_a_loop_died_stops_and_exits_1() -> None:
    import uvicorn

    from gateway.server import DispatcherRef, GatewayServer

    ref = DispatcherRef()
    server = GatewayServer(uvicorn.Config(app=lambda *a: None), ref)
    assert server.exit_code == 0 and not server.should_exit
    assert ref.on_broken is not None
    ref.on_broken("task gateway-heartbeat died: RuntimeError()")
    assert server.should_exit and server.exit_code == 1


async def test_a_stop_waits_for_queued_aborts_a_bounded_time(
    nats_config: NatsConfig, monkeypatch: pytest.MonkeyPatch
):
    """A stalled link still reads as connected: the wait for queued aborts had no deadline,
    and nothing bounds uvicorn's lifespan shutdown (SIGTERM hung until SIGKILL)."""
    import gateway.streams

    monkeypatch.setattr(gateway.streams, "ABORT_FLUSH_S", 0.3)
    async with serve(gateway_config(nats_config)) as gw:
        dispatcher = gw.app.state.gateway.dispatch.dispatcher

        async def stalled(*args: object, **kwargs: object) -> None:
            await asyncio.sleep(3600)

        dispatcher._nc.publish = stalled
        for i in range(2):  # the loop holds the first; the second stays queued
            stream = dispatcher.open(f"r{i}", "short", lambda done, new: "")
            dispatcher.close(stream, abort=True, reason="client_disconnected")
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        await dispatcher.stop()
        assert time.monotonic() - t0 < 5.0  # the publish it waits on never ends


async def test_a_request_failing_before_it_is_sent_leaves_no_stream_registered(
    nats_config: NatsConfig, monkeypatch: pytest.MonkeyPatch
):
    """The response stream was registered before the rest of the set-up: a step failing
    after it left the stream in the dispatcher for good (counted open at every shutdown)."""
    import gateway.generate

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug in the response shaping")

    monkeypatch.setattr(gateway.generate, "Shaper", broken)
    async with (
        serve(gateway_config(nats_config)) as gw,
        running_worker(nats_config, "short"),
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        failed = await http.post("/v1/completions", json=BODY)
        dispatcher = gw.app.state.gateway.dispatch.dispatcher
        assert failed.status_code == 500 and dispatcher._streams == {}


async def test_a_bug_before_the_request_is_sent_still_counts_a_500(
    nats_config: NatsConfig, monkeypatch: pytest.MonkeyPatch
):
    """Only QosErrors and hang-ups were counted before take-off: an unexpected exception
    (parsing, tokenizing, classifying) answered 500 with no qos_gateway_requests_total."""
    import gateway.generate

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug in classification")

    monkeypatch.setattr(gateway.generate, "classify", broken)
    async with (
        serve(gateway_config(nats_config)) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        failed = await http.post("/v1/completions", json=BODY)
        metrics = (await http.get("/metrics")).text
    assert failed.status_code == 500
    assert 'qos_gateway_requests_total{group="-",status="500"} 1.0' in metrics


async def test_non_streaming_client_that_gives_up_aborts_the_worker(nats_config: NatsConfig):
    async with (
        serve(gateway_config(nats_config)) as gw,
        running_worker(nats_config, "short", behaviour=never_answer) as worker,
    ):
        controls: list[Control] = []

        async def on_msg(msg) -> None:  # type: ignore[no-untyped-def]
            controls.append(Control.from_bytes(msg.data))

        await worker.nc.subscribe(Subjects(nats_config.subject_prefix).abort("short"), cb=on_msg)
        async with httpx.AsyncClient(base_url=gw.url, timeout=0.3) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post("/v1/completions", json=BODY)
        for _ in range(100):  # the gateway looks for a gone client once a second
            if controls:
                break
            await asyncio.sleep(0.03)
        assert [c.request_id for c in controls] == [worker.jobs[0].request.id]
        assert gw.app.state.gateway.admission.in_flight("short") == 0


async def _one_token_then_silence(job: Job) -> None:
    await job.send(0, alphabet_tokens(1))
    await asyncio.sleep(3600)


async def test_ttft_is_observed_when_the_first_token_arrives(nats_config: NatsConfig):
    """Not when the request ends: a long answer reported it a minute late, and one that then
    failed (a 504, a client gone) never."""
    name = 'qos_gateway_time_to_first_token_seconds_count{group="short",model="dummy:tiny"}'
    async with (
        serve(gateway_config(nats_config)) as gw,
        running_worker(nats_config, "short", behaviour=_one_token_then_silence),
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
        http.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as response,
    ):
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                break
        metrics = (await http.get("/metrics")).text
    assert f"{name} 1.0" in metrics


async def test_a_request_that_waits_out_its_deadline_counts_in_ttft_and_an_error_does_not(
    nats_config: NatsConfig,
):
    """A request that got no token before its deadline (or before its client left) was in
    no TTFT series: under overload the slowest requests vanished and p99 TTFT read best
    when it was worst. It counts with the time it waited (a lower bound); a worker's error
    answered at once is not a first-token wait and stays out."""
    count = 'qos_gateway_time_to_first_token_seconds_count{group="short",model="dummy:tiny"}'
    total = 'qos_gateway_time_to_first_token_seconds_sum{group="short",model="dummy:tiny"}'
    async with (
        serve(gateway_config(nats_config)) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        async with running_worker(nats_config, "short", behaviour=fail_with):
            failed = await http.post("/v1/completions", json=BODY)
        async with running_worker(nats_config, "short", behaviour=never_answer):
            late = await http.post("/v1/completions", json=BODY, headers={DEADLINE_HEADER: "400"})
        metrics = (await http.get("/metrics")).text
    assert failed.status_code == 400 and late.status_code == 504
    samples = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line.startswith("qos_"))
    assert float(samples[count]) == 1.0
    assert 0.4 <= float(samples[total]) < 5.0


async def test_a_key_bound_to_a_group_gets_403_for_another_and_is_served_in_its_own(
    nats_config: NatsConfig,
):
    team = "sk-team-0123456789"
    config = gateway_config(
        nats_config,
        api_key_sha256=[key_digest(KEY), key_digest(team)],
        api_key_groups={key_digest(team): ["short"]},
    )
    async with serve(config) as gw, running_worker(nats_config, "short"):
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key=team, max_retries=0)
        served = await client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
        with pytest.raises(openai.PermissionDeniedError) as refused:
            await client.completions.create(
                model=MODEL, prompt="hi", max_tokens=3,
                extra_headers={"X-QoS-Group": "realtime"},
            )  # fmt: skip
        # The lengths it may send: short's, not long's (clients size prompts from this).
        models = await client.models.list()
        everyone = openai.AsyncOpenAI(base_url=gw.base_url, api_key=KEY, max_retries=0)
        open_models = await everyone.models.list()
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            counted = await http.post(
                "/tokenize", json={"prompt": "hi"}, headers={"Authorization": f"Bearer {team}"}
            )
            # Another group's limit is not its to read (it was, under that group's path).
            peeked = await http.get("/v1/long/models", headers={"Authorization": f"Bearer {team}"})
    assert served.choices[0].text == "abc"
    assert peeked.status_code == 403 and peeked.json()["error"]["code"] == "group_not_allowed"
    assert refused.value.status_code == 403
    assert refused.value.body["code"] == "group_not_allowed"  # type: ignore[index]
    short, longest = config.groups["short"].max_seq_len, config.groups["long"].max_seq_len
    assert models.data[0].max_model_len == counted.json()["max_model_len"] == short  # type: ignore[attr-defined]
    assert open_models.data[0].max_model_len == longest  # type: ignore[attr-defined]


async def test_a_key_with_a_priority_floor_gets_403_for_a_more_urgent_priority(
    nats_config: NatsConfig,
):
    """gateway.api_key_min_priority: a tenant's key may not put its requests ahead of every
    other tenant's (and make their running requests the preemption victims); a key not
    listed still may."""
    team = "sk-team-0123456789"
    config = gateway_config(
        nats_config,
        api_key_sha256=[key_digest(KEY), key_digest(team)],
        api_key_min_priority={key_digest(team): 2},
    )
    async with serve(config) as gw, running_worker(nats_config, "short") as worker:
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key=team, max_retries=0)
        allowed = await client.completions.create(
            model=MODEL, prompt="hi", max_tokens=3, extra_body={"priority": 5}
        )
        # Naming none, it runs at its floor (a floor above 0 refused such requests).
        await client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
        with pytest.raises(openai.PermissionDeniedError) as refused:
            await client.completions.create(
                model=MODEL, prompt="hi", max_tokens=3, extra_body={"priority": 1}
            )
        trusted = openai.AsyncOpenAI(base_url=gw.base_url, api_key=KEY, max_retries=0)
        await trusted.completions.create(
            model=MODEL, prompt="hi", max_tokens=3, extra_body={"priority": -1}
        )
    assert allowed.choices[0].text == "abc"
    assert refused.value.body["code"] == "priority_not_allowed"  # type: ignore[index]
    assert refused.value.body["param"] == "priority"  # type: ignore[index]
    # The refused one never reached a worker.
    assert [job.request.priority for job in worker.jobs] == [5, 2, -1]


def test_api_key_min_priority_must_name_configured_keys():
    from common.config import Config, GatewayConfig

    digest = key_digest("sk-team-0123456789")
    with pytest.raises(ValueError, match="api_key_min_priority"):
        Config(gateway=GatewayConfig(api_key_min_priority={digest: 0}))


def test_api_key_groups_must_name_configured_keys_and_groups():
    from common.config import Config, GatewayConfig

    digest = key_digest(KEY)
    with pytest.raises(ValueError, match=r"not in gateway\.api_key_sha256"):
        Config(gateway=GatewayConfig(api_key_groups={digest: ["short"]}))
    with pytest.raises(ValueError, match="unknown groups"):
        Config(gateway=GatewayConfig(api_key_sha256=[digest], api_key_groups={digest: ["gpu"]}))


async def test_cache_isolation_by_key_salts_each_keys_requests_apart(nats_config: NatsConfig):
    """gateway.cache_isolation=api_key: each key's requests carry a namespace of their own
    (the same for every request of that key), a client's cache_salt is kept inside it, and
    no client salt can name another key's namespace."""
    team = "sk-team-0123456789"
    config = gateway_config(
        nats_config, api_key_sha256=[key_digest(KEY), key_digest(team)], cache_isolation="api_key"
    )
    async with serve(config) as gw, running_worker(nats_config, "short") as worker:
        for key, extra in [(KEY, {}), (KEY, {}), (team, {}), (team, {"cache_salt": "s1"})]:
            client = openai.AsyncOpenAI(base_url=gw.base_url, api_key=key, max_retries=0)
            await client.completions.create(
                model=MODEL, prompt="hi", max_tokens=3, extra_body=extra
            )
    salts = [job.request.cache_salt for job in worker.jobs]
    assert salts[0] == salts[1] and salts[0] != salts[2]  # per key, stable
    assert len(salts[0]) == 33 and salts[0].endswith(":")  # 32 hex digits, then the client's
    assert salts[3] == salts[2] + "s1"
    assert KEY not in salts[0] and key_digest(KEY) not in salts[0]  # nothing secret travels


async def test_shared_cache_forwards_a_clients_cache_salt_and_checks_it(nats_config: NatsConfig):
    async with (
        serve(gateway_config(nats_config)) as gw,
        running_worker(nats_config, "short") as worker,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        served = await http.post("/v1/completions", json={**BODY, "cache_salt": "tenant-7"})
        plain = await http.post("/v1/completions", json=BODY)
        empty = await http.post("/v1/completions", json={**BODY, "cache_salt": ""})
        huge = await http.post("/v1/completions", json={**BODY, "cache_salt": "x" * 257})
    assert served.status_code == plain.status_code == 200
    assert [job.request.cache_salt for job in worker.jobs] == ["tenant-7", ""]
    for refused in (empty, huge):
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "cache_salt"


def test_cache_isolation_by_key_needs_keys():
    from common.config import Config, GatewayConfig

    with pytest.raises(ValueError, match="no keys are configured"):
        Config(gateway=GatewayConfig(cache_isolation="api_key"))
