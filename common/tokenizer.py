"""Text <-> token ids and chat templates, the way transformers does it, without torch.

The gateway tokenizes and renders chat prompts but never loads a model, so this module
depends only on ``tokenizers`` and ``jinja2``. ``Tokenizer`` reads a Hugging Face folder
and gives the same ids and chat strings as transformers' ``AutoTokenizer`` (the generic
``TokenizersBackend`` path); ``ByteTokenizer`` serves ``dummy:*`` models that ship none.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

# Named special tokens, in transformers' order; chat templates see them by these names.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Older names for a message's reasoning; templates read ``reasoning_content`` or ``thinking``.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TokenizerFileNotFoundError(FileNotFoundError):
    """A file the tokenizer needs is missing; ``path`` names it."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path = path


class ChatTemplateError(ValueError):
    """The chat template is missing, or refused the messages (``raise_exception``);
    ``param`` names the input to blame."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


class BrokenChatTemplateError(ValueError):
    """A chat template that does not compile: the model folder's fault, not a client's."""


# Steps one render may take (template attribute and item reads, calls, range elements): a
# template that scans the conversation per message (Gemma 4 looks back over every earlier
# message for each one) does quadratic work, 27 s of CPU for 4,096 messages on a thread
# nothing can stop. At about 2 us a step this bounds a render to seconds; linear templates
# take 3 to 15 steps a message (Qwen 3, Gemma 3), so the longest chat served (4,096
# messages) stays far below it, and Gemma 4 still renders some 2,000 messages.
RENDER_STEP_BUDGET = 4_000_000
# What transformers appends to the final message to find where it ends in the rendered text.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class BaseTokenizer(ABC):
    """What the gateway and the engine need from a tokenizer; chat rendering is shared."""

    bos_token_id: int | None
    eos_token_ids: set[int]
    pad_token_id: int | None
    all_special_ids: list[int]  # every id ``skip_special_tokens`` drops, sorted
    special_tokens: dict[str, str]  # name (``bos_token`` ...) -> text, for chat templates
    template_tokens: dict[str, str]  # every named token a chat template sees (a superset)
    chat_templates: dict[str, str]  # template name ("default", "tool_use", ...) -> source

    def control_token_pattern(self, *, template_tokens: bool = True) -> re.Pattern[str] | None:
        """One pattern matching the text of any control token (None when there are none),
        to find them in client text in one pass: the special tokens', and with
        ``template_tokens`` the added tokens' a chat template writes (:meth:`control_token_texts`)."""
        patterns: dict[bool, re.Pattern[str] | None] = self.__dict__.setdefault(
            "_control_patterns", {}
        )
        if template_tokens not in patterns:
            found = self.control_token_texts() if template_tokens else self.special_token_texts()
            texts = sorted(set(found), key=len, reverse=True)
            patterns[template_tokens] = (
                re.compile("|".join(map(re.escape, texts))) if texts else None
            )
        return patterns[template_tokens]

    def special_token_texts(self) -> list[str]:
        """The text of every special token (what ``skip_special_tokens`` drops)."""
        return [t for i in self.all_special_ids if (t := self.id_to_token(i))]

    def control_token_texts(self) -> list[str]:
        """Texts a client must not type (``gateway.reject_control_tokens``): the special
        tokens'; a tokenizer with added tokens adds its own (see :class:`Tokenizer`)."""
        return self.special_token_texts()

    @property
    def content_parts(self) -> bool:
        """Whether the default chat template loops over a message's content parts itself
        (Gemma 3, Llama 4...): then a list of ``{"type": "text"}`` parts reaches it as is, as
        transformers passes it; else parts are joined into one string first, as vLLM does
        for templates that treat content as a string."""
        cached: bool | None = getattr(self, "_content_parts", None)
        if cached is None:  # asked per request: the template's source is searched once
            templates = self.chat_templates
            source = templates.get("default") or next(iter(templates.values()), "")
            cached = self._content_parts = bool(_LOOPS_OVER_CONTENT.search(source))
        return cached

    @property
    def knows_developer_role(self) -> bool:
        """Whether the default chat template names OpenAI's ``developer`` role (gpt-oss's
        does); most print only system/user/assistant/tool and drop, or refuse, the rest."""
        cached: bool | None = getattr(self, "_knows_developer", None)
        if cached is None:
            templates = self.chat_templates
            source = templates.get("default") or next(iter(templates.values()), "")
            cached = self._knows_developer = "developer" in source
        return cached

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids this tokenizer can produce, added tokens included."""

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds BOS/EOS as the model expects."""

    @abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; an incomplete UTF-8 tail decodes to U+FFFD."""

    @abstractmethod
    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of ``token_id``, or None when out of range."""

    @abstractmethod
    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes ``token_id`` stands for (``b""`` when out of range).

        Unlike ``decode([token_id])`` this keeps a character split over several tokens
        intact: each piece gives its own bytes, not U+FFFD, and the pieces' bytes join
        into the text. Special tokens give their text.
        """

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's own EOS id (its config's ``eos_token``), else any stop id."""
        eos = self.special_tokens.get("eos_token")
        primary = self.token_to_id(eos) if eos is not None else None
        return primary if primary is not None else min(self.eos_token_ids, default=None)

    @abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """The id of vocabulary entry ``token``, or None."""

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: object = False,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` into the prompt string, as transformers' ``tokenize=False``.

        ``template_kwargs`` reach the template as variables (``enable_thinking=False``...).
        ``continue_final_message`` (True, or the name of the field to continue) ends the
        prompt inside the final message, for the model to go on with it, as transformers.
        Raises :class:`ChatTemplateError` when there is no template or it refuses the input
        (or the render would take more than :data:`RENDER_STEP_BUDGET` steps), and
        :class:`BrokenChatTemplateError` for a template that does not compile.
        """
        if not messages:
            raise ChatTemplateError("cannot apply a chat template to an empty conversation")
        _check_objects(tools, "tools")
        variables = {**self.template_tokens, **template_kwargs}
        # RAG templates (Command-R, Granite) take documents, as transformers passes them.
        documents = variables.pop("documents", None)
        _check_objects(documents, "documents")
        source = self._select_template(tools)
        template = _compiled(source, "the chat template")  # a syntax error is no client's
        chat = [_normalize_message(m) for m in messages]
        final = None
        if continue_final_message:
            if add_generation_prompt:
                raise ChatTemplateError(
                    "continue_final_message continues the final message, add_generation_prompt "
                    "starts a new one: set add_generation_prompt to false",
                    param="continue_final_message",
                )
            final = _tag_final_message(chat, continue_final_message, source)
        budget = _RENDER_BUDGET.set([RENDER_STEP_BUDGET])
        try:
            rendered = template.render(
                messages=chat,
                tools=[dict(t) for t in tools] if tools is not None else None,
                documents=[dict(d) for d in documents] if documents is not None else None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except _RenderBudgetSpent:
            raise ChatTemplateError(
                f"this conversation is too costly for the model's chat template to render "
                f"(over {RENDER_STEP_BUDGET:,} template steps); send fewer messages"
            ) from None
        except (
            jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError,
            ArithmeticError, RecursionError,
        ) as e:  # fmt: skip
            # The messages' shape meeting the template (content a list where it concatenates
            # strings, a format spec it applies to client text, a key it expects, dictsort
            # on a string, a range() past the sandbox's bound): bad input, not a server fault.
            raise ChatTemplateError(f"chat template: {e}") from e
        finally:
            _RENDER_BUDGET.reset(budget)
        return rendered if final is None else _cut_after_final_message(rendered, final)

    def _select_template(self, tools: object) -> str:
        templates = self.chat_templates
        if not templates:
            raise ChatTemplateError(
                "this tokenizer has no chat template (tokenizer_config.json 'chat_template' "
                "or chat_template.jinja); send a plain prompt instead"
            )
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        raise ChatTemplateError(
            f"several chat templates and none named 'default': {sorted(templates)}"
        )


# Texts longer than this are encoded without holding the GIL (see Tokenizer.encode).
GIL_FREE_CHARS = 16 * 1024
# A template loop over a message's content: {% for part in message['content'] %},
# {%- for c in message.content -%}, {% for item in content %}.
_LOOPS_OVER_CONTENT = re.compile(r"\{%-?\s*for\s+\w+\s+in\s+[\w.\[\]'\"]*content\b")


class Tokenizer(BaseTokenizer):
    """A Hugging Face tokenizer folder, read with ``tokenizers`` (no transformers).

    BOS/EOS come from tokenizer.json's post-processor alone: transformers 5 drops
    tokenizer_config's ``add_bos_token``/``add_eos_token`` whenever tokenizer.json exists,
    and ids must match what the model was evaluated with there.

    One known difference: for a folder whose ``tokenizer_class`` is ``LlamaTokenizer``
    (Llama 2's SentencePiece layout), transformers 5 rebuilds tokenizer.json's
    pre-tokenizer (Metaspace, prepend "first") and adds no "▁" after a special token
    (``<s>[INST]``); ids here follow tokenizer.json as written, which is what SentencePiece
    and Meta's reference code produce.
    """

    def __init__(
        self,
        backend: Any,
        config: Mapping[str, Any],
        chat_templates: dict[str, str],
        model_eos_ids: Sequence[int] = (),
        model_bos_id: int | None = None,
        model_pad_id: int | None = None,
    ) -> None:
        self._tok = backend
        self.special_tokens = {
            name: text
            for name in SPECIAL_TOKEN_NAMES
            if (text := _token_text(config.get(name))) is not None
        }
        # Templates see every named token transformers 5 exposes: the standard ones, any
        # other ``*_token`` key (Gemma 3's image_token) and ``extra_special_tokens``.
        extra = config.get("extra_special_tokens")
        named = {**config, **(extra if isinstance(extra, dict) else {})}
        self.template_tokens = {
            name: text
            for name, value in named.items()
            if name.endswith("_token") and (text := _token_text(value)) is not None
        } | self.special_tokens
        self.chat_templates = chat_templates
        self._add_missing_special_tokens(
            [*_model_specific_tokens(config), *_listed_special_tokens(config)]
        )

        self.bos_token_id = self._named_id("bos_token", model_bos_id)
        self.pad_token_id = self._named_id("pad_token", model_pad_id)
        eos = self._named_id("eos_token", None)
        self.eos_token_ids = set(model_eos_ids) | ({eos} if eos is not None else set())
        specials = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        specials |= {i for n in self.special_tokens if (i := self._named_id(n, None)) is not None}
        self.all_special_ids = sorted(specials)

    def control_token_texts(self) -> list[str]:
        """The special tokens' texts, and those of the added tokens the chat templates
        write: Qwen's ``<tool_call>`` and DeepSeek's ``<think>`` are added tokens not marked
        special, encoded as their ids all the same, so a client typing one forged a tool call
        or a thought (transformers counts them as control tokens the same way)."""
        texts = set(self.special_token_texts())
        sources = "\n".join(self.chat_templates.values())
        for token in self._tok.get_added_tokens_decoder().values():
            if not token.special and token.content.strip() and token.content in sources:
                texts.add(token.content)
        return sorted(texts)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` + ``tokenizer_config.json`` (+ eos ids from
        ``generation_config.json``/``config.json``, chat template from
        ``chat_template.jinja`` when present) from the folder ``path``."""
        from tokenizers import Tokenizer as RustTokenizer

        folder = Path(path)
        if not folder.is_dir():
            raise TokenizerFileNotFoundError(folder, "tokenizer folder does not exist")
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerFileNotFoundError(
                tok_file, "missing; only fast (tokenizer.json) tokenizers are supported"
            )
        config = _with_legacy_special_tokens(
            _read_json(folder / "tokenizer_config.json", required=True),
            _read_json(folder / "special_tokens_map.json", required=False),
        )
        generation = _read_json(folder / "generation_config.json", required=False)
        model = _read_json(folder / "config.json", required=False)

        eos_ids: list[int] = []
        for source in (generation, model):
            eos_ids += _ids(source.get("eos_token_id"))
        bos = _ids(generation.get("bos_token_id")) or _ids(model.get("bos_token_id"))
        pad = _ids(generation.get("pad_token_id")) or _ids(model.get("pad_token_id"))
        tokenizer = cls(
            RustTokenizer.from_file(str(tok_file)),
            config,
            _load_chat_templates(folder, config),
            model_eos_ids=eos_ids,
            model_bos_id=bos[0] if bos else None,
            model_pad_id=pad[0] if pad else None,
        )
        # Read now, not on the first logprobs request: it serialises the whole vocabulary
        # (megabytes for a 128k one), which on a gateway's event loop stalls every stream.
        _ = tokenizer._piece_style
        return tokenizer

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def to_json(self) -> str:
        """The Rust tokenizer as ``tokenizer.json`` text (guided decoding reads it)."""
        return str(self._tok.to_str())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > GIL_FREE_CHARS:
            # encode() holds the GIL for the whole Rust call; encode_batch() lets it go, so
            # a long prompt tokenized on a thread stalls no event loop and no engine thread.
            batch = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)
            return list(batch[0].ids)
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # No clean_up_tokenization_spaces: transformers 5 ignores it for BPE, and it would
        # make streamed text differ from the whole decode.
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def id_to_token(self, token_id: int) -> str | None:
        token = self._tok.id_to_token(token_id)
        return None if token is None else str(token)

    def token_to_id(self, token: str) -> int | None:
        token_id = self._tok.token_to_id(token)
        return None if token_id is None else int(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        added = self._added_texts.get(token_id)
        if added is not None:
            return added.encode()  # added tokens are stored as plain text, never encoded
        piece = self.id_to_token(token_id) if token_id >= 0 else None
        if piece is None:
            return b""
        data = _piece_bytes(piece, self._piece_style)
        if data is None:  # a vocabulary we cannot read byte for byte (WordPiece...)
            data = self.decode([token_id], skip_special_tokens=False).encode()
        return data

    @cached_property
    def _added_texts(self) -> dict[int, str]:
        return {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}

    @cached_property
    def _piece_style(self) -> _PieceStyle:
        # to_str() serialises the whole vocabulary: read once, at load (from_pretrained).
        return _piece_style(json.loads(self._tok.to_str()).get("decoder"))

    def _named_id(self, name: str, fallback: int | None) -> int | None:
        text = self.special_tokens.get(name)
        token_id = self.token_to_id(text) if text is not None else None
        return token_id if token_id is not None else fallback

    def _add_missing_special_tokens(self, listed: Sequence[str] = ()) -> None:
        # transformers adds the special tokens tokenizer.json lacks, named (the standard
        # names, then a model's own: image_token...) then listed (additional_special_tokens,
        # a list of extra_special_tokens): ids must agree, or "<|tool_call|>" is split into
        # pieces and its id decodes to nothing.
        from tokenizers import AddedToken

        # Missing: not among tokenizer.json's added tokens, as transformers decides. A token
        # in the vocabulary only (an odd export) is split into pieces by the model until it
        # is registered; registering it keeps its id.
        wanted = dict.fromkeys([*self.special_tokens.values(), *listed])
        added = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        missing = [t for t in wanted if t not in added]
        if missing:
            self._tok.add_special_tokens(
                [AddedToken(t, special=True, normalized=False) for t in missing]
            )


class ByteTokenizer(BaseTokenizer):
    """UTF-8 bytes as tokens 0..255 plus BOS/EOS/PAD, for ``dummy:*`` models.

    Ids past the specials (a random model's vocabulary is larger) decode to nothing.
    """

    BOS, EOS, PAD = 256, 257, 258
    _SPECIALS: ClassVar[dict[int, str]] = {BOS: "<|bos|>", EOS: "<|eos|>", PAD: "<|pad|>"}
    CHAT_TEMPLATE = (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )

    def __init__(self) -> None:
        self.bos_token_id = self.BOS
        self.eos_token_ids = {self.EOS}
        self.pad_token_id = self.PAD
        self.all_special_ids = sorted(self._SPECIALS)
        self.special_tokens = {
            "bos_token": self._SPECIALS[self.BOS],
            "eos_token": self._SPECIALS[self.EOS],
            "pad_token": self._SPECIALS[self.PAD],
        }
        self.template_tokens = self.special_tokens
        self.chat_templates = {"default": self.CHAT_TEMPLATE}

    @property
    def vocab_size(self) -> int:
        return 256 + len(self._SPECIALS)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for i in ids:
            if 0 <= i < 256:
                out.append(i)
            elif i in self._SPECIALS and not skip_special_tokens:
                out += self._SPECIALS[i].encode()
        return out.decode("utf-8", errors="replace")

    def id_to_token(self, token_id: int) -> str | None:
        if 0 <= token_id < 256:
            return f"<0x{token_id:02X}>"
        return self._SPECIALS.get(token_id)

    def token_to_id(self, token: str) -> int | None:
        return next((i for i, t in self._SPECIALS.items() if t == token), None)

    def token_bytes(self, token_id: int) -> bytes:
        if 0 <= token_id < 256:
            return bytes((token_id,))
        special = self._SPECIALS.get(token_id)
        return b"" if special is None else special.encode()


def _with_legacy_special_tokens(
    config: dict[str, Any], legacy: Mapping[str, Any]
) -> dict[str, Any]:
    """tokenizer_config with ``special_tokens_map.json`` merged in, as transformers does
    for a folder whose config has no ``added_tokens_decoder`` (one saved before it
    existed): the map's tokens win, its ``extra_special_tokens`` list adds to the config's.
    An older repository's config may name no ``bos_token`` at all: its chat template then
    rendered without one."""
    if "added_tokens_decoder" in config or not legacy:
        return config
    merged = dict(config)
    for key, value in legacy.items():
        if key == "extra_special_tokens" and isinstance(value, list):
            existing = merged.get(key)
            merged[key] = [*(existing if isinstance(existing, list) else []), *value]
        elif isinstance(value, dict) and key != "extra_special_tokens":
            # transformers reads the map's objects as AddedTokens (see _model_specific_tokens).
            merged[key] = {**value, "__type": "AddedToken"}
        else:
            merged[key] = value
    return merged


def _model_specific_tokens(config: Mapping[str, Any]) -> list[str]:
    """tokenizer_config's model-specific named tokens, in the order transformers 5
    registers them: any ``*_token`` key besides the standard names (Gemma 3's
    ``image_token``) holding an AddedToken object, then those holding a string, then an
    ``extra_special_tokens`` map's. A plain object (no ``__type``) names no token there."""
    custom = [
        value
        for key, value in config.items()
        if key.endswith("_token") and key not in SPECIAL_TOKEN_NAMES
    ]
    objects = [
        t
        for v in custom
        if isinstance(v, dict) and v.get("__type") == "AddedToken" and (t := _token_text(v))
    ]
    strings = [v for v in custom if isinstance(v, str)]
    extra = config.get("extra_special_tokens")
    mapped = [t for v in extra.values() if (t := _token_text(v))] if isinstance(extra, dict) else []
    return [*objects, *strings, *mapped]


def _listed_special_tokens(config: Mapping[str, Any]) -> list[str]:
    """tokenizer_config's special tokens by list: ``additional_special_tokens`` and an
    ``extra_special_tokens`` given as a list (a map names them: _model_specific_tokens)."""
    listed: list[str] = []
    for key in ("additional_special_tokens", "extra_special_tokens"):
        value = config.get(key)
        if isinstance(value, list):
            listed += [t for v in value if (t := _token_text(v)) is not None]
    return listed


def _check_objects(value: object, name: str) -> None:
    """``value`` (``tools``, ``documents``) is None or a list of objects, as templates
    iterate them; else a :class:`ChatTemplateError` naming it."""
    if value is not None and (
        isinstance(value, str | bytes | Mapping)
        or not isinstance(value, Sequence)
        or not all(isinstance(item, Mapping) for item in value)
    ):
        raise ChatTemplateError(f"{name} must be a list of objects", param=name)


# ---- vocabulary entries as bytes ------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> character table for byte-level BPE vocabularies: printable bytes
    stand for themselves, the others (controls, space, 127-160, 173) for 256, 257, ..."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in table]
    table.update({b: chr(256 + n) for n, b in enumerate(others)})
    return table


_BYTE_OF_CHAR = {c: b for b, c in _bytes_to_unicode().items()}
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True)
class _PieceStyle:
    """How a vocabulary spells bytes, read off tokenizer.json's decoder."""

    byte_level: bool = False  # GPT-2's byte alphabet (GPT-2, Llama 3, Qwen)
    byte_fallback: bool = False  # <0xNN> pieces for bytes (Llama 2, Mistral, Gemma)
    space: str | None = None  # SentencePiece's word-boundary mark, usually "▁"


