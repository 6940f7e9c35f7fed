#!/usr/bin/env bash
# Routing quality against the TTFT floor, repeated: `kvgate bench compare` RUNS times per workload
# (each run one command, every policy side by side on the same fleet), then a table per workload
# and policy: median TTFT p50 / p99 over the runs, their ratios to the floor printed by the same
# runs, the spread of p50 over the runs ((max - min) / median) and hit / oracle.
# Not run in CI. Loopback only. Every process it starts is stopped by its pid on exit or signal.
#
#   benches/floor.sh [OUT_DIR]          (default floor-out; run from the repository root)
#
# Environment:
#   KVGATE     kvgate binary (default target/release/kvgate; build it with --release)
#   RUNS       runs per workload (3)
#   POLICIES   --policies of every run (round_robin,kv_time,kv,latency: kv_time is the default); entries may carry keys
#              (kv:prefill_weight=1, LABEL=kv:...), see docs/bench.md
#   WORKLOADS  any of: agentic20 agentic60 multi-turn shared-prefix mooncake
#              (default: all five; mooncake only with MOONCAKE)
#   MOONCAKE   a Mooncake JSONL trace (e.g. conversation_trace.jsonl): the mooncake workload's
#              first 1000 requests; skipped with a note when unset or not a file
#   PEERS      a directory where ../shared/tools/peers/setup.sh installed the peer routers
#              (PEERS/venv/bin/vllm-router, PEERS/venv/bin/smg): the script then starts the sims
#              itself (fresh for every run), puts vllm-router (kv_aware if its --help lists it,
#              else cache_aware; fed the sims' KV events) in front of them, and smg with SMG=1,
#              and adds them as --external rows (the floor then needs a kvgate with
#              `bench compare --sim-floor`)
#   SMG        1 adds smg (cache_aware) to the peer rows (default 0: smg 0.3.2 rejects token-id
#              prompts with HTTP 422, so its row is all errors unless the prompts are text:
#              COMPARE_ARGS="--api text" with the same tokenizer on sims and gateways, where the
#              oracle and the floor, computed on the bench's token ids, are only indicative)
#   SIM_ARGS   extra `kvgate sim` arguments (word-split), given to the sims and to the floor
#   COMPARE_ARGS  extra arguments for every `bench compare` (word-split), e.g. "--seed 7"
#   LOADED_FLOOR  `bench compare --loaded-floor` entries (default least_loaded,latency;
#              empty: no loaded floor): the same trace again per entry with every request at the
#              infinite cache's hit on whichever worker it goes to (sims with
#              --assume-cached-header); summary.md gets the loaded floor (best p50 / best p99 of
#              those rows, median over runs) and each policy's ratios to it
#   SUMMARY_ONLY  1: run nothing, print the table of the runs already in OUT_DIR
set -euo pipefail

OUT=${1:-floor-out}
KVGATE=${KVGATE:-target/release/kvgate}
RUNS=${RUNS:-3}
POLICIES=${POLICIES:-round_robin,kv_time,kv,latency}
# --loaded-floor rows (empty: none); the loaded floor is their best p50 and best p99.
LOADED_FLOOR=${LOADED_FLOOR-least_loaded,latency}
WORKLOADS=${WORKLOADS:-agentic20 agentic60 multi-turn shared-prefix mooncake}
MOONCAKE=${MOONCAKE:-}
PEERS=${PEERS:-}
SMG=${SMG:-0}
read -r -a COMPARE_EXTRA <<<"${COMPARE_ARGS:-}"
read -r -a SIM_EXTRA <<<"${SIM_ARGS:-}"
FLOOR_ARGS=()
if [ -n "$LOADED_FLOOR" ]; then
    FLOOR_ARGS=(--loaded-floor "$LOADED_FLOOR")
    # Sims this script starts (PEERS) honour the assumed-cache header; bench compare adds the
    # flag to the sims it starts itself.
    [[ " ${SIM_EXTRA[*]} " == *" --assume-cached-header "* ]] || [ -z "$PEERS" ] \
        || SIM_EXTRA+=(--assume-cached-header)
fi
SIM_FOR_COMPARE=()
for a in "${SIM_EXTRA[@]}"; do SIM_FOR_COMPARE+=("--sim-arg=$a"); done
MODEL=sim-model
BS=16

