"""The OpenAI error object and which HTTP status each failure gets.

Every error the HTTP face answers is ``{"error": {"message", "type", "param", "code"}}``
with one of: 400 (a bad field, named in ``param`` when it is known), 404 (an unknown model
or path), 405, 408 (a body that did not arrive in time), 413 (a body over the limit), 429 (the
server's queue bound), 500 (the server failed a request it had accepted), 503 (the server is
starting, unreachable, or a process died). :func:`from_final_error` maps the error text of a
client-protocol ``final`` onto these: the protocol carries no error code, so the mapping reads the
prefixes the scheduler and bin/serve give their texts (``overloaded:``, ``timeout:``, "... process
died ...", "server shutting down"); any other error final is a request the frontend or the scheduler
refused (``ProtocolError`` and the context rules), a 400.
"""

from __future__ import annotations

import re
from typing import Any

# The OpenAI error types, by the status they go with.
INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
RATE_LIMIT = "rate_limit_error"
SERVER_ERROR = "server_error"
UNAVAILABLE = "service_unavailable_error"

_TYPE_OF_STATUS = {
    400: INVALID_REQUEST,
    404: NOT_FOUND,
    405: INVALID_REQUEST,
    408: INVALID_REQUEST,
    413: INVALID_REQUEST,
    429: RATE_LIMIT,
    503: UNAVAILABLE,
}

# Client-protocol field names that are spelled otherwise in the OpenAI API.
_OPENAI_NAME = {"token_ids": "prompt"}
_QUOTED_FIELD = re.compile(r"'([a-z_]+)'")
# Refusals by the context rules (protocol.validation.context_problem) name no field in quotes.
_LEADING_FIELD = (
    ("max_tokens", "max_tokens"),
    ("min_tokens", "min_tokens"),
    ("stop token id", "stop_token_ids"),
    ("logit_bias token id", "logit_bias"),
    ("token id", "prompt"),
    ("prompt", "prompt"),
    ("messages", "messages"),
)


class ApiError(Exception):
    """A request answered with an OpenAI error object and ``status``."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None, type: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_OF_STATUS.get(status, SERVER_ERROR)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_field(param: str, message: str) -> ApiError:
    """A 400 for the field ``param`` (``message`` says what is wrong with it)."""
    return ApiError(400, message, param=param)


def unavailable(message: str, code: str = "unavailable") -> ApiError:
    return ApiError(503, message, code=code)


def from_final_error(message: str) -> ApiError:
    """The HTTP error for a request whose client-protocol ``final`` ended in ``error``."""
    if message.startswith("overloaded:"):
        return ApiError(429, message, code="overloaded")
    if message.startswith("timeout:"):
        return ApiError(503, message, code="queue_timeout")
    if "process died" in message or "shutting down" in message or message.startswith("startup failed"):
        return unavailable(message, "server_stopping")
    if message.startswith("unknown LoRA adapter"):  # unloaded since this process last saw the names
        return ApiError(404, message, param="model", code="model_not_found")
    if message.startswith("worker hung"):  # conveyor.scheduler.liveness: retry once it steps (or restarts)
        return unavailable(message, "worker_hung")
    if message.startswith("scheduler hung"):  # conveyor.frontend.liveness
        return unavailable(message, "scheduler_hung")
    if message.startswith("worker ") or message.startswith("malformed worker result"):
        return ApiError(500, message, code="internal_error")
    return ApiError(400, message, param=_field_named(message))


def _field_named(message: str) -> str | None:
    """The request field a frontend or scheduler refusal names, in the OpenAI spelling."""
    quoted = _QUOTED_FIELD.search(message)
    if quoted:
        return _OPENAI_NAME.get(quoted.group(1), quoted.group(1))
    for start, field in _LEADING_FIELD:
        if message.startswith(start):
            return field
    return None
