"""common.tokenizer against transformers' AutoTokenizer on tiny folders built here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from common.tokenizer import (
    BaseTokenizer,
    ByteTokenizer,
    ChatTemplateError,
    Tokenizer,
    TokenizerFileNotFoundError,
    load_tokenizer,
)

BOS, EOS, EOT, PAD = "<|begin|>", "<|end|>", "<|eot|>", "<|pad|>"
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello there, how are you today?",
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "日本語のテキストと中文文本 and emoji 🙂🚀 mixed in.",
    "def f(x):\n    return x * 2  # tabs\tand  spaces",
] * 4

CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system = none %}
    {%- set loop_messages = messages %}
{%- endif %}
{% if system %}<|system|>
{{ system | trim }}<|eot|>
{% endif %}
{% set ns = namespace(turns=0) %}
{% for message in loop_messages %}
    {% if message['role'] not in ['user', 'assistant', 'tool'] %}
        {{ raise_exception('unknown role: ' + message['role']) }}
    {% endif %}
    {% set ns.turns = ns.turns + 1 %}
    <|{{ message['role'] }}|>
{% if message.tool_calls is defined %}{{ message.tool_calls | tojson }}{% endif %}
{% if message.content is defined %}{{ message['content'] | trim }}{% endif %}<|eot|>
{% endfor %}
{% if tools %}<|tools|>{{ tools | tojson(indent=2) }}<|eot|>
{% endif %}
{% if add_generation_prompt %}<|assistant|>
{% endif %}"""

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "  You are terse.  "},
        {"role": "user", "content": 'Say <b>"hé"</b> & 🙂'},
        {"role": "assistant", "content": "hé 🙂"},
        {"role": "user", "content": "日本語?"},
    ],
    [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"name": "get_weather", "arguments": {"city": "Zürich"}}],
        },
        {"role": "tool", "content": "12°C"},
    ],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"city": "str"}}}]
TEXTS = [
    "Hello world!",
    " leading space and trailing ",
    "日本語のテキスト 🙂🚀 mixed",
    f"{BOS}special{EOT} tokens in text{EOS}",
    "",
    "def f(x):\n\treturn x",
]


def train_byte_bpe(specials: list[str] = [BOS, EOS, EOT, PAD]) -> RustTokenizer:  # noqa: B006
    """A byte-level BPE (GPT-2/Llama-3 style) small enough to train in milliseconds."""
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def write_hf_folder(
    folder: Path,
    *,
    bos_post_processor: bool = True,
    config: dict[str, Any] | None = None,
    generation_eos: object = "default",
) -> Path:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = train_byte_bpe()
    if bos_post_processor:
        bos_id = tok.token_to_id(BOS)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS}:0 $A:0",
            pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
            special_tokens=[(BOS, bos_id)],
        )
    tok.save(str(folder / "tokenizer.json"))
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "chat_template": CHAT_TEMPLATE,
    }
    cfg.update(config or {})
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    if generation_eos == "default":
        generation_eos = [tok.token_to_id(EOS), tok.token_to_id(EOT)]
    if generation_eos is not None:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return folder


def hf_auto_tokenizer(folder: Path) -> Any:
    import transformers  # the reference: a dev dependency, never skipped

    return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


# Ways a folder can ask for BOS/EOS. transformers 5 ignores tokenizer_config's flags when
# tokenizer.json exists: its post-processor alone decides (value: BOS expected).
BOS_EOS_LAYOUTS: dict[str, tuple[dict[str, Any], bool]] = {
    "post_processor_only": (dict(bos_post_processor=True, config={}), True),
    "flag_without_post_processor": (
        dict(bos_post_processor=False, config={"add_bos_token": True}),
        False,
    ),
    "flag_false_with_post_processor": (
        dict(bos_post_processor=True, config={"add_bos_token": False}),
        True,
    ),
    "no_post_processor_no_flags": (dict(bos_post_processor=False, config={}), False),
}