[ -x "$KVGATE" ] || { echo "floor.sh: no kvgate binary at $KVGATE (set KVGATE or build --release)" >&2; exit 2; }
[[ "$RUNS" =~ ^[1-9][0-9]*$ ]] || { echo "floor.sh: RUNS must be a positive integer, got '$RUNS'" >&2; exit 2; }
command -v python3 >/dev/null || { echo "floor.sh: needs python3" >&2; exit 2; }
if [ -n "$PEERS" ]; then
    for b in vllm-router $([ "$SMG" != 0 ] && echo smg); do
        [ -x "$PEERS/venv/bin/$b" ] || { echo "floor.sh: $PEERS/venv/bin/$b missing (run ../shared/tools/peers/setup.sh $PEERS)" >&2; exit 2; }
    done
    "$KVGATE" bench compare --help | grep -q -- '--sim-floor' \
        || { echo "floor.sh: $KVGATE has no 'bench compare --sim-floor' (the floor of a fleet started here); rebuild it" >&2; exit 2; }
    VLLM_POLICY=kv_aware
    "$PEERS/venv/bin/vllm-router" --help 2>&1 | grep -q 'kv_aware' || VLLM_POLICY=cache_aware
fi
if [ -n "$LOADED_FLOOR" ]; then
    "$KVGATE" bench compare --help | grep -q -- '--loaded-floor' \
        || { echo "floor.sh: $KVGATE has no 'bench compare --loaded-floor'; rebuild it or set LOADED_FLOOR=" >&2; exit 2; }
fi
mkdir -p "$OUT"

# Every process started here, by pid; stopped on any exit.
# The running `bench compare` (it stops its own children on SIGINT) is CMP, the rest in PIDS.
PIDS=()
CMP=
stop_all() {
    local p
    [ -n "$CMP" ] && PIDS=("$CMP" "${PIDS[@]}") && CMP=
    for p in "${PIDS[@]}"; do kill -INT "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do
        for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$p" 2>/dev/null || true
        wait "$p" 2>/dev/null || true
    done
    PIDS=()
}
trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# N consecutive free loopback ports from a base whose +1000 and +1100 ranges are free too (sims'
# HTTP, KV-event and replay ports), then more single free ports: prints them space-separated.
free_ports() { # n_consecutive n_single
    python3 - "$1" "$2" <<'EOF'
import random, socket, sys
n, k = int(sys.argv[1]), int(sys.argv[2])
def free(p):
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p)); return True
    except OSError:
        return False
    finally:
        s.close()
for _ in range(500):
    b = random.randrange(20000, 40000)
    if all(free(b + i) and free(b + 1000 + i) and free(b + 1100 + i) for i in range(n)):
        break
else:
    sys.exit("no free port range")
singles = []
while len(singles) < k:
    p = random.randrange(41000, 60000)
    if free(p) and p not in singles:
        singles.append(p)
print(b, *singles)
EOF
}

wait_http() { # url pid what
    python3 - "$1" "$2" <<'EOF' &
import os, sys, time, urllib.request
deadline = time.time() + 60
while time.time() < deadline:
    try:
        os.kill(int(sys.argv[2]), 0)
    except ProcessLookupError:
        sys.exit(1)
    try:
        with urllib.request.urlopen(sys.argv[1], timeout=2) as r:
            if 200 <= r.status < 300:
                sys.exit(0)
    except Exception:
        pass
    time.sleep(0.2)
sys.exit(1)
EOF
    local w=$!
    wait "$w" || { echo "floor.sh: $3 (pid $2) not ready at $1 within 60 s" >&2; return 1; }
    kill -0 "$2" 2>/dev/null || { echo "floor.sh: $3 (pid $2) exited" >&2; return 1; }
}

# Workload arguments and fleet shape (workers, blocks per worker) of each name; docs/bench.md.
AGENTIC=(--workload agentic --turns 8 --session-rate 1.5 --think-ms 1000 --system-prompts 4
    --system-tokens 1536 --user-tokens 64 --tool-tokens 640 --output-len 32)
workload() { # name -> sets WL_ARGS, NW, NB; returns 1 to skip
    case "$1" in
        agentic20) WL_ARGS=("${AGENTIC[@]}" --sessions 20); NW=4; NB=1024 ;;
        agentic60) WL_ARGS=("${AGENTIC[@]}" --sessions 60); NW=4; NB=1024 ;;
        multi-turn) WL_ARGS=(--workload multi-turn --sessions 32 --turns 6 --system-tokens 1024
                --user-tokens 128 --output-len 32 --rate 20); NW=8; NB=1024 ;;
        shared-prefix) WL_ARGS=(--workload shared-prefix --groups 32 --prompts-per-group 16
                --system-tokens 2048 --question-tokens 128 --output-len 32 --rate 34); NW=8; NB=1024 ;;
        mooncake)
            if [ -z "$MOONCAKE" ] || [ ! -f "$MOONCAKE" ]; then
                echo "floor.sh: skipping mooncake (MOONCAKE='${MOONCAKE}' is not a file)" >&2
                return 1
            fi
            WL_ARGS=(--workload "mooncake:$MOONCAKE" --requests 1000 --trace-block-tokens 64
                --max-output-tokens 32 --time-scale 0.1); NW=8; NB=16384 ;;
        *) echo "floor.sh: unknown workload '$1' (agentic20 agentic60 multi-turn shared-prefix mooncake)" >&2; exit 2 ;;
    esac
}

