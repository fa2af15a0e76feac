"""A tiny HTTP server whose every answer a test scripts: the hostile registry of the fuzz tests.

Why hand-written: a real registry (tests/integration runs the real one) never misbehaves on
purpose; these tests need bad challenges, cross-host redirects, truncated bodies and lying
manifests, on the reliability area's ports (5350-5399).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Reply:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    cut_after: int | None = None  # send only this many body bytes, then drop the connection


@dataclass
class Seen:
    server: str
    method: str
    path: str
    headers: dict[str, str]


Script = Callable[[str, str, dict[str, str]], Reply]


class HostileServer:
    def __init__(self, name: str, host: str, port: int, log: list[Seen]) -> None:
        self.name = name
        self.host = host
        self.port = port
        self.script: Script = lambda m, p, h: Reply(404)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _any(self) -> None:
                headers = {k.lower(): v for k, v in self.headers.items()}
                n = int(headers.get("content-length", "0") or 0)
                if n:
                    self.rfile.read(n)
                log.append(Seen(outer.name, self.command, self.path, headers))
                reply = outer.script(self.command, self.path, headers)
                self.send_response(reply.status)
                hdrs = {"Content-Length": str(len(reply.body)), **reply.headers}
                for k, v in hdrs.items():
                    self.send_header(k, v)
                if reply.cut_after is not None:
                    self.send_header("Connection", "close")
                self.end_headers()
                if self.command == "HEAD":
                    return
                body = reply.body if reply.cut_after is None else reply.body[: reply.cut_after]
                self.wfile.write(body)
                if reply.cut_after is not None:
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)

            do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _any

        ThreadingHTTPServer.allow_reuse_address = True
        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    def __enter__(self) -> "HostileServer":
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
