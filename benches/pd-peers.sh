#!/usr/bin/env bash
# Prefill/decode against the peers' PD modes (NOT part of CI: CI installs no peers), loopback only.
#
# Run A (vLLM NixlConnector handoff): one PD fleet of `kvgate sim` (P prefill + D decode workers),
#   vllm-router 0.1.17 in `--vllm-pd-disaggregation` mode in front of it, and one
#   `kvgate bench compare` over the same fleet: kvgate PD always (`kv:pd_min_uncached_tokens=0`),
#   kvgate PD conditional (`kv`, default threshold), round-robin pairs, the same sims as one
#   unified fleet (`kv:unified=true`), and vllm-router PD (its default policy, cache_aware) as
#   `--external`.
# Run B (SGLang bootstrap handoff): a second fleet of the same shape with `--pd-protocol sglang`,
#   `smg launch --pd-disaggregation` (sglang-router 0.3.2) in front of it, and a second
#   `bench compare`: kvgate PD (always) and round-robin pairs with `pd_protocol=sglang`, and smg PD
#   (its default policy) as `--external`. The sim serves the bootstrap rendezvous on the prefill
#   worker's HTTP port, so that port is the bootstrap port given to smg (`--prefill URL PORT`) and
#   to kvgate (`--bootstrap-on-http-port`).
# Both runs use `--api text` (smg refuses token-id prompts) with the approximate tokenizer on the
# sims and the gateways (the same function, so the gateways' KV-event index is exact).
# Every process this script starts is stopped by its pid on exit (bench compare stops its own
# gateways).
#
# Usage: benches/pd-peers.sh [OUT_DIR=pd-peers-out]
# Env: CARGO_TARGET_DIR (kvgate is built there, debug profile unless PROFILE=release),
#      PEERS (dir of ../shared/tools/peers/setup.sh, default /work/peers),
#      P (prefill workers, 2), D (decode workers, 4), RATE (20), REQUESTS (160), SPEEDUP (2),
#      WORKLOAD_ARGS (default: the shared-prefix set of docs/bench.md's PD section),
#      SKIP_A=1 / SKIP_B=1 (skip a run), SKIP_BUILD=1,
#      POLICIES_A (run A's `--policies`; default below: kv PD always (decode legs by
#      least_loaded, the default), conditional, always with kv decode legs, round-robin pairs,
#      unified), POLICIES_B (run B's: kv PD always and conditional, round-robin pairs; all with
#      the SGLang handoff).
set -euo pipefail
OUT=${1:-pd-peers-out}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TGT=${CARGO_TARGET_DIR:-$ROOT/target}
PROFILE=${PROFILE:-debug}
PEERS=${PEERS:-/work/peers}
P=${P:-2}
D=${D:-4}
RATE=${RATE:-20}
REQUESTS=${REQUESTS:-160}
SPEEDUP=${SPEEDUP:-2}
WORKLOAD_ARGS=${WORKLOAD_ARGS:---workload shared-prefix --groups 16 --prompts-per-group 10 --system-tokens 1024 --question-tokens 128 --output-len 32}
N=$((P + D))
POLICIES_A=${POLICIES_A:-kv_pd=kv:pd_min_uncached_tokens=0,kv_pd_cond=kv,kv_pd_kv_decode=kv:pd_min_uncached_tokens=0:pd_decode_policy=kv,rr_pairs=round_robin:pd_min_uncached_tokens=0,unified_kv=kv:unified=true}
POLICIES_B=${POLICIES_B:-kv_pd_sglang=kv:pd_min_uncached_tokens=0:pd_protocol=sglang,kv_pd_cond_sglang=kv:pd_protocol=sglang,rr_pairs_sglang=round_robin:pd_min_uncached_tokens=0:pd_protocol=sglang}
MODEL=sim-model
BASE_A=${BASE_A:-18300}   # HTTP base+i, KV events base+1000+i, replay base+1100+i
BASE_B=${BASE_B:-18500}
VR_PORT=30301; VR_PROM=29301
SMG_PORT=30501; SMG_PROM=29501

PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do
    for _ in $(seq 1 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$p" 2>/dev/null || true
  done
}
trap cleanup EXIT

if [ -z "${SKIP_BUILD:-}" ]; then
  if [ "$PROFILE" = release ]; then (cd "$ROOT" && cargo build -q --release -p kvgate); else (cd "$ROOT" && cargo build -q -p kvgate); fi
fi
KVGATE=$TGT/$PROFILE/kvgate
VLLM_ROUTER=$PEERS/venv/bin/vllm-router
SMG=$PEERS/venv/bin/smg
for b in "$KVGATE" "$VLLM_ROUTER" "$SMG"; do [ -x "$b" ] || { echo "missing $b (peers: ../shared/tools/peers/setup.sh $PEERS)" >&2; exit 1; }; done
mkdir -p "$OUT"

port_free() { ! (echo > /dev/tcp/127.0.0.1/"$1") 2>/dev/null; }
wait_http() { # url seconds
  for _ in $(seq 1 $(($2 * 10))); do curl -sf -o /dev/null "$1" && return 0; sleep 0.1; done
  echo "$1 never answered" >&2; return 1
}

start_fleet() { # label base extra-sim-args...
  local label=$1 base=$2; shift 2
  for i in $(seq 0 $((N - 1))); do
    for p in $((base + i)) $((base + 1000 + i)) $((base + 1100 + i)); do
      port_free "$p" || { echo "port $p is in use" >&2; exit 1; }
    done
  done
  "$KVGATE" sim --workers "$N" --prefill-workers "$P" --base-port "$base" --block-size 16 \
    --num-gpu-blocks 2048 --speedup "$SPEEDUP" --model "$MODEL" "$@" \
    > "$OUT/sim-$label.out" 2> "$OUT/sim-$label.log" & PIDS+=($!)
  echo "started sim fleet $label (pid $!)" >&2
  for i in $(seq 0 $((N - 1))); do wait_http "http://127.0.0.1:$((base + i))/health" 60; done
}

worker_args() { # base → --worker URL ... --worker-kv-events tcp://... (prefill workers first)
  local base=$1
  for i in $(seq 0 $((N - 1))); do
    printf -- '--worker http://127.0.0.1:%d --worker-kv-events tcp://127.0.0.1:%d ' $((base + i)) $((base + 1000 + i))
  done
}

# Prefill-side hit per row, from the prefill sims themselves: their vllm:prefix_cache_{hits,queries}
# counters summed, sampled every 0.2 s, differenced over each row's window (the timestamped
# "running ROW" lines of bench compare's stderr). The client's hit column is the prefill side only
# where the router merges usage from the prefill leg (kvgate and vllm-router with vLLM); with
# SGLang the client sees the decode worker's usage.
sample_prefill() { # base file
  while :; do
    local h=0 q=0
    for i in $(seq 0 $((P - 1))); do
      m=$(curl -s "http://127.0.0.1:$(($1 + i))/metrics" || true)
      h=$(awk -v h="$h" '/^vllm:prefix_cache_hits_total/ {h += $NF} END {print h}' <<< "$m")
      q=$(awk -v q="$q" '/^vllm:prefix_cache_queries_total/ {q += $NF} END {print q}' <<< "$m")
    done
    echo "$(date +%s.%N) $h $q" >> "$2"
    sleep 0.2
  done
}
stamp() { while IFS= read -r l; do echo "$(date +%s.%N) $l"; done; }

COMMON=(bench compare --api text --model "$MODEL" --block-size 16 --num-gpu-blocks 2048
        --prefill-workers "$P" --rate "$RATE" --requests "$REQUESTS" --quiet)
# shellcheck disable=SC2206
WL=($WORKLOAD_ARGS)

echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)" | tee "$OUT/loadavg.txt"

if [ -z "${SKIP_A:-}" ]; then
  start_fleet A "$BASE_A"
  vr_args=(--host 127.0.0.1 --port $VR_PORT --vllm-pd-disaggregation --prometheus-host 127.0.0.1
           --prometheus-port $VR_PROM --log-level warning)
  for i in $(seq 0 $((P - 1))); do vr_args+=(--prefill "http://127.0.0.1:$((BASE_A + i))"); done
  for i in $(seq "$P" $((N - 1))); do vr_args+=(--decode "http://127.0.0.1:$((BASE_A + i))"); done
  port_free $VR_PORT || { echo "port $VR_PORT is in use" >&2; exit 1; }
  "$VLLM_ROUTER" "${vr_args[@]}" > "$OUT/vllm-router.log" 2>&1 & PIDS+=($!)
  echo "started vllm-router (pid $!)" >&2
  wait_http "http://127.0.0.1:$VR_PORT/health" 60
  sample_prefill "$BASE_A" "$OUT/A-vllm.prefill-samples" & PIDS+=($!); SAMPLER=$!
  # shellcheck disable=SC2046
  "$KVGATE" "${COMMON[@]}" "${WL[@]}" $(worker_args "$BASE_A") \
    --policies "$POLICIES_A" \
    --external "vllm_router_pd=http://127.0.0.1:$VR_PORT" \
    --out-dir "$OUT/A-vllm" 2> >(stamp > "$OUT/A-vllm.stderr")
  echo "$(date +%s.%N) END" >> "$OUT/A-vllm.stderr"
  kill "$SAMPLER" 2>/dev/null || true
  echo "load average after A: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/loadavg.txt"
  for i in $(seq 0 $((P - 1))); do
    echo "A prefill $i: $(curl -s "http://127.0.0.1:$((BASE_A + i))/metrics" | grep -E '^kvgate_sim_pd_pinned_blocks')"
  done | tee "$OUT/A-pinned.txt"
fi

if [ -z "${SKIP_B:-}" ]; then
  start_fleet B "$BASE_B" --pd-protocol sglang --bootstrap-timeout-ms 30000
  smg_args=(launch --host 127.0.0.1 --port $SMG_PORT --pd-disaggregation --prometheus-host 127.0.0.1
            --prometheus-port $SMG_PROM --log-level warn)
  for i in $(seq 0 $((P - 1))); do smg_args+=(--prefill "http://127.0.0.1:$((BASE_B + i))" $((BASE_B + i))); done
  for i in $(seq "$P" $((N - 1))); do smg_args+=(--decode "http://127.0.0.1:$((BASE_B + i))"); done
  port_free $SMG_PORT || { echo "port $SMG_PORT is in use" >&2; exit 1; }
  "$SMG" "${smg_args[@]}" > "$OUT/smg.log" 2>&1 & PIDS+=($!)
  echo "started smg (pid $!)" >&2
  wait_http "http://127.0.0.1:$SMG_PORT/health" 60
  sample_prefill "$BASE_B" "$OUT/B-sglang.prefill-samples" & PIDS+=($!); SAMPLER=$!
  # shellcheck disable=SC2046
  "$KVGATE" "${COMMON[@]}" "${WL[@]}" $(worker_args "$BASE_B") --bootstrap-on-http-port \
    --policies "$POLICIES_B" \
    --external "smg_pd=http://127.0.0.1:$SMG_PORT" \
    --out-dir "$OUT/B-sglang" 2> >(stamp > "$OUT/B-sglang.stderr")
  echo "$(date +%s.%N) END" >> "$OUT/B-sglang.stderr"
  kill "$SAMPLER" 2>/dev/null || true
  echo "load average after B: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/loadavg.txt"
  for i in $(seq 0 $((P - 1))); do
    echo "B prefill $i: $(curl -s "http://127.0.0.1:$((BASE_B + i))/metrics" | grep -E '^kvgate_sim_pd_bootstrap_(rooms|timeouts_total)' | tr '\n' ' ')"
  done | tee "$OUT/B-rooms.txt"
