"""Wire messages (DESIGN §2): dataclasses ↔ msgpack, strictly checked.

Every message is a msgpack map with a version field ``v``. Token ids travel as packed
little-endian int32 bytes (logprobs as float32), not lists. Decoding is strict: an unknown
version, a wrong type, a missing field, an unknown enum value or an oversized payload
raises :class:`~common.errors.ProtocolError` with the reason — never anything else — so a
bad message becomes an error chunk, not a crash. No pickle anywhere.
"""

from __future__ import annotations

import math
import sys
import types
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from functools import cache
from typing import Any, ClassVar, Literal, TypeVar

import msgpack
import numpy as np

from common.errors import ProtocolError

WIRE_VERSION = 1
DEFAULT_MAX_PAYLOAD = 8 * 1024 * 1024
_INT32 = np.dtype("<i4")
_FLOAT32 = np.dtype("<f4")

FinishReason = Literal["stop", "length", "abort", "error"]
T = TypeVar("T", bound="Message")


def packed_i32() -> Any:
    """A ``list[int]`` field carried as little-endian int32 bytes."""
    return field(default_factory=list, metadata={"packed": _INT32})


def packed_f32() -> Any:
    """A ``list[float]`` field carried as little-endian float32 bytes."""
    return field(default_factory=list, metadata={"packed": _FLOAT32})


def pack_ints(values: typing.Sequence[int]) -> bytes:
    """Token ids → packed little-endian int32 bytes (range-checked)."""
    arr = np.asarray(values, dtype=np.int64)
    if arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31):
        raise ProtocolError("token id out of int32 range")
    return arr.astype(_INT32).tobytes()


def unpack_ints(data: bytes) -> list[int]:
    if len(data) % 4:
        raise ProtocolError("packed int32 field has a length that is not a multiple of 4")
    return np.frombuffer(data, dtype=_INT32).tolist()


class Message:
    """Base of wire messages: ``to_bytes()`` / ``from_bytes()`` with strict checks."""

    KIND: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        return _encode_dataclass(self)

    def to_bytes(self) -> bytes:
        return msgpack.packb(self.to_dict(), use_bin_type=True)

    @classmethod
    def from_bytes(cls: type[T], data: bytes, max_bytes: int = DEFAULT_MAX_PAYLOAD) -> T:
        """Decode and validate; every failure is a :class:`ProtocolError`."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise ProtocolError(f"{cls.KIND}: payload must be bytes")
        if len(data) > max_bytes:
            raise ProtocolError(f"{cls.KIND}: payload of {len(data)} bytes exceeds {max_bytes}")
        try:
            # unpackb bounds every container by the buffer length, so a small payload
            # cannot claim a huge array; strict_map_key keeps map keys to str/bytes.
            obj = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several unrelated types
            raise ProtocolError(f"{cls.KIND}: not valid msgpack ({type(exc).__name__})") from None
        return cls.from_dict(obj)

    @classmethod
    def from_dict(cls: type[T], obj: Any) -> T:
        if not isinstance(obj, dict):
            raise ProtocolError(f"{cls.KIND}: top level must be a map")
        version = obj.get("v")
        if version != WIRE_VERSION:
            raise ProtocolError(
                f"{cls.KIND}: unsupported version v={version!r} (want {WIRE_VERSION})"
            )
        body = {k: v for k, v in obj.items() if k != "v"}
        message = _decode_dataclass(cls, body, cls.KIND)
        message.validate()
        return message

    def validate(self) -> None:
        """Cross-field checks beyond types; raise ProtocolError."""


# -- generic strict (de)coding of dataclasses ---------------------------------------------


def _encode_value(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return {k: v for k, v in _encode_dataclass(value).items() if k != "v"}
    if isinstance(value, list):
        return [_encode_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode_value(v) for k, v in value.items()}
    return value


def _encode_dataclass(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"v": WIRE_VERSION}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if value is None:
            continue  # absent = None: keeps chunks small
        packed = f.metadata.get("packed")
        if packed is _INT32:
            out[f.name] = pack_ints(value)
        elif packed is _FLOAT32:
            out[f.name] = np.asarray(value, dtype=_FLOAT32).tobytes()
        else:
            out[f.name] = _encode_value(value)
    return out


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))


def _check(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in args:
            if option is type(None):
                continue
            try:
                return _check(value, option, where)
            except ProtocolError as exc:
                errors.append(str(exc))
        raise ProtocolError(errors[0] if len(errors) == 1 else f"{where}: wrong type")
    if origin is Literal:
        if value not in args:
            raise ProtocolError(f"{where}: {value!r} is not one of {list(args)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected a list")
        return [_check(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected a map")
        return {
            _check(k, args[0], f"{where} key"): _check(v, args[1], f"{where}.{k}")
            for k, v in value.items()
        }
    if isinstance(hint, type) and is_dataclass(hint):
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected a map")
        return _decode_dataclass(hint, value, where)
    if hint is bool:
        if not isinstance(value, bool):
            raise ProtocolError(f"{where}: expected a bool")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(f"{where}: expected an integer")
        if not -(2**63) <= value < 2**64:
            raise ProtocolError(f"{where}: integer out of range")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ProtocolError(f"{where}: expected a number")
        if not math.isfinite(value):
            raise ProtocolError(f"{where}: must be finite")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ProtocolError(f"{where}: expected a string")
        return value
    if hint is bytes:
        if not isinstance(value, bytes):
            raise ProtocolError(f"{where}: expected bytes")
        return value
    raise ProtocolError(f"{where}: unsupported field type {hint!r}")  # a bug in a schema


def _decode_dataclass(cls: type, obj: dict[str, Any], where: str) -> Any:
    hints = _hints(cls)
    known = {f.name: f for f in fields(cls)}
    unknown = [k for k in obj if k not in known]
    if unknown:
        raise ProtocolError(f"{where}: unknown field(s) {sorted(map(str, unknown))}")
    kwargs: dict[str, Any] = {}
    for name, f in known.items():
        path = f"{where}.{name}"
        if name not in obj or obj[name] is None:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ProtocolError(f"{path}: missing")
            continue
        packed = f.metadata.get("packed")
        value = obj[name]
        if packed is not None:
            if not isinstance(value, bytes):
                raise ProtocolError(f"{path}: expected packed {packed.name} bytes")
            if len(value) % 4:
                raise ProtocolError(f"{path}: packed length is not a multiple of 4")
            arr = np.frombuffer(value, dtype=packed)
            # -inf logprobs are legitimate; NaN never is.
            if packed is _FLOAT32 and arr.size and np.isnan(arr).any():
                raise ProtocolError(f"{path}: NaN")
            kwargs[name] = arr.tolist()
        else:
            kwargs[name] = _check(value, hints[name], path)
    return cls(**kwargs)


# -- messages -------------------------------------------------------------------------


@dataclass
class RequestParams:
    """Sampling parameters as they travel; the worker builds engine SamplingParams from them."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None


