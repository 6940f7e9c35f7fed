#!/usr/bin/env bash
# Routing quality through Envoy + `kvgate epp` against kvgate as the front door and Envoy's own
# round robin (NOT part of CI): `kvgate bench compare --epp` on one `kvgate sim` fleet, same
# workload for every row (caches reset between rows), exact index (the sims' KV events).
#   1. shared-prefix, 32 groups x 16 prompts, 2048-token system prompt + 128, 32 output tokens,
#      Poisson 30 req/s, 8 sims with 1024 blocks each (a worker holds 7 of the 32 groups);
#   2. the Mooncake slice: conversation_trace.jsonl's first 1000 requests, 64 tokens per hash
#      block, 32 output tokens, --time-scale 0.1 (about 30 req/s), 16384 blocks per sim
#      (docs/bench.md's settings).
# Rows: round_robin and kv at the front door, envoy_round_robin, envoy_epp_kv. The table of each
# run goes to OUT/<workload>/compare.md; the script prints the EPP-vs-front-door ratios.
#
# Usage: benches/epp-quality.sh MOONCAKE_TRACE [OUT=epp-quality-out] [RUNS=1]
#   (run r uses --seed r; FIRST_RUN=K numbers the runs from K, to add runs to an OUT)
# Env: CARGO_TARGET_DIR (release `kvgate` built there unless SKIP_BUILD=1; KVGATE_BIN overrides),
#      KVGATE_ENVOY (else `envoy` on PATH), POLICY (the front-door and picker entry, default kv).
set -euo pipefail
TRACE=${1:?usage: benches/epp-quality.sh MOONCAKE_TRACE [OUT] [RUNS]}
OUT=${2:-epp-quality-out}
RUNS=${3:-1}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TGT=${CARGO_TARGET_DIR:-$ROOT/target}
[ -f "$TRACE" ] || { echo "no trace at $TRACE" >&2; exit 2; }
[ -n "${SKIP_BUILD:-}" ] || (cd "$ROOT" && cargo build -q --release --locked -p kvgate)
KV=${KVGATE_BIN:-$TGT/release/kvgate}
P=${POLICY:-kv}
ENVOY_ARGS=()
[ -n "${KVGATE_ENVOY:-}" ] && ENVOY_ARGS=(--envoy "$KVGATE_ENVOY")

run() { # name args...
  local name=$1; shift
  "$KV" bench compare --policies "round_robin,$P" --epp "$P" "${ENVOY_ARGS[@]}" --quiet \
    --block-size 16 --out-dir "$OUT/$name" "$@" >"$OUT/$name.stdout"
  cat "$OUT/$name/compare.md"
}

mkdir -p "$OUT"
for r in $(seq "${FIRST_RUN:-1}" $(( ${FIRST_RUN:-1} + RUNS - 1 ))); do
  run "shared-prefix-$r" --workload shared-prefix --groups 32 --prompts-per-group 16 \
    --system-tokens 2048 --question-tokens 128 --output-len 32 --rate 30 --seed "$r" \
    --workers 8 --num-gpu-blocks 1024 --speedup 1
  run "mooncake-$r" --workload "mooncake:$TRACE" --trace-block-tokens 64 --max-output-tokens 32 \
    --time-scale 0.1 --requests 1000 --workers 8 --num-gpu-blocks 16384 --speedup 1
done

# Ratios of the picker row to the front door's row with the same entry, per run.
python3 - "$OUT" "$P" <<'PYEOF'
import json, pathlib, sys
out, p = pathlib.Path(sys.argv[1]), sys.argv[2]
stem = "".join(c if c.isascii() and (c.isalnum() or c in "_-.") else "_" for c in p)
print(f"\n{'run':<18} {'hit front':>9} {'hit epp':>8} {'hit rr':>7} {'epp/front hit':>13} "
      f"{'TTFT p50 front':>14} {'epp':>7} {'envoy rr':>8} {'epp/front':>9} {'picker saw':>10}")
for d in sorted(x for x in out.iterdir() if x.is_dir()):
    j = json.loads((d / "compare.json").read_text())
    rows = {r["policy"]: r for r in j["rows"]}
    f, e, rr = rows[p], rows[f"envoy_epp_{stem}"], rows["envoy_round_robin"]
    h = lambda r: r["summary"]["hit_rate"] or 0.0
    t = lambda r: r["summary"]["ttft_ms"]["p50"]
    seen = e.get("replica_traffic", [{}])[0]
    print(f"{d.name:<18} {h(f):>9.3f} {h(e):>8.3f} {h(rr):>7.3f} {h(e) / max(h(f), 1e-9):>13.3f} "
          f"{t(f):>14.1f} {t(e):>7.1f} {t(rr):>8.1f} {t(e) / t(f):>9.3f} "
          f"{seen.get('served', '?')}/{seen.get('sent', '?'):>4}")
PYEOF
