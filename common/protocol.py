"""Wire messages (DESIGN §2): dataclasses ↔ msgpack, strictly checked.

Every message is a msgpack map with a version field ``v``. Token ids travel as packed
little-endian int32 bytes (logprobs as float32), not lists. Decoding is strict: an unknown
version, a wrong type, a missing field, an unknown enum value or an oversized payload
raises :class:`~common.errors.ProtocolError` with the reason — never anything else — so a
bad message becomes an error chunk, not a crash. No pickle anywhere.
"""

from __future__ import annotations

import math
import operator
import reprlib
import struct
import sys
import threading
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
_UINT32 = np.dtype("<u4")
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
    """Token ids → packed little-endian int32 bytes; anything but an int in int32 range
    (a float, a string, a bool) is a :class:`ProtocolError`."""
    # struct at every length: it refuses floats, strings and out-of-range ints, where
    # numpy's int64 cast truncated 1.9 to 1, read '7' as 7 and overflowed on 2**70; it is
    # also no slower than numpy on long lists.
    try:
        data = struct.pack(f"<{len(values)}i", *values)
    except struct.error as exc:
        raise ProtocolError(f"token id is not an integer in int32 range ({exc})") from None
    # bool, an int subclass, is the one non-int struct takes, as 0 or 1. A long list's types
    # are scanned only when it packed a 0 or 1 (rare ids): a prompt's pack stays one pass.
    if (len(values) <= 64 or bool((np.frombuffer(data, _UINT32) <= 1).any())) and (
        bool in map(type, values)
    ):
        raise ProtocolError("token id is a bool, not an integer")
    return data


def per_item_of(packed_field: str) -> Any:
    """A ``list[<dataclass>]`` field with at most one item per element of the packed field
    ``packed_field``, which must come before it: checked before any item is decoded, so a
    small payload of many empty maps cannot make as many objects."""
    return field(default_factory=list, metadata={"per_item_of": packed_field})


def unpack_ints(data: bytes) -> list[int]:
    if len(data) % 4:
        raise ProtocolError("packed int32 field has a length that is not a multiple of 4")
    return np.frombuffer(data, dtype=_INT32).tolist()


_packers = threading.local()


_SHORT_REPR = reprlib.Repr()  # its keyword arguments are 3.12's
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = _SHORT_REPR.maxlong = 40
_SHORT_REPR.maxlevel = 1


def _shown(value: Any) -> str:
    """A sender's value, cut short: errors are logged on every worker and sent back, and
    an 8 MiB field echoed whole made a 32 MiB log line of each."""
    return _SHORT_REPR.repr(value)


