"""An OTLP trace receiver for benchmarks: a process of its own that accepts OTLP/gRPC and
OTLP/HTTP (protobuf) exports and counts the distinct spans it received (an export retried
after a timeout counts once), so a benchmark can wait for every span and report the
receiver's CPU apart, as a collector's would be on another host."""

from __future__ import annotations

import multiprocessing
import multiprocessing.synchronize
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.serve_stack import cpu_seconds
from common.services import free_port


def _serve_sink(
    grpc_port: int,
    http_port: int,
    spans: Any,
    ready: multiprocessing.synchronize.Event,
    stop: multiprocessing.synchronize.Event,
    with_grpc: bool = True,
) -> None:
    """OTLP trace receivers (HTTP/protobuf, and gRPC when ``with_grpc``: grpcio is not on
    every machine) that count distinct spans; runs in a child process."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb

    seen: set[bytes] = set()  # an export retried after a timeout must not count twice

    def count(request: Any) -> None:
        with spans.get_lock():
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    seen.update(s.span_id for s in ss.spans)
            spans.value = len(seen)

    class Http(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as a collector: no connect per export

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            count(pb.ExportTraceServiceRequest.FromString(body))
            reply = pb.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = None
    if with_grpc:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as pb_grpc

        class Grpc(pb_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                count(request)
                return pb.ExportTraceServiceResponse()

        server = grpc.server(ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_TraceServiceServicer_to_server(Grpc(), server)
        server.add_insecure_port(f"127.0.0.1:{grpc_port}")
        server.start()
    http = ThreadingHTTPServer(("127.0.0.1", http_port), Http)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    ready.set()
    stop.wait()
    http.shutdown()
    if server is not None:
        server.stop(grace=1).wait()


class SpanSink:
    """The receiver's process: ``endpoint`` for the services, ``spans`` received so far."""

    def __init__(self, protocol: str = "grpc") -> None:
        ctx = multiprocessing.get_context("spawn")
        self.protocol = protocol
        self.ports = {"grpc": free_port(), "http/protobuf": free_port()}
        self._spans = ctx.Value("q", 0)
        self._ready, self._stop = ctx.Event(), ctx.Event()
        self._proc = ctx.Process(
            target=_serve_sink,
            args=(*self.ports.values(), self._spans, self._ready, self._stop, protocol == "grpc"),
            daemon=True,
        )  # fmt: skip

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports[self.protocol]}"

    @property
    def spans(self) -> int:
        return int(self._spans.value)

    def cpu_s(self) -> float:
        return cpu_seconds(self._proc.pid) if self._proc.pid else -1.0

    def __enter__(self) -> SpanSink:
        self._proc.start()
        if not self._ready.wait(30):
            raise RuntimeError("the OTLP receiver did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._proc.join(10)
