#!/usr/bin/env bash
# Instructions per proxied request (NOT part of CI): a deterministic companion to overhead.sh's CPU
# figures, which move with the machine's load. Each `serve` binary given runs under callgrind in
# front of the release mock worker with one io thread and one runtime thread; instrumentation is
# switched on after a warm-up, wrk sends the 1.3 KB chat body at c=1 for SECONDS, and the
# instructions executed in that window (user space, every thread) are divided by the requests
# wrk completed. Binaries run one after another against the same mock, so the figures compare.
#
# Usage: benches/callgrind.sh [seconds=10] [label=command ...]
#   command: the `serve` example, or `path/to/kvgate serve` (quote it: "after=target/release/kvgate serve").
#   default: after=$CARGO_TARGET_DIR/release/examples/serve (built here unless SKIP_BUILD=1).
#   Note: examples are built with the crate's dev-dependencies, so the `serve` example runs tokio
#   with `test-util` (its clock takes a lock per read); the `kvgate` binary does not: compare
#   like with like.
# Env: CARGO_TARGET_DIR, CHAT_LUA (default /work/shared/tools/peers/chat.lua), POLICY (default kv),
#      MOCK (a mock_worker binary; default the release example),
#      KEEP_DIR (copy each run's callgrind files there, for callgrind_annotate),
#      TRACING=1 (each binary also runs with `[tracing]` at sample_ratio 0.01 and 1.0, exporting
#      OTLP/HTTP to an nginx sink that answers 200: tracing's instructions per request beside
#      tracing off, same binary, same run; needs nginx).
# Needs valgrind (callgrind_control) and wrk.
set -euo pipefail
DUR=${1:-10}
shift || true
ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=benches/otlp-sink.sh
. "$ROOT/benches/otlp-sink.sh"
TGT=${CARGO_TARGET_DIR:-$ROOT/target}
CHAT_LUA=${CHAT_LUA:-/work/shared/tools/peers/chat.lua}
POLICY=${POLICY:-kv}
WORK=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

for tool in valgrind callgrind_control wrk; do
  command -v "$tool" >/dev/null || { echo "$tool not found" >&2; exit 1; }
done
[ -n "${SKIP_BUILD:-}" ] || (cd "$ROOT" && cargo build -q --release -p kvgate-gateway --features mock --example serve --example mock_worker)
MOCK=${MOCK:-$TGT/release/examples/mock_worker}
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=("after=$TGT/release/examples/serve")

wait_port() { for _ in $(seq 1 600); do (echo > /dev/tcp/127.0.0.1/$1) 2>/dev/null && return 0; sleep 0.1; done; echo "port $1 never opened" >&2; return 1; }

MOCK_PORT=${MOCK_PORT:-18941}
"$MOCK" 127.0.0.1:$MOCK_PORT 16 1 2>"$WORK/mock.log" & PIDS+=($!)
wait_port $MOCK_PORT
printf '[server]\nio_threads = 1\n' > "$WORK/one-thread.toml"
CONFIGS=("|$WORK/one-thread.toml")
if [ -n "${TRACING:-}" ]; then
  start_otlp_sink "$WORK/sink" 30232
  for r in 0.01 1.0; do
    printf '[server]\nio_threads = 1\n[tracing]\notlp_endpoint = "http://127.0.0.1:30232"\nsample_ratio = %s\n' "$r" > "$WORK/trace-$r.toml"
  done
  CONFIGS+=("(trace 1%)|$WORK/trace-0.01.toml" "(trace 100%)|$WORK/trace-1.0.toml")
fi

echo "| binary | policy | requests | instructions | instructions / request |"
echo "|---|---|---:|---:|---:|"
port=30201
for spec in "${TARGETS[@]}"; do
for conf in "${CONFIGS[@]}"; do
  label="${spec%%=*}${conf%%|*}"; config=${conf#*|}; read -ra cmd <<<"${spec#*=}"
  out="$WORK/run$port.callgrind"
  KVGATE_THREADS=1 TOKIO_WORKER_THREADS=1 valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$out" \
    "${cmd[@]}" --listen 127.0.0.1:$port --worker http://127.0.0.1:$MOCK_PORT --model mock-model \
    --no-request-log --log warn --policy "$POLICY" --config "$config" \
    >"$WORK/run$port.log" 2>&1 & pid=$!; PIDS+=($pid)
  wait_port $port
  # Warm-up: connections pooled, thread-locals and caches filled.
  wrk -t1 -c1 -d3s -s "$CHAT_LUA" "http://127.0.0.1:$port" >/dev/null
  callgrind_control -i on "$pid" >/dev/null 2>&1
  res=$(wrk -t1 -c1 -d"${DUR}"s -s "$CHAT_LUA" "http://127.0.0.1:$port")
  callgrind_control -i off "$pid" >/dev/null 2>&1
  callgrind_control -d "$pid" >/dev/null 2>&1
  reqs=$(echo "$res" | awk '/requests in/{print $1}')
  non2xx=$(echo "$res" | awk '/Non-2xx/{print $NF}'); [ -z "$non2xx" ] || echo "WARN $label: $non2xx non-2xx responses" >&2
  kill "$pid"; wait "$pid" 2>/dev/null || true
  # Every dump (one per thread part) of this run: sum their totals.
  # Every dump of this run (the requested one, and the one at exit): each file's `totals:` (else
  # its `summary:`), summed.
  instr=0
  for f in "$out"*; do
    n=$(awk '/^totals:/{t=$2} /^summary:/{s=$2} END{print (t != "" ? t : s + 0)}' "$f")
    instr=$((instr + n))
  done
  [ -z "${KEEP_DIR:-}" ] || { mkdir -p "$KEEP_DIR"; cp "$out"* "$KEEP_DIR/"; }
  echo "| $label | $POLICY | $reqs | $instr | $(awk -v i="$instr" -v n="$reqs" 'BEGIN{ if (n>0) printf "%.0f", i/n; else print "-" }') |"
  port=$((port + 1))
done
done
