"""OpenAI's error JSON: `{"error": {"message", "type", "param", "code"}}`, one exception per answer."""

from __future__ import annotations

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An answer other than 200: the status, OpenAI's error fields and any extra headers."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, headers=None
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        kind = _TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def bad_request(param: str | None, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def too_large(size: int, limit: int) -> APIError:
    message = f"the request body has {size} bytes; this server takes at most {limit} (--max-request-bytes)"
    return APIError(413, message, code="request_too_large")


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


def bad_api_key() -> APIError:
    return APIError(401, "Incorrect API key provided.", code="invalid_api_key")


def overloaded(waiting: int, limit: int) -> APIError:
    message = f"The server is overloaded: {waiting} requests are waiting (limit {limit}); retry later."
    return APIError(503, message, code="server_overloaded", headers={"Retry-After": "1"})


def engine_refusal(err: ValueError) -> APIError:
    """The engine refused a request: a 400 naming the field its message starts with, if any."""
    message = str(err).splitlines()[0] if str(err) else "the engine refused the request"
    known = ("max_tokens", "prompt", "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
             "stop_token_ids", "logprobs", "min_tokens", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "include_stop_str_in_output", "skip_special_tokens")  # fmt: skip
    words = message.replace("`", " ").replace("=", " ").replace(":", " ").split()
    param = next((w for w in words if w in known), None)
    return APIError(400, message, param=param, code="invalid_value")
