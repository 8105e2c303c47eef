"""One error shape for every failure, the one OpenAI clients already parse:
`{"error": {"message", "type", "param", "code"}}` with a 4xx status for anything the caller
can fix. A NotFound from the store becomes 404 with the store's message, which never says
whether the id exists in another tenant."""

from __future__ import annotations

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
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str, code: str | None = None, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, code, param), status_code=status, headers=headers)


_HTTP_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error"}


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError):
        return error_response(exc.status, exc.message, exc.type, exc.code, exc.param, exc.headers)

    @app.exception_handler(NotFound)
    async def _missing(_: Request, exc: NotFound):
        return error_response(404, str(exc), "not_found_error", "not_found")

    @app.exception_handler(InvalidInput)
    async def _invalid(_: Request, exc: InvalidInput):
        return error_response(400, str(exc), "invalid_request_error", "invalid_input")

    @app.exception_handler(Conflict)
    async def _conflict(_: Request, exc: Conflict):
        return error_response(409, str(exc), "conflict_error", "version_conflict")

    @app.exception_handler(EngineError)
    async def _engine(_: Request, exc: EngineError):
        return error_response(400, str(exc), "invalid_request_error", type(exc).__name__)

    @app.exception_handler(EngineUnavailable)
    async def _engine_down(_: Request, exc: EngineUnavailable):
        return error_response(503, str(exc), "api_error", "engine_unavailable", headers={"Retry-After": "5"})

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        msg = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in errs[:5])
        return error_response(422, msg or "invalid request", "invalid_request_error", "validation_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), _HTTP_TYPES.get(exc.status_code, "api_error"),
                              headers=getattr(exc, "headers", None))
