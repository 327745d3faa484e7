"""A failure while serving one request answers 500 with an error id and no exception text; the server log holds the
traceback under that id. The connection stays open for the client's next request (keep-alive)."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable

from starlette.responses import Response

log = logging.getLogger("mlaserve.server")


def new_error_id() -> str:
    return "err-" + secrets.token_hex(8)


def internal_error_message(error_id: str, exc: BaseException | None = None) -> str:
    """The client's message: the id, and the error's own words only where it is marked public (a dead rank)."""
    msg = f"internal error {error_id}: the server log holds the details under this id"
    return f"{msg}; {exc}" if getattr(exc, "public", False) else msg


def log_internal_error(error_id: str, what: str, exc: BaseException) -> None:
    log.error("%s: %s", error_id, what, exc_info=(type(exc), exc, exc.__traceback__))


class InternalErrors:
    """ASGI middleware inside Starlette's last-resort handler, which would answer and then re-raise (uvicorn then
    drops the connection): here the exception ends with the 500, unless the response had started (then nothing
    else can be sent and the connection must close)."""

    def __init__(self, app, respond: Callable[[str, Exception], Response]):
        self.app, self.respond = app, respond

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_)
        except Exception as e:  # noqa: BLE001 - a bug in one request must not reach the client or the connection
            eid = new_error_id()
            log_internal_error(eid, f"unexpected error serving {scope.get('method')} {scope.get('path')}", e)
            if started:
                raise
            await self.respond(eid, e)(scope, receive, send)
