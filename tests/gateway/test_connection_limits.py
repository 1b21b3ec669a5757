"""The server's connection limits (gateway/connection_limits.py) on a real uvicorn over loopback:
a client trickling its headers is closed after the header deadline, a kept-alive connection gets a
new deadline per request, and connections past the cap are closed on accept while the open ones
keep working."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from gateway.connection_limits import protocol_class


async def _ok(request):  # noqa: ANN001 - starlette handler
    return PlainTextResponse("ok")


class _Server:
    def __init__(self, header_timeout_s: float, max_connections: int) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        app = Starlette(routes=[Route("/", _ok)])
        self.protocol = protocol_class(header_timeout_s, max_connections)
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off",
                                http=self.protocol)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> _Server:
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)


def _closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closes ``sock`` (EOF or reset) within ``within_s`` seconds."""
    sock.settimeout(within_s)
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _get(sock: socket.socket) -> bytes:
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\nok" not in data:
        chunk = sock.recv(1024)
        assert chunk, f"closed after {data!r}"
        data += chunk
    return data


def test_a_client_trickling_its_headers_is_closed_after_the_deadline():
    with _Server(header_timeout_s=0.5, max_connections=100) as server:
        slow = server.connect()
        slow.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # the headers never end
        for _ in range(3):  # still trickling: a byte now and then does not extend the deadline
            time.sleep(0.1)
            slow.sendall(b"X")
        assert _closed_by_server(slow, within_s=5.0)
        silent = server.connect()  # connects and says nothing
        assert _closed_by_server(silent, within_s=5.0)
        assert server.protocol.expired_headers >= 2


def test_a_kept_alive_connection_gets_a_deadline_per_request_not_per_connection():
    with _Server(header_timeout_s=0.6, max_connections=100) as server:
        conn = server.connect()
        for _ in range(4):  # 4 x 0.3 s: past one deadline in all, each request inside its own
            assert b"200 OK" in _get(conn)
            time.sleep(0.3)
        assert b"200 OK" in _get(conn)
        assert server.protocol.expired_headers == 0


def test_connections_past_the_cap_are_closed_on_accept_and_the_open_ones_keep_working():
    with _Server(header_timeout_s=30.0, max_connections=3) as server:
        held = [server.connect() for _ in range(3)]
        assert b"200 OK" in _get(held[0])  # all three are being served (the cap counts them)
        extra = server.connect()
        assert _closed_by_server(extra, within_s=5.0)
        assert server.protocol.refused_connections >= 1
        for sock in held:  # the connections already open are not the ones dropped
            assert b"200 OK" in _get(sock)
        held[2].close()
        deadline = time.time() + 5
        while True:  # once one is gone, a new connection is served again
            again = server.connect()
            try:
                if b"200 OK" in _get(again):
                    break
            except (AssertionError, ConnectionResetError, BrokenPipeError):
                assert time.time() < deadline, "no new connection was served after one closed"
                time.sleep(0.1)
            finally:
                again.close()


def test_prefixgate_serve_applies_the_config_files_limits(tmp_path):
    """End to end: `prefixgate serve` with `header_timeout_s` / `max_connections` in its config file."""
    from tests.serverutil import serve_tiny, stop

    config = tmp_path / "gw.toml"
    config.write_text("[server]\nheader_timeout_s = 0.5\nmax_connections = 50\n")
    url, proc = serve_tiny(tmp_path / "home", "--config", str(config), "--model", "none")
    try:
        port = int(url.rsplit(":", 1)[1])
        silent = socket.create_connection(("127.0.0.1", port), timeout=10)
        assert _closed_by_server(silent, within_s=8.0)  # uvicorn alone would hold it for ever
    finally:
        stop(proc)
