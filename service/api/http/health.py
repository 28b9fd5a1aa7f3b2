"""``GET /health`` and a one-gauge ``GET /metrics`` for a pipeline stage after the first: it serves no
API (stage 0 does, and counts the requests), but its pod carries the same probes as every pod of the
group, and the chart's PodMonitor scrapes every pod of the engine (a 404 there would be a failing
target). A thread of the standard library's HTTP server: the stage's process has no event loop."""

from __future__ import annotations

import contextlib
import http.server
import threading
from typing import Any

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def stage_metrics(stage: int, serving: bool) -> bytes:
    """Prometheus text: whether this stage follows stage 0."""
    return (
        "# HELP switchyard_pipeline_stage_serving 1 while this pipeline stage follows stage 0, else 0 "
        "(stage 0 serves the request metrics).\n"
        "# TYPE switchyard_pipeline_stage_serving gauge\n"
        f'switchyard_pipeline_stage_serving{{stage="{stage}"}} {int(serving)}\n'
    ).encode()


class HealthEndpoint:
    """``/health``: 200 while :attr:`serving`, 503 before; ``/metrics``: the stage's gauge; 404
    elsewhere."""

    def __init__(self, host: str, port: int, stage: int = 0) -> None:
        self.serving = False
        endpoint = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                content_type = "application/json"
                if self.path == "/metrics":
                    status, body = 200, stage_metrics(stage, endpoint.serving)
                    content_type = METRICS_CONTENT_TYPE
                elif self.path == "/health" and endpoint.serving:
                    status, body = 200, b"{}"
                elif self.path == "/health":
                    status, body = 503, b'{"error": {"message": "not serving"}}'
                else:
                    status, body = 404, b'{"error": {"message": "not found"}}'
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds: not logged
                pass

        family_host = host.strip("[]")
        server_class = http.server.ThreadingHTTPServer
        if ":" in family_host:
            import socket

            class IPv6Server(http.server.ThreadingHTTPServer):
                address_family = socket.AF_INET6

                def server_bind(self) -> None:
                    # "::" is every address, IPv4 too (the kubelet probes the pod's IPv4 address).
                    with contextlib.suppress(OSError, AttributeError):
                        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                    super().server_bind()

            server_class = IPv6Server
        self._server = server_class((family_host, port), Handler)  # OSError when it cannot listen
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="switchyard-health", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
