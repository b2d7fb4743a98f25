"""The error every OpenAI API refusal raises (``disagg.serving.openai_api``), in OpenAI's shape."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """A request the API refuses (or could not serve), in OpenAI's error shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}
