"""API errors: ``{"error": {"message", "type", "param", "code"}}``, with the HTTP status OpenAI uses (docs/api.md)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class APIError(Exception):
    status: int
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def context_too_long(message: str, param: str) -> APIError:
    return APIError(400, message, "invalid_request_error", param, "context_length_exceeded")


def unauthorized() -> APIError:
    return APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')", "authentication_error",
                    None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})


def model_not_found(model: str, served: str) -> APIError:
    return APIError(404, f"the model {model!r} does not exist; this server serves {served!r}", "not_found_error",
                    "model", "model_not_found")


def unavailable(message: str, code: str, retry_after: int | None = 1) -> APIError:
    headers = {} if retry_after is None else {"Retry-After": str(retry_after)}
    return APIError(503, message, "service_unavailable_error", None, code, headers)


def engine_dead() -> APIError:
    return APIError(500, "the engine process died; the request cannot complete", "internal_error", None,
                    "engine_dead")


def request_timeout(seconds: float) -> APIError:
    return APIError(504, f"the request did not finish within the server's request timeout ({seconds:g} s)",
                    "timeout_error", None, "request_timeout")


def internal(message: str) -> APIError:
    return APIError(500, message, "internal_error", None, "internal_error")
