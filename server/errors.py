"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging
import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxpaged.engine.async_llm import EngineShutdownError, QueueFullError
from jaxpaged.errors import InvalidRequestError

logger = logging.getLogger(__name__)

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowed",
          413: "RequestTooLargeError", 499: "ClientClosedRequest", 500: "InternalServerError",
          503: "ServiceUnavailableError"}
RETRY_AFTER_SECONDS = 1  # Retry-After of a 503 for a full waiting queue


class ClientDisconnected(Exception):
    """The client went away before the response was ready (its request is already aborted)."""


class OpenAIError(Exception):
    """An error answered as `{"error": {...}}` with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | int | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code if code is not None else status

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def error_body(status: int, message: str, param: str | None = None, code: str | int | None = None) -> dict:
    kind = _TYPES.get(status) or _phrase(status).replace(" ", "")
    return {"error": {"message": message, "type": kind, "param": param,
                      "code": code if code is not None else status}}


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:  # 499 and other non-standard codes
        return "Error"


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None, code: str | int | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)


def from_invalid_request(err: InvalidRequestError, prompt_param: str = "prompt") -> OpenAIError:
    """The engine's typed error as a 400 naming its parameter; a prompt problem is named as the
    endpoint calls its prompt (`prompt_param`: "prompt", or "messages" for chat)."""
    return bad_request(str(err), prompt_param if err.param == "prompt" else err.param)


# pydantic's location tags for a union's members ("list[constrained-str]", "TextPart", "str"): not fields
_UNION_TAG = re.compile(r"[\[\]-]|^[A-Z]|^(str|int|float|bool|dict|list|none)$")


def _validation_message(err: RequestValidationError) -> tuple[str, str | None]:
    """pydantic's error list as one readable line, and the first offending field.

    A value that fails every member of a union gets one error per member; where some member got past the
    type (e.g. a list of stop strings, one empty), the other members' "not a string" errors are left out."""
    errors, param = err.errors(), None
    past_type = {_top(e) for e in errors if not e.get("type", "").endswith(("_type", "_parsing"))}
    parts: list[str] = []
    for e in errors:
        loc = [str(p) for p in e.get("loc", ()) if p != "body"]
        param = param or (loc[0] if loc else None)
        if _top(e) in past_type and e.get("type", "").endswith(("_type", "_parsing")):
            continue
        field = ".".join(p for p in loc if not _UNION_TAG.search(p))
        msg = str(e.get("msg"))
        if e.get("type") == "literal_error":  # a value outside the allowed ones: say which was given
            msg = f"{e.get('input')!r} is not supported; {msg[:1].lower()}{msg[1:]}"
        part = f"{field}: {msg}" if field else msg
        if part not in parts:
            parts.append(part)
    return "; ".join(parts) or "invalid request", param


def _top(error: dict) -> str | None:
    """The body field an error is about."""
    loc = [p for p in error.get("loc", ()) if p != "body"]
    return str(loc[0]) if loc else None


def install_handlers(app: FastAPI) -> None:
    """Every error path answers in OpenAI's shape; validation problems are 400, never pydantic's 422."""

    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, err: OpenAIError):
        return err.response()

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, err: InvalidRequestError):
        return from_invalid_request(err).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, err: RequestValidationError):
        message, param = _validation_message(err)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException):
        message = err.detail if isinstance(err.detail, str) else _phrase(err.status_code)
        if err.status_code == 404:
            message = f"{request.method} {request.url.path}: no such route"
        elif err.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return error_response(err.status_code, message, headers=getattr(err, "headers", None))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, _: ClientDisconnected):
        logger.info("client left %s %s; request aborted", request.method, request.url.path)
        return error_response(499, "client closed the request")

    @app.exception_handler(QueueFullError)
    async def _overloaded(_: Request, err: QueueFullError):
        return error_response(503, f"the server is overloaded: {err}", code="queue_full",
                              headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    @app.exception_handler(EngineShutdownError)
    async def _shutdown(_: Request, err: EngineShutdownError):
        return error_response(503, f"the engine is not running: {err}")

    @app.exception_handler(Exception)
    async def _internal(_: Request, err: Exception):
        logger.exception("internal error")
        return error_response(500, f"internal server error: {type(err).__name__}: {err}")