run_one() { # name run_dir
    local name=$1 dir=$2
    mkdir -p "$dir"
    local fleet=() ext=()
    if [ -n "$PEERS" ]; then
        local ports base vr vrp smg smgp i simpid attempt urls=() sources=() events=()
        # Another process may take a port between the check and the bind: a few fresh tries.
        for attempt in 1 2 3; do
            read -r -a ports <<<"$(free_ports "$NW" 4)"
            base=${ports[0]} vr=${ports[1]} vrp=${ports[2]} smg=${ports[3]} smgp=${ports[4]}
            "$KVGATE" sim --workers "$NW" --host 127.0.0.1 --base-port "$base" --block-size "$BS" \
                --num-gpu-blocks "$NB" --model "$MODEL" "${SIM_EXTRA[@]}" >"$dir/sim.log" 2>&1 &
            simpid=$!
            PIDS+=("$simpid")
            local ok=1
            for ((i = 0; i < NW; i++)); do
                wait_http "http://127.0.0.1:$((base + i))/health" "$simpid" sim || { ok=0; break; }
            done
            [ "$ok" = 1 ] && break
            stop_all
            [ "$attempt" = 3 ] && return 1
            echo "floor.sh: retrying the sims on other ports" >&2
        done
        for ((i = 0; i < NW; i++)); do
            urls+=("http://127.0.0.1:$((base + i))")
            events+=("tcp://127.0.0.1:$((base + 1000 + i))")
            sources+=(--kv-event-source "http://127.0.0.1:$((base + i))=tcp://127.0.0.1:$((base + 1000 + i))")
            fleet+=(--worker "http://127.0.0.1:$((base + i))" --worker-kv-events "tcp://127.0.0.1:$((base + 1000 + i))")
        done
        "$PEERS/venv/bin/vllm-router" --host 127.0.0.1 --port "$vr" --policy "$VLLM_POLICY" \
            --prometheus-host 127.0.0.1 --prometheus-port "$vrp" "${sources[@]}" \
            --kv-event-model "$MODEL" --kv-event-block-size "$BS" \
            --worker-urls "${urls[@]}" >"$dir/vllm-router.log" 2>&1 &
        PIDS+=($!)
        wait_http "http://127.0.0.1:$vr/health" $! vllm-router || return 1
        ext+=(--external "vllm_router_$VLLM_POLICY=http://127.0.0.1:$vr")
        if [ "$SMG" != 0 ]; then
            "$PEERS/venv/bin/smg" launch --host 127.0.0.1 --port "$smg" --policy cache_aware \
                --prometheus-host 127.0.0.1 --prometheus-port "$smgp" --log-level warn \
                --worker-urls "${urls[@]}" >"$dir/smg.log" 2>&1 &
            PIDS+=($!)
            wait_http "http://127.0.0.1:$smg/health" $! smg || return 1
            ext+=(--external "sglang_cache_aware=http://127.0.0.1:$smg")
        fi
        fleet+=(--sim-floor --block-size "$BS" --num-gpu-blocks "$NB")
    else
        fleet=(--workers "$NW" --block-size "$BS" --num-gpu-blocks "$NB")
    fi
    "$KVGATE" bench compare --quiet --model "$MODEL" "${fleet[@]}" "${SIM_FOR_COMPARE[@]}" "${WL_ARGS[@]}" \
        --policies "$POLICIES" "${FLOOR_ARGS[@]}" "${ext[@]}" "${COMPARE_EXTRA[@]}" --out-dir "$dir" \
        >"$dir/compare.out" 2>"$dir/compare.err" &
    CMP=$!
    local rc=0
    wait "$CMP" || rc=$?
    CMP=
    if [ "$rc" != 0 ]; then
        echo "floor.sh: bench compare failed ($name, $dir; exit $rc); see $dir/compare.err" >&2
        tail -5 "$dir/compare.err" >&2
        return 1
    fi
}

FAILED=0
for name in $WORKLOADS; do
    [ "${SUMMARY_ONLY:-0}" = 1 ] && break
    workload "$name" || continue
    for ((r = 1; r <= RUNS; r++)); do
        echo "floor.sh: $name run $r/$RUNS ($(date -u +%H:%M:%S) UTC, load $(cut -d' ' -f1-3 /proc/loadavg))" >&2
        run_one "$name" "$OUT/$name/run$r" || FAILED=1
        stop_all
    done