@pytest.mark.parametrize("layout", sorted(BOS_EOS_LAYOUTS))
def test_ids_and_decode_equal_transformers(tmp_path: Path, layout: str) -> None:
    kwargs, adds_bos = BOS_EOS_LAYOUTS[layout]
    folder = write_hf_folder(tmp_path, **kwargs)
    ours, ref = Tokenizer.from_pretrained(folder), hf_auto_tokenizer(folder)
    assert (ours.encode("Hi")[0] == ours.bos_token_id) is adds_bos
    for text in TEXTS:
        for add in (True, False):
            ids = ours.encode(text, add_special_tokens=add)
            assert ids == ref.encode(text, add_special_tokens=add), (text, add)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(
                    ids, skip_special_tokens=skip
                )
    assert ours.bos_token_id == ref.bos_token_id
    assert ours.pad_token_id == ref.pad_token_id
    assert ours.vocab_size == len(ref)
    # Ours also lists special added tokens transformers leaves unnamed (<|eot|>): exactly
    # the ids that skip_special_tokens drops.
    assert set(ref.all_special_ids) <= set(ours.all_special_ids)
    assert all(ours.decode([i]) == "" for i in ours.all_special_ids)
    assert ours.token_to_id(EOT) in ours.all_special_ids
    assert ours.id_to_token(ours.bos_token_id) == BOS  # type: ignore[arg-type]
    assert ours.id_to_token(10**6) is None


def test_special_token_missing_from_vocab_gets_the_same_id_as_transformers(
    tmp_path: Path,
) -> None:
    folder = write_hf_folder(tmp_path, config={"pad_token": "<|brand_new_pad|>"})
    ours, ref = Tokenizer.from_pretrained(folder), hf_auto_tokenizer(folder)
    assert ours.pad_token_id == ref.pad_token_id is not None
    assert ours.encode("x<|brand_new_pad|>y") == ref.encode("x<|brand_new_pad|>y")


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_chat_template_renders_like_transformers(
    tmp_path: Path, conversation: int, add_generation_prompt: bool
) -> None:
    folder = write_hf_folder(tmp_path)
    ours, ref = Tokenizer.from_pretrained(folder), hf_auto_tokenizer(folder)
    messages = CONVERSATIONS[conversation]
    for tools in (None, TOOLS):
        expected = ref.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, tools=tools
        )
        got = ours.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tools=tools
        )
        assert got == expected


def test_chat_template_file_overrides_tokenizer_config(tmp_path: Path) -> None:
    folder = write_hf_folder(tmp_path)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}]{% generation %}{{ m.content }}"
        "{% endgeneration %}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    ours, ref = Tokenizer.from_pretrained(folder), hf_auto_tokenizer(folder)
    messages = CONVERSATIONS[1]
    got = ours.apply_chat_template(messages)
    assert got == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert got.startswith("[system]")


def test_template_raise_exception_is_a_chat_template_error(tmp_path: Path) -> None:
    ours = Tokenizer.from_pretrained(write_hf_folder(tmp_path))
    with pytest.raises(ChatTemplateError, match="unknown role: wizard"):
        ours.apply_chat_template([{"role": "wizard", "content": "hi"}])
    with pytest.raises(ChatTemplateError, match="empty"):
        ours.apply_chat_template([])


def test_template_cannot_escape_the_sandbox(tmp_path: Path) -> None:
    folder = write_hf_folder(
        tmp_path, config={"chat_template": "{{ messages.__class__.__mro__[1].__subclasses__() }}"}
    )
    with pytest.raises(ChatTemplateError):
        Tokenizer.from_pretrained(folder).apply_chat_template([{"role": "user", "content": "x"}])


def test_eos_ids_join_generation_config_and_tokenizer_config(tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(write_hf_folder(tmp_path / "list"))
    assert tok.eos_token_ids == {tok.token_to_id(EOS), tok.token_to_id(EOT)}
    assert tok.eos_token_id == tok.token_to_id(EOS)

    eot_id = tok.token_to_id(EOT)
    single = Tokenizer.from_pretrained(write_hf_folder(tmp_path / "int", generation_eos=eot_id))
    assert single.eos_token_ids == {eot_id, tok.token_to_id(EOS)}

    no_generation = write_hf_folder(tmp_path / "none", generation_eos=None)
    assert Tokenizer.from_pretrained(no_generation).eos_token_ids == {tok.token_to_id(EOS)}


@pytest.mark.parametrize("missing", ["tokenizer.json", "tokenizer_config.json"])
def test_missing_file_error_names_the_file(tmp_path: Path, missing: str) -> None:
    folder = write_hf_folder(tmp_path)
    (folder / missing).unlink()
    with pytest.raises(FileNotFoundError, match=missing) as info:
        Tokenizer.from_pretrained(folder)
    assert isinstance(info.value, TokenizerFileNotFoundError)
    assert info.value.path == folder / missing


def test_missing_folder_is_a_file_not_found_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerFileNotFoundError, match="does-not-exist"):
        load_tokenizer(tmp_path / "does-not-exist")


