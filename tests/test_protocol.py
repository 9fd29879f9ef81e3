"""Wire protocol: round trips, every rejection path, and a fuzz that only ProtocolError escapes."""

from __future__ import annotations

import contextlib
import struct

import msgpack
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from common.errors import ProtocolError
from common.protocol import (
    DEFAULT_MAX_PAYLOAD,
    WIRE_VERSION,
    Chunk,
    Control,
    ErrorInfo,
    GenerateRequest,
    KvEvent,
    Message,
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


def _biased(ids: list[int], values: list[float]) -> bytes:
    """A request whose logit_bias lists are packed as sent."""
    params = {
        "logit_bias_ids": struct.pack(f"<{len(ids)}i", *ids),
        "logit_bias_values": struct.pack(f"<{len(values)}f", *values),
    }
    return _raw(id="a", group="g", reply="r", prompt="x", params=params)


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
            logit_bias_ids=[3, 50256],
            logit_bias_values=[-100.0, 2.5],
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
        (_biased([1, 2], [1.0]), "equal lengths"),
        (_biased([1, 1], [1.0, 2.0]), "unique non-negative"),
        (_biased([-1], [1.0]), "unique non-negative"),
        (_biased([1], [100.5]), r"\[-100, 100\]"),
        (_biased([1], [float("inf")]), r"\[-100, 100\]"),
        (_biased([1], [float("nan")]), "NaN"),
        (_biased(list(range(1025)), [1.0] * 1025), "at most 1024 token ids"),
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


def _top(token_ids: list[int], logprobs: list[float]) -> dict[str, bytes]:
    """A top_logprobs entry as sent."""
    return {
        "token_ids": struct.pack(f"<{len(token_ids)}i", *token_ids),
        "logprobs": struct.pack(f"<{len(logprobs)}f", *logprobs),
    }


_TWO_IDS = struct.pack("<2i", 7, 8)


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"top_logprobs": [{}, {}]}, "2 items for 0 token_ids"),
        ({"token_ids": _TWO_IDS, "top_logprobs": [{}, {}, {}]}, "3 items for 2 token_ids"),
        ({"token_ids": _TWO_IDS, "top_logprobs": [{}]}, "one entry per token id"),
        ({"token_ids": _TWO_IDS, "top_logprobs": [_top([1, 2], [-0.5]), {}]},
         "one logprob per token id"),
        # What a worker sends: an entry per token id, k alternatives each (k=0: empty ones).
        ({"token_ids": _TWO_IDS, "top_logprobs": [_top([1, 2], [-0.5, -1.0]), _top([3], [-2.0])]},
         None),
        ({"token_ids": _TWO_IDS, "top_logprobs": [{}, {}]}, None),
        ({"token_ids": _TWO_IDS}, None),
    ],
)  # fmt: skip
def test_top_logprobs_are_one_entry_per_token_id_or_none(fields: dict, reason: str | None) -> None:
    """Unbounded, a 1 MB chunk of a million empty maps decoded into a million objects; the
    gateway read entries by position, for tokens they did not belong to."""
    payload = _raw(id="a", **fields)
    if reason is None:
        chunk = Chunk.from_bytes(payload)
        assert len(chunk.top_logprobs) in (0, len(chunk.token_ids))
        return
    with pytest.raises(ProtocolError, match=reason):
        Chunk.from_bytes(payload)


def test_a_chunk_of_a_million_empty_top_logprobs_is_refused_before_decoding_them() -> None:
    payload = _raw(id="a", token_ids=_TWO_IDS, top_logprobs=[{}] * 1_000_000)
    assert len(payload) < DEFAULT_MAX_PAYLOAD
    with pytest.raises(ProtocolError, match="too many maps and arrays"):
        Chunk.from_bytes(payload)


