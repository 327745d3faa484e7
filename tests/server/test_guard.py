"""The HTTP guard and limits without a model: API keys (401), JSON content type on POST (415), Retry-After on 503,
CORS only when asked, and uvicorn's request-head limits (408 on a half-open connection, 431 on a large or crowded
head, 400 as JSON on garbage), on a stand-in app served by uvicorn with the server's protocol."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from mlaserve.server import guard
from mlaserve.server.guard import HTTPLimits, api_keys
from mlaserve.server.http_limits import uvicorn_kwargs


def stand_in_app(limits: HTTPLimits) -> FastAPI:
    app = FastAPI()
    guard.install(app, limits)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": "0"}

    @app.get("/metrics")
    async def metrics():
        return "m"

    @app.get("/v1/models")
    async def models():
        return {"data": []}

    @app.post("/v1/echo")
    async def echo(request: Request):
        return await request.json()

    @app.get("/v1/busy")
    async def busy():
        return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)

    return app


class Serving:
    def __init__(self, limits: HTTPLimits):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(stand_in_app(limits), log_level="critical", **uvicorn_kwargs(limits))
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline
            time.sleep(0.01)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def keyed():
    s = Serving(HTTPLimits(api_keys=("k1", "k2"), header_timeout_s=0.5, max_header_bytes=4096, max_header_count=20))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def open_cors():
    s = Serving(HTTPLimits(allowed_origins=("https://app.example",), metrics_require_key=False))
    yield s
    s.stop()


def test_api_keys_from_flags_and_env():
    assert api_keys(["a"], {"MLASERVE_API_KEY": " b, c ,,a"}) == ("a", "b", "c")
    assert api_keys(None, {}) == ()
    with pytest.raises(ValueError, match="--header-timeout"):
        HTTPLimits(header_timeout_s=0)


def test_v1_needs_a_key(keyed):
    r = httpx.get(f"{keyed.url}/v1/models")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    err = r.json()["error"]
    assert err["type"] == "authentication_error" and err["param"] == "authorization" and err["code"] == 401
    r = httpx.get(f"{keyed.url}/v1/models", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and "invalid_token" in r.headers["www-authenticate"]
    r = httpx.get(f"{keyed.url}/v1/models", headers={"Authorization": "Basic k1"})
    assert r.status_code == 401
    for key in ("k1", "k2"):
        assert httpx.get(f"{keyed.url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    # an unknown route under a guarded prefix says nothing without a key
    assert httpx.get(f"{keyed.url}/v1/nothing-here").status_code == 401


def test_open_routes(keyed):
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(f"{keyed.url}{path}").status_code == 200, path


def test_metrics_require_key():
    s = Serving(HTTPLimits(api_keys=("k",), metrics_require_key=True))
    try:
        assert httpx.get(f"{s.url}/metrics").status_code == 401
        assert httpx.get(f"{s.url}/metrics", headers={"Authorization": "Bearer k"}).status_code == 200
        assert httpx.get(f"{s.url}/health").status_code == 200
    finally:
        s.stop()


def test_post_needs_json(keyed):
    auth = {"Authorization": "Bearer k1"}
    r = httpx.post(f"{keyed.url}/v1/echo", content=b'{"a": 1}', headers={**auth, "Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["param"] == "content-type"
    assert "text/plain" in r.json()["error"]["message"]
    r = httpx.post(f"{keyed.url}/v1/echo", content=b'{"a": 1}', headers=auth)  # no content type at all
    assert r.status_code == 415
    r = httpx.post(f"{keyed.url}/v1/echo", json={"a": 1}, headers=auth)
    assert r.status_code == 200 and r.json() == {"a": 1}
    ct = {**auth, "Content-Type": "application/json; charset=utf-8"}
    assert httpx.post(f"{keyed.url}/v1/echo", content=b"{}", headers=ct).status_code == 200


def test_cross_site_text_plain_post_refused(open_cors):
    """A browser's 'simple' cross-site POST (text/plain, a foreign Origin) is never executed."""
    r = httpx.post(
        f"{open_cors.url}/v1/echo",
        content=b'{"prompt": "x"}',
        headers={"Content-Type": "text/plain", "Origin": "https://evil.example", "Host": "evil.example"},
    )
    assert r.status_code == 415
    assert "access-control-allow-origin" not in r.headers


def test_retry_after_on_503(keyed):
    r = httpx.get(f"{keyed.url}/v1/busy", headers={"Authorization": "Bearer k1"})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"


