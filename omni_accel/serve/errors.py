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


def queue_full_error(queued: int, limit: int, retry_after_s: int, what: str = "requests") -> ApiError:
    """429 for a full queue (``--max-queue``), with the Retry-After header clients back off by."""
    return ApiError(429, f"the server is busy: {queued} {what} are queued (limit {limit}, --max-queue); retry after "
                         f"{retry_after_s} s", type="rate_limit_error", code="queue_full",
                    headers={"Retry-After": str(retry_after_s)})


def timeout_error(timeout_s: float) -> ApiError:
    """504 for a request not answered within ``--request-timeout``."""
    return ApiError(504, f"the request did not finish within {timeout_s:g} s (--request-timeout)",
                    type="timeout_error", code="request_timeout")


class StreamAborted(Exception):
    """Raised from a streamed body after its 200 header went out, to cut the connection instead of ending the body
    cleanly: the client reads an incomplete response (for raw audio there is no other way to say "failed")."""


def shutting_down_error() -> ApiError:
    """503 for a request that comes, or still waits in the queue, while the server drains."""
    return ApiError(503, "the server is shutting down: this request was not run; send it again once the server is "
                         "back (or to another instance)", type="server_error", code="unavailable",
                    headers={"Connection": "close"})


def pipeline_failure(exc: BaseException, what: str = "the pipeline") -> ApiError:
    """The answer for an exception raised by the pipeline call. A ``ValueError`` (``AccelError`` included) is the
    pipeline refusing the request's values -- diffusers' ``check_inputs`` raises it -- so it is the client's: 400.
    Anything else is the server's: 500."""
    if isinstance(exc, ValueError):
        return ApiError(400, f"{what} refused the request: {exc}", code="pipeline_refused")
    return ApiError(500, f"{what} call failed: {exc.__class__.__name__}: {exc}", type="server_error",
                    code="pipeline_error")
