"""A stand-in for ``coalesce serve`` in tests of gpu_check's service step, standard library only: the
routes its load uses (``/ready``, ``/v1/models``, ``/v1/embeddings``; no ``/metrics``), on 127.0.0.1.

    python stub_service.py --port P

With ``STUB_EVENTS=PATH`` it appends what happened to PATH, a line each, in order: ``pid N``, then
``connect C`` for every connection accepted and ``request C METHOD PATH`` for each connection's first
request.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_lock = threading.Lock()
_ids = itertools.count()


def event(line: str) -> None:
    path = os.environ.get("STUB_EVENTS")
    if path:
        with _lock, open(path, "a") as f:
            f.write(line + "\n")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the service
    disable_nagle_algorithm = True  # headers and body go out in separate writes

    def setup(self) -> None:
        super().setup()
        self.conn = next(_ids)
        self.seen = False
        event(f"connect {self.conn}")

    def _first(self) -> None:
        if not self.seen:
            self.seen = True
            event(f"request {self.conn} {self.command} {self.path}")

    def do_GET(self) -> None:
        self._first()
        if self.path == "/ready":
            self._send(200, b"ready")
        elif self.path == "/v1/models":
            self._send(200, json.dumps({"object": "list", "data": [{"id": "stub"}]}).encode())
        else:
            self._send(404, b"not here")

    def do_POST(self) -> None:
        self._first()
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._send(200, b'{"object": "list", "data": []}')

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    port = p.parse_args().port
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    event(f"pid {os.getpid()}")
    print(f"stub service listening on 127.0.0.1:{port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