def test_cors_off_by_default(keyed):
    r = httpx.options(
        f"{keyed.url}/v1/models",
        headers={"Origin": "https://app.example", "Access-Control-Request-Method": "GET"},
    )
    assert "access-control-allow-origin" not in r.headers


def test_cors_allowed_origin(open_cors):
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(f"{open_cors.url}/v1/echo", headers={"Origin": "https://app.example", **pre})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    r = httpx.options(f"{open_cors.url}/v1/echo", headers={"Origin": "https://evil.example", **pre})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.get(f"{open_cors.url}/v1/models", headers={"Origin": "https://app.example"})
    assert r.headers["access-control-allow-origin"] == "https://app.example"


def _raw(port: int, data: bytes, timeout: float = 5) -> bytes:
    """Send data on a fresh connection, then read until the server closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def _status_and_json(resp: bytes) -> tuple[int, dict]:
    head, _, body = resp.partition(b"\r\n\r\n")
    assert b"application/json" in head, head
    return int(head.split(b" ")[1]), json.loads(body)


def test_half_open_connection_times_out(keyed):
    t0 = time.monotonic()
    resp = _raw(keyed.port, b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the head never ends
    assert time.monotonic() - t0 < 4
    status, body = _status_and_json(resp)
    assert status == 408 and body["error"]["param"] == "request"


def test_idle_connection_closed(keyed):
    t0 = time.monotonic()
    assert _raw(keyed.port, b"") == b""  # opened, nothing sent: closed within the header timeout
    assert time.monotonic() - t0 < 4


def test_slow_header_drip_times_out(keyed):
    with socket.create_connection(("127.0.0.1", keyed.port), timeout=5) as s:
        s.sendall(b"GET /health HTTP/1.1\r\n")
        t0 = time.monotonic()
        try:
            for _ in range(20):  # one header byte every 0.1 s: each byte would reset a per-read timer
                s.sendall(b"X")
                time.sleep(0.1)
        except OSError:
            pass
        assert s.recv(65536).startswith(b"HTTP/1.1 408")
        assert time.monotonic() - t0 < 3


def test_keep_alive_then_timeout(keyed):
    with socket.create_connection(("127.0.0.1", keyed.port), timeout=5) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while not first.endswith(b'{"status":"ok"}'):
            first += s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        s.sendall(b"GET /health HTTP/1.1\r\n")  # a second request on the connection, never finished
        resp = b""
        while chunk := s.recv(65536):
            resp += chunk
        assert resp.startswith(b"HTTP/1.1 408")


def test_large_header_431(keyed):
    resp = _raw(keyed.port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8000 + b"\r\n\r\n")
    status, body = _status_and_json(resp)
    assert status == 431 and "4096" in body["error"]["message"]


def test_one_megabyte_header_gets_a_status(keyed):
    """Far over the limit, sent whole: the client still reads the 431 (no reset with the data unread)."""
    resp = _raw(keyed.port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
    status, body = _status_and_json(resp)
    assert status == 431 and body["error"]["param"] == "headers"


def test_many_headers_431(keyed):
    headers = b"".join(b"X-%d: 1\r\n" % i for i in range(30))
    status, body = _status_and_json(_raw(keyed.port, b"GET /health HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n"))
    assert status == 431 and "20" in body["error"]["message"]


def test_garbage_is_json_400(keyed):
    status, body = _status_and_json(_raw(keyed.port, b"NOT HTTP AT ALL\r\n\r\n"))
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    # the server still serves
    assert httpx.get(f"{keyed.url}/health").status_code == 200


def test_serve_flags(monkeypatch, capsys):
    from mlaserve.cli import build_parser, main
    from mlaserve.server.guard import http_limits_from_args

    monkeypatch.setenv("MLASERVE_API_KEY", "e1,e2")
    argv = ["serve", "--api-key", "a", "--api-key", "b", "--allowed-origins", "https://x,https://y"]
    argv += ["--allowed-origins", "https://z", "--header-timeout", "3", "--h11-max-header-count", "50"]
    lim = http_limits_from_args(build_parser(argv).parse_args(argv))
    assert lim.api_keys == ("a", "b", "e1", "e2")
    assert lim.allowed_origins == ("https://x", "https://y", "https://z")
    assert lim.header_timeout_s == 3 and lim.max_header_count == 50 and not lim.metrics_require_key
    monkeypatch.delenv("MLASERVE_API_KEY")
    assert main(["serve", "--metrics-require-key"]) == 2
    assert "--metrics-require-key: give --api-key" in capsys.readouterr().err
    assert main(["serve", "--header-timeout", "0"]) == 2
    assert "--header-timeout: must be > 0" in capsys.readouterr().err