class ContainerBudget:
    """Counts the maps and arrays a payload decodes into, and stops the decode past a
    budget: an empty map is one byte on the wire and ~100 in memory, so 8 MiB of them cost
    ~700 MB and a second on the event loop before any schema check. No message needs one
    container per 8 bytes: the smallest, a token's top-logprobs entry with no alternatives
    (``logprobs`` without ``top_logprobs``), is an empty map beside the token's 4-byte id
    and 4-byte logprob (one per 16 bytes refused such chunks from 159 tokens)."""

    __slots__ = ("kind", "left")

    def __init__(self, kind: str, size: int) -> None:
        self.kind = kind
        self.left = 64 + size // 8

    def __call__(self, container: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise ProtocolError(f"{self.kind}: too many maps and arrays for its size")
        return container


def _packer() -> msgpack.Packer:
    """This thread's msgpack packer: ``packb`` builds a new one per call, half its cost."""
    packer: msgpack.Packer | None = getattr(_packers, "packer", None)
    if packer is None:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    return packer


class Message:
    """Base of wire messages: ``to_bytes()`` / ``from_bytes()`` with strict checks."""

    KIND: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        schema: type = type(self)
        return _encoder(schema, True)(self)

    def to_bytes(self) -> bytes:
        return _packer().pack(self.to_dict())

    @classmethod
    def from_bytes(cls: type[T], data: bytes, max_bytes: int = DEFAULT_MAX_PAYLOAD) -> T:
        """Decode and validate; every failure is a :class:`ProtocolError`."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise ProtocolError(f"{cls.KIND}: payload must be bytes")
        if len(data) > max_bytes:
            raise ProtocolError(f"{cls.KIND}: payload of {len(data)} bytes exceeds {max_bytes}")
        count = ContainerBudget(cls.KIND, len(data))
        try:
            # unpackb bounds every container by the buffer length, so a small payload
            # cannot claim a huge array; strict_map_key keeps map keys to str/bytes.
            obj = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True,
                                  object_hook=count, list_hook=count)  # fmt: skip
        except ProtocolError:
            raise
        except Exception as exc:  # msgpack raises several unrelated types
            raise ProtocolError(f"{cls.KIND}: not valid msgpack ({type(exc).__name__})") from None
        return cls.from_dict(obj)

    @classmethod
    def from_dict(cls: type[T], obj: Any) -> T:
        if not isinstance(obj, dict):
            raise ProtocolError(f"{cls.KIND}: top level must be a map")
        version = obj.get("v")
        # An int, exactly: True and 1.0 compare equal to 1.
        if type(version) is not int or version != WIRE_VERSION:
            raise ProtocolError(
                f"{cls.KIND}: unsupported version v={_shown(version)} (want {WIRE_VERSION})"
            )
        schema: type = cls
        message: T = _decoder(schema, True)(obj, cls.KIND)
        message.validate()
        return message

    def validate(self) -> None:
        """Cross-field checks beyond types; raise ProtocolError."""


# -- generic strict (de)coding of dataclasses ---------------------------------------------
# Each dataclass gets an encoder and a decoder compiled once from its field plan (name,
# packing, checker). A worker encodes a chunk per token and decodes every request; the
# gateway decodes every chunk. So the common case, a field of the exact scalar type, is
# one type test inline, and the checker (and the error path's "where" text) runs only
# for the rest: nested maps, lists, ints given for floats, and everything that is wrong.

Checker = typing.Callable[[Any, str], Any]


def _pack(values: typing.Sequence[Any], dtype: np.dtype) -> bytes:
    if dtype is _INT32:
        return pack_ints(values)
    return np.asarray(values, dtype=_FLOAT32).tobytes()


def _unpack(value: Any, dtype: np.dtype, where: str, name: str) -> list[Any]:
    """Packed bytes of field ``name`` → a list (``where`` names the map, for errors)."""
    if not isinstance(value, bytes):
        raise ProtocolError(f"{where}.{name}: expected packed {dtype.name} bytes")
    if len(value) % 4:
        raise ProtocolError(f"{where}.{name}: packed length is not a multiple of 4")
    if dtype is _INT32:
        return list(struct.unpack(f"<{len(value) // 4}i", value))
    arr = np.frombuffer(value, dtype=_FLOAT32)
    # -inf logprobs are legitimate; NaN never is.
    if arr.size and np.isnan(arr).any():
        raise ProtocolError(f"{where}.{name}: NaN")
    return arr.tolist()


@dataclass(frozen=True)
class _FieldPlan:
    name: str
    packed: np.dtype | None
    check: Checker
    required: bool
    nested: bool
    hint: Any
    per_item_of: str | None  # the packed field bounding this list's length (per_item_of)


@cache
def _plan(cls: type) -> tuple[_FieldPlan, ...]:
    hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
    plan: list[_FieldPlan] = []
    for f in fields(cls):
        hint = hints[f.name]
        per = f.metadata.get("per_item_of")
        if per is not None and not any(p.name == per and p.packed for p in plan):
            # The decoder bounds the list by that field's decoded length: it must be before.
            raise TypeError(f"{cls.__name__}.{f.name}: per_item_of({per!r}) needs an earlier "
                            "packed field")  # fmt: skip
        plan.append(
            _FieldPlan(
                name=f.name,
                packed=f.metadata.get("packed"),
                check=_checker(hint),
                required=f.default is MISSING and f.default_factory is MISSING,
                nested=_mentions_dataclass(hint),
                hint=hint,
                per_item_of=per,
            )
        )
    return tuple(plan)


def _mentions_dataclass(hint: Any) -> bool:
    if isinstance(hint, type) and is_dataclass(hint):
        return True
    return any(_mentions_dataclass(a) for a in typing.get_args(hint))


def _encode_value(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return _encoder(type(value))(value)
    if isinstance(value, list):
        return [_encode_value(v) for v in value]
    return value


@cache
def _encoder(cls: type, top: bool = False) -> typing.Callable[[Any], dict[str, Any]]:
    """``obj`` → its map (``top``: with ``v`` first); None fields and empty packed lists
    are left out."""
    plan: tuple[tuple[str, np.dtype | None, typing.Callable[[Any], Any] | None], ...] = tuple(
        (f.name, f.packed, _nested_encoder(f.hint) if f.nested else None) for f in _plan(cls)
    )
    names = [name for name, _, _ in plan]
    # One C call for every value (attrgetter of one name returns the bare value).
    values: typing.Callable[[Any], tuple[Any, ...]] = (
        operator.attrgetter(*names) if len(names) > 1 else lambda obj: (getattr(obj, names[0]),)
    )

    def encode(obj: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"v": WIRE_VERSION} if top else {}
        for (name, packed, nested), value in zip(plan, values(obj), strict=False):
            if value is None:
                continue  # absent = None: keeps chunks small
            if nested is not None:
                out[name] = nested(value)
            elif packed is None:
                out[name] = value
            elif value:
                out[name] = _pack(value, packed)
        return out

    return encode


def _nested_encoder(hint: Any) -> typing.Callable[[Any], Any]:
    """How a field that holds dataclasses is encoded: straight to the class's encoder for
    ``X | None`` and ``list[X]`` (a chunk's ``usage``, ``error``, ``top_logprobs``)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        hint = args[0]
    if isinstance(hint, type) and is_dataclass(hint):
        return _encoder(hint)
    item = typing.get_args(hint)[0] if typing.get_origin(hint) is list else None
    if isinstance(item, type) and is_dataclass(item):
        encode_item = _encoder(item)
        return lambda values: [encode_item(v) for v in values]
    return _encode_value


def _check_bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ProtocolError(f"{where}: expected a bool")
    return value


def _check_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{where}: expected an integer")
    if not -(2**63) <= value < 2**64:
        raise ProtocolError(f"{where}: integer out of range")
    return value


def _check_float(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProtocolError(f"{where}: expected a number")
    if not math.isfinite(value):
        raise ProtocolError(f"{where}: must be finite")
    return float(value)


def _check_str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ProtocolError(f"{where}: expected a string")
    return value


def _check_bytes(value: Any, where: str) -> bytes:
    if not isinstance(value, bytes):
        raise ProtocolError(f"{where}: expected bytes")
    return value


_SCALARS: dict[Any, Checker] = {
    bool: _check_bool,
    int: _check_int,
    float: _check_float,
    str: _check_str,
    bytes: _check_bytes,
}


def _checker(hint: Any) -> Checker:
    """Build the validating converter for one type hint (once per field)."""
    if hint is Any:
        return lambda value, where: value
    if hint in _SCALARS:
        return _SCALARS[hint]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        nullable = type(None) in args
        options = [_checker(a) for a in args if a is not type(None)]

        def check_union(value: Any, where: str) -> Any:
            if value is None and nullable:
                return None
            first: ProtocolError | None = None
            for option in options:
                try:
                    return option(value, where)
                except ProtocolError as exc:
                    first = first or exc
            raise first if len(options) == 1 and first else ProtocolError(f"{where}: wrong type")

        return check_union
    if origin is Literal:
        allowed = args

        def check_literal(value: Any, where: str) -> Any:
            if isinstance(value, bool | int | float | str) and value in allowed:
                return value
            raise ProtocolError(f"{where}: {_shown(value)} is not one of {list(allowed)}")

        return check_literal
    if origin is list:
        item = _checker(args[0])

        def check_list(value: Any, where: str) -> list[Any]:
            if not isinstance(value, list):
                raise ProtocolError(f"{where}: expected a list")
            return [item(v, f"{where}[{i}]") for i, v in enumerate(value)]

        return check_list
    if isinstance(hint, type) and is_dataclass(hint):
        cls = hint

        def check_nested(value: Any, where: str) -> Any:
            if not isinstance(value, dict):
                raise ProtocolError(f"{where}: expected a map")
            return _decoder(cls)(value, where)

        return check_nested
    raise TypeError(f"unsupported wire field type {hint!r}")  # a bug in a schema, at import


_INT_MIN, _INT_MAX = -(2**63), 2**64
# How a field's value is accepted without its checker: the exact type (and for numbers,
# the range the checker enforces). Other hints always go through the checker.
_FAST_EXACT = {bool: 1, str: 1, bytes: 1, int: 2, float: 3}


def _fast_kind(hint: Any) -> tuple[int, type | None]:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        hint = args[0]  # Optional[X]: None never reaches the fast path
    if isinstance(hint, type) and hint in _FAST_EXACT:
        return _FAST_EXACT[hint], hint
    return 0, None


@cache
def _decoder(cls: type, top: bool = False) -> typing.Callable[[dict[str, Any], str], Any]:
    """The strict decoder of ``cls`` from a map (``top``: the map may carry ``v``)."""
    plan: tuple[tuple[str, bool, np.dtype | None, int, Any, Checker], ...] = tuple(
        (f.name, f.required, f.packed, *_fast_kind(f.hint), f.check) for f in _plan(cls)
    )
    allowed = _names(cls) | {"v"} if top else _names(cls)
    isfinite = math.isfinite
    # Lists bounded by an earlier packed field's length: looked up on the slow path only.
    bounds = {f.name: f.per_item_of for f in _plan(cls) if f.per_item_of is not None}

    def decode(obj: dict[str, Any], where: str) -> Any:
        if not allowed.issuperset(obj):
            unknown = sorted(_shown(k) for k in obj if k not in allowed)
            more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            raise ProtocolError(f"{where}: unknown field(s) {', '.join(unknown[:5])}{more}")
        kwargs: dict[str, Any] = {}
        for name, required, packed, kind, exact, check in plan:
            value: Any = obj.get(name)
            if value is None:
                if required:
                    raise ProtocolError(f"{where}.{name}: missing")
                continue
            if packed is not None:
                kwargs[name] = _unpack(value, packed, where, name)
            elif type(value) is exact and (
                kind == 1
                or (kind == 2 and _INT_MIN <= value < _INT_MAX)
                or (kind == 3 and isfinite(value))
            ):
                kwargs[name] = value
            else:
                per = bounds.get(name) if bounds else None
                if per is not None and isinstance(value, list):
                    limit = len(kwargs.get(per, ()))
                    if len(value) > limit:  # before its items become objects
                        raise ProtocolError(f"{where}.{name}: {len(value)} items for {limit} {per}")
                kwargs[name] = check(value, f"{where}.{name}")
        return cls(**kwargs)

    return decode


@cache
def _names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in fields(cls))


# -- messages -------------------------------------------------------------------------


# Stop token ids a request may name: each generated token is checked against them on the
# engine thread that serves the whole batch, so a list of thousands would slow everyone.
MAX_STOP_TOKEN_IDS = 64
# Per stop string: the engine matches every one against each token's text (cost grows with
# their length, for the whole batch on its thread).
MAX_STOP_CHARS = 1024
# Token ids one request may bias: each biased row adds its entries to the step's logits.
MAX_LOGIT_BIAS = 1024
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range, either way
MAX_CACHE_SALT_CHARS = 512  # the gateway's key part (64) plus a caller's salt (<= 256)


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
    # vLLM's extensions. None is left out on the wire, so a worker of an earlier release
    # still reads every request that does not use them.
    min_tokens: int | None = None  # EOS, stop ids and stop strings wait for this many tokens
    skip_special_tokens: bool | None = None  # None: True
    include_stop_str_in_output: bool | None = None  # None: False
    # The caller reads Chunk.stop_reason: a worker sends it only then, so a gateway of an
    # earlier release (which refuses unknown chunk fields) never gets one.
    want_stop_reason: bool | None = None
    # OpenAI's logit_bias as two parallel packed lists (token id, bias added to its logit;
    # ids unique). Empty is left out on the wire, as None is above.
    logit_bias_ids: list[int] = packed_i32()
    logit_bias_values: list[float] = packed_f32()
    # vLLM's prompt_logprobs (OpenAI's echo with logprobs): each prompt token's logprob and
    # this many alternatives, on the first chunk. None is left out on the wire.
    prompt_logprobs: int | None = None
    # Guided decoding (common.guided): the output must match this JSON schema, regex,
    # choice or grammar. None is left out on the wire; a worker of an earlier release
    # refuses a request that has them instead of answering it unguided.
    guided_kind: str | None = None
    guided_spec: str | None = None
    # With them: the token (a reasoning model's </think>) up to which the output is free,
    # the grammar holding after it. None is left out on the wire.
    guided_after_token: int | None = None

    def logit_bias(self) -> dict[int, float] | None:
        return dict(zip(self.logit_bias_ids, self.logit_bias_values, strict=True)) or None


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
    # The gateway that holds the caller's connection, heartbeating on qos.gw.<origin>;
    # "" for callers on NATS itself. Workers abort a request whose origin went silent.
    origin: str = ""
    # Prefix-cache namespace: only requests with the same salt share cached KV blocks
    # (on the worker and in the Redis tier). The gateway derives it from the API key
    # when gateway.cache_isolation is "api_key", joined to the request's own cache_salt.
    cache_salt: str = ""

    def validate(self) -> None:
        from common.subjects import is_subject_token

        if not is_subject_token(self.id):
            raise ProtocolError("request.id: must match [A-Za-z0-9_-]{1,128}")
        if self.origin and not is_subject_token(self.origin):
            raise ProtocolError("request.origin: must match [A-Za-z0-9_-]{1,128} or be empty")
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
        if len(self.params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ProtocolError(
                f"request.params.stop_token_ids: at most {MAX_STOP_TOKEN_IDS} token ids"
            )
        if any(len(s) > MAX_STOP_CHARS for s in self.params.stop):
            raise ProtocolError(f"request.params.stop: at most {MAX_STOP_CHARS} characters each")
        if len(self.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise ProtocolError(f"request.cache_salt: at most {MAX_CACHE_SALT_CHARS} characters")
        _check_logit_bias(self.params)
        _check_guided(self.params)


def _check_guided(params: RequestParams) -> None:
    """The shape only: whether the spec compiles is the worker's to answer (an error chunk)."""
    from common.guided import shape_problem

    kind, spec = params.guided_kind, params.guided_spec
    if (kind is None) != (spec is None):
        raise ProtocolError("request.params.guided_kind and guided_spec go together")
    why = shape_problem(kind, spec) if kind is not None and spec is not None else None
    if why is not None:
        raise ProtocolError(f"request.params.guided: {why}")
    after = params.guided_after_token
    if after is not None and (kind is None or not 0 <= after < 2**31):
        raise ProtocolError(
            "request.params.guided_after_token: a token id in [0, 2^31), with guided_kind"
        )


def _check_logit_bias(params: RequestParams) -> None:
    ids, values = params.logit_bias_ids, params.logit_bias_values
    if len(ids) != len(values):
        raise ProtocolError(
            "request.params.logit_bias_ids and logit_bias_values must have equal lengths"
        )
    if len(ids) > MAX_LOGIT_BIAS:
        raise ProtocolError(f"request.params.logit_bias_ids: at most {MAX_LOGIT_BIAS} token ids")
    if ids and (min(ids) < 0 or len(set(ids)) != len(ids)):
        raise ProtocolError("request.params.logit_bias_ids: must be unique non-negative ids")
    if any(not -LOGIT_BIAS_LIMIT <= v <= LOGIT_BIAS_LIMIT for v in values):
        raise ProtocolError("request.params.logit_bias_values: must be in [-100, 100]")


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
    # One entry per token id, or none: bounded before decoding (a payload of empty maps).
    top_logprobs: list[TopLogprobs] = per_item_of("token_ids")
    worker: str = ""
    # vLLM's: on a final chunk ended by "stop", the stop string or stop token id that ended
    # it (None: EOS). Only for a request with params.want_stop_reason; absent when None.
    stop_reason: int | str | None = None
    # For params.prompt_logprobs, on the chunk of the first token (seq 0): the logprob of
    # prompt tokens 1.. given those before (token 0 has none), and their alternatives (none
    # for prompt_logprobs 0). Absent otherwise: a gateway of an earlier release refuses it.
    prompt_logprobs: list[float] = packed_f32()
    prompt_top_logprobs: list[TopLogprobs] | None = field(
        default=None, metadata={"per_item_of": "prompt_logprobs"}
    )

    @property
    def final(self) -> bool:
        return self.finish_reason is not None

    def validate(self) -> None:
        if self.seq < 0 or self.attempt < 1:
            raise ProtocolError("chunk: seq must be >= 0 and attempt >= 1")
        if self.logprobs and len(self.logprobs) != len(self.token_ids):
            raise ProtocolError("chunk.logprobs: one per token id")
        if self.top_logprobs:  # the worker sends one per token id (k of them each), or none
            if len(self.top_logprobs) != len(self.token_ids):
                raise ProtocolError("chunk.top_logprobs: one entry per token id")
            if any(len(top.token_ids) != len(top.logprobs) for top in self.top_logprobs):
                raise ProtocolError("chunk.top_logprobs: one logprob per token id in each entry")
        tops = self.prompt_top_logprobs
        if tops is not None:
            if len(tops) != len(self.prompt_logprobs):
                raise ProtocolError("chunk.prompt_top_logprobs: one entry per prompt logprob")
            if any(len(top.token_ids) != len(top.logprobs) for top in tops):
                raise ProtocolError(
                    "chunk.prompt_top_logprobs: one logprob per token id in each entry"
                )


@dataclass
class ResumeQuery(Message):
    """Sent by a worker on ``qos.resume.<id>`` for a redelivered request."""

    KIND: ClassVar[str] = "resume_query"
    id: str
    attempt: int
    worker: str = ""


@dataclass
class ResumeReply(Message):
    """The caller's answer: every output token it already delivered, in order; or, with
    ``closed``, that it has finished with the request (answered it, or gave up on it): a
    redelivered copy is to be acked and dropped, nothing re-sent."""

    KIND: ClassVar[str] = "resume_reply"
    id: str
    token_ids: list[int] = packed_i32()
    text_len: int = 0
    # Sent only when true (None is never encoded): a peer that predates the field, and
    # decodes strictly, still reads every other reply during a rolling upgrade.
    closed: bool | None = None


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
    # The longest sequence (prompt + output tokens) this worker serves now: its group's
    # max_seq_len capped by its model's context and KV cache. None = not said (an older
    # worker); never encoded then, so a peer that predates the field still decodes reports.
    max_seq_len: int | None = None
    # The longest sequence its engine can hold in any group (built for the longest group,
    # capped by model and KV cache): the scheduler moves it only into groups it can serve
    # at their current length. None = not said, as above.
    engine_max_seq_len: int | None = None

    def validate(self) -> None:
        # The scheduler sizes groups from these (desired replicas, a demand history kept for
        # weeks): one absurd report must not reach them.
        for name in _TELEMETRY_COUNTS:
            value = getattr(self, name)
            if not 0 <= value <= MAX_TELEMETRY_COUNT:
                raise ProtocolError(
                    f"telemetry.{name}: {value} is outside [0, {MAX_TELEMETRY_COUNT}]"
                )
        for name in _TELEMETRY_AMOUNTS:
            if getattr(self, name) < 0:
                raise ProtocolError(f"telemetry.{name}: must be >= 0")
        for name in ("kv_usage", "busy_ratio"):
            if not 0 <= getattr(self, name) <= 1:
                raise ProtocolError(f"telemetry.{name}: must be a ratio in [0, 1]")
        for name in ("max_seq_len", "engine_max_seq_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ProtocolError(f"telemetry.{name}: must be >= 1")


# Per worker: sequences running or waiting, batch cap. Far above any engine, far below harm.
MAX_TELEMETRY_COUNT = 1 << 20
_TELEMETRY_COUNTS = ("running", "waiting", "batch_cap")
_TELEMETRY_AMOUNTS = (
    "tokens_per_s", "requests_done", "errors", "ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms",
    "e2e_p99_ms", "samples", "prefix_queried_tokens", "prefix_hit_tokens",
)  # fmt: skip


@dataclass
class Control(Message):
    """A command on ``qos.ctl.<worker>`` or ``qos.ctl.group.<group>``."""

    KIND: ClassVar[str] = "control"
    action: Literal["assign_group", "drain", "set_batch_cap", "abort", "resume", "supersede"]
    issued_ms: int = 0
    group: str | None = None
    batch_cap: int | None = None
    request_id: str | None = None
    reason: str = ""
    # supersede: a later delivery of the request resumed it (this attempt asked its caller
    # where to go on); a replica still serving an earlier delivery stops, unanswered.
    attempt: int | None = None
    # supersede: only this worker's run of delivery ``attempt`` stops (a second run of one
    # delivery: common/sequencer.py). None = any earlier delivery's; never encoded then, so
    # a worker from before the field still decodes the others.
    worker: str | None = None
    # With ``worker``: the stream sequence of the message the caller follows, when known. A
    # run of another message (the same id published twice) is terminated there; one of the
    # same message (its consumer made again) is left to come back if the followed run dies.
    stream_seq: int | None = None
    # The scheduler's leadership term as a fencing token (the lease bucket's revision when
    # the term began; rises with every new leader): a worker drops a scheduler's command
    # whose fence is below the highest it has seen, a deposed leader's, sent late. None =
    # not a scheduler's (or from one that predates the field); never encoded then.
    fence: int | None = None


@dataclass
class KvEvent(Message):
    """Blocks stored in or evicted from a worker's cache, for cache-aware routing."""

    KIND: ClassVar[str] = "kv_event"
    worker: str
    kind: Literal["stored", "evicted"]
    block_hashes: list[bytes] = field(default_factory=list)


# --- gateway heartbeat (qos.gw.<gateway id>) ---------------------------------------------
# Not msgpack: the payload is the gateway's NATS reconnect count in ASCII digits, empty
# from gateways older than the field. Workers resync a gateway's streams when it changes.


def heartbeat_payload(reconnects: int) -> bytes:
    return str(reconnects).encode()


def heartbeat_reconnects(payload: bytes) -> int | None:
    """The reconnect count a heartbeat carries; None for an empty or malformed payload."""
    if 0 < len(payload) <= 12 and payload.isdigit():
        return int(payload)
    return None
