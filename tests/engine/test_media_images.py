"""Image chat parts (:mod:`mrv2.engine.media`): a decoded image is turned upright by its EXIF
orientation, as HF's ``load_image`` does; parts past ``--limit-mm-per-prompt`` are refused
before anything is fetched; a remote fetch (``--allow-remote-media``) follows redirects to
http(s) only, never reads a redirect's body, and has a deadline on the whole fetch; the chat
route's messages keep their tool calls when a message carries an image."""

from __future__ import annotations

import base64
import http.server
import io
import threading
import time
from collections.abc import Iterator

import pytest
from PIL import Image

from mrv2.engine import media
from mrv2.engine.media import load_image_url, split_chat_media
from mrv2.entrypoints.openai_messages import ChatMessage


def _png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4), (9, 9, 9)).save(buffer, "PNG")
    return buffer.getvalue()


class _Handler(http.server.BaseHTTPRequestHandler):
    hits: list[str] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        type(self).hits.append(self.path)
        try:
            if self.path == "/slow":  # a byte at a time, each well within a read's timeout
                self.send_response(200)
                self.send_header("Content-Length", "1000")
                self.end_headers()
                for _ in range(1000):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.05)
            elif self.path.startswith("/redirect"):
                target = {"/redirect-ftp": "ftp://127.0.0.1:1/x.png",
                          "/redirect-loop": "/redirect-loop"}.get(self.path, "/image")
                self.send_response(302)
                self.send_header("Location", target)
                self.end_headers()
                self.wfile.write(b"y" * (1 << 20))  # (a body nobody should read)
            else:
                body = _png()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
        except OSError:  # (the client left)
            pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    _Handler.hits = []
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_exif_orientation_is_applied() -> None:
    image = Image.new("RGB", (40, 20), (255, 0, 0))
    exif = Image.Exif()
    exif[0x0112] = 6  # (shown rotated 90 degrees clockwise)
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", exif=exif.tobytes())
    url = "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()
    assert load_image_url(url).size == (20, 40)


def test_parts_past_the_limit_are_refused_before_any_fetch(server: str) -> None:
    parts = [{"type": "image_url", "image_url": {"url": f"{server}/image{i}"}}
             for i in range(5)]
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[2\]: more than 2 images; "
                                         r"at most 2 per prompt \(--limit-mm-per-prompt\)"):
        split_chat_media([{"role": "user", "content": parts}], True, limit=2)
    assert len(_Handler.hits) == 2
    _, mm_data = split_chat_media([{"role": "user", "content": parts[:2]}], True, limit=2)
    assert len(mm_data["image"]) == 2


def test_redirects_are_followed_to_http_only(server: str) -> None:
    assert load_image_url(f"{server}/redirect", True).size == (4, 4)
    with pytest.raises(ValueError, match=r"image_url: redirected to 'ftp://.*only http\(s\)"):
        load_image_url(f"{server}/redirect-ftp", True)
    with pytest.raises(ValueError, match="image_url: more than 5 redirects"):
        load_image_url(f"{server}/redirect-loop", True)


def test_a_slow_fetch_stops_at_the_deadline(server: str, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    # (2 s: the connection and headers come well within it on a busy machine; at 0.5 s a
    # late header timed the open out, "could not fetch", not the deadline's error)
    monkeypatch.setattr(media, "_FETCH_TIMEOUT_S", 2.0)
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"image_url: fetching .*/slow' took more than 2 s"):
        load_image_url(f"{server}/slow", True)
    assert time.monotonic() - start < 10  # (the body alone takes 50 s)


def test_messages_with_media_keep_their_tool_calls() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    messages = [ChatMessage.model_validate(m) for m in (
        {"role": "user", "content": parts},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "2", "tool_call_id": "c1"})]
    user, assistant, tool = (m.with_parts() for m in messages)
    assert user == {"role": "user", "content": parts}
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert tool["tool_call_id"] == "c1"
