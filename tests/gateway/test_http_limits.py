"""The HTTP server's own bounds, before any route runs: a request head too large or too slow,
a body too slow, too many connections (``gateway/http_protocol.py``, ``uvicorn_config``)."""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

import httpx
import pytest

from common.config import NatsConfig
from tests.gateway.conftest import MODEL, gateway_config, serve
from tests.gateway.fake_worker import echo_alphabet, running_worker

pytestmark = pytest.mark.timeout(60)


async def _answer(reader: asyncio.StreamReader) -> tuple[bytes, dict[str, Any]]:
    """The status line and the JSON body of one response (``content-length`` framed)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    body = await asyncio.wait_for(reader.readexactly(length), 10)
    return head.split(b"\r\n", 1)[0], json.loads(body)


async def _closed(reader: asyncio.StreamReader) -> bool:
    return await asyncio.wait_for(reader.read(), 10) == b""


async def _refused(reader: asyncio.StreamReader, status: bytes, code: str, setting: str) -> None:
    """The server answered ``status`` in OpenAI's error shape naming ``setting``, then closed."""
    line, body = await _answer(reader)
    assert line == status
    assert body["error"]["code"] == code
    assert setting in body["error"]["message"]
    assert await _closed(reader)


async def _connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    parsed = httpx.URL(url)
    assert parsed.host and parsed.port
    return await asyncio.open_connection(parsed.host, parsed.port)


async def test_a_request_head_over_the_limit_gets_431_before_the_key_is_checked(
    nats_config: NatsConfig,
) -> None:
    """Megabytes of headers were read (httptools rebuilds a long value by concatenation)
    before the API key was checked; one huge header or many small ones are both refused."""
    config = gateway_config(nats_config, max_header_bytes=2048, api_key_sha256=["0" * 64])
    async with serve(config) as gw:
        for headers in (b"X-Big: " + b"a" * 4096 + b"\r\n", b"X-A: b\r\n" * 600):
            reader, writer = await _connect(gw.url)
            writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + headers)  # no end yet
            await writer.drain()
            await _refused(
                reader, b"HTTP/1.1 431 Request Header Fields Too Large",
                "request_header_fields_too_large", "gateway.max_header_bytes",
            )  # fmt: skip
            writer.close()
        # A head within the limit is served as before (here: 401, no key sent).
        async with httpx.AsyncClient(base_url=gw.url) as http:
            assert (await http.get("/v1/models", headers={"X-Small": "a" * 512})).status_code == 401


async def test_a_large_body_under_its_own_limit_is_not_taken_for_a_large_head(
    nats_config: NatsConfig,
) -> None:
    """The chunk that completes a head may carry the body too: only the head is bounded."""
    config = gateway_config(nats_config, max_header_bytes=2048)
    async with serve(config) as gw, httpx.AsyncClient(base_url=gw.base_url) as http:
        reply = await http.post(
            "/completions", json={"model": MODEL, "prompt": "a" * 30_000, "max_tokens": 1}
        )
    assert reply.status_code == 400  # too many tokens for every group, not 431
    assert reply.json()["error"]["code"] == "context_length_exceeded"


async def test_a_head_that_trickles_past_the_timeout_gets_408_and_is_closed(
    nats_config: NatsConfig,
) -> None:
    """Slowloris: a client sending a header byte now and then held its connection (and the
    file descriptor) for ever; nothing in uvicorn timed a request's head."""
    config = gateway_config(nats_config, header_timeout_s=0.5)
    async with serve(config) as gw:
        reader, writer = await _connect(gw.url)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
        for _ in range(3):  # bytes keep coming, the head never ends
            await asyncio.sleep(0.2)
            writer.write(b"X: y\r\n")
        await _refused(
            reader, b"HTTP/1.1 408 Request Timeout", "request_timeout", "gateway.header_timeout_s"
        )
        writer.close()

        # Timed again on a kept-alive connection, once its response has ended.
        reader, writer = await _connect(gw.url)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _ = await _answer(reader)
        assert status.startswith(b"HTTP/1.1 ")  # its own answer, whatever health says
        writer.write(b"GET /v1/models HTTP/1.1\r\n")  # the next head, never finished
        status, _ = await _answer(reader)
        assert status == b"HTTP/1.1 408 Request Timeout"
        writer.close()