done

python3 - "$OUT" $WORKLOADS <<'EOF' | tee "$OUT/summary.md"
import glob, json, os, statistics, sys
out, names = sys.argv[1], sys.argv[2:]
def med(v):
    v = [x for x in v if x is not None]
    return statistics.median(v) if v else None
def f(v, d=1, suffix=""):
    return "–" if v is None else f"{v:.{d}f}{suffix}"
for name in names:
    runs = []
    for p in sorted(glob.glob(os.path.join(out, name, "run*", "compare.json"))):
        with open(p) as fh:
            runs.append(json.load(fh))
    if not runs:
        continue
    floors = [r["oracle"].get("ttft_floor") for r in runs]
    fl50 = med([x["p50_ms"] for x in floors if x])
    fl99 = med([x["p99_ms"] for x in floors if x])
    loaded = [r.get("loaded_floor") for r in runs]
    ld50 = med([x["p50_ms"] for x in loaded if x])
    ld99 = med([x["p99_ms"] for x in loaded if x])
    print(f"\n### {name}: {len(runs)} runs; TTFT floor p50 {f(fl50)} ms, p99 {f(fl99)} ms; "
          f"oracle hit {f(med([r['oracle']['infinite_hit_rate'] for r in runs]), 3)}\n")
    if any(loaded):
        best = lambda k: ", ".join(sorted({x[k] for x in loaded if x}))
        print(f"TTFT loaded floor (median over runs of each run's best floor: row): p50 {f(ld50)} ms "
              f"(best: {best('p50_row')}), p99 {f(ld99)} ms (best: {best('p99_row')}). "
              "÷ loaded: median over runs of the per-run ratio; (m) = median p50 (p99) ÷ median "
              "loaded floor p50 (p99), the ratio of medians.\n")
    print("| policy | TTFT p50 ms | p50 / floor | p50 ÷ loaded | p50 ÷ loaded (m) | TTFT p99 ms | "
          "p99 / floor p99 | p99 ÷ loaded | p99 ÷ loaded (m) | p50 spread | hit / oracle | "
          "step wait ms | p50 / (floor + step wait) | errors |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    order = []
    for r in runs:
        for row in r["rows"]:
            if row["policy"] not in order:
                order.append(row["policy"])
    for pol in order:
        p50, p99, r50, r99, hit, wait, rw, errs = [], [], [], [], [], [], [], 0
        l50, l99 = [], []
        for r, fl in zip(runs, floors):
            row = next((x for x in r["rows"] if x["policy"] == pol), None)
            if row is None:
                continue
            s = row["summary"]
            errs += sum(s["errors"].values())
            if not s["ttft_ms"].get("count"):
                continue
            p50.append(s["ttft_ms"]["p50"]); p99.append(s["ttft_ms"]["p99"])
            if fl:
                r50.append(s["ttft_ms"]["p50"] / fl["p50_ms"]); r99.append(s["ttft_ms"]["p99"] / fl["p99_ms"])
            lr = row.get("over_loaded_floor")
            if lr:
                l50.append(lr["p50"]); l99.append(lr["p99"])
            hit.append(row.get("hit_over_oracle"))
            w = (row.get("engine") or {}).get("step_wait_ms")
            wait.append(w)
            if fl and w is not None:
                rw.append(s["ttft_ms"]["p50"] / (fl["p50_ms"] + w))
        m50, m99 = med(p50), med(p99)
        spread = (max(p50) - min(p50)) / m50 if len(p50) > 1 and m50 else None
        floor_row = pol.startswith("floor:")
        lm50 = m50 / ld50 if m50 and ld50 and not floor_row else None
        lm99 = m99 / ld99 if m99 and ld99 and not floor_row else None
        print(f"| {pol} | {f(m50)} | {f(med(r50), 2, '×')} | {f(med(l50), 2, '×')} | {f(lm50, 2, '×')} | "
              f"{f(m99)} | {f(med(r99), 2, '×')} | {f(med(l99), 2, '×')} | {f(lm99, 2, '×')} | "
              f"{f(None if spread is None else 100 * spread, 0, '%')} | {f(med(hit), 2)} | "
              f"{f(med(wait))} | {f(med(rw), 2, '×')} | {errs} |")
    for q in ("p50", "p99"):
        print(f"\nper run {q} ms: " + "; ".join(
            f"{pol} " + " / ".join(f(next((x['summary']['ttft_ms'][q] for x in r['rows'] if x['policy'] == pol), None))
                                   for r in runs) for pol in order))
EOF
exit "$FAILED"
