"""One error shape for every failure, the one OpenAI clients already parse:
`{"error": {"message", "type", "param", "code"}}` with a 4xx status for anything the caller
can fix. A NotFound from the store becomes 404 with the store's message, which never says
whether the id exists in another tenant."""

from __future__ import annotations

import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import EngineError, EngineUnavailable
from ..tiers.records import Conflict, InvalidInput, NotFound


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        if code is None and status < 500:
            code = _HTTP_CODES.get(status, f"http_{status}")
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str, code: str | None = None, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, code, param), status_code=status, headers=headers)


_HTTP_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error"}
# the code of an HTTP error raised by the framework itself (no route, wrong method, a body
# it cannot read): every 4xx has a stable snake_case code
_HTTP_CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
               405: "method_not_allowed", 413: "body_too_large", 415: "unsupported_media_type",
               429: "rate_limited"}
_ENGINE_CODES = {"InvalidGrammar": "invalid_schema"}


def snake(name: str) -> str:
    """`PromptTooLong` -> `prompt_too_long`: an exception class as a stable error code."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError):
        return error_response(exc.status, exc.message, exc.type, exc.code, exc.param, exc.headers)

    @app.exception_handler(NotFound)
    async def _missing(_: Request, exc: NotFound):
        return error_response(404, str(exc), "not_found_error", "not_found")

    @app.exception_handler(InvalidInput)
    async def _invalid(_: Request, exc: InvalidInput):
        return error_response(400, str(exc), "invalid_request_error", getattr(exc, "code", "invalid_input"),
                              getattr(exc, "param", None))

    @app.exception_handler(Conflict)
    async def _conflict(_: Request, exc: Conflict):
        return error_response(409, str(exc), "conflict_error", "version_conflict")

    @app.exception_handler(EngineError)
    async def _engine(_: Request, exc: EngineError):
        name = type(exc).__name__
        return error_response(400, str(exc), "invalid_request_error", _ENGINE_CODES.get(name, snake(name)),
                              getattr(exc, "param", None))

    @app.exception_handler(EngineUnavailable)
    async def _engine_down(_: Request, exc: EngineUnavailable):
        return error_response(503, str(exc), "api_error", "engine_unavailable", headers={"Retry-After": "5"})

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        if first.get("type") == "json_invalid":  # the body is not JSON at all: nothing to name but the body
            return error_response(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
                                  .rstrip(": "), "invalid_request_error", "invalid_json")
        msg = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in errs[:5])
        return error_response(422, msg or "invalid request", "invalid_request_error", "validation_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        status = exc.status_code
        code = "invalid_json" if status == 400 and "parsing the body" in str(exc.detail) else _HTTP_CODES.get(status)
        return error_response(status, str(exc.detail),
                              _HTTP_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error"),
                              code or (f"http_{status}" if status < 500 else None), headers=getattr(exc, "headers", None))
