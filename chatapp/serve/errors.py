"""What a request that fails gets: OpenAI's error object, `{"error": {"message", "type", "param", "code"}}`, with the
HTTP status OpenAI's clients expect (they raise `BadRequestError` for 400, `RateLimitError` for 429, ...)."""

from __future__ import annotations

from typing import Any

from chatapp.errors import ChatappError, ContextOverflowError, user_message

# The `type` OpenAI gives each status.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class ApiError(Exception):
    """A request the server answers with an error object instead of a reply."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    @classmethod
    def from_chatapp(cls, err: ChatappError, param: str | None = None) -> ApiError:
        """A user-caused engine error (a bad value, a prompt over the context, a bad schema): 400 with its fix."""
        code = "context_length_exceeded" if isinstance(err, ContextOverflowError) else "invalid_value"
        return cls(400, user_message(err).one_line(), param=param, code=code)


def bad_value(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")
