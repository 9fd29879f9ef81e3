"""The project's error types and their one mapping to OpenAI's error shape.

Every error a client can see is a :class:`QosError`. The gateway turns it into
``{"error": {"message", "type", "param", "code"}}`` with its HTTP status; a worker puts
``{code, message}`` into an error chunk, and :func:`error_from_code` rebuilds the same type
on the other side, so a NATS error surfaces over HTTP with the right status.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar


class QosError(Exception):
    """Base of every error that reaches a client."""

    http_status: ClassVar[int] = 500
    error_type: ClassVar[str] = "internal_error"
    default_code: ClassVar[str] = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.default_code
        self.retry_after_s = retry_after_s
        # Headers of the request it ended (its X-Request-Id once it had one): a failure is
        # what a client most wants to quote the id of.
        self.request_headers: dict[str, str] = {}

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's error body."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        """HTTP headers that go with the error (``Retry-After`` for 429/503)."""
        if self.retry_after_s is None:
            return dict(self.request_headers)
        # Rounded up: a client back a little early would only be refused again.
        return {**self.request_headers, "Retry-After": str(max(1, math.ceil(self.retry_after_s)))}

    def to_wire(self) -> dict[str, str]:
        """The ``error`` field of a NATS chunk."""
        return {"code": self.code, "message": self.message}


class InvalidRequestError(QosError):
    http_status = 400
    error_type = "invalid_request_error"
    default_code = "invalid_request"


class ContextLengthExceededError(InvalidRequestError):
    default_code = "context_length_exceeded"


class GuidedDecodingError(InvalidRequestError):
    """A request's grammar could not be followed to its end (a parser limit of the guided
    decoding library reached mid-output): the client's spec, so a 400, which no breaker
    counts against the group."""

    default_code = "guided_decoding_failed"


class ProtocolError(InvalidRequestError):
    """A NATS payload that cannot be decoded: wrong version, types, size or shape."""

    default_code = "protocol_error"


class ConfigError(QosError):
    """Bad configuration; raised at start-up, naming the key."""

    default_code = "config_error"


class AuthenticationError(QosError):
    http_status = 401
    error_type = "authentication_error"
    default_code = "invalid_api_key"


class PermissionDeniedError(QosError):
    http_status = 403
    error_type = "permission_error"
    default_code = "permission_denied"


class NotFoundError(QosError):
    http_status = 404
    error_type = "invalid_request_error"
    default_code = "not_found"


class ModelNotFoundError(NotFoundError):
    default_code = "model_not_found"


class PayloadTooLargeError(QosError):
    http_status = 413
    error_type = "invalid_request_error"
    default_code = "payload_too_large"


class RequestTimeoutError(QosError):
    """The client did not send its request (its body) within the time it had."""

    http_status = 408
    error_type = "invalid_request_error"
    default_code = "request_timeout"


class RateLimitError(QosError):
    """Load shedding: the group is full now; try again after ``retry_after_s``."""

    http_status = 429
    error_type = "rate_limit_error"
    default_code = "rate_limit_exceeded"


class ServiceUnavailableError(QosError):
    """The group has no live worker or its breaker is open with no fallback."""

    http_status = 503
    error_type = "service_unavailable"
    default_code = "service_unavailable"


class DeadlineExceededError(QosError):
    http_status = 504
    error_type = "timeout_error"
    default_code = "deadline_exceeded"

    def headers(self) -> dict[str, str]:
        # The openai client retries any 5xx unless told not to: the same generation would
        # run into the same deadline two more times.
        return {**super().headers(), "x-should-retry": "false"}


class InternalError(QosError):
    pass


class RequestGivenUpError(InternalError):
    """Failed on every delivery JetStream allows (a request that crashes workers, say)."""

    default_code = "request_given_up"

    def headers(self) -> dict[str, str]:
        # Run again by the openai client's retries, it would fail (or kill workers) on every
        # delivery once more, twice.
        return {**super().headers(), "x-should-retry": "false"}


_BY_CODE: dict[str, type[QosError]] = {
    cls.default_code: cls
    for cls in (
        InvalidRequestError,
        ContextLengthExceededError,
        GuidedDecodingError,
        ProtocolError,
        AuthenticationError,
        NotFoundError,
        ModelNotFoundError,
        PayloadTooLargeError,
        RequestTimeoutError,
        RateLimitError,
        ServiceUnavailableError,
        DeadlineExceededError,
        InternalError,
        RequestGivenUpError,
    )
}


def error_from_code(code: str, message: str, param: str | None = None) -> QosError:
    """Rebuild the error a worker reported in a chunk; unknown codes become 500s."""
    cls = _BY_CODE.get(code, InternalError)
    # A retryable refusal says when: the gateway's own 429s and 503s carry Retry-After.
    retry = 1.0 if cls in (RateLimitError, ServiceUnavailableError) else None
    return cls(message, code=code, param=param, retry_after_s=retry)
