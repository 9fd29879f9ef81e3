"""Streaming text: incremental detokenization and stop strings that never leak."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.detokenizer import (
    IncrementalDetokenizer,
    StopCheck,
    StopStringMatcher,
    attach_text_state,
    held_back_text,
)
from common.tokenizer import ByteTokenizer, Tokenizer
from tests.engine.test_tokenizer import write_hf_folder

FFFD = "\ufffd"
# Multi-byte characters a byte-level BPE splits across tokens: emoji (4 bytes, with
# modifiers and flags), CJK (3 bytes), accents (2 bytes).
TRICKY = [*"🙂🚀👍🏽🇨🇭日本語中文éøß€", "\U0001f468\u200d\U0001f469\u200d\U0001f467"]
TEXT = st.lists(
    st.one_of(st.characters(codec="utf-8", exclude_characters=FFFD), st.sampled_from(TRICKY)),
    max_size=40,
).map("".join)
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_pretrained(write_hf_folder(tmp_path_factory.mktemp("bpe")))


def stream(detok: IncrementalDetokenizer, ids: Sequence[int]) -> list[str]:
    return [detok.add(i) for i in ids]


class CountingDecoder:
    """``tokenizer``'s decode, recording how many ids each call was given."""

    def __init__(self, tokenizer: Tokenizer | ByteTokenizer) -> None:
        self.tokenizer = tokenizer
        self.lengths: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@FAST
@given(prompt=TEXT, text=TEXT)
def test_streamed_text_equals_the_whole_decode_and_never_shows_a_half_character(
    bpe: Tokenizer, prompt: str, text: str
) -> None:
    ids = bpe.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(bpe, bpe.encode(prompt))
    deltas = stream(detok, ids)
    assert "".join(deltas) + detok.flush() == bpe.decode(ids) == text
    assert not any(FFFD in d for d in deltas)


@FAST
@given(
    ids=st.lists(st.integers(0, 419), max_size=40),
    skip=st.booleans(),
)
def test_arbitrary_token_sequences_add_up_to_the_whole_decode(
    bpe: Tokenizer, ids: list[int], skip: bool
) -> None:
    detok = IncrementalDetokenizer(bpe, bpe.encode("context: "), skip_special_tokens=skip)
    deltas = stream(detok, ids)
    whole = bpe.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) + detok.flush() == whole
    if FFFD not in whole:
        assert not any(FFFD in d for d in deltas)


@FAST
@given(data=st.binary(max_size=40))
def test_byte_tokens_hold_back_until_the_character_is_complete(data: bytes) -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, tok.encode("hi"))
    deltas = stream(detok, list(data))
    whole = data.decode("utf-8", errors="replace")
    assert "".join(deltas) + detok.flush() == whole
    for delta in deltas:
        assert delta.count(FFFD) <= whole.count(FFFD)
    assert not (deltas and deltas[-1].endswith(FFFD) and not whole.endswith(FFFD))


def test_one_emoji_over_four_byte_tokens_arrives_whole_on_the_last() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, tok.encode("a"))
    assert stream(detok, list("🙂b".encode())) == ["", "", "", "🙂", "b"]
    assert detok.flush() == ""


def test_resumed_prompt_cut_inside_a_character_emits_that_character_whole() -> None:
    # After a redelivery the prompt is prompt + delivered tokens, and those may end with
    # the first bytes of a character the client never received.
    tok = ByteTokenizer()
    emoji = "🙂".encode()
    detok = IncrementalDetokenizer(tok, [*tok.encode("ok "), *emoji[:2]], resumed_tokens=2)
    assert stream(detok, [*emoji[2:], ord("!")]) == ["", "🙂", "!"]


def test_a_real_replacement_character_ending_the_prompt_is_not_repeated() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, tok.encode(f"bad {FFFD}"))
    assert stream(detok, list(b"ok")) == ["o", "k"]


