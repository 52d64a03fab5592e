"""OpenAI-style errors: every refusal the server makes is one :class:`ApiError`, answered as
``{"error": {"message", "type", "param", "code"}}`` with its HTTP status (the shape of OpenAI's API
and vLLM's server)."""

from __future__ import annotations

from typing import Any

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
          405: "MethodNotAllowedError", 408: "RequestTimeoutError", 409: "ConflictError", 413: "PayloadTooLargeError",
          415: "UnsupportedMediaTypeError", 429: "RateLimitError", 500: "InternalServerError",
          503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}


class ApiError(Exception):
    """A request the server refuses or cannot complete.

    Args:
        status: the HTTP status (400 bad input, 401 no or wrong key, 404 unknown model or route, 408 a
            body sent too slowly, 409 a route this run does not allow now, 413 a body over the limit,
            429 too many requests in flight, 503 no generator, 504 no generation within the timeout).
        message: what was wrong, naming the value and what was expected.
        param: the request field at fault (``messages[2].content``), if any.
        code: a short machine-readable code, if any.
        retry_after_s: sent as ``Retry-After`` (429, 503).
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "Error"), "param": self.param,
                          "code": self.code if self.code is not None else self.status}}

    def headers(self) -> dict[str, str]:
        """Response headers: ``Retry-After`` when set; ``Connection: close`` when the body was not read to
        its end (408, 413), so the connection is dropped (kept alive, a slow client could hold it on)."""
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}
        if self.status in (408, 413):
            headers["Connection"] = "close"
        return headers


def bad_request(message: str, param: str | None = None) -> ApiError:
    """A 400 naming the field."""
    return ApiError(400, message, param=param, code="invalid_request")