def test_folder_without_chat_template_errors_only_when_chat_is_used(tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(write_hf_folder(tmp_path, config={"chat_template": None}))
    assert tok.encode("plain prompts still work")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_byte_tokenizer_round_trips_utf8_and_renders_chat() -> None:
    tok = load_tokenizer("dummy:llama-1b")
    assert isinstance(tok, ByteTokenizer)
    text = "héllo 🙂 日本"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and len(ids) == 1 + len(text.encode())
    assert tok.decode(ids) == text
    assert tok.decode([*ids, *sorted(tok.eos_token_ids)], skip_special_tokens=False).endswith(
        "<|eos|>"
    )
    assert tok.decode(ids[:-1]).endswith("\ufffd")  # cut inside a character
    assert tok.decode([70000, 104, 105]) == "hi"  # ids past the vocabulary decode to nothing
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|user|>\nhi\n<|assistant|>\n"
    assert max(tok.all_special_ids) < tok.vocab_size


def test_a_long_text_encodes_the_same_without_holding_the_gil() -> None:
    """Over GIL_FREE_CHARS, encode goes through encode_batch, which releases the GIL (a
    prompt tokenized on a thread must not stall the event loop or the engine thread)."""
    from common.models import demo_model_path
    from common.tokenizer import GIL_FREE_CHARS, load_tokenizer

    tok = load_tokenizer(demo_model_path())
    text = "def f(x):\n    return x + 1\n" * (GIL_FREE_CHARS // 10)
    rust = RustTokenizer.from_file(str(demo_model_path() / "tokenizer.json"))
    assert tok.encode(text) == rust.encode(text).ids
    assert (
        tok.encode(text, add_special_tokens=False)
        == rust.encode(text, add_special_tokens=False).ids
    )
    # Through encode_batch (it releases the GIL; encode holds it for the whole Rust call).
    calls: list[str] = []

    class Spy:
        def __getattr__(self, name: str) -> Any:
            calls.append(name)
            return getattr(rust, name)

    tok._tok = Spy()  # type: ignore[assignment]
    tok.encode(text)
    tok.encode("short")
    assert calls == ["encode_batch", "encode"]


def sentencepiece_byte_fallback() -> Tokenizer:
    """A Llama-2-style vocabulary: "▁" marks spaces, characters outside it are <0xNN> bytes."""
    vocab = {"<unk>": 0, BOS: 1, EOS: 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ("▁", "o", "k", "▁o", "▁ok"):
        vocab[piece] = len(vocab)
    rust = RustTokenizer(
        models.BPE(vocab, [("▁", "o"), ("▁o", "k")], unk_token="<unk>", byte_fallback=True)
    )
    rust.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    rust.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return Tokenizer(rust, {"bos_token": BOS, "eos_token": EOS}, {})


@pytest.mark.parametrize("kind", ["byte", "byte_level_bpe", "sentencepiece_byte_fallback"])
def test_token_bytes_join_into_the_text_where_characters_span_tokens(
    tmp_path: Path, kind: str
) -> None:
    """Logprobs' ``bytes``: each piece of a split character gives its own bytes (decode of
    one piece gives U+FFFD), and the pieces join into the text."""
    text = "é🙂 ok"
    expected = text.encode()
    tok: BaseTokenizer
    if kind == "byte":
        tok = ByteTokenizer()
    elif kind == "byte_level_bpe":
        tok = Tokenizer.from_pretrained(write_hf_folder(tmp_path))
    else:
        tok = sentencepiece_byte_fallback()
        expected = b" " + expected  # the word boundary SentencePiece prepends is a space
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.token_bytes(i) for i in ids]
    assert b"".join(pieces) == expected
    assert "\ufffd".encode() not in pieces
    assert any(tok.decode([i]) == "\ufffd" for i in ids)  # what logprobs used to show
    eos = tok.token_to_id(tok.special_tokens["eos_token"])
    assert eos is not None and tok.token_bytes(eos) == tok.special_tokens["eos_token"].encode()
    assert tok.token_bytes(10**6) == b""


def test_byte_level_vocabulary_maps_back_through_gpt2s_byte_table() -> None:
    tok = Tokenizer(train_byte_bpe(), {"eos_token": EOS}, {})
    # The 256 one-character entries are the 256 bytes, one each.
    singles = [tok.token_to_id(c) for c in pre_tokenizers.ByteLevel.alphabet()]
    assert sorted(tok.token_bytes(i) for i in singles if i is not None) == [
        bytes((b,)) for b in range(256)
    ]
    assert [tok.token_bytes(tok.token_to_id(c) or 0) for c in "!ĠĊÃ"] == [
        b"!",
        b" ",
        b"\n",
        b"\xc3",
    ]
    # Longer entries: their text is what decoding them alone gives.
    specials = set(tok.all_special_ids)
    for i in range(tok.vocab_size):
        if i not in specials:
            assert tok.token_bytes(i).decode("utf-8", errors="replace") == tok.decode([i])


def test_documents_reach_a_rag_template_as_transformers_passes_them(tmp_path: Path) -> None:
    """They collided with the documents=None we passed: a TypeError, a 400 on messages."""
    folder = write_hf_folder(tmp_path)
    (folder / "chat_template.jinja").write_text(
        "{% for d in documents or [] %}<doc {{ d.title }}>{{ d.text }}</doc>{% endfor %}"
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    )
    ours, ref = Tokenizer.from_pretrained(folder), hf_auto_tokenizer(folder)
    messages = [{"role": "user", "content": "what is in it?"}]
    documents = [{"title": "a", "text": "alpha"}, {"title": "b", "text": "beta"}]
    got = ours.apply_chat_template(messages, documents=documents)
    assert got == ref.apply_chat_template(messages, documents=documents, tokenize=False)
    with pytest.raises(ChatTemplateError, match="documents"):
        ours.apply_chat_template(messages, documents="not a list")


def test_a_template_failing_on_client_data_is_a_chat_template_error(tmp_path: Path) -> None:
    """A ValueError inside the template (a format spec meeting client text) was a 500."""
    body = '{{ "{:d}".format(messages[0].content) }}'
    folder = write_hf_folder(tmp_path, config={"chat_template": body})
    with pytest.raises(ChatTemplateError, match="format code"):
        Tokenizer.from_pretrained(folder).apply_chat_template([{"role": "user", "content": "x"}])


GEMMA3_LIKE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}{% if item['type'] == 'text' %}"
    "{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def test_content_parts_reach_a_template_that_loops_over_them_as_transformers_passes_them(
    tmp_path: Path,
) -> None:
    """Joined with newlines first, Gemma 3's parts rendered 'Describe\\nbriefly.' where
    transformers renders 'Describebriefly.': other tokens than the reference's."""
    from gateway.openai_api import ChatMessage

    folder = write_hf_folder(tmp_path)
    (folder / "chat_template.jinja").write_text(GEMMA3_LIKE)
    ours, ref = Tokenizer.from_pretrained(folder), hf_auto_tokenizer(folder)
    raw = [{"role": "user", "content": [{"type": "text", "text": "Describe"},
                                        {"type": "text", "text": "briefly."}]}]  # fmt: skip
    assert ours.content_parts
    messages = [ChatMessage.model_validate(m).for_template(ours.content_parts) for m in raw]
    expected = ref.apply_chat_template(raw, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == expected
    assert "Describebriefly." in expected
    plain = Tokenizer.from_pretrained(write_hf_folder(tmp_path / "plain"))
    assert not plain.content_parts  # a template that prints content as a string: joined


def test_the_control_token_pattern_finds_every_special_tokens_text(tmp_path: Path) -> None:
    ours = Tokenizer.from_pretrained(write_hf_folder(tmp_path))
    pattern = ours.control_token_pattern()
    assert pattern is not None
    for token_id in ours.all_special_ids:
        text = ours.id_to_token(token_id)
        assert text and pattern.search(f"before {text} after").group() == text
    assert pattern.search("plain text with <| and |> but no token") is None


def test_templates_see_every_named_token_as_transformers_exposes_them(tmp_path: Path) -> None:
    """transformers 5 hands a template every ``*_token`` key of tokenizer_config and the
    ``extra_special_tokens`` map (Gemma 3's image_token, boi_token); they rendered as ''."""
    body = "{{ image_token }}|{{ boi_token }}|{% for m in messages %}{{ m.content }}{% endfor %}"
    folder = write_hf_folder(
        tmp_path,
        config={
            "chat_template": body,
            "image_token": EOT,
            "extra_special_tokens": {"boi_token": EOS},
        },
    )
    ours, ref = Tokenizer.from_pretrained(folder), hf_auto_tokenizer(folder)
    messages = [{"role": "user", "content": "hi"}]
    got = ours.apply_chat_template(messages, add_generation_prompt=False)
    assert got == ref.apply_chat_template(messages, tokenize=False)
    assert got.startswith(f"{EOT}|{EOS}|")


QWEN_LIKE = (
    "{% for message in messages %}{% if message['role'] in ['system', 'user', 'assistant'] %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_developer_message_reaches_a_template_that_knows_only_system_as_system(
    tmp_path: Path,
) -> None:
    """OpenAI's developer role is its system role; Qwen's templates print only the roles
    they know, so the developer's instructions vanished from the prompt (a 200 all the
    same). A template that names the role (gpt-oss) gets it as sent."""
    from gateway.openai_api import ChatMessage

    folder = write_hf_folder(tmp_path)
    (folder / "chat_template.jinja").write_text(QWEN_LIKE)
    ours = Tokenizer.from_pretrained(folder)
    raw = [{"role": "developer", "content": "Answer in French."},
           {"role": "user", "content": "Hello"}]  # fmt: skip
    assert not ours.knows_developer_role
    messages = [
        ChatMessage.model_validate(m).for_template(developer=ours.knows_developer_role) for m in raw
    ]
    rendered = ours.apply_chat_template(messages)
    assert "<|im_start|>system\nAnswer in French.<|im_end|>" in rendered
    named = write_hf_folder(tmp_path / "named")
    (named / "chat_template.jinja").write_text(QWEN_LIKE.replace("'system', ", "'developer', "))
    knows = Tokenizer.from_pretrained(named)
    assert knows.knows_developer_role
    kept = ChatMessage.model_validate(raw[0]).for_template(developer=knows.knows_developer_role)
    assert kept["role"] == "developer"


@pytest.mark.parametrize(
    "extra",
    [
        {"additional_special_tokens": ["<|tool_call|>"]},
        {"extra_special_tokens": ["<|x|>"]},
        {"extra_special_tokens": {"tool_token": "<|x|>"}},
    ],
)
def test_special_tokens_listed_in_the_config_but_not_in_tokenizer_json_are_added(
    tmp_path: Path, extra: dict[str, Any]
) -> None:
    """transformers adds additional/extra special tokens that tokenizer.json lacks: we
    split "<|tool_call|>" into pieces, and the id transformers gives it decoded to nothing."""
    folder = write_hf_folder(tmp_path, config=extra)
    ours, ref = Tokenizer.from_pretrained(folder), hf_auto_tokenizer(folder)
    text = "hi<|tool_call|>x<|x|>"
    assert ours.encode(text) == ref.encode(text)
    ids = ref.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids)
    assert ours.vocab_size == len(ref)


