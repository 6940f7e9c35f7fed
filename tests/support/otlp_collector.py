"""A test OTLP trace collector: decodes what it receives with the OpenTelemetry project's own
protobuf definitions (PyPI `opentelemetry-proto`), over OTLP/HTTP (POST /v1/traces, protobuf) and
OTLP/gRPC (grpcio, TraceService/Export), and serves the spans as JSON at GET /spans.

Prints `http=PORT grpc=PORT` once both listen on 127.0.0.1, then serves until killed.
Used by tests/tracing.rs.
"""
import json
import sys
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

lock = threading.Lock()
spans = []
requests = {"http": 0, "grpc": 0}


def value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def record(req, protocol):
    with lock:
        requests[protocol] += 1
        for rs in req.resource_spans:
            resource = {kv.key: value(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append({
                        "protocol": protocol,
                        "service": resource.get("service.name"),
                        "scope": ss.scope.name,
                        "trace_id": s.trace_id.hex(),
                        "span_id": s.span_id.hex(),
                        "parent_span_id": s.parent_span_id.hex(),
                        "trace_state": s.trace_state,
                        "name": s.name,
                        "kind": s.kind,
                        "start": s.start_time_unix_nano,
                        "end": s.end_time_unix_nano,
                        "flags": s.flags,
                        "attributes": {kv.key: value(kv.value) for kv in s.attributes},
                        "events": [{"name": e.name, "time": e.time_unix_nano,
                                    "attributes": {kv.key: value(kv.value) for kv in e.attributes}}
                                   for e in s.events],
                        "status_code": s.status.code,
                        "status_message": s.status.message,
                    })


class Http(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        if self.path != "/v1/traces" or self.headers.get("content-type") != "application/x-protobuf":
            self.send_response(404)
            self.send_header("content-length", "0")
            self.end_headers()
            return
        req = trace_service_pb2.ExportTraceServiceRequest()
        req.ParseFromString(body)
        record(req, "http")
        out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def do_GET(self):
        with lock:
            out = json.dumps({"spans": spans, "requests": requests}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def Export(self, request, context):
        record(request, "grpc")
        return trace_service_pb2.ExportTraceServiceResponse()


def main():
    http = ThreadingHTTPServer(("127.0.0.1", 0), Http)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), server)
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"http={http.server_address[1]} grpc={grpc_port}", flush=True)
    http.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
