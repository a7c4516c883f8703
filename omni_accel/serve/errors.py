"""OpenAI-shaped errors: every 4xx/5xx body is ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An HTTP error with an OpenAI error body. ``headers`` are added to the response (e.g. Retry-After)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


class StreamAborted(Exception):
    """Raised from a streamed body after its 200 header went out, to cut the connection instead of ending the body
    cleanly: the client reads an incomplete response (for raw audio there is no other way to say "failed")."""