def _piece_style(decoder: object) -> _PieceStyle:
    parts = _decoder_parts(decoder)
    space = None
    for part in parts:
        if part.get("type") == "Metaspace":
            space = str(part.get("replacement", "\u2581"))
        elif part.get("type") == "Replace" and part.get("content") == " ":
            pattern = part.get("pattern")
            if isinstance(pattern, dict) and isinstance(pattern.get("String"), str):
                space = pattern["String"]
    return _PieceStyle(
        byte_level=any(p.get("type") == "ByteLevel" for p in parts),
        byte_fallback=any(p.get("type") == "ByteFallback" for p in parts),
        space=space or None,
    )


def _decoder_parts(decoder: object) -> list[dict[str, Any]]:
    """A decoder and, for a ``Sequence``, the decoders in it (nested ones too)."""
    if not isinstance(decoder, dict):
        return []
    if decoder.get("type") == "Sequence":
        return [p for d in decoder.get("decoders") or [] for p in _decoder_parts(d)]
    return [decoder]


def _piece_bytes(piece: str, style: _PieceStyle) -> bytes | None:
    """The bytes of vocabulary entry ``piece``, or None when ``style`` cannot tell."""
    if style.byte_level:
        if all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        return None
    if style.byte_fallback and (m := _BYTE_PIECE.fullmatch(piece)):
        return bytes((int(m.group(1), 16),))
    if style.space is not None:
        return piece.replace(style.space, " ").encode()
    return None