@pytest.mark.parametrize("cls", [GenerateRequest, Chunk, Control])
def test_empty_containers_stop_the_decode_before_they_cost_memory(cls: type[Message]) -> None:
    """An empty map is one byte on the wire and ~100 in memory: 8 MiB of them in any field
    cost ~700 MB and a second of the event loop before the schema saw them. The decode
    stops once they outnumber what any message of that size holds."""
    for nested in ([{}] * 200_000, [[[]] * 1000] * 200):
        payload = msgpack.packb({"v": WIRE_VERSION, "x": nested})
        with pytest.raises(ProtocolError, match="too many maps and arrays"):
            cls.from_bytes(payload)
    # Real chunks decode: top logprobs on every token, and the smallest containers of all,
    # a token's entry with no alternatives (logprobs without top_logprobs: empty maps).
    for alternatives in (1, 0):
        tops = [TopLogprobs(token_ids=[1] * alternatives, logprobs=[-1.0] * alternatives)
                for _ in range(5000)]  # fmt: skip
        chunk = Chunk(id="a", seq=0, token_ids=list(range(5000)), logprobs=[-0.5] * 5000,
                      top_logprobs=tops)  # fmt: skip
        assert Chunk.from_bytes(chunk.to_bytes()).top_logprobs == tops


def test_a_refused_value_is_echoed_cut_short() -> None:
    """Errors are logged by every worker and sent back: an 8 MiB field echoed whole made a
    32 MiB log line."""
    huge = "x" * 1_000_000
    for payload in (
        Control(action="drain").to_bytes().replace(b"drain", b"xxxxx"),
        msgpack.packb({"v": huge}),
        msgpack.packb({"v": WIRE_VERSION, "action": huge}),
        msgpack.packb(
            {"v": WIRE_VERSION, "action": "drain", **{huge + str(i): 1 for i in range(9)}}
        ),
    ):
        with pytest.raises(ProtocolError) as refused:
            Control.from_bytes(payload)
        assert len(str(refused.value)) < 400, str(refused.value)[:400]


@pytest.mark.parametrize("version", [True, 1.0, "1", 2, None])
@pytest.mark.parametrize("cls", [GenerateRequest, Chunk, Control])
def test_the_version_must_be_the_integer_it_is(cls: type[Message], version: object) -> None:
    """True and 1.0 compare equal to 1, and passed for it."""
    with pytest.raises(ProtocolError, match="unsupported version"):
        cls.from_bytes(msgpack.packb({"v": version, "id": "a", "group": "g", "reply": "r",
                                      "prompt": "x", "action": "drain"}))  # fmt: skip


@pytest.mark.parametrize("length", [3, 64, 65, 1000])
@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (1.9, "not an integer"),  # numpy's int64 cast truncated it to 1
        ("7", "not an integer"),  # ... and read it as 7
        (2**70, "int32 range"),  # ... and raised a raw OverflowError
        (2**31, "int32 range"),
        (-(2**31) - 1, "int32 range"),
        (True, "bool"),
        (None, "not an integer"),
    ],
)
def test_token_ids_that_are_no_int32_are_refused_at_any_length(
    length: int, bad: object, reason: str
) -> None:
    """Up to 64 ids were packed by struct, longer lists by numpy: each took other things."""
    for at in (0, length - 1):
        ids: list = [5] * length
        ids[at] = bad
        with pytest.raises(ProtocolError, match=reason):
            _request(prompt=None, prompt_token_ids=ids).to_bytes()
        with pytest.raises(ProtocolError, match=reason):
            Chunk(id="a", token_ids=ids).to_bytes()


@pytest.mark.parametrize("length", [1, 64, 65, 5000])
def test_token_ids_at_any_length_round_trip(length: int) -> None:
    ids = [(i * 7919) % 2**31 for i in range(length)]
    ids[:3] = [0, 1, 2**31 - 1][:length]  # 0 and 1 are ids, not bools
    request = _request(prompt=None, prompt_token_ids=ids)
    assert GenerateRequest.from_bytes(request.to_bytes()).prompt_token_ids == ids
    chunk = Chunk(id="a", token_ids=[-(2**31), *ids])
    assert Chunk.from_bytes(chunk.to_bytes()).token_ids == chunk.token_ids


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


# -- valid messages, then one field broken ------------------------------------------------
# The fuzz above almost never builds a message that decodes: these build valid ones (through
# the dataclasses' constructors), so the success path is checked too, then break them.

