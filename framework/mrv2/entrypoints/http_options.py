"""How ``mrv2 serve`` meets HTTP clients around the API itself, with vLLM's flags: CORS for
browser clients, the path prefix a reverse proxy serves it under, TLS, and FastAPI's pages.

- ``--allowed-origins`` / ``--allowed-methods`` / ``--allowed-headers`` (JSON lists, default
  ``["*"]``) and ``--allow-credentials``: Starlette's CORS middleware, outermost, so a browser's
  preflight ``OPTIONS`` is answered before the API key is asked for and an error answer
  (401, 400) carries the CORS headers too. ``--allowed-origins '[]'`` adds no middleware.
- ``--root-path /prefix``: uvicorn's root path, for a reverse proxy that serves the API
  under ``/prefix`` and forwards ``/prefix/v1/...`` as ``/v1/...`` (it strips the prefix);
  FastAPI's pages then link ``/prefix/openapi.json``.
- ``--ssl-keyfile`` / ``--ssl-certfile`` (together), ``--ssl-ca-certs``, ``--ssl-cert-reqs``
  (0: no client certificate, 1: optional, 2: required, as Python's ``ssl.CERT_*``): uvicorn's
  TLS. The files are checked before the engine loads.
- ``--disable-fastapi-docs``: no ``/docs``, ``/redoc`` or ``/openapi.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Any

__all__ = ["HTTPOptions", "add_http_args"]

_CERT_REQS = (0, 1, 2)


@dataclass(frozen=True)
class HTTPOptions:
    """CORS, root path, TLS and docs settings of one server (module doc); :meth:`check`
    refuses bad values, naming the flag."""

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    root_path: str = ""
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    disable_fastapi_docs: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> HTTPOptions:
        """The options of ``mrv2 serve``'s parsed flags (:func:`add_http_args`)."""
        return cls(
            allowed_origins=_json_strings("--allowed-origins", args.allowed_origins),
            allowed_methods=_json_strings("--allowed-methods", args.allowed_methods),
            allowed_headers=_json_strings("--allowed-headers", args.allowed_headers),
            allow_credentials=args.allow_credentials, root_path=args.root_path,
            ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
            ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
            disable_fastapi_docs=args.disable_fastapi_docs)

    def check(self) -> None:
        """ValueError naming the flag: a root path without its leading ``/``, one TLS file
        without the other, a file that is not there, an unknown ``ssl_cert_reqs``, or
        credentials allowed for every origin (browsers refuse that pair)."""
        if self.root_path and (not self.root_path.startswith("/") or self.root_path == "/"):
            raise ValueError(f"--root-path={self.root_path!r}: expected a path such as /api "
                             "(a leading /, not / alone)")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together (TLS needs both)")
        if self.ssl_ca_certs is not None and self.ssl_certfile is None:
            raise ValueError("--ssl-ca-certs needs --ssl-keyfile and --ssl-certfile")
        for flag, path in (("--ssl-keyfile", self.ssl_keyfile),
                           ("--ssl-certfile", self.ssl_certfile),
                           ("--ssl-ca-certs", self.ssl_ca_certs)):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{flag}={path!r}: no such file")
        if self.ssl_cert_reqs not in _CERT_REQS:
            raise ValueError(f"--ssl-cert-reqs={self.ssl_cert_reqs}: allowed values are 0 (no "
                             "client certificate), 1 (optional), 2 (required)")
        if self.ssl_cert_reqs and self.ssl_ca_certs is None:
            raise ValueError("--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs (the client "
                             "certificates' issuers)")
        if self.allow_credentials and "*" in self.allowed_origins:
            raise ValueError("--allow-credentials with --allowed-origins '[\"*\"]': browsers "
                             "refuse credentials for any origin; list the origins")

    @property
    def scheme(self) -> str:
        """``https`` with TLS, else ``http``."""
        return "https" if self.ssl_certfile else "http"

    def fastapi_kwargs(self) -> dict[str, Any]:
        """With the docs disabled, no docs pages."""
        if self.disable_fastapi_docs:
            return {"docs_url": None, "redoc_url": None, "openapi_url": None}
        return {}

    def add_cors(self, app: Any) -> None:
        """Starlette's CORS middleware on ``app`` (call after every other middleware: the
        last added runs first); none when no origin is allowed."""
        if not self.allowed_origins:
            return
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(self.allowed_origins),
                           allow_methods=list(self.allowed_methods),
                           allow_headers=list(self.allowed_headers),
                           allow_credentials=self.allow_credentials)

    def uvicorn_kwargs(self) -> dict[str, Any]:
        """uvicorn's root path (the server sets it in every request's scope: FastAPI's own
        parameter is deprecated) and TLS settings."""
        kwargs: dict[str, Any] = {"root_path": self.root_path} if self.root_path else {}
        if self.ssl_certfile is not None:
            kwargs.update(ssl_keyfile=self.ssl_keyfile, ssl_certfile=self.ssl_certfile,
                          ssl_ca_certs=self.ssl_ca_certs, ssl_cert_reqs=self.ssl_cert_reqs)
        return kwargs


def _json_strings(flag: str, text: str) -> tuple[str, ...]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{flag}={text!r}: expected a JSON list of strings, such as "
                         "'[\"https://example.com\"]'")
    return tuple(value)


def add_http_args(parser: argparse.ArgumentParser) -> None:
    """``mrv2 serve``'s CORS, root-path, TLS and docs flags (vLLM's names)."""
    group = parser.add_argument_group("HTTP (CORS, proxy, TLS)")
    group.add_argument("--allowed-origins", default='["*"]',
                       help="CORS: origins allowed, a JSON list (default [\"*\"]; [] adds no "
                       "CORS headers)")
    group.add_argument("--allowed-methods", default='["*"]',
                       help="CORS: methods allowed, a JSON list (default [\"*\"])")
    group.add_argument("--allowed-headers", default='["*"]',
                       help="CORS: request headers allowed, a JSON list (default [\"*\"])")
    group.add_argument("--allow-credentials", action="store_true",
                       help="CORS: allow credentials (needs listed origins, not *)")
    group.add_argument("--root-path", default="",
                       help="the path prefix a reverse proxy serves the API under (e.g. /llm)")
    group.add_argument("--ssl-keyfile", default=None, help="TLS: the private key file")
    group.add_argument("--ssl-certfile", default=None, help="TLS: the certificate file")
    group.add_argument("--ssl-ca-certs", default=None,
                       help="TLS: the CA certificates that issue client certificates")
    group.add_argument("--ssl-cert-reqs", type=int, default=0,
                       help="TLS: client certificates: 0 none (default), 1 optional, "
                       "2 required")
    group.add_argument("--disable-fastapi-docs", action="store_true",
                       help="no /docs, /redoc or /openapi.json")
