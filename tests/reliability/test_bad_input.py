"""Bad input never costs a 5xx, a hang or a stuck resource.

Through the gateway: NaN / Infinity literals, huge, negative and out-of-range numbers in
every numeric parameter; header values that try to smuggle a NATS subject or a header;
invalid UTF-8; oversized and deeply nested bodies; a flood of streams whose clients hang
up at once. Straight onto NATS: random bytes and random msgpack on ``qos.req.<group>``
never crash a worker, are terminated, and the worker keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import httpx
import msgpack
import nats.js.api
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import common.nats as qnats
from common.protocol import WIRE_VERSION, Chunk, GenerateRequest, RequestParams
from common.services import NatsServer
from common.subjects import Subjects
from common.tokenizer import BaseTokenizer
from tests.e2e.stack import Stack
from tests.reliability.harness import body, completion, expected_text, group

NUMERIC = [
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "priority", "logprobs",
]  # fmt: skip
# Raw JSON literals: Python's json module would refuse to write most of them.
LITERALS = ["NaN", "Infinity", "-Infinity", "1e308", "-1e308", "-1", "0", "18446744073709551616",
            "-18446744073709551617", "1e-320", "2.5", "9" * 5000]  # fmt: skip


@pytest.fixture(scope="module")
def stack(
    nats_server: NatsServer, tokenizer: BaseTokenizer, model_dir: Any, tmp_path_factory: Any
) -> Any:
    """One gateway and one fast sim worker for every bad-input test of this module."""
    from tests.reliability.harness import nats_for, sim_engine, stack_config

    config = stack_config(nats_for(nats_server.url, "badin"), {"short": group(4)},
                          max_body_bytes=64 * 1024)  # fmt: skip
    with Stack(config, tokenizer, str(model_dir), tmp_path_factory.mktemp("badin")) as s:
        s.add_worker("short-0", "short", sim_engine(tokenizer, 4, step_s=0.002))
        s.wait_live({"short": 1})
        yield s


def raw_body(model: str, field: str, literal: str) -> bytes:
    return (
        f'{{"model": "{model}", "prompt": "hi", "max_tokens": 4, "{field}": {literal}}}'
    ).encode()


async def test_every_numeric_parameter_with_nan_infinity_huge_or_negative_values_is_never_a_5xx(
    stack: Stack,
) -> None:
    results: dict[tuple[str, str], int] = {}
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=20) as http:
        for field in NUMERIC:
            for literal in LITERALS:
                response = await http.post(
                    "/completions", content=raw_body(stack.model, field, literal),
                    headers={"content-type": "application/json"},
                )  # fmt: skip
                results[(field, literal)] = response.status_code
                if response.status_code != 200:
                    assert response.json()["error"]["type"], (field, literal)
    server_errors = {k: v for k, v in results.items() if v >= 500}
    assert server_errors == {}
    for literal in ("NaN", "Infinity", "-Infinity"):  # not JSON numbers: refused everywhere
        assert {results[(f, literal)] for f in NUMERIC} == {400}, literal


async def test_out_of_range_token_ids_and_stop_ids_are_400(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=20) as http:
        for fields in (
            {"prompt": [2**64]}, {"prompt": [-1]}, {"prompt": [10**9]},
            {"stop_token_ids": [2**64]}, {"stop_token_ids": [-5]},
        ):  # fmt: skip
            response = await http.post("/completions", json={"model": stack.model, **fields})
            assert response.status_code == 400, (fields, response.text)


@pytest.mark.parametrize(
    "value",
    ["short.>", "short.*", "short ", " short", "short\tx", "shört", "short\x00", "*", ">",
     "..", "short.req", "$JS.API.STREAM.DELETE.QOS_REQ", "ＳＨＯＲＴ", "a" * 10_000],
)  # fmt: skip
def test_a_group_header_that_names_no_group_is_400_and_reaches_no_subject(
    stack: Stack, value: str
) -> None:
    # Raw bytes on the socket: httpx refuses some of these values itself (surrounding
    # whitespace, NUL), and then nothing would reach the server to be checked.
    payload = b'{"model": "%s", "prompt": "hi", "max_tokens": 2}' % stack.model.encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"X-QoS-Group: " + value.encode("utf-8") + b"\r\nContent-Length: %d\r\n"
        b"Connection: close\r\n\r\n" % len(payload) + payload
    )  # fmt: skip
    # Every request the gateway publishes, to any subject under req (the snoop's own
    # connection: a wildcard's subscriber sees subjects no stream takes, too).
    published = stack.call(stack._nc.subscribe(f"{stack.config.nats.subject_prefix}.req.>"))
    stack.call(qnats.barrier(stack._nc))
    try:
        answer = raw_http(stack.port, request, half_close=False)
        assert answer.startswith(b"HTTP/1.1 "), answer[:300]
        status = int(answer.split(b" ", 2)[1])
        if value.strip() == "short":
            assert status == 200, answer[:300]  # surrounding whitespace is not a different group
            return
        assert status in (400, 431), answer[:300]
        head, _, text = answer.partition(b"\r\n\r\n")
        if b"application/json" in head.lower():  # ours; the HTTP parser's own refusals are text
            assert json.loads(text)["error"]["param"] == "X-QoS-Group"
        # Then a request it takes: the gateway publishes on one connection, in order, so
        # once that one is answered (and the snoop's barrier is through) anything published
        # by mistake before it is in the snoop's queue, ahead of it. No wait for chunks.
        ok = httpx.post(f"{stack.base_url}/completions", headers={"X-QoS-Group": "short"},
                        json=body(stack.model, 3, 2, stream=False))  # fmt: skip
        assert ok.status_code == 200, ok.text
        stack.call(qnats.barrier(stack._nc))
        seen = [stack.call(published.next_msg()) for _ in range(published.pending_msgs)]
        assert [(m.subject, GenerateRequest.from_bytes(m.data).group) for m in seen] == [
            (Subjects(stack.config.nats.subject_prefix).request("short"), "short")
        ]  # nothing but that request reached any subject
    finally:
        stack.call(published.unsubscribe())


def raw_http(port: int, request: bytes, *, half_close: bool = True) -> bytes:
    """The server's whole answer to ``request`` (it closes: ``Connection: close``).
    ``half_close`` ends our side at once, so a parser waiting for more bytes answers; a
    request that reaches the app must not, or the app sees its client gone."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        chunks = []
        while data := sock.recv(65536):
            chunks.append(data)
    return b"".join(chunks)