async def test_a_long_stream_is_not_cut_by_the_head_timeout(nats_config: NatsConfig) -> None:
    """The head timer stops when the head is complete and restarts only after the response:
    a stream running past it (the client sending nothing meanwhile) runs to its end."""
    config = gateway_config(nats_config, header_timeout_s=0.3)
    slow = functools.partial(echo_alphabet, chunk_size=1, delay_s=0.05)  # 26 letters, ~1.3 s
    async with (
        serve(config) as gw,
        running_worker(nats_config, "short", behaviour=slow),
        httpx.AsyncClient(base_url=gw.base_url, timeout=10) as http,
        http.stream(
            "POST",
            "/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 26, "stream": True},
        ) as response,  # fmt: skip
    ):
        lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1])
    assert lines[-1] == "data: [DONE]" and text == "abcdefghijklmnopqrstuvwxyz"


async def test_a_body_is_bounded_by_the_body_timeout_under_a_long_deadline(
    nats_config: NatsConfig,
) -> None:
    """The body's read was bounded by the request's deadline alone, which a client sets up
    to 24 h: a trickled body held a handler and its buffer that long."""
    config = gateway_config(nats_config, body_timeout_s=0.3)
    async with serve(config) as gw:
        reader, writer = await _connect(gw.url)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nX-QoS-Deadline-Ms: 86400000\r\nContent-Length: 100\r\n\r\n{\"model\"")  # fmt: skip
        status, body = await _answer(reader)
        writer.close()
    assert status == b"HTTP/1.1 408 Request Timeout"
    assert "gateway.body_timeout_s" in body["error"]["message"]


async def test_connections_past_the_cap_get_503(nats_config: NatsConfig) -> None:
    config = gateway_config(nats_config, max_connections=2)
    async with serve(config) as gw:
        held = [await _connect(gw.url) for _ in range(2)]
        await asyncio.sleep(0.1)  # both accepted by the server
        async with httpx.AsyncClient(base_url=gw.url) as http:
            refused = await http.get("/v1/models")
            # Probes and scrapes are answered still: a gateway saturated by long streams
            # failed its liveness probe (and was restarted, cutting them all) and went
            # dark to Prometheus.
            metrics = await http.get("/metrics")
            health = await http.get("/health?verbose=1")
        for _, writer in held:
            writer.close()
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "too_many_connections"  # OpenAI's shape
    assert metrics.status_code == 200 and "qos_" in metrics.text
    # Counted, under group "-" as the gateway's other refusals before classification.
    assert _refusals(metrics.text, "503") == 1
    assert health.status_code != 503 or "Exceeded concurrency limit" not in health.text


async def test_a_head_over_the_limit_that_arrives_in_one_read_gets_431(
    nats_config: NatsConfig,
) -> None:
    """A whole head in one read was parsed before the byte count was judged, and then it
    counted for nothing: the app got every oversized header, the bound held only for heads
    split across reads."""
    config = gateway_config(nats_config, max_header_bytes=2048)
    async with serve(config) as gw:
        for head in (b"X-Big: " + b"a" * 4096 + b"\r\n", b"X-A: b\r\n" * 600):
            reader, writer = await _connect(gw.url)
            writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n")
            await _refused(
                reader, b"HTTP/1.1 431 Request Header Fields Too Large",
                "request_header_fields_too_large", "gateway.max_header_bytes",
            )  # fmt: skip
            writer.close()
        async with httpx.AsyncClient(base_url=gw.url) as http:
            assert _refusals((await http.get("/metrics")).text, "431") == 2


