"""The Prometheus text format (0.0.4), written directly, and the HTTP endpoint that serves it.

The cluster exporter answers with nine series per (group, queue), eleven in key order: about
90,000 lines at 10,000 queues. prometheus-client's ``generate_latest`` validates and escapes every
label name and value of every sample, one sample at a time: at 2,000 queues with
``bench.exporter_scrape``'s setup that took 0.9 s, as long as reading Redis did (a loaded machine;
the whole scrape took about 0.4 s there after this change). Here the label set of a queue is
escaped once and shared by every series of that queue, and a line is one f-string.

Only gauges are written (the exporter has nothing else); the workers' own endpoint keeps
prometheus-client, which their multiprocess mode needs.
"""

from __future__ import annotations

import gzip
import logging
import threading
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from mqorder.metrics.names import MetricSpec

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def escape(value: str) -> str:
    """A label value as the text format quotes it: backslash, double quote and newline escaped."""
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return value


def labels(names: Sequence[str], values: Sequence[str]) -> str:
    """``{name="value",...}``: built once per label set, reused by every series that has it."""
    return "{" + ",".join(f'{n}="{escape(v)}"' for n, v in zip(names, values, strict=True)) + "}"


def number(value: float) -> str:
    """A sample value as prometheus-client writes it for small numbers (``1.0``): integers with all
    their digits (an epoch has 16, which prometheus-client would round to ``1.7956e+15``), the rest
    as Python's shortest round-tripping repr; Prometheus parses both."""
    if isinstance(value, int):
        return f"{int(value)}.0"  # int(): a bool is 1.0, not True.0
    return repr(float(value))


class Family:
    """The lines of one gauge family: ``add(label_set, value)``, then ``text()``."""

    __slots__ = ("spec", "lines")

    def __init__(self, spec: MetricSpec) -> None:
        self.spec = spec
        self.lines: list[str] = []

    def add(self, label_set: str, value: float) -> None:
        self.lines.append(f"{self.spec.name}{label_set} {number(value)}\n")

    def text(self) -> str:
        help_ = self.spec.help.replace("\\", "\\\\").replace("\n", "\\n")
        head = f"# HELP {self.spec.name} {help_}\n# TYPE {self.spec.name} {self.spec.kind}\n"
        return head + "".join(self.lines)


def render(families: Sequence[Family]) -> str:
    return "".join(f.text() for f in families)


#: Seconds a metrics connection may sit idle before its request is read (then it is closed).
REQUEST_TIMEOUT_S = 30.0


def serve(addr: str, port: int, scrape: Callable[[], str]) -> ThreadingHTTPServer:
    """Serve ``scrape()`` on ``GET /metrics`` (and ``/``) from a daemon thread; ``OSError`` if the
    port is taken. Stop it with ``shutdown()`` and ``server_close()``."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                self.send_error(404, "try /metrics")
                return
            try:
                body = scrape().encode()
            except Exception:  # a bug: say so to the scraper and the log, keep serving
                log.exception("mqorder exporter: the scrape failed")
                self.send_error(500, "the scrape failed; see the exporter's log")
                return
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            if "gzip" in self.headers.get("Accept-Encoding", ""):
                # Prometheus asks for it: 10,000 queues are about 10 MB of text, a few hundred KB
                # gzipped (level 1: a few ms per MB), as prometheus-client's server did.
                body = gzip.compress(body, compresslevel=1)
                self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            log.debug("exporter: " + format, *args)

    # A connection that never sends its request (a TCP health probe) must not hold a thread for
    # ever, nor may server_close() wait for one (request threads are daemons: not joined).
    Handler.timeout = REQUEST_TIMEOUT_S
    server = ThreadingHTTPServer((addr, port), Handler)
    server.daemon_threads = True
    server.block_on_close = False
    threading.Thread(target=server.serve_forever, name="mqorder-exporter-http", daemon=True).start()
    return server
