"""Wire protocol: round trips, every rejection path, and a fuzz that only ProtocolError escapes."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.errors import ProtocolError
from common.protocol import (
    WIRE_VERSION,
    Chunk,
    Control,
    ErrorInfo,
    GenerateRequest,
    KvEvent,
    RequestParams,
    ResumeQuery,
    ResumeReply,
    Telemetry,
    TopLogprobs,
    Usage,
)


def _request(**overrides) -> GenerateRequest:
    base = dict(id="req-1", group="short", reply="qos.out.req-1", prompt="hello")
    base.update(overrides)
    return GenerateRequest(**base)


def _raw(**fields) -> bytes:
    return msgpack.packb({"v": WIRE_VERSION, **fields}, use_bin_type=True)


MESSAGES = [
    _request(),
    _request(prompt=None, prompt_token_ids=[0, 1, 2**31 - 1], priority=-3, deadline_ms=123),
    _request(
        params=RequestParams(
            max_tokens=7,
            temperature=0.0,
            seed=2**40,
            stop=["\n", "END"],
            stop_token_ids=[2],
            ignore_eos=True,
            logprobs=3,
        )
    ),
    Chunk(id="req-1", seq=4, attempt=2, token_ids=[9, 8], text="é🙂", worker="w1"),
    Chunk(
        id="req-1",
        finish_reason="stop",
        usage=Usage(3, 4, 1),
        logprobs=[-0.5],
        token_ids=[1],
        top_logprobs=[TopLogprobs([1, 2], [-0.5, -1.5])],
    ),
    Chunk(id="req-1", finish_reason="error", error=ErrorInfo("deadline_exceeded", "too late")),
    ResumeQuery(id="req-1", attempt=2, worker="w2"),
    ResumeReply(id="req-1", token_ids=[5, 6, 7], text_len=3),
    Telemetry(worker="w1", group="short", ts_ms=1, running=3, kv_usage=0.5, e2e_p99_ms=12.5),
    Control(action="set_batch_cap", batch_cap=4, reason="breaker open"),
    KvEvent(worker="w1", kind="stored", block_hashes=[b"\x00" * 16]),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_exactly(message) -> None:
    assert type(message).from_bytes(message.to_bytes()) == message


def test_token_ids_travel_as_packed_little_endian_int32() -> None:
    payload = msgpack.unpackb(_request(prompt=None, prompt_token_ids=[1, 256]).to_bytes())
    assert payload["prompt_token_ids"] == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    assert payload["v"] == WIRE_VERSION


def test_token_id_beyond_int32_is_refused_when_encoding() -> None:
    with pytest.raises(ProtocolError, match="int32"):
        _request(prompt=None, prompt_token_ids=[2**31]).to_bytes()


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\xc1", "not valid msgpack"),
        (msgpack.packb([1, 2]), "top level must be a map"),
        (msgpack.packb({"v": 99, "id": "a"}), "unsupported version"),
        (msgpack.packb({"id": "a"}), "unsupported version"),
        (_raw(id="a", reply="r", prompt="x"), "group: missing"),
        (_raw(id="a", group="g", reply="r", prompt="x", extra=1), "unknown field"),
        (_raw(id="a", group="g", reply="r", prompt=5), "prompt: expected a string"),
        (_raw(id="a", group="g", reply="r", prompt="x", priority=True), "expected an integer"),
        (
            _raw(id="a", group="g", reply="r", prompt="x", params={"temperature": "hot"}),
            "expected a number",
        ),
        (
            _raw(id="a", group="g", reply="r", prompt="x", params={"temperature": float("nan")}),
            "finite",
        ),
        (_raw(id="a", group="g", reply="r", prompt="x", params={"stop": "x"}), "expected a list"),
        (_raw(id="a", group="g", reply="r", prompt="x", params={"bogus": 1}), "unknown field"),
        (_raw(id="a", group="g", reply="r", prompt_token_ids=[1, 2]), "packed int32 bytes"),
        (_raw(id="a", group="g", reply="r", prompt_token_ids=b"\x00\x00\x00"), "multiple of 4"),
        (_raw(id="a", group="g", reply="r"), "exactly one of prompt"),
        (
            _raw(id="a", group="g", reply="r", prompt="x", prompt_token_ids=b"\x01\x00\x00\x00"),
            "exactly one",
        ),
        (_raw(id="a.b", group="g", reply="r", prompt="x"), "request.id"),
        (_raw(id="a", group="g>", reply="r", prompt="x"), "request.group"),
        (_raw(id="a", group="g", reply="qos.*", prompt="x"), "request.reply"),
        (_raw(id="a", group="g", reply="r", prompt_token_ids=b"\xff\xff\xff\xff"), "negative"),
        (_raw(id="a", group="g", reply="r", prompt="x", params={"max_tokens": 0}), "max_tokens"),
        (
            _raw(
                id="a", group="g", reply="r", prompt="x", params={"stop_token_ids": list(range(65))}
            ),
            "at most 64 token ids",
        ),
        (
            _raw(id="a", group="g", reply="r", prompt="x", params={"stop": ["x" * 1025]}),
            "at most 1024 characters",
        ),
        (
            _raw(id="a", group="g", reply="r", prompt="x", cache_salt="s" * 513),
            "cache_salt: at most 512 characters",
        ),
        (msgpack.packb({1: 2}), "not valid msgpack"),
    ],
)
def test_malformed_request_is_rejected_with_a_reason(payload: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        GenerateRequest.from_bytes(payload)


def test_an_integer_where_a_float_is_expected_decodes_as_a_float() -> None:
    payload = _raw(id="a", group="g", reply="r", prompt="x", params={"temperature": 1, "top_p": 0})
    params = GenerateRequest.from_bytes(payload).params
    assert (params.temperature, params.top_p) == (1.0, 0.0)
    assert type(params.temperature) is float and type(params.top_p) is float


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        ({"temperature": float("inf")}, "params.temperature: must be finite"),
        ({"temperature": True}, "params.temperature: expected a number"),
        ({"max_tokens": 2.0}, "params.max_tokens: expected an integer"),
        ({"ignore_eos": 1}, "params.ignore_eos: expected a bool"),
        ({"seed": "7"}, "params.seed: expected an integer"),
        ({"stop": [b"x"]}, r"params.stop\[0\]: expected a string"),
    ],
)
def test_a_scalar_of_the_wrong_type_names_its_field(params: dict, reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        GenerateRequest.from_bytes(_raw(id="a", group="g", reply="r", prompt="x", params=params))


def test_oversized_payload_is_rejected_before_decoding() -> None:
    big = _request(prompt="x" * 2000).to_bytes()
    with pytest.raises(ProtocolError, match="exceeds"):
        GenerateRequest.from_bytes(big, max_bytes=1024)


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (_raw(id="a", finish_reason="exploded"), "not one of"),
        (_raw(id="a", seq=-1), "seq must be"),
        (_raw(id="a", token_ids=b"\x01\x00\x00\x00", logprobs=b""), None),
        (
            _raw(
                id="a", token_ids=b"\x01\x00\x00\x00\x02\x00\x00\x00", logprobs=b"\x00\x00\x00\x00"
            ),
            "one per token",
        ),
        (_raw(id="a", logprobs=b"\x00\x00\xc0\x7f", token_ids=b"\x01\x00\x00\x00"), "NaN"),
        (_raw(id="a", error={"code": "x"}), "error.message: missing"),
    ],
)
def test_chunk_rejections(payload: bytes, reason: str | None) -> None:
    if reason is None:
        Chunk.from_bytes(payload)
        return
    with pytest.raises(ProtocolError, match=reason):
        Chunk.from_bytes(payload)


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"running": 2**62}, r"running: \d+ is outside"),
        ({"waiting": -3}, "waiting: -3 is outside"),
        ({"requests_done": -1}, "requests_done: must be >= 0"),
        ({"e2e_p99_ms": -5.0}, "e2e_p99_ms: must be >= 0"),
        ({"kv_usage": 1.5}, "kv_usage: must be a ratio"),
        ({"busy_ratio": -0.1}, "busy_ratio: must be a ratio"),
        ({"running": 1 << 20, "kv_usage": 1.0, "busy_ratio": 0.0}, None),
    ],
)
def test_telemetry_outside_sane_ranges_is_rejected(fields: dict, reason: str | None) -> None:
    """The scheduler sizes groups from telemetry: one absurd report must not reach it."""
    payload = Telemetry(worker="w", group="short", ts_ms=0, **fields).to_bytes()
    if reason is None:
        assert Telemetry.from_bytes(payload).running == fields["running"]
        return
    with pytest.raises(ProtocolError, match=reason):
        Telemetry.from_bytes(payload)


def test_control_action_is_an_enum() -> None:
    with pytest.raises(ProtocolError, match="not one of"):
        Control.from_bytes(_raw(action="self_destruct"))


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=12),
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
_field_names = st.sampled_from(
    [
        "v",
        "id",
        "group",
        "reply",
        "prompt",
        "prompt_token_ids",
        "params",
        "priority",
        "seq",
        "token_ids",
        "finish_reason",
        "usage",
        "error",
        "logprobs",
        "top_logprobs",
        "action",
        "worker",
        "ts_ms",
        "kind",
        "block_hashes",
        "attempt",
        "max_tokens",
        "stop",
    ]
)
_maps = st.dictionaries(_field_names, _values, max_size=10).map(
    lambda d: {**d, "v": WIRE_VERSION} if d.get("v") is None else d
)


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.binary(max_size=64), _maps.map(lambda d: msgpack.packb(d, use_bin_type=True))))
def test_decoders_raise_nothing_but_protocol_error(payload: bytes) -> None:
    for cls in (GenerateRequest, Chunk, ResumeQuery, ResumeReply, Telemetry, Control, KvEvent):
        with contextlib.suppress(ProtocolError):
            cls.from_bytes(payload)


def test_fields_added_since_the_last_release_are_not_sent_unless_set() -> None:
    """Decoding is strict: a peer of the release before these fields rejects a message that
    carries them, so a rolling upgrade must not send them with their defaults."""
    report = Telemetry(worker="w", group="short", ts_ms=1)
    assert "max_seq_len" not in msgpack.unpackb(report.to_bytes())
    assert "max_seq_len" in msgpack.unpackb(
        Telemetry(worker="w", group="short", ts_ms=1, max_seq_len=4096).to_bytes()
    )
    assert "closed" not in msgpack.unpackb(ResumeReply(id="r").to_bytes())
    assert msgpack.unpackb(ResumeReply(id="r", closed=True).to_bytes())["closed"] is True
    # A chunk's stop_reason, which a gateway of the release before cannot decode, goes only
    # to a caller that asked for it (a gateway of this release, for a request with stops).
    assert "stop_reason" not in msgpack.unpackb(Chunk(id="r", finish_reason="stop").to_bytes())
    params = msgpack.unpackb(GenerateRequest(id="r", group="g", reply="o.r").to_bytes())["params"]
    assert "want_stop_reason" not in params and "attempt" not in msgpack.unpackb(
        Control(action="abort", request_id="r").to_bytes()
    )
