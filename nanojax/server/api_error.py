"""The OpenAI-style error a request gets (HTTP 4xx with {"error": {...}}), shared by the
request parsers (protocol.py, tools.py) and the app."""
from __future__ import annotations

from typing import Any


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param)


def brief(v: Any, limit: int = 60) -> str:
    """A value for an error message: never long, whatever the client sent."""
    text = repr(v) if isinstance(v, (str, int, float, bool, type(None))) else type(v).__name__
    return text if len(text) <= limit else text[:limit] + "..."