def test_special_tokens_map_fills_in_for_a_config_saved_before_added_tokens_decoder(
    tmp_path: Path,
) -> None:
    """An older repository names its BOS only in special_tokens_map.json: transformers
    reads it there (for a config without added_tokens_decoder), and the chat template
    renders it; ours rendered no BOS."""
    folder = write_hf_folder(tmp_path / "tok", config={"bos_token": None})
    (folder / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": {"content": BOS, "lstrip": False, "rstrip": False, "special": True}}
    ))  # fmt: skip
    ours, theirs = load_tokenizer(str(folder)), hf_auto_tokenizer(folder)
    assert ours.special_tokens["bos_token"] == theirs.bos_token == BOS
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True) == (
        theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    )
    # A config with added_tokens_decoder is complete: the map is not read (as transformers).
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"] = {}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert "bos_token" not in load_tokenizer(str(folder)).special_tokens


def test_added_tokens_the_chat_template_writes_count_as_control_tokens(tmp_path: Path) -> None:
    """Qwen's <tool_call> (DeepSeek's <think>) is an added token not marked special: left
    out of the pattern, a user typing it forged a tool call the template's own syntax
    reads, under gateway.reject_control_tokens."""
    from tokenizers import AddedToken

    folder = write_hf_folder(tmp_path, config={
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}<tool_call>",
    })  # fmt: skip
    rust = RustTokenizer.from_file(str(folder / "tokenizer.json"))
    rust.add_tokens([AddedToken("<tool_call>", special=False), AddedToken("<unused>")])
    rust.save(str(folder / "tokenizer.json"))
    ours = Tokenizer.from_pretrained(folder)
    pattern = ours.control_token_pattern()
    assert pattern is not None
    assert pattern.search("a <tool_call>{} b").group() == "<tool_call>"
    assert pattern.search("an <unused> one the template never writes") is None
    # The model's own output, sent back in its assistant turns: only special tokens there.
    special = ours.control_token_pattern(template_tokens=False)
    assert special is not None and special.search("a <tool_call>{} b") is None