fi

# One table over both runs: decode-pool max/mean from compare.json (workers P..N-1), and TTFT p50
# ratios against vllm-router PD and round-robin pairs of the same run.
python3 - "$OUT" "$P" <<'PY'
import json, os, sys
out, p = sys.argv[1], int(sys.argv[2])
rows = []
for run in ("A-vllm", "B-sglang"):
    f = os.path.join(out, run, "compare.json")
    if not os.path.exists(f):
        continue
    j = json.load(open(f))
    # row windows from the timestamped stderr, prefill-side hit from the samples
    lines_ = [l.split(" ", 1) for l in open(os.path.join(out, run + ".stderr")).read().splitlines() if " " in l]
    marks = sorted((float(t), m) for t, m in lines_ if m.startswith(("running ", "started serve", "END")))
    samples = [tuple(map(float, l.split())) for l in open(os.path.join(out, run + ".prefill-samples")) if len(l.split()) == 3]
    def at(ts):
        prev = None
        for s_ in samples:
            if s_[0] > ts:
                break
            prev = s_
        return prev
    phit = {}
    for k, (t0, m) in enumerate(marks):
        if m.startswith("running ") and k + 1 < len(marks):
            name = m.split()[1]
            # The sampler's first scrape can land just after the first row started: a first
            # sample that has seen no prompt tokens yet is that row's baseline.
            first = samples[0] if samples and samples[0][2] == 0 else None
            a, b = at(t0) or first, at(marks[k + 1][0])
            if a and b and b[2] > a[2]:
                phit[name] = ((b[1] - a[1]) / (b[2] - a[2]), b[2] - a[2])
    for r in j["rows"]:
        s = r["summary"]
        dec = r["worker_mean_running"][p:]
        m = sum(dec) / len(dec) if dec else 0
        rows.append(dict(run=run, name=r["policy"], hit=s.get("hit_rate"), hio=r.get("hit_over_oracle"),
                         t50=s["ttft_ms"]["p50"], t99=s["ttft_ms"]["p99"], i99=s["itl_ms"]["p99"],
                         dmm=(max(dec) / m) if m > 0 else None, err=s["requests"] - s["succeeded"],
                         rps=s["req_per_s"], phit=phit.get(r["policy"], (None, 0))))
ref = {}
for r in rows:
    if r["name"] in ("vllm_router_pd", "rr_pairs", "smg_pd", "rr_pairs_sglang"):
        ref[(r["run"], r["name"])] = r["t50"]
f = lambda v, d=1: "–" if v is None else f"{v:.{d}f}"
lines = ["| run | row | client hit | hit/oracle | prefill sims' hit (prompt tokens) | TTFT p50 ms | TTFT p99 ms | ITL p99 ms | decode max/mean | errors | req/s | TTFT p50 / vllm-router PD | TTFT p50 / rr pairs (same run) |",
         "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
for r in rows:
    vr = ref.get(("A-vllm", "vllm_router_pd"))
    rr = ref.get((r["run"], "rr_pairs" if r["run"] == "A-vllm" else "rr_pairs_sglang"))
    lines.append(f"| {r['run']} | {r['name']} | {f(r['hit'],3)} | {f(r['hio'],2)} | {f(r['phit'][0],3)} ({int(r['phit'][1])}) | {f(r['t50'])} | {f(r['t99'])} | {f(r['i99'])} | {f(r['dmm'],2)} | {r['err']} | {f(r['rps'],2)} | {f(r['t50']/vr if vr else None,2)} | {f(r['t50']/rr if rr else None,2)} |")
t = "\n".join(lines)
print(t)
open(os.path.join(out, "summary.md"), "w").write(t + "\n")
PY