@pytest.mark.parametrize(
    "header",
    [
        b"X-QoS-Group: short\r\n X-Injected: yes",  # an obs-fold continuation line
        b"X-QoS-Group: short\rX-Injected: yes",  # a bare CR
        b"X-QoS-Group: short\nX-Injected: yes",  # a bare LF
        b"X-QoS-Group: \xff\xfeshort",  # not UTF-8
        b"X-QoS-Group: short\x00",
    ],
)
def test_header_injection_attempts_are_refused_and_the_server_keeps_serving(
    stack: Stack, header: bytes
) -> None:
    payload = b'{"model": "%s", "prompt": "hi", "max_tokens": 2}' % stack.model.encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + header + b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(payload) + payload
    )  # fmt: skip
    answer = raw_http(stack.port, request)
    assert answer.startswith(b"HTTP/1.1 4"), answer[:300]  # an answer, and a refusal
    assert b"x-injected" not in answer.lower()
    ok = httpx.post(f"{stack.base_url}/completions", json=body(stack.model, 2, 4, stream=False))
    assert ok.status_code == 200


async def test_invalid_utf8_lone_surrogates_and_control_characters_are_never_a_5xx(
    stack: Stack,
) -> None:
    model = stack.model.encode()
    bodies = [
        b'{"model": "%s", "prompt": "\xc3\x28"}' % model,
        b'{"model": "%s", "prompt": "\\ud800"}' % model,
        b'{"model": "%s", "prompt": "\\udfff\\ud800 x"}' % model,
        b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud83d"}]}' % model,
        b'{"model": "%s", "prompt": "\x00\x01\x1f"}' % model,
        b'{"model": "%s", "prompt": "\\u0000 nul"}' % model,
        b'{"model": "%s", "prompt": "hi", "stop": ["\\ud800"]}' % model,
        b'\xef\xbb\xbf{"model": "%s", "prompt": "bom"}' % model,
    ]
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=20) as http:
        for raw in bodies:
            for path in ("/completions", "/chat/completions"):
                response = await http.post(
                    path, content=raw, headers={"content-type": "application/json"}
                )
                assert response.status_code < 500, (path, raw, response.text)


async def test_oversized_and_deeply_nested_bodies_are_refused_without_a_5xx(stack: Stack) -> None:
    model = stack.model
    cases: list[tuple[bytes, int]] = [
        (b'{"model": "%s", "prompt": "%s"}' % (model.encode(), b"x" * 70_000), 413),
        (b"[" * 30_000 + b"]" * 30_000, 400),
        (b'{"model": "%s", "prompt": ' % model.encode() + b"[" * 5_000 + b"]" * 5_000 + b"}", 400),
    ]
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=20) as http:
        for raw, status in cases:
            response = await http.post(
                "/completions", content=raw, headers={"content-type": "application/json"}
            )
            assert response.status_code == status, (raw[:60], response.text[:200])
        # Within the byte limit but longer than any group's context: 400, not a worker error.
        long = await http.post(
            "/completions", json={"model": model, "prompt": "lorem ipsum " * 3_000}
        )
        assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
        many = await http.post(
            "/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "x"}] * 5_000},
        )
        assert many.status_code in (400, 413), many.text[:200]