def test_a_special_token_in_the_vocabulary_but_not_registered_is_one_id_as_in_transformers(
    tmp_path: Path,
) -> None:
    """An export whose tokenizer.json has the EOS text in its vocabulary but not among its
    added tokens: transformers registers every named special token, so a template's EOS
    after each turn is one id there; it was split into pieces here."""
    folder = write_hf_folder(tmp_path)
    doc = json.loads((folder / "tokenizer.json").read_text())
    doc["added_tokens"] = [t for t in doc["added_tokens"] if t["content"] != EOS]
    assert EOS in doc["model"]["vocab"]
    (folder / "tokenizer.json").write_text(json.dumps(doc))
    ours, ref = Tokenizer.from_pretrained(folder), hf_auto_tokenizer(folder)
    text = f"a turn{EOS}next"
    assert ours.encode(text) == ref.encode(text)
    assert ref.convert_tokens_to_ids(EOS) in ref.encode(text)
    ids = ref.encode(text)
    assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


GEMMA4_LIKE_SCAN = (
    "{% for message in messages %}{% set prev = namespace(role=none, found=false) %}"
    "{% for j in range(loop.index0 - 1, -1, -1) %}{% if not prev.found %}"
    "{% if messages[j]['role'] != 'tool' %}{% set prev.role = messages[j]['role'] %}"
    "{% set prev.found = true %}{% endif %}{% endif %}{% endfor %}"
    "{% if not (message['role'] == 'assistant' and prev.role == 'assistant') %}"
    "<|{{ message['role'] }}|>{% endif %}{{ message['content'] }}<|eot|>{% endfor %}"
)