def test_special_tokens_are_skipped_or_shown_as_asked(bpe: Tokenizer) -> None:
    eot = bpe.token_to_id("<|eot|>")
    assert eot is not None
    ids = [*bpe.encode("hi", add_special_tokens=False), eot]
    skipping = IncrementalDetokenizer(bpe, [])
    assert "".join(stream(skipping, ids)) == "hi"
    showing = IncrementalDetokenizer(bpe, [], skip_special_tokens=False)
    assert "".join(stream(showing, ids)) == "hi<|eot|>"


def test_work_per_token_stays_bounded_on_long_outputs(bpe: Tokenizer) -> None:
    counting = CountingDecoder(bpe)
    decoded = counting.lengths

    ids = bpe.encode("The quick brown fox 🙂 日本語. " * 60, add_special_tokens=False)
    detok = IncrementalDetokenizer(counting, bpe.encode("prompt " * 100))
    assert "".join(stream(detok, ids)) == bpe.decode(ids)
    assert max(decoded) <= 16  # a window, never the whole output
    assert sum(decoded) <= 16 * len(ids)


# ---- stop strings ----------------------------------------------------------------------


def feed_all(matcher: StopStringMatcher, deltas: Sequence[str]) -> tuple[list[str], bool]:
    """Feed deltas until a stop; each entry is everything emitted so far."""
    emitted, sent = [], ""
    for delta in deltas:
        check = matcher.feed(delta)
        sent += check.text
        emitted.append(sent)
        if check.stopped:
            return emitted, True
    emitted.append(sent + matcher.flush())
    return emitted, False


def split_at(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


STOPS = ["</s>", "STOP", "\n\n", "ab"]


@FAST
@given(
    head=st.text(st.sampled_from("xyz\n/s<>STOPa"), max_size=20),
    stop=st.sampled_from(STOPS),
    tail=st.text(st.sampled_from("xyz\n/s<>STOPab"), max_size=10),
    cuts=st.lists(st.integers(0, 40), max_size=8),
    include=st.booleans(),
)
def test_a_stop_string_split_across_deltas_never_leaks(
    head: str, stop: str, tail: str, cuts: list[int], include: bool
) -> None:
    text = head + stop + tail
    # Where generation stops: the first stop string to complete.
    end = min(text.find(s) + len(s) for s in STOPS if s in text)
    first = min((s for s in STOPS if s in text), key=lambda s: (text.find(s) + len(s), -len(s)))
    expected = text[:end] if include else text[: end - len(first)]

    matcher = StopStringMatcher(STOPS, include)
    emitted, stopped = feed_all(matcher, split_at(text, cuts))
    assert stopped and matcher.matched == first
    assert emitted[-1] == expected
    # Everything ever sent is a prefix of the final output: no partial stop string went out.
    assert all(expected.startswith(sent) for sent in emitted)


@FAST
@given(
    text=st.text(st.sampled_from("xyz/s<>STO\na"), max_size=30), cuts=st.lists(st.integers(0, 30))
)
def test_text_without_a_stop_string_all_comes_out(text: str, cuts: list[int]) -> None:
    stops = ["</s>", "STOP", "\n\n", "ab"]
    if any(s in text for s in stops):
        return
    emitted, stopped = feed_all(StopStringMatcher(stops), split_at(text, cuts))
    assert not stopped and emitted[-1] == text


def test_held_back_prefix_is_released_when_it_stops_matching() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("go ST") == ("go ", False)
    assert matcher.feed("ART") == ("START", False)
    assert matcher.feed("ST") == ("", False)
    assert matcher.flush() == "ST"


def test_stop_ends_the_output_before_or_after_the_stop_string() -> None:
    assert StopStringMatcher(["STOP"]).feed("a STOP b") == ("a ", True)
    assert StopStringMatcher(["STOP"], include_stop_str_in_output=True).feed("a STOP b") == (
        "a STOP",
        True,
    )
    matcher = StopStringMatcher(["bcd", "c"])
    assert matcher.feed("abcd") == ("ab", True)  # "c" completes first
    assert matcher.matched == "c"
    assert matcher.feed("more") == ("", True) and matcher.flush() == ""


def test_detokenizer_into_stop_matcher_cuts_inside_a_token(bpe: Tokenizer) -> None:
    ids = bpe.encode("Hello world! Hello there", add_special_tokens=False)
    detok, matcher = IncrementalDetokenizer(bpe, []), StopStringMatcher(["o th"])
    sent = ""
    for token in ids:
        check = matcher.feed(detok.add(token))
        sent += check.text
        if check.stopped:
            break
    assert check.stopped and sent == "Hello world! Hell"


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher([""])


def test_stray_bytes_are_released_so_a_garbage_stream_costs_a_window_per_token() -> None:
    tok = ByteTokenizer()
    counting = CountingDecoder(tok)
    decoded = counting.lengths

    # Lone continuation bytes never become characters; a valid emoji and text come after.
    data = b"\x80\xbf" * 300 + "🙂 ok".encode() + b"\xe2\x82" * 50 + b"!"
    detok = IncrementalDetokenizer(counting, tok.encode("x"))
    deltas = stream(detok, list(data))
    assert "".join(deltas) + detok.flush() == data.decode("utf-8", errors="replace")
    assert max(decoded) <= 24  # a bounded window, not the whole output
    # The emoji arrives whole on its last byte, not as stray bytes.
    last_byte = data.index("🙂".encode()) + 3
    assert "🙂" in deltas[last_byte] and "🙂" not in "".join(deltas[:last_byte])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(min_size=10, max_size=120))
