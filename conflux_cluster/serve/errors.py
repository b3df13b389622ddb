"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status."""

from __future__ import annotations

from pydantic import ValidationError

from .protocol import ErrorInfo, ErrorResponse


class APIError(Exception):
    """An error the client caused (4xx) or a server fault (5xx), rendered in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers: dict[str, str] = {}  # extra HTTP headers (e.g. Retry-After)
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)

    def __reduce__(self):  # picklable across Ray (handle callers get the same error back)
        i = self.info
        return (APIError, (self.status, i.message, i.type, i.param, i.code))

    def body(self) -> dict:
        return ErrorResponse(error=self.info).model_dump()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def from_validation_error(err: ValidationError) -> APIError:
    """First failing field becomes ``param``; every failure is listed in the message."""
    errors = err.errors()
    parts, param = [], None
    for e in errors:
        loc = ".".join(str(x) for x in e["loc"] if x not in ("body",))
        param = param or (str(e["loc"][0]) if e["loc"] else None)
        parts.append(f"{loc}: {e['msg']}" if loc else e["msg"])
    return bad_request("; ".join(parts) or "invalid request", param=param)


def model_not_found(name: str, served: str) -> APIError:
    return APIError(404, f"The model '{name}' does not exist; this server serves '{served}'.",
                    "not_found_error", "model", "model_not_found")


def unauthorized() -> APIError:
    return APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                    "authentication_error", None, "invalid_api_key")


def starting(retry_after_s: int = 2) -> APIError:
    """503 while the instances load weights and warm up (``Retry-After`` says when to ask again)."""
    err = APIError(503, "ConfluxServe is starting: the XP instances are still loading and warming up; "
                        "retry shortly.", "service_unavailable", None, "server_starting")
    err.headers = {"Retry-After": str(retry_after_s)}
    return err


def overloaded(retry_after_s: int) -> APIError:
    """503 when every XP instance's queue is full (the router's admission bound); retry later."""
    err = APIError(503, "ConfluxServe is overloaded: every instance's request queue is full; "
                        f"retry after {retry_after_s} s.", "service_unavailable", None, "server_overloaded")
    err.headers = {"Retry-After": str(retry_after_s)}
    return err