def _refusals(metrics_text: str, status: str) -> float:
    """``qos_gateway_requests_total`` under group "-" for ``status``."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        sample.value
        for family in text_string_to_metric_families(metrics_text)
        for sample in family.samples
        if sample.name == "qos_gateway_requests_total"
        and sample.labels == {"group": "-", "status": status}
    )


async def test_the_rest_of_a_body_answered_early_is_timed_then_the_connection_closed(
    nats_config: NatsConfig,
) -> None:
    """An early 401 kept the connection alive while the client trickled its chunked body:
    uvicorn dropped the bytes, its keep-alive timer stopped at each, and the head timer
    waited for a head that never began, so one client could hold a slot for ever. The rest
    of the body now has the head's time; one that never sent any (``Expect:
    100-continue``) is closed at once, or its next request would be read as that body."""
    config = gateway_config(nats_config, api_key_sha256=["0" * 64], header_timeout_s=0.5)
    async with serve(config) as gw:
        reader, writer = await _connect(gw.url)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n")  # fmt: skip
        status, body = await _answer(reader)
        assert status == b"HTTP/1.1 401 Unauthorized"
        assert body["error"]["code"] == "missing_api_key"
        for _ in range(3):  # more of the body, now and then: nobody reads it
            await asyncio.sleep(0.1)
            writer.write(b"1\r\na\r\n")
        assert await _closed(reader)  # 0.5 s after the answer, the body still unfinished
        writer.close()

        reader, writer = await _connect(gw.url)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 20\r\n"
                     b"Expect: 100-continue\r\n\r\n")  # fmt: skip
        status, _ = await _answer(reader)
        assert status == b"HTTP/1.1 401 Unauthorized"
        assert await asyncio.wait_for(reader.read(), 0.4) == b""  # before the head's time
        writer.close()


async def test_a_body_answered_early_that_ends_leaves_the_connection_serving(
    nats_config: NatsConfig,
) -> None:
    """Drained to its end, the connection is in step again: the next request is served;
    so is one whose head alone had arrived when it was answered (httpx writes the head and
    the body apart: closing then reset the connection under the answer)."""
    config = gateway_config(nats_config, api_key_sha256=["0" * 64])
    async with serve(config) as gw:
        for head, rest in (
            (b"Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n", b"1\r\n}\r\n0\r\n\r\n"),
            (b"Content-Length: 2\r\n\r\n", b"{}"),
        ):
            reader, writer = await _connect(gw.url)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + head)
            status, _ = await _answer(reader)
            assert status == b"HTTP/1.1 401 Unauthorized"
            writer.write(rest + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            status, _ = await _answer(reader)
            assert status.startswith(b"HTTP/1.1 ") and b"401" not in status  # /health is open
            writer.close()
        # The openai SDK's transport: a large body refused by its key gets its 401.
        async with httpx.AsyncClient(base_url=gw.url) as http:
            reply = await http.post("/v1/completions", content=b" " * 2_000_000,
                                    headers={"content-type": "application/json"})  # fmt: skip
        assert reply.status_code == 401


async def test_a_malformed_body_of_the_request_being_read_gets_its_400(
    nats_config: NatsConfig,
) -> None:
    config = gateway_config(nats_config)
    async with serve(config) as gw:
        reader, writer = await _connect(gw.url)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")  # fmt: skip
        line, body = await _answer(reader)
        assert line == b"HTTP/1.1 400 Bad Request"
        assert body["error"]["code"] == "invalid_http_request"
        assert await _closed(reader)
        writer.close()


async def test_refusals_count_each_request_once_and_an_unused_connection_none(
    nats_config: NatsConfig,
) -> None:
    """What the HTTP layer refuses counts under group "-" only for requests the app never
    saw: a body malformed while the app read it is the app's own 499, a drained body after
    an early answer closes with no second answer, and a connection that sent nothing
    (a pool's preconnect) timed out holding no request."""
    config = gateway_config(nats_config, api_key_sha256=["0" * 64], header_timeout_s=0.3)
    async with serve(config) as gw:
        reader, writer = await _connect(gw.url)  # never sends a byte
        status, _ = await _answer(reader)
        assert status == b"HTTP/1.1 408 Request Timeout"
        writer.close()
        reader, writer = await _connect(gw.url)  # an early 401, then a malformed chunk
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n")  # fmt: skip
        status, _ = await _answer(reader)
        assert status == b"HTTP/1.1 401 Unauthorized"
        writer.write(b"zz\r\nbad\r\n")
        assert await _closed(reader)  # closed, no second answer
        writer.close()
        async with httpx.AsyncClient(base_url=gw.url) as http:
            text = (await http.get("/metrics")).text
    assert _refusals(text, "408") == 0
    assert _refusals(text, "400") == 0
    assert _refusals(text, "401") == 1  # the app's own


async def test_a_malformed_body_the_app_was_reading_counts_once(nats_config: NatsConfig) -> None:
    config = gateway_config(nats_config)
    async with serve(config) as gw:
        reader, writer = await _connect(gw.url)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n{\r\n")  # fmt: skip
        await asyncio.sleep(0.2)  # the app is reading the body
        writer.write(b"zz\r\nbad\r\n")
        line, _ = await _answer(reader)
        assert line == b"HTTP/1.1 400 Bad Request"
        writer.close()
        await asyncio.sleep(0.2)  # the app's read ends (the client went)
        async with httpx.AsyncClient(base_url=gw.url) as http:
            text = (await http.get("/metrics")).text
    assert _refusals(text, "400") + _refusals(text, "499") == 1


async def test_a_pipelined_request_whose_body_comes_later_is_still_answered(
    nats_config: NatsConfig,
) -> None:
    """Closing after an early answer must not take a pipelined request's unfinished body
    for the answered one's."""
    config = gateway_config(nats_config)
    async with serve(config) as gw:
        reader, writer = await _connect(gw.url)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
                     b"POST /v1/tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nContent-Length: 33\r\n\r\n{\"model\": ")  # fmt: skip
        first, models = await _answer(reader)
        assert first == b"HTTP/1.1 200 OK" and models["data"]
        await asyncio.sleep(0.1)
        writer.write(f'"{MODEL}", "prompt": "ab"}}'.encode()[: 33 - 10])
        second, _ = await _answer(reader)
        assert second.startswith(b"HTTP/1.1 ")
        writer.close()


async def test_a_malformed_request_gets_400_in_openai_shape(nats_config: NatsConfig) -> None:
    config = gateway_config(nats_config)
    async with serve(config) as gw:
        reader, writer = await _connect(gw.url)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n")
        line, body = await _answer(reader)
        assert line == b"HTTP/1.1 400 Bad Request"
        assert body["error"]["code"] == "invalid_http_request"
        assert await _closed(reader)
        writer.close()


@pytest.mark.parametrize("framing", ["one packet", "body later", "chunked"])
async def test_a_request_asking_to_upgrade_to_h2c_is_served_as_http_1_1(
    nats_config: NatsConfig, framing: str
) -> None:
    """Java's HttpClient asks every http:// request to upgrade (``Upgrade: h2c``): httptools
    skipped its body, so the app read none (a 400, "not valid JSON") and the body's bytes,
    coming later, were read as a malformed next request. The upgrade is declined, the
    request served, and the connection stays usable."""
    body = json.dumps({"model": MODEL, "prompt": "abc"}).encode()
    head = (b"POST /v1/tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAEAAEAA\r\n")  # fmt: skip
    if framing == "chunked":
        head += b"Transfer-Encoding: chunked\r\n\r\n"
        parts = [
            head + b"%x\r\n%s\r\n" % (5, body[:5]),
            b"%x\r\n%s\r\n0\r\n\r\n" % (len(body) - 5, body[5:]),
        ]
    else:
        head += b"Content-Length: %d\r\n\r\n" % len(body)
        parts = [head + body] if framing == "one packet" else [head, body]
    async with serve(gateway_config(nats_config)) as gw:
        reader, writer = await _connect(gw.url)
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0.05)
        status, answer = await _answer(reader)
        async with httpx.AsyncClient(base_url=gw.url) as http:  # the same, asked plainly
            plain = (await http.post("/v1/tokenize", content=body)).json()
        assert status == b"HTTP/1.1 200 OK" and answer == plain, answer
        # The same connection, a request without a body asking again, then a plain one.
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
                     b"Upgrade: h2c\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")  # fmt: skip
        for _ in range(2):
            status, models = await _answer(reader)
            assert status == b"HTTP/1.1 200 OK" and models["data"]
        writer.close()