def test_long_byte_streams_add_up_to_the_whole_decode(data: bytes) -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, tok.encode("hi"))
    deltas = stream(detok, list(data))
    assert "".join(deltas) + detok.flush() == data.decode("utf-8", errors="replace")


def test_tokens_without_text_do_not_grow_the_window(bpe: Tokenizer) -> None:
    counting = CountingDecoder(bpe)
    decoded = counting.lengths

    eot = bpe.token_to_id("<|eot|>")
    assert eot is not None
    ids = [*bpe.encode(" hello", add_special_tokens=False), *[eot] * 200]
    ids += bpe.encode(" world 🙂", add_special_tokens=False)
    detok = IncrementalDetokenizer(counting, bpe.encode("say"))
    assert "".join(stream(detok, ids)) + detok.flush() == bpe.decode(ids)
    assert max(decoded) <= 24


def test_held_back_text_is_what_the_deltas_gave_past_the_delivered_characters(
    bpe: Tokenizer,
) -> None:
    prompt = bpe.encode("Q: ")
    ids = bpe.encode("hello world 🙂", add_special_tokens=False)
    text = bpe.decode(ids)
    assert held_back_text(bpe, prompt, ids, 0) == text
    assert held_back_text(bpe, prompt, ids, 6) == text[6:]
    # An unfinished character stays out: the resumed prompt's detokenizer emits it whole.
    tok = ByteTokenizer()
    assert held_back_text(tok, tok.encode("a"), list("ok🙂".encode())[:4], 1) == "k"


def test_a_held_tail_is_released_or_cut_like_any_other() -> None:
    matcher = StopStringMatcher(["END"])
    matcher.hold("E")
    assert matcher.feed("x") == StopCheck("Ex", False)
    matcher = StopStringMatcher(["END"])
    matcher.hold("EN")
    check = matcher.feed("D and more")
    assert check == StopCheck("", True) and matcher.matched == "END"