def _long_chat(n: int) -> list[dict[str, Any]]:
    return [{"role": ("user", "assistant")[i % 2], "content": f"turn {i}"} for i in range(n)]


def test_a_template_doing_quadratic_work_is_refused_within_the_step_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 4 looks back over every earlier message for each one: 4,096 messages took
    27 s of CPU on a thread nothing could stop. A render now stops past its step budget
    (lowered here, so the test stays fast) with a ChatTemplateError (a 400 on messages)."""
    import time

    import common.tokenizer as tokenizer_module

    folder = write_hf_folder(tmp_path, config={"chat_template": GEMMA4_LIKE_SCAN})
    ours = Tokenizer.from_pretrained(folder)
    monkeypatch.setattr(tokenizer_module, "RENDER_STEP_BUDGET", 100_000)
    started = time.monotonic()
    with pytest.raises(ChatTemplateError, match="too costly") as info:
        ours.apply_chat_template(_long_chat(2000))
    assert info.value.param == "messages"
    assert time.monotonic() - started < 5
    # A short chat renders, as transformers renders it.
    chat = _long_chat(5)
    expected = hf_auto_tokenizer(folder).apply_chat_template(chat, tokenize=False)
    assert ours.apply_chat_template(chat, add_generation_prompt=False) == expected


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, GEMMA3_LIKE, QWEN_LIKE])
def test_the_longest_chat_of_a_linear_template_is_far_within_the_step_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, template: str
) -> None:
    """4,096 messages (the most a request may send) render with a twentieth of the budget."""
    import common.tokenizer as tokenizer_module

    folder = write_hf_folder(tmp_path, config={"chat_template": template})
    ours = Tokenizer.from_pretrained(folder)
    chat = [{"role": "system", "content": "be brief"}, *_long_chat(4095)]
    full = ours.apply_chat_template(chat)
    monkeypatch.setattr(
        tokenizer_module, "RENDER_STEP_BUDGET", tokenizer_module.RENDER_STEP_BUDGET // 20
    )
    assert ours.apply_chat_template(chat) == full


def test_range_in_a_template_behaves_as_in_transformers(tmp_path: Path) -> None:
    """range() is counted against the step budget; templates see it as the sandbox's."""
    body = (
        "{{ range(3) | list }}|{{ range(5) | length }}|{{ range(4) | reverse | join(',') }}|"
        "{{ 2 in range(3) }}|{{ range(4) | last }}|{{ range(10)[2:5] | list }}|"
        "{{ range(0) | list }}|{% for i in range(2) %}{{ loop.last }}{% endfor %}|"
        "{{ range(6)[-1] }}|{% if range(0) %}x{% else %}empty{% endif %}|"
        "{{ range(1, 9, 2).stop }}|{{ range(3) }}|{{ range(2) == range(0, 2) }}|"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    folder = write_hf_folder(tmp_path, config={"chat_template": body})
    ours, ref = Tokenizer.from_pretrained(folder), hf_auto_tokenizer(folder)
    chat = [{"role": "user", "content": "hi"}]
    expected = ref.apply_chat_template(chat, tokenize=False)
    assert ours.apply_chat_template(chat, add_generation_prompt=False) == expected


@pytest.mark.parametrize(
    ("body", "kwargs"),
    [
        # dictsort on a client's string (a tool's "function"): AttributeError in jinja.
        (
            "{% for t in tools %}{{ t.function | dictsort }}{% endfor %}",
            {"tools": [{"function": "x"}]},
        ),
        # xmlattr on a client's string: AttributeError too.
        ("{{ attrs | xmlattr }}{{ messages[0].content }}", {"attrs": "x"}),
        # Arithmetic on client data: ZeroDivisionError.
        ("{{ 10 // (messages | length - 1) }}", {}),
        # range() past the sandbox's bound: OverflowError.
        ("{% for i in range(n) %}{% endfor %}", {"n": 10**6}),
    ],
)
def test_a_template_error_on_client_data_is_a_chat_template_error_not_a_server_fault(
    tmp_path: Path, body: str, kwargs: dict[str, Any]
) -> None:
    """AttributeError and ArithmeticError from built-in filters and operators meeting
    client data escaped as 500s."""
    folder = write_hf_folder(tmp_path, config={"chat_template": body})
    with pytest.raises(ChatTemplateError, match="chat template"):
        Tokenizer.from_pretrained(folder).apply_chat_template(
            [{"role": "user", "content": "x"}], **kwargs
        )


@pytest.mark.parametrize(
    "where", ["tokenizer_config.json", "chat_template.jinja", "tool_use.jinja"]
)
def test_a_chat_template_that_does_not_compile_fails_the_load_naming_its_file(
    tmp_path: Path, where: str
) -> None:
    """A syntax error loaded silently, and then every chat request got a 400 blaming it."""
    from common.tokenizer import BrokenChatTemplateError

    broken = "{% for m in messages %}{{ m.content }}"  # no endfor
    folder = write_hf_folder(tmp_path)
    if where == "tokenizer_config.json":
        folder = write_hf_folder(tmp_path / "cfg", config={"chat_template": broken})
    elif where == "chat_template.jinja":
        (folder / "chat_template.jinja").write_text(broken)
    else:
        (folder / "additional_chat_templates").mkdir()
        (folder / "additional_chat_templates" / "tool_use.jinja").write_text(broken)
    with pytest.raises(BrokenChatTemplateError, match=rf"{where}.*line 1") as info:
        Tokenizer.from_pretrained(folder)
    assert not isinstance(info.value, ChatTemplateError)  # not the client's fault (a 400)
    assert isinstance(info.value, ValueError)  # the gateway's start reports it and exits


def test_a_broken_template_overridden_by_a_file_does_not_fail_the_load(tmp_path: Path) -> None:
    """transformers reads chat_template.jinja instead of the config's: so does the check."""
    folder = write_hf_folder(tmp_path, config={"chat_template": "{% if %}"})
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    assert Tokenizer.from_pretrained(folder).apply_chat_template(CONVERSATIONS[0])


def test_a_broken_template_given_directly_is_no_clients_fault(tmp_path: Path) -> None:
    from common.tokenizer import BrokenChatTemplateError

    base = Tokenizer.from_pretrained(write_hf_folder(tmp_path))
    tok = Tokenizer(base._tok, {"eos_token": EOS}, {"default": "{% for %}"})
    with pytest.raises(BrokenChatTemplateError, match="line 1"):
        tok.apply_chat_template(CONVERSATIONS[0])


NO_TRIM_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
REASONING_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m.reasoning_content %}<think>"
    "{{ m.reasoning_content }}</think>{% endif %}{{ m['content'] }}<|eot|>{% endfor %}"
)