_tokens = st.from_regex(r"[A-Za-z0-9_-]{1,16}", fullmatch=True)  # a subject token
_reply = st.lists(_tokens, min_size=1, max_size=3).map(".".join)
_i64 = st.integers(-(2**63), 2**63 - 1)
_u = st.integers(0, 2**64 - 1)  # what a wire integer field takes
_i32 = st.integers(-(2**31), 2**31 - 1)
_i32s = st.lists(_i32, max_size=6)
_token_ids = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=6)
_finite = st.floats(allow_nan=False, allow_infinity=False)
_ratio = st.floats(0.0, 1.0)
_f32 = st.floats(width=32, allow_nan=False)  # packed as float32: exact only at that width


def _opt(values: st.SearchStrategy) -> st.SearchStrategy:
    """``values`` or None (an optional field)."""
    return st.none() | values


_params = st.builds(
    RequestParams,
    max_tokens=st.integers(1, 2**63 - 1),
    temperature=_finite, top_p=_finite, top_k=_i64, min_p=_finite,
    repetition_penalty=_finite, presence_penalty=_finite, frequency_penalty=_finite,
    seed=_opt(_u),
    stop=st.lists(st.text(max_size=8), max_size=3),
    stop_token_ids=st.lists(_i64, max_size=4),
    ignore_eos=st.booleans(),
    logprobs=_opt(_i64),
    min_tokens=_opt(_i64),
    skip_special_tokens=_opt(st.booleans()),
    include_stop_str_in_output=_opt(st.booleans()),
    want_stop_reason=_opt(st.booleans()),
)  # fmt: skip


@st.composite
def _requests(draw: st.DrawFn) -> GenerateRequest:
    by_text = draw(st.booleans())  # exactly one of prompt / prompt_token_ids
    return GenerateRequest(
        id=draw(_tokens), group=draw(_tokens), reply=draw(_reply), model=draw(st.text(max_size=8)),
        prompt=draw(st.text(max_size=12)) if by_text else None,
        prompt_token_ids=[] if by_text else draw(_token_ids),
        params=draw(_params), priority=draw(_i64), deadline_ms=draw(_opt(_u)),
        created_ms=draw(_u), origin=draw(st.just("") | _tokens),
        cache_salt=draw(st.text(max_size=12)),
    )  # fmt: skip


@st.composite
def _chunks(draw: st.DrawFn) -> Chunk:
    token_ids = draw(_i32s)
    # Logprobs are one per token id, or none; so are top_logprobs entries, each with as many
    # logprobs as token ids.
    n = len(token_ids)
    logprobs = draw(st.just([]) | st.lists(_f32, min_size=n, max_size=n))
    top = st.lists(_f32, max_size=3).flatmap(
        lambda lps: st.builds(TopLogprobs, st.lists(_i32, min_size=len(lps), max_size=len(lps)),
                              st.just(lps))
    )  # fmt: skip
    top_logprobs = draw(st.just([]) | st.lists(top, min_size=n, max_size=n))
    return Chunk(
        id=draw(st.text(max_size=8)), seq=draw(_u), attempt=draw(st.integers(1, 2**64 - 1)),
        token_ids=token_ids, text=draw(st.text(max_size=12)),
        finish_reason=draw(_opt(st.sampled_from(["stop", "length", "abort", "error"]))),
        usage=draw(_opt(st.builds(Usage, _u, _u, _u))),
        error=draw(_opt(st.builds(ErrorInfo, st.text(max_size=8), st.text(max_size=8)))),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        worker=draw(st.text(max_size=8)),
        stop_reason=draw(_opt(_i64 | st.text(max_size=8))),
    )  # fmt: skip


_count = st.integers(0, 1 << 20)  # telemetry's bounded counts (MAX_TELEMETRY_COUNT)
_amount = st.floats(0.0, allow_infinity=False)
_telemetry = st.builds(
    Telemetry,
    worker=st.text(max_size=8), group=st.text(max_size=8), ts_ms=_i64, model=st.text(max_size=8),
    state=st.sampled_from(["starting", "serving", "draining", "stopped"]),
    running=_count, waiting=_count, batch_cap=_count, kv_usage=_ratio, tokens_per_s=_amount,
    requests_done=_u, errors=_u, ttft_p50_ms=_amount, ttft_p99_ms=_amount, e2e_p50_ms=_amount,
    e2e_p99_ms=_amount, samples=_u, prefix_queried_tokens=_u, prefix_hit_tokens=_u,
    busy_ratio=_ratio, max_seq_len=_opt(st.integers(1, 2**64 - 1)),
    engine_max_seq_len=_opt(st.integers(1, 2**64 - 1)),
)  # fmt: skip
_control = st.builds(
    Control,
    action=st.sampled_from(
        ["assign_group", "drain", "set_batch_cap", "abort", "resume", "supersede"]
    ),
    issued_ms=_i64, group=_opt(st.text(max_size=8)), batch_cap=_opt(_i64),
    request_id=_opt(st.text(max_size=8)), reason=st.text(max_size=8), attempt=_opt(_i64),
    fence=_opt(_u),
)  # fmt: skip
_valid_messages = st.one_of(_requests(), _chunks(), _telemetry, _control)