def load_tokenizer(path_or_spec: str | Path) -> BaseTokenizer:
    """A ``ByteTokenizer`` for ``dummy:*`` model specs, else the folder's ``Tokenizer``."""
    if isinstance(path_or_spec, str) and path_or_spec.startswith("dummy:"):
        return ByteTokenizer()
    return Tokenizer.from_pretrained(path_or_spec)


# ---- loading helpers -------------------------------------------------------------------


def _read_json(path: Path, *, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise TokenizerFileNotFoundError(path, "missing")
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _ids(value: object) -> list[int]:
    """An ``eos_token_id``-style field (int, list of ints or null) as a list."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _token_text(value: object) -> str | None:
    """A special token as written in tokenizer_config: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _load_chat_templates(folder: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Templates by name; ``chat_template.jinja`` and ``additional_chat_templates/``
    override tokenizer_config's ``chat_template``, as in transformers 5."""
    templates: dict[str, str] = {}
    raw = config.get("chat_template")
    if isinstance(raw, str):
        templates["default"] = raw
    elif isinstance(raw, list):
        templates.update({t["name"]: t["template"] for t in raw if isinstance(t, dict)})
    from_files: dict[str, str] = {}
    where: dict[str, str] = {}
    if (folder / "chat_template.jinja").is_file():
        from_files["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        where["default"] = str(folder / "chat_template.jinja")
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        for f in sorted(extra.glob("*.jinja")):
            from_files[f.stem] = f.read_text(encoding="utf-8")
            where[f.stem] = str(f)
    chosen = from_files or templates
    # Compiled now: a broken template failed every chat request later, each a 400 that
    # blamed the client; at load the error names the file while completions never start.
    for name, source in chosen.items():
        origin = where.get(name, f"{folder / 'tokenizer_config.json'} chat_template {name!r}")
        _compiled(source, origin)
    return chosen


def _tag_final_message(chat: list[dict[str, Any]], field: object, source: str) -> str:
    """Mark the end of the final message's ``field`` (``content`` for True) with
    ``_CONTINUE_TAG``, as transformers' ``continue_final_message`` does; the text tagged."""
    if not isinstance(field, bool | str):
        raise ChatTemplateError(
            "continue_final_message must be a boolean or the name of a message field",
            param="continue_final_message",
        )
    name = field if isinstance(field, str) else "content"
    last = chat[-1]
    value = last.get(name)
    if value is None:
        raise ChatTemplateError(f"continue_final_message: the final message has no {name!r}")
    names = [name]
    if name in _REASONING_FIELDS:  # copied under every name: tag the copies the template reads
        names = [n for n in _REASONING_FIELDS if last.get(n) == value]
    if not any(n in source for n in names):
        raise ChatTemplateError(
            f"continue_final_message: the chat template does not read {name!r}",
            param="continue_final_message",
        )
    if isinstance(value, list):  # content parts: the last one with text
        parts = [dict(p) if isinstance(p, Mapping) else p for p in value]
        for part in reversed(parts):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                text: str = part["text"]
                part["text"] = text + _CONTINUE_TAG
                last[name] = parts
                return text
        raise ChatTemplateError("continue_final_message: the final message has no text")
    if not isinstance(value, str):
        raise ChatTemplateError(f"continue_final_message: the final message's {name!r} is no text")
    for n in names:
        last[n] = value + _CONTINUE_TAG
    return value


def _cut_after_final_message(rendered: str, final: str) -> str:
    """The rendered chat up to the end of the final message, found by its tag."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise ChatTemplateError(
            "continue_final_message: the chat template does not print the final message "
            "as sent, so the prompt cannot end inside it"
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message: so is its end here


def _normalize_message(message: Mapping[str, Any]) -> dict[str, Any]:
    # As transformers: drop None-valued keys (OpenAI clients send content=None with
    # tool calls) and expose reasoning under every name templates read.
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"a chat message must be a mapping, got {type(message).__name__}")
    out = {k: v for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in _REASONING_FIELDS if k in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


# ---- the jinja environment, as transformers builds it -----------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """Accept ``{% generation %}...{% endgeneration %}`` (assistant masks) as a no-op."""

    tags = {"generation"}  # noqa: RUF012 - jinja's Extension API declares it this way

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore attributes, closing a sandbox escape."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} not allowed")


class _TemplateDict:
    """``dict(...)`` for templates without handing them the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# The steps the render on this thread (or task) may still take; None outside a render.
_RENDER_BUDGET: ContextVar[list[int] | None] = ContextVar("chat_template_budget", default=None)


class _RenderBudgetSpent(Exception):
    """Raised inside a render past its step budget; no template can catch it."""


def _spend(steps: int) -> None:
    budget = _RENDER_BUDGET.get()
    if budget is not None:
        budget[0] -= steps
        if budget[0] < 0:
            raise _RenderBudgetSpent


class _CountedRange:
    """``range()`` for templates: the sandbox's bounded range, each element it yields one
    step of the render's budget (counted as yielded: a scan that stops early costs little)."""

    def __init__(self, *args: int) -> None:
        self._range = safe_range(*args)

    @property
    def start(self) -> int:
        return self._range.start

    @property
    def stop(self) -> int:
        return self._range.stop

    @property
    def step(self) -> int:
        return self._range.step

    def __iter__(self) -> Iterator[int]:
        for i in self._range:
            _spend(1)
            yield i

    def __reversed__(self) -> Iterator[int]:
        for i in reversed(self._range):
            _spend(1)
            yield i

    def __len__(self) -> int:
        return len(self._range)

    def __contains__(self, value: object) -> bool:
        return value in self._range

    def __getitem__(self, index: int | slice) -> Any:
        item = self._range[index]
        if isinstance(item, range):
            return _CountedRange(item.start, item.stop, item.step)
        return item

    def __eq__(self, other: object) -> bool:
        inner = other._range if isinstance(other, _CountedRange) else other
        return self._range == inner

    def __hash__(self) -> int:
        return hash(self._range)

    def __repr__(self) -> str:
        return repr(self._range)


class _BudgetedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, counting each attribute or item read and each call against the render's
    step budget: whatever a template loops over, its loop bodies do these."""

    def getitem(self, obj: Any, argument: Any) -> Any:
        _spend(1)
        return super().getitem(obj, argument)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _spend(1)
        return super().getattr(obj, attribute)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _spend(1)
        return super().call(__context, __obj, *args, **kwargs)


def _compiled(source: str, origin: str) -> jinja2.Template:
    """:func:`_compile`, a template that does not compile a :class:`BrokenChatTemplateError`
    naming ``origin`` (its file) and the line."""
    try:
        return _compile(source)
    except jinja2.TemplateSyntaxError as e:
        raise BrokenChatTemplateError(
            f"{origin} does not compile: line {e.lineno}: {e.message}"
        ) from e
    except (jinja2.TemplateError, RecursionError) as e:
        raise BrokenChatTemplateError(f"{origin} does not compile: {e}") from e


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    """Compile a chat template in a sandbox: templates come from model repos, untrusted."""
    env = _BudgetedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    env.globals["range"] = _CountedRange
    return env.from_string(source)
