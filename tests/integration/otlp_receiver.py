"""An OTLP/HTTP (protobuf) trace receiver: the collector the tracing tests export to, and the
sink the H200's traces A/B (bench/gpu_tracing.sh) points the stack at.

Run alone: ``python -m tests.integration.otlp_receiver --port 4318 --summary FILE`` serves until
SIGTERM/SIGINT, then writes FILE (JSON: spans, traces and spans per ``serve_app.component``),
so that a benchmark can tell how many requests were traced."""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class Receiver:
    """An OTLP/HTTP collector on 127.0.0.1 (``port`` 0: a free one): every span it was sent,
    flattened into dicts (``keep=False``: counted only, for long benchmark runs)."""

    def __init__(self, port: int = 0, keep: bool = True) -> None:
        self.spans: list[dict] = []
        self.counts: collections.Counter[str] = collections.Counter()
        self.traces: set[str] = set()
        self.keep = keep
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
                    ExportTraceServiceRequest,
                    ExportTraceServiceResponse,
                )

                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.add(request)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, request) -> None:
        def value(v):
            return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None

        spans = []
        for rs in request.resource_spans:
            resource = {a.key: value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append({
                        "name": s.name, "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                        "parent": s.parent_span_id.hex(),
                        "component": resource.get("serve_app.component"),
                        "service": resource.get("service.name"),
                        "attributes": {a.key: value(a.value) for a in s.attributes},
                        "events": [e.name for e in s.events]})
        with self.lock:
            for s in spans:
                self.counts[str(s["component"])] += 1
                self.traces.add(s["trace_id"])
            if self.keep:
                self.spans.extend(spans)

    def of(self, trace_id: str) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def summary(self) -> dict:
        with self.lock:
            return {"spans": sum(self.counts.values()), "traces": len(self.traces),
                    "spans_per_component": dict(self.counts)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=4318)
    p.add_argument("--summary", required=True, help="JSON written on SIGTERM/SIGINT")
    a = p.parse_args()
    receiver = Receiver(a.port, keep=False)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    print(f"receiving OTLP traces on {receiver.url}", flush=True)
    done.wait()
    receiver.server.shutdown()
    Path(a.summary).write_text(json.dumps(receiver.summary(), indent=1))


if __name__ == "__main__":
    main()
