"""A lean HTTP/1.1 client for streamed answers: what ``mrv2 bench serve`` reads streams with.

httpx's async streaming costs the client ~100 µs of CPU a chunk (h11's parser, anyio, its
line decoder), so one client process reading 256 streams could not take more than ~8,000
chunks a second: the twenty-third session found ``mrv2 bench serve`` at 100% CPU while the
H200 server it measured was idle most of the time. This client writes one request on a fresh
connection (``Connection: close``) and reads the answer straight off an
:class:`asyncio.StreamReader`: a status line, headers, then a chunked, sized or
read-to-the-end body split into lines. It has httpx's shape where the bench uses it
(``async with client.stream("POST", path, json=...) as response``, ``status_code``,
``aread()``, ``aiter_lines()``) so the bench's checks read either.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import ssl
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit


class ProtocolError(RuntimeError):
    """The server's answer is not HTTP/1.1 this client reads."""


class StreamResponse:
    """The answer to one request: its status and headers; the body is read on demand."""

    def __init__(self, reader: asyncio.StreamReader, status_code: int,
                 headers: dict[str, str], watchdog: _Watchdog) -> None:
        self._reader, self.status_code, self.headers = reader, status_code, headers
        self._watchdog = watchdog
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        self._left = int(length) if length is not None and not self._chunked else None

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body's pieces as they arrive."""
        reader = self._reader
        if self._chunked:
            while True:
                line = await reader.readline()
                if not line.endswith(b"\n"):
                    raise ProtocolError("the connection closed inside a chunked body")
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while (await reader.readline()).strip():  # trailers, then the blank line
                        pass
                    return
                data = await reader.readexactly(size + 2)
                self._watchdog.touch()
                yield data[:-2]
        elif self._left is not None:
            while self._left > 0:
                data = await reader.read(min(self._left, 1 << 16))
                if not data:
                    raise ProtocolError("the connection closed inside the body")
                self._left -= len(data)
                self._watchdog.touch()
                yield data
        else:
            while data := await reader.read(1 << 16):
                self._watchdog.touch()
                yield data

    async def aread(self) -> bytes:
        return b"".join([piece async for piece in self.aiter_bytes()])

    async def aiter_lines(self) -> AsyncIterator[str]:
        """The body's lines (``\\n`` or ``\\r\\n`` ends a line; the ends are dropped)."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        rest = ""
        async for piece in self.aiter_bytes():
            rest += decoder.decode(piece)
            if "\n" not in rest:
                continue
            *lines, rest = rest.split("\n")
            for line in lines:
                yield line[:-1] if line.endswith("\r") else line
        rest += decoder.decode(b"", final=True)
        if rest:
            yield rest


class _Watchdog:
    """Cancels its task when no body piece came for ``timeout`` seconds (re-armed at most
    every ``timeout / 4``, so a chunk costs one clock read)."""

    def __init__(self, timeout: float) -> None:
        self.timeout, self.fired = timeout, False
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._armed = 0.0
        self._handle: asyncio.TimerHandle | None = None
        self.touch(force=True)

    def touch(self, force: bool = False) -> None:
        now = self._loop.time()
        if not force and now - self._armed < self.timeout / 4:
            return
        if self._handle is not None:
            self._handle.cancel()
        self._armed = now
        self._handle = self._loop.call_later(self.timeout, self._fire)

    def _fire(self) -> None:
        self.fired = True
        if self._task is not None:
            self._task.cancel()

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()


class StreamClient:
    """POSTs JSON to one server (``http://`` or ``https://`` base URL), one connection a
    request; ``timeout``: seconds without a byte from the server before the request fails."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None,
                 timeout: float = 600.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url={base_url!r} is invalid: expected http://HOST[:PORT] or "
                             "https://HOST[:PORT]")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/")
        self.timeout = timeout
        netloc = self.host if parts.port is None else f"{self.host}:{parts.port}"
        self._head = "".join(f"{k}: {v}\r\n" for k, v in {
            "Host": netloc, "Content-Type": "application/json", "Accept": "*/*",
            "Connection": "close", **(headers or {})}.items())

    @contextlib.asynccontextmanager
    async def stream(self, method: str, path: str, json: Any = None
                     ) -> AsyncIterator[StreamResponse]:
        """Send the request; the answer's status and headers are read when this enters,
        the body as the caller reads it; leaving closes the connection."""
        body = _dumps(json)
        watchdog = _Watchdog(self.timeout)
        writer: asyncio.StreamWriter | None = None
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port, ssl=self.ssl,
                                                           limit=1 << 20)
            writer.write(f"{method} {self.prefix}{path} HTTP/1.1\r\n{self._head}"
                         f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            status, headers = await _read_head(reader)
            watchdog.touch()
            yield StreamResponse(reader, status, headers, watchdog)
        except asyncio.CancelledError:
            if watchdog.fired:
                raise TimeoutError(f"no answer from the server for {self.timeout:g} s") from None
            raise
        finally:
            watchdog.cancel()
            if writer is not None:
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    line = await reader.readline()
    parts = line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise ProtocolError(f"not an HTTP/1.x status line: {line[:80]!r}")
    headers: dict[str, str] = {}
    while True:
        line = await reader.readline()
        if not line.endswith(b"\n"):
            raise ProtocolError("the connection closed inside the headers")
        if not line.strip():
            return int(parts[1]), headers
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
