"""Subject tokens: what may stand as one token of a NATS subject (ids, groups)."""

from __future__ import annotations

import pytest

from common.errors import ProtocolError
from common.protocol import GenerateRequest
from common.subjects import Subjects, is_subject_token


@pytest.mark.parametrize("value", ["short", "a", "A-z_09", "x" * 128])
def test_plain_tokens_are_subject_tokens(value: str) -> None:
    assert is_subject_token(value)


@pytest.mark.parametrize(
    "value",
    ["short\n", "\nshort", "sh\nort", "", "a.b", "a*", ">", "a b", "x" * 129, "x" * 128 + "\n"],
)
def test_anything_else_is_not(value: str) -> None:
    """``$`` also matches before a final newline: "short\\n" passed as a token."""
    assert not is_subject_token(value)


def test_a_trailing_newline_reaches_no_subject_nor_request() -> None:
    with pytest.raises(ValueError, match="not a valid subject token"):
        Subjects().request("short\n")
    with pytest.raises(ValueError, match="not a valid subject token"):
        Subjects().out("req-1\n")
    request = GenerateRequest(id="req-1\n", group="short", reply="qos.out.x", prompt="hi")
    with pytest.raises(ProtocolError, match=r"request\.id"):
        GenerateRequest.from_bytes(request.to_bytes())