@dataclass
class GenerateRequest(Message):
    """A request on ``qos.req.<group>``; exactly one of ``prompt`` / ``prompt_token_ids``."""

    KIND: ClassVar[str] = "request"
    id: str
    group: str
    reply: str
    model: str = ""
    prompt: str | None = None
    prompt_token_ids: list[int] = packed_i32()
    params: RequestParams = field(default_factory=RequestParams)
    priority: int = 0
    deadline_ms: int | None = None  # absolute, unix epoch milliseconds
    created_ms: int = 0

    def validate(self) -> None:
        from common.subjects import is_subject_token

        if not is_subject_token(self.id):
            raise ProtocolError("request.id: must match [A-Za-z0-9_-]{1,128}")
        if not is_subject_token(self.group):
            raise ProtocolError("request.group: must match [A-Za-z0-9_-]{1,128}")
        if not self.reply or any(c in self.reply for c in " \t\r\n*>"):
            raise ProtocolError("request.reply: must be a concrete subject")
        if (self.prompt is None) == (not self.prompt_token_ids):
            raise ProtocolError("request: exactly one of prompt / prompt_token_ids is required")
        if self.prompt_token_ids and min(self.prompt_token_ids) < 0:
            raise ProtocolError("request.prompt_token_ids: negative token id")
        if self.params.max_tokens < 1:
            raise ProtocolError("request.params.max_tokens: must be >= 1")


@dataclass
class TopLogprobs:
    """The top-k alternatives at one position."""

    token_ids: list[int] = packed_i32()
    logprobs: list[float] = packed_f32()


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class ErrorInfo:
    code: str
    message: str


@dataclass
class Chunk(Message):
    """Response chunk on ``qos.out.<id>``. ``seq`` = index of its first token in the output."""

    KIND: ClassVar[str] = "chunk"
    id: str
    seq: int = 0
    attempt: int = 1
    token_ids: list[int] = packed_i32()
    text: str = ""
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: ErrorInfo | None = None
    logprobs: list[float] = packed_f32()
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    worker: str = ""

    @property
    def final(self) -> bool:
        return self.finish_reason is not None

    def validate(self) -> None:
        if self.seq < 0 or self.attempt < 1:
            raise ProtocolError("chunk: seq must be >= 0 and attempt >= 1")
        if self.logprobs and len(self.logprobs) != len(self.token_ids):
            raise ProtocolError("chunk.logprobs: one per token id")


@dataclass
class ResumeQuery(Message):
    """Sent by a worker on ``qos.resume.<id>`` for a redelivered request."""

    KIND: ClassVar[str] = "resume_query"
    id: str
    attempt: int
    worker: str = ""


@dataclass
class ResumeReply(Message):
    """The caller's answer: every output token it already delivered, in order."""

    KIND: ClassVar[str] = "resume_reply"
    id: str
    token_ids: list[int] = packed_i32()
    text_len: int = 0


@dataclass
class Telemetry(Message):
    """One worker's state, every second, on ``qos.tel.<group>.<worker>``."""

    KIND: ClassVar[str] = "telemetry"
    worker: str
    group: str
    ts_ms: int
    model: str = ""
    state: Literal["starting", "serving", "draining", "stopped"] = "serving"
    running: int = 0
    waiting: int = 0
    batch_cap: int = 0
    kv_usage: float = 0.0
    tokens_per_s: float = 0.0
    requests_done: int = 0
    errors: int = 0
    ttft_p50_ms: float = 0.0
    ttft_p99_ms: float = 0.0
    e2e_p50_ms: float = 0.0
    e2e_p99_ms: float = 0.0
    samples: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    busy_ratio: float = 0.0


@dataclass
class Control(Message):
    """A command on ``qos.ctl.<worker>`` or ``qos.ctl.group.<group>``."""

    KIND: ClassVar[str] = "control"
    action: Literal["assign_group", "drain", "set_batch_cap", "abort", "resume"]
    issued_ms: int = 0
    group: str | None = None
    batch_cap: int | None = None
    request_id: str | None = None
    reason: str = ""


@dataclass
class KvEvent(Message):
    """Blocks stored in or evicted from a worker's cache, for cache-aware routing."""

    KIND: ClassVar[str] = "kv_event"
    worker: str
    kind: Literal["stored", "evicted"]
    block_hashes: list[bytes] = field(default_factory=list)
