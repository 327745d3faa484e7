"""What every HTTP request passes before a route: CORS (only with --allowed-origins), API keys, a JSON content type
on POST, and a Retry-After on every 503. A plain ASGI middleware, so streamed responses pass through untouched.
Also the server's HTTP settings (HTTPLimits, which http_limits.py enforces in uvicorn) and their `serve` flags.

    /health, /version          open
    /metrics                   open unless metrics_require_key
    everything else            needs `Authorization: Bearer <key>` when keys are set (401 otherwise)
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
from dataclasses import dataclass

from .protocol import error_json

API_KEY_ENV = "MLASERVE_API_KEY"  # several keys: comma-separated
OPEN_PATHS = ("/health", "/version")
JSON_TYPES = ("application/json",)  # and any application/*+json
BODYLESS_POSTS = ("/reset_prefix_cache", "/flush_cache")  # admin commands: no body, so no content type


FLAGS = {  # HTTPLimits field -> its `mlaserve serve` flag, named in errors
    "retry_after_s": "retry_after_s",
    "timeout_keep_alive_s": "--timeout-keep-alive",
    "header_timeout_s": "--header-timeout",
    "max_header_bytes": "--h11-max-incomplete-event-size",
    "max_header_count": "--h11-max-header-count",
}


@dataclass(frozen=True)
class HTTPLimits:
    """The server's HTTP-level settings (`mlaserve serve` flags): keys, CORS, and what uvicorn enforces
    (http_limits.py)."""

    api_keys: tuple[str, ...] = ()
    metrics_require_key: bool = False
    allowed_origins: tuple[str, ...] = ()  # empty: no CORS headers at all (browsers cannot read the responses)
    retry_after_s: int = 1  # the Retry-After of a 503
    timeout_keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after this
    header_timeout_s: float = 10.0  # a request's line and headers must arrive within this, else 408 and close
    max_header_bytes: int = 64 << 10  # h11's max incomplete event size: larger request heads get 431
    max_header_count: int = 256  # more header lines get 431

    def __post_init__(self):
        if any(not k or k != k.strip() for k in self.api_keys):
            raise ValueError("--api-key: keys must be non-empty, without surrounding spaces")
        for name, flag in FLAGS.items():
            if getattr(self, name) <= 0:
                raise ValueError(f"{flag}: must be > 0, got {getattr(self, name)!r}")


def api_error(message: str, status: int, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    """An OpenAI-style error body for the statuses the routes never give (401, 408, 415, 431)."""
    body = error_json(message, status, param)
    body["error"]["type"] = kind
    return body


def api_keys(flags: list[str] | None, environ=os.environ) -> tuple[str, ...]:
    """--api-key values (repeatable) and $MLASERVE_API_KEY (comma-separated), in order, without repeats."""
    env = [k.strip() for k in environ.get(API_KEY_ENV, "").split(",") if k.strip()]
    return tuple(dict.fromkeys([*(flags or []), *env]))


def add_http_args(p: argparse.ArgumentParser) -> None:
    """The `mlaserve serve` flags of HTTPLimits."""
    d = HTTPLimits()
    g = p.add_argument_group("http")
    g.add_argument(
        "--api-key",
        action="append",
        default=None,
        help=f"a key clients must send as 'Authorization: Bearer <key>' (repeatable; also ${API_KEY_ENV}, "
        "comma-separated); /health and /version stay open",
    )
    g.add_argument("--metrics-require-key", action="store_true", help="/metrics needs an API key too")
    g.add_argument(
        "--allowed-origins",
        action="append",
        default=None,
        help="CORS: origins browsers may call from (repeatable or comma-separated; '*' for any); off by default",
    )
    g.add_argument(
        "--timeout-keep-alive", type=float, default=d.timeout_keep_alive_s, help="idle keep-alive connections close"
    )
    g.add_argument(
        "--header-timeout",
        type=float,
        default=d.header_timeout_s,
        help="seconds for a request's line and headers to arrive; later: 408 and the connection closed",
    )
    g.add_argument(
        "--h11-max-incomplete-event-size",
        type=int,
        default=d.max_header_bytes,
        help="largest request line and headers in bytes; larger: 431",
    )
    g.add_argument("--h11-max-header-count", type=int, default=d.max_header_count, help="more header lines: 431")


def http_limits_from_args(args) -> HTTPLimits:
    """Raises ValueError naming the flag."""
    origins = [o.strip() for v in args.allowed_origins or () for o in v.split(",") if o.strip()]
    return HTTPLimits(
        api_keys=api_keys(args.api_key),
        metrics_require_key=args.metrics_require_key,
        allowed_origins=tuple(origins),
        timeout_keep_alive_s=args.timeout_keep_alive,
        header_timeout_s=args.header_timeout,
        max_header_bytes=args.h11_max_incomplete_event_size,
        max_header_count=args.h11_max_header_count,
    )


def _header(scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return v.decode("latin-1")
    return None


def _is_json(content_type: str | None) -> bool:
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media in JSON_TYPES or (media.startswith("application/") and media.endswith("+json"))


class Guard:
    """ASGI middleware: API keys (401), JSON content type on POST (415), Retry-After on every 503."""

    def __init__(self, app, limits: HTTPLimits):
        self.app, self.limits = app, limits
        self.keys = [k.encode() for k in limits.api_keys]

    def needs_key(self, path: str) -> bool:
        if not self.keys or path in OPEN_PATHS:
            return False
        return path != "/metrics" or self.limits.metrics_require_key

    def key_ok(self, scope) -> bool | None:
        """True: a valid key; False: a wrong one; None: none sent."""
        auth = _header(scope, b"authorization")
        if auth is None:
            return None
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer":
            return False
        token = token.strip().encode()
        # compare with every key (no early exit): the time taken says nothing about which key came close
        return any([hmac.compare_digest(token, k) for k in self.keys])

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method = scope["path"], scope["method"]
        if method != "OPTIONS" and self.needs_key(path):
            ok = self.key_ok(scope)
            if not ok:
                if ok is None:
                    msg, challenge = "missing API key: send the header 'Authorization: Bearer <key>'", "Bearer"
                else:
                    msg, challenge = "invalid API key", 'Bearer error="invalid_token"'
                body = api_error(f"authorization: {msg}", 401, "authorization", "authentication_error")
                return await _respond(send, 401, body, [(b"www-authenticate", challenge.encode())])
        if method == "POST" and path not in BODYLESS_POSTS and not _is_json(_header(scope, b"content-type")):
            got = _header(scope, b"content-type")
            msg = (
                f"content-type: POST bodies must be application/json, got {got!r}"
                if got
                else ("content-type: POST bodies must be application/json; the header is missing")
            )
            return await _respond(send, 415, api_error(msg, 415, "content-type"))
        retry = str(self.limits.retry_after_s).encode()

        async def send_(message):
            if message["type"] == "http.response.start" and message["status"] == 503:
                headers = list(message.get("headers", ()))
                if not any(k.lower() == b"retry-after" for k, _ in headers):
                    message = {**message, "headers": [*headers, (b"retry-after", retry)]}
            await send(message)

        await self.app(scope, receive, send_)


async def _respond(send, status: int, body: dict, headers: list | None = None) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


def install(app, limits: HTTPLimits) -> None:
    """The guard on a FastAPI/Starlette app, and CORS around it when origins are allowed (so a preflight is
    answered before the key check: browsers send no Authorization on OPTIONS)."""
    app.add_middleware(Guard, limits=limits)
    if limits.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(limits.allowed_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type"],
            expose_headers=["Retry-After"],
            max_age=600,
        )
