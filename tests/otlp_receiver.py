"""A loopback OTLP/HTTP trace receiver for tests: what a collector's ``/v1/traces``
receives, decoded with the ``opentelemetry-proto`` classes (the protocol's own
definitions), kept as plain span records the test can read."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Status

TRACES_PATH = "/v1/traces"


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]
    status_error: bool
    status_message: str
    service_name: str
    scope: str


@dataclass
class Receiver:
    port: int
    spans: list[ReceivedSpan] = field(default_factory=list)
    requests: list[dict[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def received(self) -> list[ReceivedSpan]:
        with self.lock:
            return list(self.spans)

    def wait_for(self, count: int, timeout: float = 20.0) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout
        while len(self.received()) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.received()


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


def decode(body: bytes) -> list[ReceivedSpan]:
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    out = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                out.append(
                    ReceivedSpan(
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        status_error=span.status.code == Status.STATUS_CODE_ERROR,
                        status_message=span.status.message,
                        service_name=str(resource.get("service.name", "")),
                        scope=scope_spans.scope.name,
                    )
                )
    return out


@contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    """A receiver on a free loopback port, stopped on exit."""
    holder: list[Receiver] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            receiver = holder[0]
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            if self.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            with receiver.lock:
                receiver.requests.append(
                    {"path": self.path, "content-type": self.headers.get("content-type", "")}
                )
            if self.path != TRACES_PATH:
                self.send_response(404)
                self.end_headers()
                return
            spans = decode(body)
            with receiver.lock:
                receiver.spans.extend(spans)
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    holder.append(Receiver(port=server.server_address[1]))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield holder[0]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
