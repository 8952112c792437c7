"""The bench's streaming HTTP client against a scripted asyncio server: what it sends, and
every body framing it reads (chunked with pieces split mid-line and mid-character, sized, to
the end), error answers, non-HTTP answers, a stalled server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from mrv2.bench.sse_client import ProtocolError, StreamClient

Script = Callable[[asyncio.StreamWriter], Awaitable[None]]


async def _serve(script: Script, seen: list[bytes]) -> asyncio.Server:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        seen.append(head + await reader.readexactly(length))
        try:
            await script(writer)
        finally:
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def _run(script: Script, body: Any = None, path: str = "/v1/completions",
         timeout: float = 10.0, prefix: str = "", lines: bool = True
         ) -> tuple[int, list[str] | bytes, list[bytes]]:
    seen: list[bytes] = []

    async def main() -> tuple[int, list[str] | bytes]:
        server = await _serve(script, seen)
        port = server.sockets[0].getsockname()[1]
        client = StreamClient(f"http://127.0.0.1:{port}{prefix}",
                              {"Authorization": "Bearer k"}, timeout=timeout)
        try:
            async with client.stream("POST", path, json=body) as response:
                if lines:
                    return response.status_code, [x async for x in response.aiter_lines()]
                return response.status_code, await response.aread()
        finally:
            server.close()

    status, got = asyncio.run(main())
    return status, got, seen


def _chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def test_the_request_carries_method_path_headers_and_json_body() -> None:
    async def ok(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")

    body = {"prompt": "h\u00e9llo", "max_tokens": 3, "stream": True}
    status, got, seen = _run(ok, body, prefix="/base/")
    assert status == 200 and got == []
    head, _, sent = seen[0].partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /base/v1/completions HTTP/1.1"
    assert "Authorization: Bearer k" in lines and "Connection: close" in lines
    assert any(x.startswith("Host: 127.0.0.1:") for x in lines)
    assert json.loads(sent) == body


def test_chunked_lines_split_across_pieces_and_inside_a_character() -> None:
    text = "data: {\"a\": \"\u00e9\u4e2d\"}\n\ndata: [DONE]\n\n".encode()
    cut = text.index("\u4e2d".encode()) + 1  # inside the 3-byte character

    async def chunked(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for piece in (text[:5], text[5:cut], text[cut:]):
            writer.write(b"%x;ext=1\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            await asyncio.sleep(0.01)  # separate reads
        writer.write(b"0\r\nx-trailer: 1\r\n\r\n")

    status, got, _ = _run(chunked)
    assert status == 200
    assert got == ["data: {\"a\": \"\u00e9\u4e2d\"}", "", "data: [DONE]", ""]


def test_crlf_line_ends_and_a_last_line_without_end() -> None:
    async def sized(writer: asyncio.StreamWriter) -> None:
        body = b"one\r\ntwo\nthree"
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    assert _run(sized)[1] == ["one", "two", "three"]


def test_a_body_read_to_the_end_of_the_connection() -> None:
    async def until_close(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nabc\ndef")

    assert _run(until_close, lines=False)[1] == b"abc\ndef"


def test_an_error_answer_keeps_its_status_and_body() -> None:
    error = b'{"error": {"message": "max_tokens=-1 is invalid"}}'

    async def bad(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 400 Bad Request\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + _chunked(error[:10], error[10:]))

    status, got, _ = _run(bad, lines=False)
    assert status == 400 and got == error


def test_an_answer_that_is_not_http_is_a_protocol_error() -> None:
    async def garbage(writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")

    with pytest.raises(ProtocolError, match="status line"):
        _run(garbage)


def test_a_connection_closed_inside_a_chunk_is_a_protocol_error() -> None:
    async def cut(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab")

    with pytest.raises((ProtocolError, asyncio.IncompleteReadError)):
        _run(cut)


def test_a_server_that_stops_sending_times_out() -> None:
    async def stall(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"6\r\ndata: \r\n")
        await writer.drain()
        await asyncio.sleep(5)

    with pytest.raises(TimeoutError, match="0.3 s"):
        _run(stall, timeout=0.3)


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "ftp://host", "http://"])
def test_a_bad_url_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="url="):
        StreamClient(url)
