"""uvicorn's HTTP/1.1 protocol (h11) with limits on the request head, and protocol errors as OpenAI-style JSON.

uvicorn times out only idle keep-alive connections, and only after a first response: a client that opens a
connection and sends part of a request line (or one header byte a minute) holds it forever. Here a request's line and
headers must arrive within header_timeout_s of the connection opening (or of the previous response ending), else the
server answers 408 and closes. A head larger than max_header_bytes (h11's max incomplete event size) or with more than
max_header_count lines gets 431; any other malformed request 400, each as a JSON error while the socket is writable.
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .guard import HTTPLimits, api_error

DRAIN_S = 2.0  # after an error response, the client's unread bytes are drained this long before the close
_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class HeadTooLarge(h11.RemoteProtocolError):
    pass


def protocol_class(limits: HTTPLimits) -> type[H11Protocol]:
    """The h11 protocol with these limits (uvicorn.Config(http=...) takes a class)."""
    return type("LimitedH11Protocol", (LimitedH11Protocol,), {"limits": limits})


def uvicorn_kwargs(limits: HTTPLimits) -> dict:
    """uvicorn.Config arguments for these limits."""
    return dict(
        http=protocol_class(limits),
        timeout_keep_alive=limits.timeout_keep_alive_s,
        h11_max_incomplete_event_size=limits.max_header_bytes,
    )


class LimitedH11Protocol(H11Protocol):
    limits = HTTPLimits()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer = None
        self._draining = False
        self._error: h11.RemoteProtocolError | None = None
        next_event = self.conn.next_event

        def checked_next_event():  # the error that uvicorn's handle_events swallows, and the header count
            try:
                event = next_event()
            except h11.RemoteProtocolError as e:
                self._error = e
                raise
            if isinstance(event, h11.Request):
                self._check_head(event)
            return event

        self.conn.next_event = checked_next_event
        self._arm_head_timer()

    def _check_head(self, event: h11.Request) -> None:
        """h11 bounds only a head that arrives in pieces; one that arrives whole is measured here."""
        lim = self.limits
        if len(event.headers) > lim.max_header_count:
            msg = f"headers: {len(event.headers)} header lines exceed the limit of {lim.max_header_count}"
        elif len(event.target) + sum(len(k) + len(v) + 4 for k, v in event.headers) > lim.max_header_bytes:
            msg = f"headers: the request line and headers exceed the limit of {lim.max_header_bytes} bytes"
        else:
            return
        self._error = HeadTooLarge(msg, error_status_hint=431)
        raise self._error

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def data_received(self, data: bytes) -> None:
        if self._draining:  # the rest of a refused request: read and dropped (see _close_after_error)
            return
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the request's head is in: its body is the route's business
            self._cancel_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_head_timer()  # the next request on this connection gets the same deadline

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a response is still being written (a pipelined request waits for it)
        partial = bool(self.conn.trailing_data[0])
        if partial:  # a request was started: say why it is dropped; an idle connection is just closed
            msg = f"request: the request line and headers did not arrive within {self.limits.header_timeout_s:g} s"
            self._write_error(408, msg, "request")
            self._close_after_error()
        else:
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        e = self._error
        status = e.error_status_hint if e is not None and e.error_status_hint in (400, 431) else 400
        if status == 431 and not isinstance(e, HeadTooLarge):
            text = f"headers: the request line and headers exceed the limit of {self.limits.max_header_bytes} bytes"
        else:
            text = f"request: malformed HTTP request ({e})" if e is not None and status == 400 else str(e)
        self.logger.warning("%s", text)
        self._write_error(status, text, "headers" if status == 431 else "request")
        self._close_after_error()

    def _close_after_error(self) -> None:
        """Send the error, then end our side, but read the client's leftover bytes for a moment before closing:
        closing a socket with unread data resets the connection, and the client would never see the status."""
        if self.transport.can_write_eof():
            self._draining = True
            self.transport.write_eof()
            self.loop.call_later(DRAIN_S, self.transport.close)
        else:
            self.transport.close()

    def _write_error(self, status: int, message: str, param: str) -> None:
        """A JSON error written straight to the socket: h11 cannot answer a request it never parsed."""
        body = json.dumps(api_error(message, status, param)).encode()
        head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
        self.transport.write(head % (status, _REASONS[status], len(body)) + body)