@pytest.mark.parametrize(
    ("template", "final", "field"),
    [
        (CHAT_TEMPLATE, {"role": "assistant", "content": "The answer is"}, True),
        (CHAT_TEMPLATE, {"role": "assistant", "content": "The answer is "}, True),  # trimmed
        (NO_TRIM_TEMPLATE, {"role": "assistant", "content": "The answer is "}, True),
        (NO_TRIM_TEMPLATE, {"role": "user", "content": "Finish this: "}, "content"),
        (GEMMA3_LIKE, {"role": "assistant", "content": [
            {"type": "text", "text": "One"}, {"type": "text", "text": "two "}]}, True),
        (REASONING_TEMPLATE, {"role": "assistant", "content": "x",
                              "reasoning_content": "Let me think"}, "reasoning_content"),
    ],
)  # fmt: skip
def test_continue_final_message_ends_the_prompt_inside_it_as_transformers(
    tmp_path: Path, template: str, final: dict[str, Any], field: bool | str
) -> None:
    """It reached the template as a variable no template reads: the prompt closed the final
    message and the model started a new one."""
    folder = write_hf_folder(tmp_path, config={"chat_template": template})
    ours, ref = Tokenizer.from_pretrained(folder), hf_auto_tokenizer(folder)
    chat = [{"role": "user", "content": "Question?"}, final]
    expected = ref.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=False, continue_final_message=field
    )
    got = ours.apply_chat_template(chat, add_generation_prompt=False, continue_final_message=field)
    assert got == expected
    assert not got.endswith("<|eot|>\n") and not got.endswith("<|eot|>")
    ids = ref.apply_chat_template(
        chat, add_generation_prompt=False, continue_final_message=field, return_dict=False
    )
    assert ours.encode(got, add_special_tokens=False) == list(ids)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"add_generation_prompt": True}, "add_generation_prompt"),
        ({"add_generation_prompt": False, "continue_final_message": "reasoning_content"},
         "does not read"),
        ({"add_generation_prompt": False, "continue_final_message": "name"}, "has no"),
        ({"add_generation_prompt": False, "continue_final_message": 3}, "boolean"),
    ],
)  # fmt: skip
def test_continue_final_message_refusals_are_chat_template_errors(
    tmp_path: Path, kwargs: dict[str, Any], match: str
) -> None:
    ours = Tokenizer.from_pretrained(write_hf_folder(tmp_path))
    chat = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hel", "reasoning_content": "r"}]  # fmt: skip
    kwargs.setdefault("continue_final_message", True)
    with pytest.raises(ChatTemplateError, match=match):
        ours.apply_chat_template(chat, **kwargs)


