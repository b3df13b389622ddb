"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

``client_error`` is the only way an exception becomes something a client reads: no path, IP, pid,
actor id, ANSI code or traceback reaches a client; the full error goes to the server log with the
request id the client gets back (in the message and the ``x-request-id`` header).
"""

from __future__ import annotations

import asyncio
import logging
import re

from pydantic import ValidationError
from ray.exceptions import TaskCancelledError

from conflux_cluster.engine.contracts.stream import InstanceUnavailable
from conflux_cluster.engine.contracts.request import ContextLengthExceeded
from conflux_cluster.engine.scheduler.admission import DeadlineUnattainable
from conflux_cluster.router.state import clamp_retry_after

from .protocol import ErrorInfo, ErrorResponse

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error the client caused (4xx) or a server fault (5xx), rendered in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers: dict[str, str] = dict(headers or {})  # extra HTTP headers (e.g. Retry-After)
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)

    def __reduce__(self):  # picklable across Ray (handle callers get the same error back, headers too)
        i = self.info
        return (APIError, (self.status, i.message, i.type, i.param, i.code, self.headers))

    def body(self) -> dict:
        return ErrorResponse(error=self.info).model_dump()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


_VALUE_ERROR = "Value error, "  # pydantic's prefix of a validator's ValueError
_NAMED = re.compile(r"([a-z_]+): ")


def from_validation_error(err: ValidationError) -> APIError:
    """First failing field becomes ``param``; every failure is listed in the message."""
    errors = err.errors()
    parts, param = [], None
    for e in errors:
        loc = ".".join(str(x) for x in e["loc"] if x not in ("body",))
        msg = e["msg"]
        if e.get("type") == "value_error" and msg.startswith(_VALUE_ERROR):  # our own check's message
            msg = msg[len(_VALUE_ERROR):]
        named = _NAMED.match(msg) if not loc else None  # a whole-request check names its field first
        param = param or (str(e["loc"][0]) if e["loc"] else named.group(1) if named else None)
        parts.append(f"{loc}: {msg}" if loc and not msg.startswith(f"{loc}: ") else msg)  # the field named once
    return bad_request("; ".join(parts) or "invalid request", param=param)


def model_not_found(name: str, served: str) -> APIError:
    return APIError(404, f"The model '{printable(name, 100)}' does not exist; this server serves '{served}'.",
                    "not_found_error", "model", "model_not_found")


def unauthorized() -> APIError:
    return APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                    "authentication_error", None, "invalid_api_key")


def starting(retry_after_s: int = 2) -> APIError:
    """503 while the instances load weights and warm up (``Retry-After`` says when to ask again)."""
    return APIError(503, "ConfluxServe is starting: the XP instances are still loading and warming up; "
                         "retry shortly.", "service_unavailable", None, "server_starting",
                    {"Retry-After": str(retry_after_s)})


def overloaded(retry_after_s: int) -> APIError:
    """503 when every XP instance's queue is full (the router's admission bound); retry later."""
    return APIError(503, "ConfluxServe is overloaded: every instance's request queue is full; "
                         f"retry after {retry_after_s} s.", "service_unavailable", None, "server_overloaded",
                    {"Retry-After": str(retry_after_s)})


def unavailable(retry_after_s: int) -> APIError:
    """503 when no instance is healthy: each lost a worker and is being rebuilt."""
    return APIError(503, "ConfluxServe is recovering from a worker failure and has no instance ready; "
                         f"retry after {retry_after_s} s.", "service_unavailable", None, "no_healthy_instance",
                    {"Retry-After": str(retry_after_s)})


def draining(retry_after_s: int = 1) -> APIError:
    """503 while the server shuts down: it finishes the requests it holds and admits none (``serve/drain.py``)."""
    return APIError(503, "ConfluxServe is shutting down and admits no new requests; retry (another replica "
                         "takes it).", "service_unavailable", None, "server_draining",
                    {"Retry-After": str(retry_after_s)})


def instance_failed(e: InstanceUnavailable, request_id: str) -> APIError:
    """503 for a request whose instance lost a worker: while it ran (its output so far is all there is),
    or when it arrived before the router knew."""
    what = ("The model instance serving this request lost a worker and was stopped" if e.in_flight else
            "The model instance this request was sent to is restarting after a worker failure")
    return APIError(503, f"{what} (request id {request_id}); retry after {e.retry_after_s} s.",
                    "service_unavailable", None, "instance_failed", {"Retry-After": str(e.retry_after_s)})


def slo_unattainable(e: DeadlineUnattainable) -> APIError:
    """503 when the SLO scheduler refuses a request at arrival (``scheduler.reject_unattainable``)."""
    retry = clamp_retry_after(e.backlog_s - e.ttft_slo_s)
    return APIError(503, f"The server cannot start this request within its time-to-first-token objective "
                         f"({e.ttft_slo_s:g} s) under the current load, and is set to refuse such requests rather "
                         f"than answer late; retry after {retry} s.", "service_unavailable", None,
                    "slo_unattainable", {"Retry-After": str(retry)})


def rate_limited(retry_after_s: int, requests_per_minute: float) -> APIError:
    """429 when the API key's request rate limit is used up."""
    return APIError(429, f"Rate limit reached for this API key ({requests_per_minute:g} requests per minute); "
                         f"retry after {retry_after_s} s.", "requests", None, "rate_limit_exceeded",
                    {"Retry-After": str(retry_after_s)})


def too_large(limit: int) -> APIError:
    """413: the body is over ``max_request_bytes`` (checked before it is read into memory)."""
    return APIError(413, f"The request body is larger than this server accepts ({limit} bytes).",
                    "invalid_request_error", None, "request_too_large")


