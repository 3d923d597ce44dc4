"""The FastAPI app of `nmt serve`: the JSON API over the served models, its errors, the
body-size limit, and the page.

Every error is JSON, ``{"error": "<one line>"}``: 400 for options that cannot go together or
text the model cannot take (nmt's ConfigError and DataError), 404 for an unknown model or
path, 405 for a method a path does not take (with its ``Allow`` header), 413 for a request
past a limit (``Limits``), 422 for malformed JSON (or a body JSON cannot read:
``unreadable_body``) or a field of the wrong type, a missing or an unknown one, or one it
cannot take (text that is not valid Unicode), 500 for anything unexpected
while decoding (the server goes on serving), and 503 for a request still waiting or decoding
when the server shuts down (``Batcher.close``, which ``app.state.batcher`` is for).
"""

from __future__ import annotations

import asyncio
import mimetypes
import re
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nmt import __version__
from nmt.commands.serve.batching import Batcher, Batching, ShuttingDown, elapsed_ms
from nmt.commands.serve.jobs import align_job, score_job, translate_job
from nmt.commands.serve.limits import LimitError, Limits
from nmt.commands.serve.models import ServedModel
from nmt.commands.serve.schemas import (
    AlignBody,
    AlignReply,
    ErrorReply,
    HealthReply,
    ModelsReply,
    ScoreBody,
    ScoreReply,
    TranslateBody,
    TranslateReply,
    VocabularyReply,
)
from nmt.errors import NMTError

__all__ = ["ServedModel", "create_app"]

PAGE = Path(__file__).parent / "page"  # index.html, page.js, page.css, favicon.svg
PAGE_FILE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorReply, "description": description}
    for code, description in (
        (400, "options that cannot go together, or text the model cannot take"),
        (404, "no such model"),
        (413, "a limit passed: body size, sentences, characters or beam"),
        (422, "malformed JSON, or a field of the wrong type, missing, unknown or not valid"),
        (500, "an unexpected error while decoding"),
        (503, "the server is shutting down"),
    )
}


class NotFound(Exception):
    """A model or file the server does not have (404)."""


def create_app(
    served: Sequence[ServedModel], limits: Limits = Limits(), batching: Batching = Batching()
) -> FastAPI:
    """The app over ``served`` (the first: the default model), with one decode thread."""
    if not served:
        raise ValueError("create_app: no models to serve")
    models = {model.name: model for model in served}
    batcher = Batcher(batching)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await batcher.close()

    app = FastAPI(
        title="nmt",
        version=__version__,
        summary="Attention-based RNN translation: translate, score and align with the served "
        "models.",
        lifespan=lifespan,
        redoc_url=None,
    )
    app.state.batcher = batcher
    app.add_middleware(BodyLimit, limits=limits)
    app.add_middleware(HeadAsGet)
    _add_error_handlers(app)

    def pick(name: str | None) -> ServedModel:
        if name is None:
            return served[0]
        if name not in models:
            raise NotFound(
                f"model: {name!r} is not served here; this server has {', '.join(models)}"
            )
        return models[name]

    @app.get("/api/health")
    async def health() -> HealthReply:
        """The server is up, with these models."""
        return HealthReply(status="ok", models=list(models))

    @app.get("/api/models")
    async def model_info() -> ModelsReply:
        """Each served model: its config summary and config, vocabulary sizes, training
        figures; the first is the default."""
        return ModelsReply(models=[model.info() for model in served])

    @app.get("/api/models/{name}/vocabulary", responses=ERRORS)
    async def vocabulary(
        name: str,
        side: Literal["source", "target"] = "target",
        offset: int = Query(0, ge=0),
        limit: int = Query(1000, ge=1, le=100_000),
    ) -> VocabularyReply:
        """A slice of a model's source or target pieces, by id."""
        tokenizer = pick(name).translator.tokenizer
        processor = tokenizer.src if side == "source" else tokenizer.trg
        size = int(processor.get_piece_size())
        ids = range(offset, min(size, offset + limit))
        pieces = [str(processor.id_to_piece(i)) for i in ids]
        return VocabularyReply(side=side, size=size, offset=offset, pieces=pieces)

    @app.post("/api/translate", responses=ERRORS)
    async def translate(body: TranslateBody) -> TranslateReply:
        """Translate sentences: per sentence the line `nmt translate` writes, its score, the
        n-best list and, on request, the attention and word alignment."""
        started = time.perf_counter()
        model = pick(body.model)
        done = await batcher.submit(translate_job(model, body, limits))
        return TranslateReply(
            model=model.name,
            translations=done.result,
            batched_with=done.batched_with,
            elapsed_ms=elapsed_ms(started),
        )

    @app.post("/api/score", responses=ERRORS)
    async def score(body: ScoreBody) -> ScoreReply:
        """Forced scores of given translations, as `nmt score` gives them."""
        model = pick(body.model)
        done = await batcher.submit(score_job(model, body, limits))
        return ScoreReply(model=model.name, scores=done.result)

    @app.post("/api/align", responses=ERRORS)
    async def align(body: AlignBody) -> AlignReply:
        """Word alignments of given translations, as `nmt align` gives them."""
        model = pick(body.model)
        done = await batcher.submit(align_job(model, body, limits))
        return AlignReply(model=model.name, alignments=done.result)

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        if not (PAGE / "index.html").is_file():
            raise NotFound("the page is not installed here (no index.html); the API: /docs")
        return _page_file("index.html")

    @app.get("/page/{name}", include_in_schema=False)
    async def page(name: str) -> FileResponse:
        return _page_file(name)

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> FileResponse:
        """The page's icon (an SVG), for a browser that asks here: no 404 in its console."""
        return _page_file("favicon.svg")

    return app


