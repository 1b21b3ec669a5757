"""gateway.http1, the direct transport's keep-alive HTTP/1.1 client, against real loopback servers:
uvicorn (what a vLLM / SGLang / PrefixGate upstream runs) and raw asyncio peers that misbehave."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable

import pytest
from gateway_fakes import LoopbackServer

from gateway.http1 import HIGH_WATER, Http1Client, HttpProtocolError
from gateway.upstream import DirectOpenAIClient, ProviderError, _provider_error


async def _asgi(scope, receive, send):
    """Echoes what it received (and the client's port: which connection); /stream sends 5 pieces."""
    if scope["type"] == "lifespan":
        while (msg := await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    body, more = b"", True
    while more:
        msg = await receive()
        body, more = body + msg.get("body", b""), msg.get("more_body", False)
    if scope["path"].endswith("/stream"):  # no length: uvicorn sends it chunked
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(5):
            await send({"type": "http.response.body", "body": f"data: {i}\n\n".encode(), "more_body": True})
            await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b""})
        return
    out = json.dumps({"path": scope["path"], "port": scope["client"][1], "body": body.decode(),
                      "headers": [[k.decode(), v.decode()] for k, v in scope["headers"]]}).encode()
    await send({"type": "http.response.start", "status": 201,
                "headers": [(b"content-type", b"application/json"), (b"X-Echo", b"yes")]})
    await send({"type": "http.response.body", "body": out})


@pytest.fixture(scope="module")
def upstream():
    with LoopbackServer(_asgi) as srv:
        yield srv


def test_request_headers_keep_alive_reuse_lifo_and_bounded_pool(upstream):
    async def go() -> None:
        http = Http1Client(upstream.url + "/v1", {"Authorization": "Bearer default"}, max_idle=2)
        resp = await http.post("/chat/completions", b'{"x": 1}', {"Content-Type": "application/json"})
        assert resp.status == 201 and resp.headers["x-echo"] == "yes"  # names lower-cased
        first = json.loads(await resp.read())
        headers = dict(first["headers"])
        assert first["path"] == "/v1/chat/completions" and first["body"] == '{"x": 1}'
        assert headers["host"] == f"127.0.0.1:{upstream.port}" and headers["content-length"] == "8"
        assert headers["authorization"] == "Bearer default" and headers["content-type"] == "application/json"
        # a per-request header replaces the default of the same name (a tenant's own upstream key)
        again = json.loads(await (await http.post("/x", b"", {"authorization": "Bearer own"})).read())
        assert again["port"] == first["port"]  # the same keep-alive connection
        assert [v for k, v in again["headers"] if k == "authorization"] == ["Bearer own"]
        # three at once: three connections; two stay idle (max_idle) and the last one back is the next used
        resps = await asyncio.gather(*(http.post("/x", b"") for _ in range(3)))
        ports = [json.loads(await r.read())["port"] for r in resps]
        assert len(set(ports)) == 3 and len(http._idle) == 2
        nxt = json.loads(await (await http.post("/x", b"")).read())["port"]
        assert nxt == ports[1]  # LIFO: released in order 0, 1, 2; the third was closed (the pool was full)
        assert nxt == json.loads(await (await http.post("/x", b"")).read())["port"]
        await http.aclose()
        assert not http._idle

    asyncio.run(go())


def test_chunked_stream_pieces_and_content_length_body(upstream):
    async def go() -> None:
        http = Http1Client(upstream.url)
        resp = await http.post("/stream", b"{}")
        assert resp.headers.get("transfer-encoding") == "chunked" and "content-length" not in resp.headers
        pieces = [p async for p in resp.pieces()]
        assert len(pieces) >= 2  # delivered as they came, not at the end
        assert b"".join(pieces) == b"".join(f"data: {i}\n\n".encode() for i in range(5))
        assert len(http._idle) == 1  # read to the end on a keep-alive connection: pooled
        body = await (await http.post("/x", b"abc")).read()
        assert json.loads(body)["body"] == "abc" and len(http._idle) == 1
        await http.aclose()

    asyncio.run(go())


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