def not_json(content_type: str) -> APIError:
    """415: the body is declared as something other than JSON (a form or text: what a browser sends cross-origin
    without a CORS preflight)."""
    return APIError(415, f"The request body must be JSON (Content-Type: application/json), not "
                         f"'{printable(content_type, 100)}'.", "invalid_request_error", None, "unsupported_media_type")


def not_decoded(content_encoding: str) -> APIError:
    """415: the body is compressed or otherwise encoded (``Content-Encoding``); the server reads plain JSON only."""
    return APIError(415, f"The request body's Content-Encoding '{printable(content_encoding, 100)}' is not "
                         "supported: send the JSON body unencoded (Content-Encoding: identity, or none).",
                    "invalid_request_error", None, "unsupported_media_type")


def body_timed_out(seconds: float) -> APIError:
    """408: the request body did not arrive within ``body_timeout_s`` of its headers."""
    return APIError(408, f"The request body did not arrive within {seconds:g} s.", "timeout_error", None,
                    "body_timeout")


def timed_out(seconds: float) -> APIError:
    """408: the request ran past ``request_timeout_s`` (it was aborted and its KV freed)."""
    return APIError(408, f"The request did not finish within this server's time limit ({seconds:g} s); it was "
                         "aborted.", "timeout_error", None, "request_timeout")


def http_error(status: int, method: str, path: str, headers: dict[str, str] | None = None) -> APIError:
    """Starlette's own HTTP errors (unknown route, wrong method) in OpenAI's shape."""
    where = f"{method} {printable(path)}"
    if status == 404:
        return APIError(404, f"Invalid URL ({where}).", "invalid_request_error", None, "unknown_url", headers)
    if status == 405:
        allowed = (headers or {}).get("Allow", "")
        return APIError(405, f"Method not allowed ({where}); allowed: {allowed}.", "invalid_request_error",
                        None, "method_not_allowed", headers)
    return APIError(status, f"HTTP {status} ({where}).", "invalid_request_error", headers=headers)


# ---- what a client may see of an error ----------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
# paths, IPv4 addresses, pids, Ray actor/node ids, tracebacks: never shown to a client
_INTERNALS = re.compile(r"[/\\]|\b\d{1,3}(?:\.\d{1,3}){3}\b|\bpid\b|actor|node.?id|traceback|\bFile \"|"
                        r"\b[0-9a-f]{28,}\b", re.IGNORECASE)


def printable(text: str, limit: int = 200) -> str:
    """``text`` without ANSI escapes or control characters, at most ``limit`` characters."""
    text = _ANSI.sub("", text)
    return "".join(c if c.isprintable() else "?" for c in text[:limit])


def internal_error(request_id: str) -> APIError:
    return APIError(500, f"Internal error (request id {request_id}); see the server log.", "internal_error",
                    None, "internal_error")


def _original(exc: BaseException, cls: type):
    """``exc`` as raised: Ray re-raises an exception from another actor as a ``RayTaskError`` subclass of
    its type (so ``isinstance`` still holds) with the original in ``.cause``."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, cls) else exc


def context_too_long(e: ContextLengthExceeded, prompt_field: str = "prompt", budget_field: str = "max_tokens"
                     ) -> APIError:
    """400 ``context_length_exceeded``; ``prompt_field``: the endpoint's name for the prompt, ``budget_field`` the
    request's for the output budget (``max_tokens`` or ``max_completion_tokens``)."""
    param = prompt_field if e.param == "prompt" else budget_field
    return bad_request(str(e), param=param, code="context_length_exceeded")


def client_error(exc: BaseException, request_id: str, response_id: str | None = None) -> APIError:
    """The one place that decides what a client sees of ``exc`` (HTTP body or in-band stream error).

    An ``APIError`` is shown as it is (its text was written for clients). A ``ValueError`` is the engine
    rejecting the request (Ray re-raises it as ``RayTaskError(ValueError)``, the original in ``.cause``):
    a 400 with the original message, unless that message carries internals. Anything else is a 500 naming
    only ``request_id`` (the HTTP request's ``x-request-id``). Everything but an ``APIError`` is logged in
    full with ``request_id`` and ``response_id`` (the engine's request ids are ``f"{response_id}-{i}"``).
    """
    if isinstance(exc, APIError):  # raised in another actor, Ray re-raises it wrapped: keep the original
        return _original(exc, APIError)
    ids = request_id if response_id is None else f"{request_id} ({response_id})"
    if isinstance(exc, (TaskCancelledError, asyncio.CancelledError)):  # the client hung up: nothing failed
        log.info("request %s: cancelled (the client disconnected)", ids)
        return APIError(499, "The client closed the request.", "client_closed_request")
    if isinstance(exc, DeadlineUnattainable):
        return slo_unattainable(_original(exc, DeadlineUnattainable))
    if isinstance(exc, ContextLengthExceeded):  # an instance's context is smaller than the ingress knew
        return context_too_long(_original(exc, ContextLengthExceeded))
    if isinstance(exc, InstanceUnavailable):
        log.warning("request %s: its XP instance is unavailable: %s", ids, exc)
        return instance_failed(_original(exc, InstanceUnavailable), request_id)
    if isinstance(exc, ValueError):
        cause = getattr(exc, "cause", None) or exc
        lines = [ln.strip() for ln in printable(str(cause), 2000).splitlines() if ln.strip()]
        message = lines[-1] if lines else ""
        log.warning("request %s rejected by the engine: %s", ids, exc)
        if message and not _INTERNALS.search(message.replace(response_id or request_id, "")):
            return bad_request(message[:500])
        return bad_request(f"The engine rejected the request (request id {request_id}); see the server log.")
    log.error("request %s failed", ids, exc_info=exc)
    return internal_error(request_id)
