"""A test OTLP trace collector: decodes what it receives with the OpenTelemetry project's own
protobuf definitions (PyPI `opentelemetry-proto`), over OTLP/HTTP (POST /v1/traces, protobuf) and
OTLP/gRPC (grpcio, TraceService/Export), and serves the spans as JSON at GET /spans.

Prints `http=PORT grpc=PORT` once both listen on 127.0.0.1, then serves until killed. With
`--tls CERT KEY` it also serves both protocols over TLS with that certificate and prints
`https=PORT grpcs=PORT` on the same line; spans are labelled with the protocol they came by
(`http`, `grpc`, `https`, `grpcs`). GET /spans is on the plain HTTP port.
Used by tests/tracing.rs.
"""
import json
import ssl
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
        requests[protocol] = requests.get(protocol, 0) + 1
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
        record(req, self.server.protocol)
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
    def __init__(self, protocol):
        self.protocol = protocol

    def Export(self, request, context):
        record(request, self.protocol)
        return trace_service_pb2.ExportTraceServiceResponse()


def http_server(protocol, context=None):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Http)
    server.protocol = protocol
    if context is not None:
        server.socket = context.wrap_socket(server.socket, server_side=True)
    return server


def grpc_server(protocol, credentials=None):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(protocol), server)
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    return server, port


def main():
    http = http_server("http")
    servers = [grpc_server("grpc")]
    line = f"http={http.server_address[1]} grpc={servers[0][1]}"
    if len(sys.argv) == 4 and sys.argv[1] == "--tls":
        cert, key = sys.argv[2], sys.argv[3]
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        https = http_server("https", context)
        threading.Thread(target=https.serve_forever, daemon=True).start()
        with open(cert, "rb") as c, open(key, "rb") as k:
            credentials = grpc.ssl_server_credentials([(k.read(), c.read())])
        servers.append(grpc_server("grpcs", credentials))
        line += f" https={https.server_address[1]} grpcs={servers[1][1]}"
    elif len(sys.argv) != 1:
        sys.exit("usage: otlp_collector.py [--tls CERT KEY]")
    print(line, flush=True)
    http.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
