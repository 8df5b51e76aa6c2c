"""The OpenAI error shape `{"error": {"message", "type", "param", "code"}}` and the handlers
that give every failure that shape: validation (400, not FastAPI's 422), HTTP errors,
engine refusals, and unexpected exceptions (500, never a stack trace to the client)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from kvstrata.http.responses import ErrorDetail, ErrorResponse

# OpenAI's error `type` per status; anything else 4xx is an invalid request.
_ERROR_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    503: "service_unavailable_error",
}
_MAX_LISTED_ERRORS = 3
CLIENT_GONE = 499  # nginx's status for "the client closed the connection"
# The error responses of the generating routes, for the OpenAPI document.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 500, 503)
}


class StatusError(Exception):
    """An error that knows the HTTP status and error code it is answered with (the engine
    thread's group errors are such errors); the handler gives it the OpenAI shape."""

    status_code = 500
    code = "internal_error"


class OpenAIError(Exception):
    """An error answered with the OpenAI shape; raise it anywhere in a route."""

    def __init__(
        self, status_code: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code


def error_type(status_code: int) -> str:
    if status_code >= 500:
        return _ERROR_TYPES.get(status_code, "server_error")
    return _ERROR_TYPES.get(status_code, "invalid_request_error")


def error_body(
    status_code: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    detail = ErrorDetail(message=message, type=error_type(status_code), param=param, code=code)
    return ErrorResponse(error=detail).model_dump()


def error_response(
    status_code: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status_code, message, param, code), status_code=status_code)


def validation_message(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """A readable message and the offending top-level field from pydantic's error list."""
    if any(err.get("type") == "json_invalid" for err in errors):
        return "the request body is not valid JSON", None
    if errors and tuple(errors[0].get("loc", ())) == ("body",):
        return "the request body must be a JSON object (Content-Type: application/json)", None
    parts = []
    for err in errors[:_MAX_LISTED_ERRORS]:
        loc = [str(item) for item in err.get("loc", ()) if item != "body"]
        where = ".".join(loc) or "body"
        parts.append(f"{where}: {err.get('msg', 'invalid value')}")
    if len(errors) > _MAX_LISTED_ERRORS:
        parts.append(f"and {len(errors) - _MAX_LISTED_ERRORS} more")
    first_loc = [item for item in errors[0].get("loc", ()) if item != "body"] if errors else []
    param = str(first_loc[0]) if first_loc else None
    return "invalid request: " + "; ".join(parts), param


async def _on_openai_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OpenAIError)
    return error_response(exc.status_code, exc.message, exc.param, exc.code)


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, param = validation_message(list(exc.errors()))
    return error_response(400, message, param, "invalid_value")


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    response = error_response(exc.status_code, str(exc.detail))
    if exc.headers:
        response.headers.update(exc.headers)
    return response


async def _on_group_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StatusError)
    return status_error_response(exc)


def status_error_response(error: StatusError) -> JSONResponse:
    return error_response(error.status_code, str(error), code=error.code)


async def _on_unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    # Starlette re-raises after this response is sent, so the server logs the traceback.
    return error_response(500, "internal server error", code="internal_error")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(OpenAIError, _on_openai_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_exception_handler(StatusError, _on_group_error)
    app.add_exception_handler(Exception, _on_unexpected_error)