def _byte_fallback_tokenizer(root: Path) -> Tokenizer:
    """Llama 2's kind: SentencePiece spaces, and every character outside a tiny vocabulary
    spelled as <0xNN> byte tokens, which its decoder fuses back (U+FFFD for a whole run if
    any byte in it is invalid)."""
    import json

    from tokenizers import AddedToken, decoders, models, normalizers
    from tokenizers import Tokenizer as HfTokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {f"<0x{b:02X}>": 3 + b for b in range(256)}
    vocab |= {p: len(vocab) for p in ("▁", "T", "e", "l", "m", "▁T", "ell", "▁me")}
    hf = HfTokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    hf.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )  # fmt: skip
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in vocab][:3])
    root.mkdir(parents=True, exist_ok=True)
    hf.save(str(root / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_pretrained(root)


def test_a_byte_fallback_prompt_cut_inside_a_character_corrupts_no_output(
    tmp_path: Path,
) -> None:
    """The prompt's last 5 tokens, decoded as context with the output, started or ended
    inside a character: its decoder turned the whole byte run to U+FFFD, corrupting the
    output's own characters (mojibake, an emoji lost, a resumed one sent twice)."""
    tok = _byte_fallback_tokenizer(tmp_path / "bf")

    def byte_ids(text: str) -> list[int]:
        return [tok.token_to_id(f"<0x{b:02X}>") for b in text.encode()]  # type: ignore[misc]

    for prompt, out in [("中文", "测试好的"), ("😀😀", "😀👍")]:
        detok = IncrementalDetokenizer(tok, byte_ids(prompt))
        assert "".join(stream(detok, byte_ids(out))) + detok.flush() == out
    # A resumed request: the prompt ends with the first k output tokens, inside "你".
    answer = byte_ids(" 你好 😀")
    for k in range(1, len(answer)):
        first = IncrementalDetokenizer(tok, byte_ids("Tell me"))
        sent = "".join(stream(first, answer[:k]))
        resumed = IncrementalDetokenizer(tok, byte_ids("Tell me") + answer[:k], True, k)
        rest = "".join(stream(resumed, answer[k:])) + resumed.flush()
        assert sent + rest == " 你好 😀", k


def test_a_byte_fallback_prompt_ending_in_a_stray_byte_leaves_the_output_whole(
    tmp_path: Path,
) -> None:
    """A token prompt ending in an invalid byte: decoded as context with the output, its
    byte run took the output's first character with it into U+FFFD."""
    tok = _byte_fallback_tokenizer(tmp_path / "bf")

    def byte_ids(data: bytes) -> list[int]:
        return [tok.token_to_id(f"<0x{b:02X}>") for b in data]  # type: ignore[misc]

    out = byte_ids("é ok".encode())
    for prompt in (byte_ids(b"Tell me\x80"), byte_ids(b"\x80")):
        detok = IncrementalDetokenizer(tok, prompt)
        assert "".join(stream(detok, out)) + detok.flush() == tok.decode(out) == "é ok"


def test_before_min_tokens_a_stop_prefix_is_still_held_and_only_later_ends_count() -> None:
    """Unmatched text (a request short of its min_tokens) keeps a tail that may begin a stop
    string: one that starts there and ends in matched text stops the output, as vLLM finds
    it; a shorter one lying wholly inside that held tail does not."""
    matcher = StopStringMatcher(["ab", "xaby"])
    assert matcher.feed("kx", match=False) == ("k", False)  # "x" may begin "xaby"
    assert matcher.feed("ab", match=False) == ("", False)  # "ab" ends unmatched: held
    assert matcher.feed("y") == ("", True) and matcher.matched == "xaby"
    straddle = StopStringMatcher(["kbo"])
    assert straddle.feed("kk", match=False) == ("k", False)
    assert straddle.feed("bo") == ("", True)  # the output ends before the held "k"


@pytest.mark.parametrize("ids", [[0xEF, 0xBF, 0xBD, 257], [0xE4, 257], [0x68, 0xE4, 0xBD, 257]])
def test_a_hidden_eos_after_held_back_bytes_releases_them_as_decode_shows_them(
    ids: list[int],
) -> None:
    """Fed to the detokenizer and its piece dropped, the EOS took what was held back before
    it (a replacement character, an unfinished one) with it: the output ended short of
    decode(ids, skip_special_tokens=True)."""
    from types import SimpleNamespace

    from common.detokenizer import IncrementalDetokenizer
    from workers.engine.sampling_params import SamplingParams
    from workers.engine.stopping import settle_token

    tok = ByteTokenizer()
    req = SimpleNamespace(params=SamplingParams(), detokenizer=IncrementalDetokenizer(tok, [104]),
                          stop_matcher=None, stop_reason=None, num_output_tokens=0)  # fmt: skip
    text, reason = "", None
    for token in ids:
        req.num_output_tokens += 1
        piece, reason = settle_token(req, token, {tok.EOS}, False, primary_eos=tok.EOS)
        text += piece
    assert reason == "stop" and text == tok.decode(ids, skip_special_tokens=True)


# ---- prompts that end inside a character, silent tokens, redelivered requests ----------


def text_state(
    tok: ByteTokenizer,
    prompt: list[int],
    stop: list[str] | None = None,
    skip: bool = True,
    **resume: int,
) -> SimpleNamespace:
    """A request as the engine (or sim) sets it up: its detokenizer and stop matcher."""
    params = SimpleNamespace(
        stop=stop or [], include_stop_str_in_output=False, skip_special_tokens=skip
    )
    req = SimpleNamespace(stop_matcher=None)
    attach_text_state(req, tok, prompt, params, **resume)
    return req


def sent_text(req: SimpleNamespace, ids: Sequence[int], *, end: bool = False) -> str:
    """The text a request sends for ``ids`` (and, with ``end``, as it finishes)."""
    text = ""
    for delta in [*map(req.detokenizer.add, ids), *([req.detokenizer.flush()] if end else [])]:
        text += delta if req.stop_matcher is None else req.stop_matcher.feed(delta).text
    if end and req.stop_matcher is not None:
        text += req.stop_matcher.flush()
    return text


def test_a_new_requests_prompt_ending_inside_a_character_is_context_only() -> None:
    """The prompt's unfinished last character was emitted as if owed output: its lead
    byte took the output's stray continuation bytes into an emoji the output never had,
    and a stray byte before it came out as U+FFFD."""
    tok = ByteTokenizer()
    out = [0x9F, 0x98, 0x80, ord("b")]
    for prompt in ([tok.BOS, ord("x"), 0x61, 0xF0], [tok.BOS, ord("x"), 0x80, 0xF0]):
        assert sent_text(text_state(tok, prompt), out, end=True) == tok.decode(out) == "���b"
        detok = IncrementalDetokenizer(tok, prompt)
        assert "".join(stream(detok, [ord("b")])) + detok.flush() == "b"
    # Redelivered, the prompt's last tokens are output: only those are owed.
    prompt = [tok.BOS, ord("x"), 0x61, 0xF0]
    req = text_state(tok, prompt, resumed_tokens=1, delivered_text_len=0)
    assert sent_text(req, out, end=True) == "😀b"
    req = text_state(tok, [tok.BOS, ord("x"), 0x80, 0xF0], resumed_tokens=1)
    assert sent_text(req, [ord("b")], end=True) == "�b"


@pytest.mark.parametrize(("silent", "skip"), [(ByteTokenizer.PAD, True), (300, False)])
def test_tokens_without_text_inside_a_character_do_not_split_it(silent: int, skip: bool) -> None:
    """Skipped specials (or ids past a padded vocabulary) took the place of the
    character's bytes among the last few tokens a cut holds: it went out as U+FFFD, then
    whole."""
    tok = ByteTokenizer()
    ids = [0x61, 0xC3, *[silent] * 8, 0xA9, 0x62]
    detok = IncrementalDetokenizer(tok, [tok.BOS, ord("x")], skip_special_tokens=skip)
    deltas = stream(detok, ids)
    assert "".join(deltas) + detok.flush() == tok.decode(ids, skip_special_tokens=skip) == "aéb"
    assert not any(FFFD in d for d in deltas)


@pytest.mark.parametrize("stop", [None, ["zz"]])
def test_a_redelivered_request_sends_the_stray_byte_its_first_attempt_held(
    stop: list[str] | None,
) -> None:
    """The first attempt sent "a" and held 0xFF (its text ends in U+FFFD); redelivered
    with both tokens, that U+FFFD was taken for the prompt's own and never sent."""
    tok = ByteTokenizer()
    prompt, first = [tok.BOS, ord("x")], [ord("a"), 0xFF]
    assert sent_text(text_state(tok, prompt, stop), first) == "a"
    req = text_state(tok, prompt + first, stop, resumed_tokens=2, delivered_text_len=1)
    rest = sent_text(req, list(b"bc"), end=True)
    assert "a" + rest == tok.decode([*first, *b"bc"]) == "a�bc"


# Tokens of every kind a byte stream can hold: text, continuation and lead bytes, bytes
# never valid, whole characters, specials, and an id past the vocabulary.
_PIECES = [
    *([b] for b in b"ab \x80\x9f\xa9\xbf\xc3\xe2\xe6\xf0\xf4\xff\xc0"),
    *(list(c.encode()) for c in "é日🙂€"),
    [ByteTokenizer.BOS], [ByteTokenizer.EOS], [ByteTokenizer.PAD], [300],
]  # fmt: skip


# Only bytes that never end a character, and silent tokens: text held back for long.
_GARBAGE = [p for p in _PIECES if len(p) == 1 and p[0] not in set(b"ab ")]


def _random_ids(rng: random.Random, most: int, pieces: list[list[int]]) -> list[int]:
    ids = [t for _ in range(rng.randint(0, most)) for t in rng.choice(pieces)]
    return ids[:most]


def test_random_byte_streams_new_and_redelivered_at_every_cut_add_up_to_the_decode() -> None:
    """New requests with prompts ending anywhere (inside a character too) give
    ``decode(output)``; a request redelivered after any of its tokens gives the very
    deltas the first attempt would have gone on with, and with stop strings holding text
    back, the same text in all."""
    tok = ByteTokenizer()
    rng = random.Random(1234)
    for case in range(1000):
        skip = rng.random() < 0.7
        pieces = _GARBAGE if case % 4 == 0 else _PIECES
        prompt, ids = [tok.BOS, *_random_ids(rng, 6, _PIECES)], _random_ids(rng, 24, pieces)
        whole = tok.decode(ids, skip_special_tokens=skip)
        detok = IncrementalDetokenizer(tok, prompt, skip)
        deltas = stream(detok, ids)
        assert "".join(deltas) + detok.flush() == whole, (prompt, ids, skip)
        stop = rng.choice([None, ["ab\x00"], [f"{FFFD}a\x00", "b\x00"]])
        for k in range(len(ids) + 1):
            resumed = IncrementalDetokenizer(tok, prompt + ids[:k], skip, resumed_tokens=k)
            assert stream(resumed, ids[k:]) == deltas[k:], (prompt, ids, skip, k)
            sent = sent_text(text_state(tok, prompt, stop, skip), ids[:k])
            req = text_state(
                tok, prompt + ids[:k], stop, skip, resumed_tokens=k, delivered_text_len=len(sent)
            )
            assert sent + sent_text(req, ids[k:], end=True) == whole, (prompt, ids, stop, k)


def test_a_guided_output_completed_by_eos_keeps_the_eos_out_of_its_text_with_ignore_eos() -> None:
    """The grammar allows EOS where it accepts but could go on (``a+``); with ``ignore_eos``
    that EOS was no stop, so its text (``skip_special_tokens`` off, as tool-calling models
    have it) joined the output, which then broke the regex it was guided by."""
    from types import SimpleNamespace

    from common.detokenizer import IncrementalDetokenizer
    from workers.engine.sampling_params import SamplingParams
    from workers.engine.stopping import settle_token

    tok = ByteTokenizer()
    params = SamplingParams(ignore_eos=True, skip_special_tokens=False)
    req = SimpleNamespace(params=params, stop_matcher=None, stop_reason=None, num_output_tokens=0,
                          detokenizer=IncrementalDetokenizer(tok, [104], skip_special_tokens=False))  # fmt: skip
    text, reason = "", None
    for token, complete in ((ord("a"), False), (tok.EOS, True)):
        req.num_output_tokens += 1
        piece, reason = settle_token(req, token, {tok.EOS}, False, primary_eos=tok.EOS,
                                     complete=complete)  # fmt: skip
        text += piece
    assert (text, reason) == ("a", "stop")
