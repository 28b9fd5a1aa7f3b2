"""``GET /health`` alone, for a pipeline stage after the first: it serves no API (stage 0 does), but
its pod carries the same probes as every pod of the group. A thread of the standard library's HTTP
server: the stage's process has no event loop."""

from __future__ import annotations

import http.server
import threading
from typing import Any


class HealthEndpoint:
    """200 on ``/health`` while :attr:`serving`, 503 before; 404 elsewhere."""

    def __init__(self, host: str, port: int) -> None:
        self.serving = False
        endpoint = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                status = (200 if endpoint.serving else 503) if self.path == "/health" else 404
                body = b"{}" if status == 200 else b'{"error": {"message": "not serving"}}'
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds: not logged
                pass

        family_host = host.strip("[]")
        server_class = http.server.ThreadingHTTPServer
        if ":" in family_host:
            import socket

            server_class = type("IPv6Server", (http.server.ThreadingHTTPServer,), {"address_family": socket.AF_INET6})
        self._server = server_class((family_host, port), Handler)  # OSError when it cannot listen
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="switchyard-health", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