def test_a_template_that_drops_the_final_message_cannot_continue_it(tmp_path: Path) -> None:
    folder = write_hf_folder(tmp_path, config={"chat_template": QWEN_LIKE})  # no tool role
    chat = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]
    with pytest.raises(ChatTemplateError, match="does not print the final message"):
        Tokenizer.from_pretrained(folder).apply_chat_template(
            chat, add_generation_prompt=False, continue_final_message=True
        )


def test_model_specific_named_tokens_missing_from_tokenizer_json_are_registered(
    tmp_path: Path,
) -> None:
    """transformers 5 registers every ``*_token`` key of tokenizer_config (a string, or an
    AddedToken object) as a special token: "a<|img|>b" was split into pieces here, and the
    id transformers gives <|img|> was past our vocabulary."""
    img = {"__type": "AddedToken", "content": "<|aud|>", "lstrip": False, "rstrip": False,
           "normalized": False, "single_word": False, "special": True}  # fmt: skip
    folder = write_hf_folder(tmp_path, config={
        "image_token": "<|img|>",
        "audio_token": img,
        "plain_token": {"content": "<|plain|>"},  # no __type: no token in transformers
        "add_image_token": True,  # not a token
        "extra_special_tokens": {"video_token": "<|vid|>"},
        "additional_special_tokens": ["<|extra|>"],
    })  # fmt: skip
    ours, ref = Tokenizer.from_pretrained(folder), hf_auto_tokenizer(folder)
    text = "a<|img|>b<|aud|>c<|vid|>d<|extra|>e<|plain|>f"
    assert ours.encode(text) == ref.encode(text)
    assert ours.vocab_size == len(ref)
    ids = ref.encode(text)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(
            ids, skip_special_tokens=skip
        )
    assert set(ref.all_special_ids) <= set(ours.all_special_ids)
