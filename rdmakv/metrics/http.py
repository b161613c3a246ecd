"""MetricsServer: ``/metrics``, ``/healthz`` and ``/readyz`` over HTTP for one registry.

The exposition text comes from ``prometheus_client.generate_latest``; this
module only routes paths. ``/healthz`` answers 200 while the process can serve
HTTP at all (a liveness probe); ``/readyz`` answers 200 only while ``ready()``
is true (a readiness probe: for a node, pool registered and listener
accepting). Extra ``routes`` (e.g. a client's ``/rdmakv/quarantine``) answer
JSON. The server runs in one daemon thread and stops with ``close()``.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from rdmakv.defaults import DEFAULT_HOST
from rdmakv.errors import ConfigError

log = logging.getLogger("rdmakv.metrics")

HTTP_OK = 200
HTTP_NOT_FOUND = 404
HTTP_UNAVAILABLE = 503

Route = Callable[[], tuple[int, bytes]]
"""An extra endpoint: ``() -> (HTTP status, JSON body)``, keyed by ``(method, path)``."""


class MetricsServer:
    """Serves one registry; ``port=0`` picks a free port (see :attr:`port`)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        host: str = DEFAULT_HOST,
        port: int = 0,
        ready: Callable[[], bool] = lambda: True,
        routes: Mapping[tuple[str, str], Route] | None = None,
    ) -> None:
        handler = _handler_for(registry, ready, dict(routes or {}))
        try:
            self._server = ThreadingHTTPServer((host, port), handler)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"metrics port {port} on {host} is already in use: pick another "
                    "--metrics-port (node.metrics_port) or stop the process holding it"
                ) from None
            raise ConfigError(f"cannot serve metrics on {host}:{port}: {e.strerror or e}") from None
        self._server.daemon_threads = True
        self.host = str(self._server.server_address[0])
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="rdmakv-metrics", daemon=True
        )
        self._thread.start()
        log.info("metrics on http://%s:%d/metrics (/healthz, /readyz)", self.host, self.port)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _handler_for(
    registry: CollectorRegistry,
    ready: Callable[[], bool],
    routes: dict[tuple[str, str], Route],
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _route(self, method: str) -> bool:
            route = routes.get((method, self.path.split("?", 1)[0]))
            if route is None:
                return False
            code, body = route()
            self._send(code, body, "application/json")
            return True

        def do_POST(self) -> None:  # the name http.server dispatches to
            if not self._route("POST"):
                self._send(HTTP_NOT_FOUND, b"no such action\n")

        def do_GET(self) -> None:  # the name http.server dispatches to
            path = self.path.split("?", 1)[0]
            if self._route("GET"):
                return
            if path == "/metrics":
                self._send(HTTP_OK, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                self._send(HTTP_OK, b"ok\n")
            elif path == "/readyz":
                if ready():
                    self._send(HTTP_OK, b"ready\n")
                else:
                    self._send(HTTP_UNAVAILABLE, b"not ready\n")
            else:
                self._send(HTTP_NOT_FOUND, b"try /metrics, /healthz or /readyz\n")

        def _send(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            log.debug("metrics http: " + format, *args)

    return Handler