@settings(max_examples=150, deadline=None)
@given(_valid_messages)
def test_valid_messages_round_trip_exactly(message) -> None:
    assert type(message).from_bytes(message.to_bytes()) == message


# Values a field must refuse or survive: out of range for some field or other, of another
# type, non-finite.
_out_of_range = st.sampled_from(
    [-1, 0, -(2**63), 2**64 - 1, (1 << 20) + 1, -0.5, 1.5, 1e308, float("inf"), float("nan"),
     "", "a.b", "*", b"\x00\x00\x00", b"\xff\xff\xff\xff", [], {}, True, None]
)  # fmt: skip


def _maps_in(obj: dict) -> list[dict]:
    """``obj`` and every map nested in it (params, usage, error, top_logprobs' items)."""
    out = [obj]
    for value in obj.values():
        if isinstance(value, dict):
            out += _maps_in(value)
        elif isinstance(value, list):
            out += [m for item in value if isinstance(item, dict) for m in _maps_in(item)]
    return out


@st.composite
def _broken(draw: st.DrawFn) -> tuple[type, bytes]:
    """A valid message's map with one field broken: retyped, out of range, dropped, or one
    the schema lacks added, at the top or in a nested map."""
    message = draw(_valid_messages)
    obj = msgpack.unpackb(message.to_bytes(), raw=False)
    target = draw(st.sampled_from(_maps_in(obj)))
    how = draw(st.sampled_from(["retype", "out_of_range", "drop", "unknown"]))
    keys = sorted(target)
    if how == "unknown" or not keys:
        target[draw(st.text(min_size=1, max_size=6).filter(lambda k: k not in target))] = draw(
            _values
        )
    elif how == "drop":
        del target[draw(st.sampled_from(keys))]
    else:
        target[draw(st.sampled_from(keys))] = draw(_values if how == "retype" else _out_of_range)
    return type(message), msgpack.packb(obj, use_bin_type=True)


@settings(max_examples=200, deadline=None)
@given(_broken())
def test_a_valid_message_with_one_field_broken_decodes_valid_or_raises_protocol_error(
    case: tuple[type, bytes],
) -> None:
    cls, payload = case
    try:
        decoded = cls.from_bytes(payload)
    except ProtocolError:
        event("refused")
        return
    event("decoded")  # an int for a float, an optional field dropped: still a valid message
    assert type(decoded) is cls
    assert cls.from_bytes(decoded.to_bytes()) == decoded


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
    assert "logit_bias_ids" not in params and "logit_bias_values" not in params
    assert "want_stop_reason" not in params and "attempt" not in msgpack.unpackb(
        Control(action="abort", request_id="r").to_bytes()
    )


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        ({"guided_kind": "regex"}, "go together"),
        ({"guided_spec": "a+"}, "go together"),
        ({"guided_kind": "xml", "guided_spec": "<a/>"}, "unknown kind 'xml'"),
        ({"guided_kind": "regex", "guided_spec": "a" * (256 * 1024 + 1)}, "longer than"),
        ({"guided_kind": "regex", "guided_spec": "("}, None),  # compiling is the worker's
    ],
)
def test_guided_decoding_fields_are_checked_for_shape(params: dict, reason: str | None) -> None:
    payload = _raw(id="a", group="g", reply="r", prompt="x", params=params)
    if reason is None:
        assert GenerateRequest.from_bytes(payload).params.guided_spec == "("
        return
    with pytest.raises(ProtocolError, match=reason):
        GenerateRequest.from_bytes(payload)