async def test_a_flood_of_streams_that_hang_up_at_once_leaves_nothing_in_flight(
    stack: Stack,
) -> None:
    async def hang_up(seed: int) -> int:
        async with (
            httpx.AsyncClient(timeout=20) as http,
            http.stream(
                "POST", f"{stack.base_url}/completions", json=body(stack.model, seed, 200)
            ) as response,
        ):
            if response.status_code == 200:
                async for _ in response.aiter_bytes():
                    break  # the first event, then gone
            return response.status_code

    statuses = await asyncio.gather(*(hang_up(seed) for seed in range(60)))
    assert statuses.count(200) >= 50, statuses  # streams were open when their clients left
    gateway = stack.workers["short-0"]
    for _ in range(200):
        health = httpx.get(f"{stack.url}/health", timeout=5).json()
        stats = stack.engine_stats("short-0")
        idle = stats.num_running == 0 and stats.num_waiting == 0 and not gateway.inflight_ids
        if health["groups"]["short"]["in_flight"] == 0 and idle:
            break
        await asyncio.sleep(0.05)
    assert health["groups"]["short"]["in_flight"] == 0
    dispatcher = stack.call(_open_streams(stack))
    assert dispatcher == 0
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_blocks
    assert (await completion(httpx.AsyncClient(timeout=20), f"{stack.base_url}/completions",
                             body(stack.model, 7, 8))).kind == "complete"  # fmt: skip


async def _open_streams(stack: Stack) -> int:
    # The gateway app is not reachable from here except through uvicorn's config.
    server = stack._server
    assert server is not None
    app = server.config.app
    state = app.state.gateway
    return state.generator._dispatcher.open_streams


# --- straight onto NATS --------------------------------------------------------------

# Any integer msgpack can carry (int64 and uint64).
ints = st.integers(-(2**63), 2**64 - 1)
FIELDS = {
    "v": st.one_of(st.just(WIRE_VERSION), st.integers(-3, 3)),
    "id": st.one_of(st.text(max_size=8), st.just("fuzz-id")),
    "group": st.sampled_from(["short", "", "x.y"]),
    "reply": st.one_of(st.just("fuzz.reply"), st.text(max_size=6)),
    "prompt": st.one_of(st.none(), st.text(max_size=20)),
    "prompt_token_ids": st.one_of(st.binary(max_size=16), st.lists(ints, max_size=4)),
    "params": st.one_of(
        st.none(),
        st.dictionaries(
            st.sampled_from([*list(RequestParams.__dataclass_fields__), "bogus"]),
            st.one_of(
                ints,
                st.floats(allow_nan=True),
                st.text(max_size=4),
                st.lists(st.integers(-5, 2**40), max_size=3),
                st.booleans(),
                st.none(),
            ),
            max_size=6,
        ),
    ),
    "priority": ints,
    "deadline_ms": st.one_of(st.none(), ints),
    "created_ms": ints,
}
# A request that decodes, with any parameter values: reaches the engine's own checks.
VALID = {"v": WIRE_VERSION, "id": "fuzz-ok", "group": "short", "reply": "fuzz.reply",
         "prompt_token_ids": b"\x05\x00\x00\x00\x06\x00\x00\x00"}  # fmt: skip
payloads = st.one_of(
    st.binary(max_size=256),
    st.fixed_dictionaries({}, optional=FIELDS).map(lambda d: msgpack.packb(d, use_bin_type=True)),
    FIELDS["params"].map(lambda p: msgpack.packb({**VALID, "params": p}, use_bin_type=True)),
)


async def test_random_bytes_and_msgpack_on_the_request_subject_never_crash_the_worker(
    stack: Stack, tokenizer: BaseTokenizer
) -> None:
    nc = await qnats.connect(stack.config.nats, "fuzzer")
    js = nc.jetstream()
    subject = Subjects(stack.config.nats.subject_prefix).request("short")
    sent: list[bytes] = []

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(payloads)
    def collect(payload: bytes) -> None:
        sent.append(payload)

    collect()
    try:
        for payload in sent:
            await js.publish(subject, payload, timeout=5)
        stream, consumer = stack.config.nats.stream, Subjects.consumer("short")
        info: nats.js.api.ConsumerInfo | None = None
        for _ in range(200):  # every message taken and settled: answered, refused or terminated
            info = await js.consumer_info(stream, consumer)
            if info.num_pending == 0 and info.num_ack_pending == 0:
                break
            await asyncio.sleep(0.05)
        assert info is not None and (info.num_pending, info.num_ack_pending) == (0, 0), info
        assert info.num_redelivered == 0  # refused at once, never retried
    finally:
        await nc.close()
    worker = stack.workers["short-0"]
    assert worker.state == "serving" and worker.bridge is not None and worker.bridge.alive
    async with httpx.AsyncClient(timeout=20) as http:
        after = await completion(http, f"{stack.base_url}/completions", body(stack.model, 8, 8))
    assert after.kind == "complete" and after.text == expected_text(tokenizer, 8, 8)