class _Peer:
    """A raw HTTP peer on loopback; ``handler`` gets each connection's number (0, 1, ...) in ``opened``.
    Leaving the ``async with`` ends its connections' handlers (before ``asyncio.run`` closes the loop)."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.opened: list[int] = []
        self.tasks: list[asyncio.Task[None]] = []

    async def _on_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.tasks.append(asyncio.current_task())  # type: ignore[arg-type]
        self.opened.append(len(self.opened))
        try:
            await self.handler(reader, writer, self.opened[-1])
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed the connection
        finally:
            writer.close()

    async def __aenter__(self) -> _Peer:
        self.server = await asyncio.start_server(self._on_conn, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        if self.tasks:  # the handlers end on the client's close; cancelled, python 3.11 logs an error
            await asyncio.wait(self.tasks, timeout=2)
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def _request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = re.search(rb"content-length: (\d+)", head, re.I)
    return head + await reader.readexactly(int(length[1]) if length else 0)


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def test_body_ended_by_connection_close_is_read_and_not_pooled():
    async def handler(reader, writer, n):
        await _request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the ")
        await writer.drain()
        await asyncio.sleep(0.02)
        writer.write(b"end")

    async def go() -> None:
        async with _Peer(handler) as peer:
            http = Http1Client(peer.url)
            assert await (await http.post("/", b"")).read() == b"until the end"
            assert not http._idle

    asyncio.run(go())


def test_connection_closed_by_the_server_while_idle_leaves_the_pool():
    async def handler(reader, writer, n):
        await _request(reader)
        writer.write(OK)  # keep-alive, then closed at once (a short keep-alive timeout)

    async def go() -> None:
        async with _Peer(handler) as peer:
            http = Http1Client(peer.url)
            assert await (await http.post("/", b"")).read() == b"ok"
            for _ in range(100):
                if not http._idle:
                    break
                await asyncio.sleep(0.01)
            assert not http._idle
            assert await (await http.post("/", b"")).read() == b"ok" and peer.opened == [0, 1]
            await http.aclose()

    asyncio.run(go())


def test_stale_idle_connection_is_retried_once_on_a_fresh_one():
    requests: list[int] = []

    async def handler(reader, writer, n):
        await _request(reader)
        requests.append(n)
        writer.write(OK)
        await writer.drain()
        if n == 0:  # the next request on this connection is read, then dropped unanswered
            await _request(reader)  # (as a server closing it at its keep-alive timeout, racing us)
            requests.append(n)
            return
        while True:
            await _request(reader)
            requests.append(n)
            writer.write(OK)

    async def go() -> None:
        async with _Peer(handler) as peer:
            http = Http1Client(peer.url)
            assert await (await http.post("/", b"")).read() == b"ok"
            assert await (await http.post("/", b"")).read() == b"ok"  # no error: retried
            assert requests == [0, 0, 1] and peer.opened == [0, 1] and len(http._idle) == 1
            await http.aclose()

    asyncio.run(go())


def test_connection_lost_mid_response_raises_and_is_not_retried():
    requests: list[int] = []

    async def handler(reader, writer, n):
        await _request(reader)
        requests.append(n)
        writer.write(OK)
        await _request(reader)  # the second response stops after a few bytes of its body
        requests.append(n)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten b")

    async def go() -> None:
        async with _Peer(handler) as peer:
            http = Http1Client(peer.url)
            await (await http.post("/", b"")).read()
            resp = await http.post("/", b"")
            with pytest.raises(ConnectionError, match="mid-response"):
                await resp.read()
            assert requests == [0, 0] and not http._idle
            err = _provider_error(ConnectionError("the upstream closed the connection mid-response"))
            assert isinstance(err, ProviderError) and err.status == 502

    asyncio.run(go())


def test_not_http_raises_protocol_error():
    async def handler(reader, writer, n):
        await _request(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await reader.read()  # until the client closes

    async def go() -> None:
        async with _Peer(handler) as peer:
            http = Http1Client(peer.url)
            with pytest.raises(HttpProtocolError):
                await http.post("/", b"")
            assert not http._idle

    asyncio.run(go())


def test_total_timeout_covers_the_body_and_closes_the_connection():
    async def go() -> None:
        done = asyncio.Event()

        async def handler(reader, writer, n):
            await _request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nslow")
            await writer.drain()
            assert await reader.read() == b""  # the client gives up and closes
            done.set()

        async with _Peer(handler) as peer:
            http = Http1Client(peer.url, total_timeout=0.3)
            resp = await http.post("/", b"")
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(TimeoutError):
                await resp.read()
            assert 0.2 < loop.time() - t0 < 1.0 and not http._idle
            await asyncio.wait_for(done.wait(), 2)

    asyncio.run(go())


def test_cancelled_mid_stream_closes_the_connection():
    async def go() -> None:
        eof = asyncio.Event()

        async def handler(reader, writer, n):
            await _request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
            await writer.drain()
            assert await reader.read() == b""  # the client is gone: EOF, not another request
            eof.set()

        async with _Peer(handler) as peer:
            http = Http1Client(peer.url)
            got: list[bytes] = []

            async def consume() -> None:
                resp = await http.post("/", b"")
                try:
                    async for piece in resp.pieces():
                        got.append(piece)
                finally:
                    resp.release()

            task = asyncio.create_task(consume())
            while not got:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert got == [b"hello"] and not http._idle
            await asyncio.wait_for(eof.wait(), 2)

    asyncio.run(go())


def test_reading_pauses_past_the_high_water_mark_and_resumes():
    size = 8 * HIGH_WATER

    async def handler(reader, writer, n):
        await _request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size + b"x" * size)
        await writer.drain()
        await reader.read()  # until the client closes

    async def go() -> None:
        async with _Peer(handler) as peer:
            http = Http1Client(peer.url)
            resp = await http.post("/", b"")
            await asyncio.sleep(0.2)  # nobody reads: the client must stop reading, not buffer 8 MiB
            conn = resp._conn
            assert conn is not None and conn.paused and HIGH_WATER < conn.buffered < 2 * HIGH_WATER
            assert len(await resp.read()) == size
            await http.aclose()

    asyncio.run(go())


def test_aclose_closes_idle_connections():
    async def go() -> None:
        eof = asyncio.Event()

        async def handler(reader, writer, n):
            await _request(reader)
            writer.write(OK)
            await writer.drain()
            assert await reader.read() == b""  # EOF: the idle connection was closed
            eof.set()

        async with _Peer(handler) as peer:
            http = Http1Client(peer.url)
            await (await http.post("/", b"")).read()
            assert len(http._idle) == 1
            await http.aclose()
            await asyncio.wait_for(eof.wait(), 2)

    asyncio.run(go())


def test_header_line_breaks_are_refused_and_direct_client_picks_its_pool(monkeypatch):
    http = Http1Client("http://127.0.0.1:9/v1")
    with pytest.raises(ValueError):
        asyncio.run(http.post("/x", b"", {"Authorization": "Bearer k\r\nX-Evil: 1"}))
    for name in ("HTTPS_PROXY", "https_proxy", "http_proxy", "no_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.internal:3128")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    assert DirectOpenAIClient("openai/m", api_base="http://api.example.com/v1")._h1 is None  # aiohttp
    assert DirectOpenAIClient("openai/m", api_base="http://127.0.0.1:8000/v1")._h1 is not None
    assert DirectOpenAIClient("openai/m", api_base="https://api.example.com/v1")._h1 is not None


def test_https_through_an_ssl_context(tmp_path):
    """https:// upstreams: asyncio's TLS transport under the same client (a self-signed cert trusted here)."""
    import datetime
    import ipaddress
    import ssl

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")

    async def handler(reader, writer):
        try:
            while True:
                await _request(reader)
                writer.write(OK)
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            writer.close()

    async def go() -> None:
        server = await asyncio.start_server(handler, "127.0.0.1", 0, ssl=server_ctx)
        url = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        http = Http1Client(url, ssl_context=ssl.create_default_context(cafile=str(tmp_path / "cert.pem")))
        assert [await (await http.post("/", b"x")).read() for _ in range(2)] == [b"ok", b"ok"]
        assert len(http._idle) == 1
        await http.aclose()
        with pytest.raises(ssl.SSLCertVerificationError):  # the default context does not trust it
            await Http1Client(url).post("/", b"")
        server.close()
        await asyncio.sleep(0.05)

    asyncio.run(go())