def _page_file(name: str) -> FileResponse:
    """A file of the page (one of the page folder's own files, by name)."""
    path = PAGE / name
    if not PAGE_FILE.fullmatch(name) or not path.is_file():
        raise NotFound(f"/page/{name}: no such file of the page")
    media = mimetypes.guess_type(name)[0] or "application/octet-stream"
    return FileResponse(path, media_type=media)


def _error(status: int, message: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    one_line = " ".join(line.strip() for line in message.splitlines() if line.strip())
    return JSONResponse({"error": one_line}, status_code=status, headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as ``{"error": ...}`` with its status (module docstring)."""

    @app.exception_handler(NMTError)
    async def nmt_error(request: Request, exc: NMTError) -> JSONResponse:
        return _error(413 if isinstance(exc, LimitError) else 400, str(exc))

    @app.exception_handler(ShuttingDown)
    async def shutting_down(request: Request, exc: ShuttingDown) -> JSONResponse:
        return _error(503, "the server is shutting down; send the request again")

    @app.exception_handler(NotFound)
    async def not_found(request: Request, exc: NotFound) -> JSONResponse:
        return _error(404, str(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(422, invalid_message(exc.errors(), request.headers.get("content-type")))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        where = f"{request.method} {request.url.path}"
        unreadable = unreadable_body(exc.__cause__)
        if unreadable is not None:
            return _error(422, unreadable)
        if exc.status_code == 404:
            message = f"{where}: no such endpoint; the API is under /api (see /docs)"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "another method")
            message = f"{where}: not allowed; this endpoint takes {allowed}"
        else:
            message = f"{where}: {exc.detail}"
        return _error(exc.status_code, message, exc.headers)  # a 405's Allow, which HTTP asks

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        return _error(
            500,
            f"internal error: {type(exc).__name__}: {exc}; the server goes on (its log has "
            f"the traceback)",
        )


def invalid_message(errors: Sequence[Any], content_type: str | None = None) -> str:
    """FastAPI's validation errors as one line: each field and what was wrong with it."""
    parts = []
    for error in errors:
        where = ".".join(str(part) for part in error["loc"][1:]) or "request body"
        if where == "request body" and isinstance(error.get("input"), bytes):
            given = f"Content-Type {content_type}" if content_type else "no Content-Type"
            parts.append(
                f"request body: not read as JSON ({given}); send a JSON object with "
                f"Content-Type: application/json"
            )
        elif error["type"] == "json_invalid":
            reason = error.get("ctx", {}).get("error", "")
            parts.append(f"request body: not valid JSON ({reason}); send a JSON object")
        elif error["type"] == "missing" and where == "request body":
            parts.append("request body: missing; send a JSON object")
        elif error["type"] == "extra_forbidden":
            parts.append(f"{where}: not a field of this request (see /docs)")
        else:
            parts.append(f"{where}: {error['msg']}")
    return "; ".join(parts) or "the request is not valid"


def unreadable_body(cause: BaseException | None) -> str | None:
    """Why Python's json could not read a body that is not malformed JSON (FastAPI's 400
    "error parsing the body", raised from ``cause``), as one line; None for another cause."""
    if isinstance(cause, UnicodeDecodeError):
        byte = cause.object[cause.start]
        return (
            f"request body: not valid UTF-8 (byte 0x{byte:02x} at offset {cause.start}: "
            f"{cause.reason}); send a JSON object in UTF-8"
        )
    if isinstance(cause, ValueError):  # json's only other ValueError: int()'s digit limit
        digits = sys.get_int_max_str_digits()
        return (
            f"request body: not valid JSON (an integer too long: more than {digits} "
            f"digits); send a JSON object"
        )
    if isinstance(cause, RecursionError):
        return "request body: not valid JSON (nested too deep); send a JSON object"
    return None


class HeadAsGet:
    """HEAD wherever GET is answered, as HTTP asks (RFC 9110, 9.3.2; health checkers use
    it): a HEAD request is handled as a GET and its reply sent without the body (the
    headers, Content-Length too, are GET's)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def without_body(message: Message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, without_body)


# A body past --max-body is read and thrown away before its 413 goes out, as nginx's "lingering
# close" does: a client that writes its whole body before it reads the reply (Python's urllib)
# would otherwise find the connection reset and never see the 413. The discarding is bounded:
# at most DISCARD_BYTES past the limit, for at most DISCARD_SECONDS; a body longer or slower
# than that is cut off (its Content-Length past the bound: at once, none of it read), and such
# a client may still see a reset.
DISCARD_BYTES = 32 * 2**20
DISCARD_SECONDS = 10.0


class BodyLimit:
    """No request body over ``limits.max_body`` bytes: refused (413) by its Content-Length,
    or, a body of unknown length (chunked), as soon as more arrives than the limit, in both
    cases after the rest of the body is discarded (``DISCARD_BYTES``, ``DISCARD_SECONDS``).
    A body within the limit is read here and handed on whole."""

    def __init__(self, app: ASGIApp, limits: Limits):
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limits.max_body
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"")
        declared = int(length) if length.isdigit() else None
        if declared is not None and declared > limit:
            # a client that expects 100-continue sends no body unless told to: none to read
            waits = headers.get(b"expect", b"").lower() == b"100-continue"
            if declared <= limit + DISCARD_BYTES and not waits:
                if not await _discard(receive, declared):
                    return
            await _error(413, self.limits.body_message(declared))(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            more = message.get("more_body", False)
            size += len(chunk)
            if size > limit:
                if more and not await _discard(receive, limit + DISCARD_BYTES - size):
                    return
                await _error(413, self.limits.body_message(None))(scope, receive, send)
                return
            chunks.append(chunk)
            if not more:
                break
        whole: Message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        given = False

        async def replay() -> Message:
            nonlocal given
            if not given:
                given = True
                return whole
            return await receive()

        await self.app(scope, replay, send)


async def _discard(receive: Receive, most: int) -> bool:
    """Read and drop the rest of a body: until its end, ``most`` bytes or ``DISCARD_SECONDS``,
    whichever comes first. False if the client went away meanwhile (no reply to send)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DISCARD_SECONDS
    while most > 0:
        try:
            message = await asyncio.wait_for(receive(), deadline - loop.time())
        except asyncio.TimeoutError:
            return True
        if message["type"] == "http.disconnect":
            return False
        most -= len(message.get("body", b""))
        if not message.get("more_body", False):
            return True
    return True
