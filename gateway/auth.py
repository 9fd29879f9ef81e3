"""API keys: ``Authorization: Bearer <key>`` checked against configured sha256 digests.

Only digests are configured (``gateway.api_key_sha256``), so the config file holds no
secret. Every configured digest is compared with :func:`hmac.compare_digest`, so the time
taken says nothing about which key or how much of it matched. No digests configured means
the gateway is open; :func:`warn_if_open` logs that once at start-up.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Iterable

from common.errors import AuthenticationError

log = logging.getLogger(__name__)


def key_digest(key: str) -> str:
    """The sha256 hex digest to put in ``gateway.api_key_sha256`` for ``key``."""
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKeys:
    """The accepted keys (as digests); ``check`` raises 401 in OpenAI's shape."""

    def __init__(self, digests: Iterable[str]) -> None:
        self._digests = [bytes.fromhex(d.strip().lower()) for d in digests]
        if any(len(d) != 32 for d in self._digests):
            raise ValueError("gateway.api_key_sha256 entries must be sha256 hex digests")

    @property
    def open(self) -> bool:
        return not self._digests

    def warn_if_open(self) -> None:
        if self.open:
            log.warning(
                "no API keys configured (gateway.api_key_sha256): the gateway accepts every request"
            )

    def check(self, authorization: str | None) -> None:
        """Accept the request or raise :class:`AuthenticationError` (401)."""
        if self.open:
            return
        if not authorization:
            raise AuthenticationError(
                "missing API key: send 'Authorization: Bearer <key>'", code="missing_api_key"
            )
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthenticationError("malformed Authorization header: expected 'Bearer <key>'")
        digest = hashlib.sha256(key.strip().encode()).digest()
        matched = False
        for accepted in self._digests:
            # No early exit: every key costs the same.
            matched |= hmac.compare_digest(digest, accepted)
        if not matched:
            raise AuthenticationError("incorrect API key provided")
