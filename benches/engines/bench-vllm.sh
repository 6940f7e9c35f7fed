#!/usr/bin/env bash
# bench-vllm.sh — `kvgate bench compare` against two REAL vLLM 0.32 engines on this machine's CPU
# (the tiny random-weight model, one core each; install with vllm-setup.sh first), exact index from
# their KV events. Starts the engines, runs the workloads, stops the engines (by process group).
#
# Usage:  benches/engines/bench-vllm.sh [OUT_DIR]
# Env:    KVGATE=kvgate binary (default target/release/kvgate, else target/debug/kvgate)
#         POLICIES=round_robin,latency,kv     PORT=18300 (engines on PORT, PORT+1)
#         VLLM_ROUTER=path of vllm-router (PyPI vllm-router 0.1.17, ../shared/tools/peers/setup.sh):
#           also started on PORT+2 with --policy kv_aware reading the same engines' KV events
#           (and their replay sockets), compared as the external `vllm_router_kv_aware`
#         WORKLOADS="shared-prefix multi-turn"   BLOCKS=  (--num-gpu-blocks-override per engine)
# The engines' compute is ~1 core each on a shared machine: rates are low (a few req/s) and the
# numbers to read are ratios between the policies of one run.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); root=$(cd "$here/../.." && pwd)
out=${1:-$root/target/bench-vllm}; mkdir -p "$out"
kvgate=${KVGATE:-}
[ -n "$kvgate" ] || for k in "$root/target/release/kvgate" "$root/target/debug/kvgate"; do
  [ -x "$k" ] && { kvgate=$k; break; }; done
[ -x "$kvgate" ] || { echo "bench-vllm.sh: build kvgate first (cargo build --release -p kvgate)" >&2; exit 1; }
port=${PORT:-18300}
pids=()
stop() { for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null || kill -TERM "$p" 2>/dev/null || true; done
         for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done; }
trap stop EXIT
for i in 0 1; do
  p=$((port + i))
  CPUS=$i KV_PORT=$((p + 10000)) REPLAY_PORT=$((p + 20000)) setsid "$here/vllm-serve.sh" "$p" \
    >"$out/engine$i.log" 2>&1 &
  pids+=($!)
done
echo "engines on 127.0.0.1:$port and :$((port + 1)) (events :$((port + 10000)), :$((port + 10001))); waiting for /health"
for i in 0 1; do
  until curl -sf "http://127.0.0.1:$((port + i))/health" >/dev/null; do
    kill -0 "${pids[$i]}" 2>/dev/null || { tail -20 "$out/engine$i.log"; exit 1; }
    sleep 2
  done
done
ext=()
if [ -n "${VLLM_ROUTER:-}" ]; then
  r=$((port + 2)); u0=http://127.0.0.1:$port; u1=http://127.0.0.1:$((port + 1))
  "$VLLM_ROUTER" --host 127.0.0.1 --port "$r" --worker-urls "$u0" "$u1" --policy kv_aware \
    --kv-event-source "$u0=tcp://127.0.0.1:$((port + 10000))" --kv-event-source "$u1=tcp://127.0.0.1:$((port + 10001))" \
    --kv-event-replay-source "$u0=tcp://127.0.0.1:$((port + 20000))" \
    --kv-event-replay-source "$u1=tcp://127.0.0.1:$((port + 20001))" \
    --kv-event-block-size 32 --kv-event-model smollm2 --prometheus-port $((port + 3)) >"$out/vllm-router.log" 2>&1 &
  pids+=($!)
  until curl -sf "http://127.0.0.1:$r/health" >/dev/null; do
    kill -0 "${pids[2]}" 2>/dev/null || { tail -20 "$out/vllm-router.log"; exit 1; }
    sleep 1
  done
  ext=(--external "vllm_router_kv_aware=http://127.0.0.1:$r")
fi
for w in ${WORKLOADS:-shared-prefix multi-turn}; do
  case "$w" in
    shared-prefix) shape=(--groups 4 --prompts-per-group 8 --system-tokens 512 --question-tokens 64) ;;
    multi-turn) shape=(--sessions 8 --turns 4 --system-tokens 256 --user-tokens 64) ;;
    *) shape=() ;;
  esac
  "$kvgate" bench compare --quiet --model smollm2 --block-size 32 --workload "$w" "${shape[@]}" \
    --output-len 16 --rate "${RATE:-2}" --request-timeout 120 \
    --worker "http://127.0.0.1:$port" --worker "http://127.0.0.1:$((port + 1))" \
    --worker-kv-events "tcp://127.0.0.1:$((port + 10000))" --worker-kv-events "tcp://127.0.0.1:$((port + 10001))" \
    --policies "${POLICIES:-round_robin,latency,kv}" "${ext[@]}" --out-dir "$out/$w" | tee "$out/$w.txt"
done
