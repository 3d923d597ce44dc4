"""The body of `nmt serve`: check the optional dependencies and every model path, load the
models once, take the address, then serve until interrupted."""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nmt.commands.common import Models
from nmt.commands.serve.batching import Batching
from nmt.commands.serve.limits import Limits
from nmt.errors import ConfigError, DataError

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

INSTALL = "pip install -e '.[serve]'"


@dataclass(frozen=True)
class ServeRequest:
    """What `nmt serve` is asked: the models (each ``--model`` a model of its own, with the
    device and precision), where to listen, the per-request limits and the batching."""

    models: Sequence[Models]
    host: str = "127.0.0.1"
    port: int = 8000
    limits: Limits = Limits()
    batching: Batching = Batching()


def require_extra() -> None:
    """FastAPI and uvicorn (the extra ``serve``) are installed, or a ConfigError saying how
    to install them."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"nmt serve needs FastAPI and uvicorn ({exc.name or 'they'} is not installed): "
            f"{INSTALL}"
        ) from None


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host``:``port`` (0: any free port), or a DataError saying why
    not: a client that connects once the address is printed waits for the server, rather
    than being refused while the app starts."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, kind, _, _, address = info[0]
        sock = socket.socket(family, kind)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)  # connections wait from now, not from uvicorn's start
    except OSError as exc:
        raise DataError(
            f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc}); "
            f"choose another --port (or --host)"
        ) from None
    return sock


def stopping_server(app: FastAPI) -> uvicorn.Server:
    """uvicorn's server over ``app``, whose shutdown (Ctrl-C, SIGTERM) first closes the
    app's batcher: the requests still waiting or decoding get their 503 at once and the
    search in the decode thread stops at its next step, so the server neither waits out its
    graceful timeout nor exits after the decoding ends."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            await app.state.batcher.close()
            await super().shutdown(sockets)
            if self.force_exit:  # a second Ctrl-C: uvicorn skips the app's own shutdown,
                await self.lifespan.shutdown()  # whose task, cancelled at exit, logs an error

    return Server(uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=5))


def serve_command(request: ServeRequest, ready: Callable[[str], None] = lambda m: None) -> None:
    """`nmt serve`: every error (a missing extra, a bad model path or checkpoint, an address
    in use) is raised before the server listens; ``ready`` is called with the address once
    the models are loaded. Returns when the server is stopped (Ctrl-C, SIGTERM)."""
    require_extra()
    from nmt.commands.serve.app import create_app
    from nmt.commands.serve.models import load_models

    served = load_models(request.models)
    sock = listen(request.host, request.port)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    names = ", ".join(model.name for model in served)
    ready(f"serving {names} at http://{shown}:{port}/ (the API: /docs); Ctrl-C stops it")
    app = create_app(served, request.limits, request.batching)
    server = stopping_server(app)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