async def test_a_second_message_reusing_an_in_flight_request_id_is_terminated_not_mixed_in(
    stack: Stack,
) -> None:
    nc = await qnats.connect(stack.config.nats, "dup-ids")
    js = nc.jetstream()
    subjects = Subjects(stack.config.nats.subject_prefix)
    request = GenerateRequest(
        id="dup-1", group="short", reply=subjects.out("dup-1"), prompt_token_ids=[5, 6, 7],
        params=RequestParams(max_tokens=40, seed=3, ignore_eos=True),
    )  # fmt: skip
    chunks = await nc.subscribe(subjects.out("dup-1"))
    try:
        for _ in range(2):  # no Nats-Msg-Id: JetStream keeps both
            await js.publish(subjects.request("short"), request.to_bytes(), timeout=5)
        finals, tokens = 0, 0
        while finals == 0:
            chunk = Chunk.from_bytes((await chunks.next_msg(timeout=10)).data)
            tokens += len(chunk.token_ids)
            finals += chunk.finish_reason is not None
        info = None
        for _ in range(100):
            info = await js.consumer_info(stack.config.nats.stream, Subjects.consumer("short"))
            if info.num_ack_pending == 0 and info.num_pending == 0:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # nothing more arrives: no second answer on the reply
        assert chunks.pending_msgs == 0
    finally:
        await nc.close()
    assert tokens == 40 and finals == 1
    assert info is not None and (info.num_pending, info.num_ack_pending) == (0, 0), info


async def test_a_client_request_id_header_never_becomes_the_request_id_or_a_subject(
    stack: Stack, tokenizer: BaseTokenizer
) -> None:
    async with httpx.AsyncClient(timeout=20) as http:
        for value in ("evil.>", "a b", "x" * 300, "cmpl-1.req.short", "\u202e\u00e9"):
            outcome = await completion(
                http, f"{stack.base_url}/completions", body(stack.model, 4, 4),
                {"X-Request-Id": value.encode()},  # type: ignore[dict-item]
            )  # fmt: skip
            assert outcome.kind == "complete", outcome
            assert outcome.text == expected_text(tokenizer, 4, 4)
            rid = outcome.headers["x-request-id"]
            assert rid.startswith("cmpl-") and rid[5:].isalnum() and rid != value


@pytest.mark.parametrize("wrong", ["reply", "group", "undecodable"])
async def test_a_request_naming_another_reply_or_group_is_refused_on_its_own_subject(
    stack: Stack, wrong: str
) -> None:
    """A caller on NATS must not make a worker publish into another request's stream (or
    any subject it names), nor be served by a group other than the one it came to."""
    nc = await qnats.connect(stack.config.nats, "misdirect")
    js = nc.jetstream()
    subjects = Subjects(stack.config.nats.subject_prefix)
    rid, victim = f"mis-{wrong}", f"victim-{wrong}"
    own, other = await nc.subscribe(subjects.out(rid)), await nc.subscribe(subjects.out(victim))
    reply = subjects.out(victim) if wrong == "reply" else subjects.out(rid)
    request = GenerateRequest(
        id=rid, group="long" if wrong == "group" else "short", reply=reply,
        prompt_token_ids=[5, 6, 7], params=RequestParams(max_tokens=4),
    )  # fmt: skip
    payload = request.to_bytes()
    if wrong == "undecodable":  # names the victim's subject and fails strict decoding
        payload = msgpack.packb({"v": WIRE_VERSION, "id": rid, "reply": subjects.out(victim)})
    try:
        await js.publish(subjects.request("short"), payload, timeout=5)
        # The refusal comes on the request's own out subject, whatever reply it named.
        chunk = Chunk.from_bytes((await own.next_msg(timeout=10)).data)
        undecodable = wrong == "undecodable"
        assert chunk.error is not None
        assert chunk.error.code == ("protocol_error" if undecodable else "invalid_request")
        assert ("group" if undecodable else wrong) in chunk.error.message
        await asyncio.sleep(0.2)
        assert other.pending_msgs == 0  # nothing in the victim's stream
    finally:
        await nc.close()
