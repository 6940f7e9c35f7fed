#!/usr/bin/env bash
# Memory soak (NOT part of CI; issue 16 item 5): unique chat prompts at a fixed rate through
# `kvgate serve` in front of a `kvgate sim` fleet, sampling the gateway's RSS, open fds and cache
# sizes (kvgate_cache_bytes/entries) every few seconds. Prints the samples, then:
#   - RSS start (first sample under load) / peak / end, and whether RSS plateaus: the last
#     PLATEAU_SHARE of the run stays within ±5% of its mean (judged once the caches stopped growing);
#   - open fds before the load, at its end, 10 s after it, and how long after it they were back to
#     the baseline (idle pooled worker connections close after upstream.pool_idle_timeout_s, 90 s).
#
# Usage: benches/soak.sh [seconds=600] [rate=30]
# Env: KVGATE_BIN (default target/release/kvgate, built if missing), SEGMENT_BYTES (the gateway's
#      cache.tokenizer_segment_bytes, default 32 MiB), PROMPT_BYTES (~bytes of unique text per
#      request, default 1500), SAMPLE_S (default 5), PLATEAU_SHARE (default 0.5), WORKERS (default 2),
#      FD_WAIT_S (how long to wait for fds to return to baseline after the load, default 120).
set -euo pipefail
DUR=${1:-600}
RATE=${2:-30}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${KVGATE_BIN:-$ROOT/target/release/kvgate}
SEGMENT_BYTES=${SEGMENT_BYTES:-33554432}
PROMPT_BYTES=${PROMPT_BYTES:-1500}
SAMPLE_S=${SAMPLE_S:-5}
PLATEAU_SHARE=${PLATEAU_SHARE:-0.5}
WORKERS=${WORKERS:-2}
FD_WAIT_S=${FD_WAIT_S:-120}
PY=${KVGATE_PYTHON:-python3}
WORK=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

[ -x "$BIN" ] || (cd "$ROOT" && cargo build -q --release -p kvgate)

# The fleet: simulated vLLM workers, fast (speedup) so the gateway, not the sims, is measured.
"$BIN" sim --workers "$WORKERS" --port 0 --model soak-model --speedup 50 >"$WORK/sim.out" 2>"$WORK/sim.err" & PIDS+=($!)
for _ in $(seq 1 300); do grep -qx ready "$WORK/sim.out" && break; sleep 0.1; done
grep -qx ready "$WORK/sim.out" || { echo "sim did not start: $(cat "$WORK/sim.err")" >&2; exit 1; }
{
  printf '[server]\nlisten = "127.0.0.1:0"\nrequest_log = false\n'
  printf '[cache]\ntokenizer_segment_bytes = %s\n' "$SEGMENT_BYTES"
  sed -n 's/^worker [0-9]* http=\([^ ]*\).*/[[workers]]\nurl = "http:\/\/\1"\nmodels = ["soak-model"]/p' "$WORK/sim.out"
} >"$WORK/kvgate.toml"
"$BIN" serve --config "$WORK/kvgate.toml" --log warn 2>"$WORK/serve.err" & PIDS+=($!); GW=$!
for _ in $(seq 1 300); do grep -q 'listening on http://' "$WORK/serve.err" && break; sleep 0.1; done
ADDR=$(sed -n 's/.*listening on http:\/\/\([^ ]*\).*/\1/p' "$WORK/serve.err" | head -1)
[ -n "$ADDR" ] || { echo "gateway did not start: $(cat "$WORK/serve.err")" >&2; exit 1; }
for _ in $(seq 1 300); do curl -sf "http://$ADDR/ready" >/dev/null && break; sleep 0.1; done

rss_kb() { awk '/^VmRSS:/ {print $2}' "/proc/$GW/status"; }
fds() { ls "/proc/$GW/fd" | wc -l; }
caches() { curl -s "http://$ADDR/metrics" | awk '/^kvgate_cache_bytes\{cache="tokenizer_segments"\}/ {b=$2} /^kvgate_cache_entries\{cache="kv_index"\}/ {k=$2} END {printf "%d %d", b, k}'; }

FD0=$(fds); RSS0=$(rss_kb)
echo "gateway pid $GW at $ADDR; ${WORKERS} sim workers; ${RATE} req/s unique prompts (~${PROMPT_BYTES} B) for ${DUR} s"
echo "idle: rss ${RSS0} kB, fds ${FD0}; cache.tokenizer_segment_bytes = ${SEGMENT_BYTES}"

# Load: open-loop at RATE req/s on keep-alive connections, each prompt unique (a per-request
# counter in the system and user messages, so every ChatML segment is new to the gateway).
cat >"$WORK/load.py" <<'PY'
import http.client, json, sys, threading, time
addr, rate, dur, size = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
host, port = addr.rsplit(":", 1)
threads = max(4, int(rate // 5))
ok = [0] * threads; bad = [0] * threads
start = time.monotonic()
def worker(i):
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    n = i
    while True:
        due = start + n / rate
        if due - start > dur:
            break
        d = due - time.monotonic()
        if d > 0:
            time.sleep(d)
        tag = f"request {n} "
        sys_msg = (tag + "You are assistant number %d; keep answers short. " % n) * (size // 120 + 1)
        user = (tag + "tell me something new about topic %d. " % n) * (size // 100 + 1)
        body = json.dumps({"model": "soak-model", "max_tokens": 8, "messages": [
            {"role": "system", "content": sys_msg[: size // 2]},
            {"role": "user", "content": user[: size // 2]}]})
        try:
            conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
            r = conn.getresponse(); r.read()
            if r.status == 200: ok[i] += 1
            else: bad[i] += 1
        except Exception:
            bad[i] += 1
            conn.close()
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
        n += threads
    conn.close()
ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
[t.start() for t in ts]; [t.join() for t in ts]
print(f"load done: {sum(ok)} ok, {sum(bad)} failed, {sum(ok) / (time.monotonic() - start):.1f} req/s")
PY
"$PY" "$WORK/load.py" "$ADDR" "$RATE" "$DUR" "$PROMPT_BYTES" >"$WORK/load.out" 2>&1 & LOAD=$!; PIDS+=($LOAD)

echo "   t_s   rss_kB  fds  segment_cache_B  kv_index_entries"
T0=$(date +%s)
: >"$WORK/samples"
while kill -0 "$LOAD" 2>/dev/null; do
  sleep "$SAMPLE_S"
  t=$(( $(date +%s) - T0 )); r=$(rss_kb); f=$(fds); c=$(caches)
  printf '%6d %8d %4d %16s %17s\n' "$t" "$r" "$f" ${c% *} ${c#* }
  echo "$t $r $f $c" >>"$WORK/samples"
done
cat "$WORK/load.out"
FD_END=$(tail -1 "$WORK/samples" | awk '{print $3}')
sleep 10
FD_AFTER=$(fds); RSS_AFTER=$(rss_kb)
FD_BACK=-1
for s in $(seq 10 "$FD_WAIT_S"); do
  if [ "$(fds)" -le "$FD0" ]; then FD_BACK=$s; break; fi
  sleep 1
done
FD_LAST=$(fds)

"$PY" - "$WORK/samples" "$PLATEAU_SHARE" "$SEGMENT_BYTES" "$RSS0" "$FD0" "$FD_END" "$FD_AFTER" "$RSS_AFTER" "$FD_BACK" "$FD_LAST" <<'PY'
import sys
rows = [list(map(int, l.split())) for l in open(sys.argv[1]) if l.strip()]
share, seg_bound = float(sys.argv[2]), int(sys.argv[3])
rss0, fd0, fd_end, fd_after, rss_after, fd_back, fd_last = map(int, sys.argv[4:11])
rss = [r[1] for r in rows]
tail = rows[int(len(rows) * (1 - share)):]
mean = sum(r[1] for r in tail) / len(tail)
dev = max(abs(r[1] - mean) / mean for r in tail)
seg_full = [r[0] for r in rows if r[3] >= seg_bound * 0.9]
print(f"RSS kB: idle {rss0}, start {rss[0]}, peak {max(rss)}, end {rss[-1]}, 10 s after load {rss_after}")
print(f"RSS over the last {share:.0%} of the run (t >= {tail[0][0]} s): mean {mean:.0f} kB, max deviation {dev:.1%}"
      f" -> {'PLATEAU (within ±5%)' if dev <= 0.05 else 'NOT flat (beyond ±5%)'}")
when = f"{seg_full[0]} s" if seg_full else "never (raise the rate or the duration, or lower SEGMENT_BYTES)"
print(f"segment cache reached 90% of its bound at t = {when}")
back = f"back to baseline {fd_back} s after the load" if fd_back >= 0 else f"NOT back to baseline ({fd_last})"
print(f"fds: before load {fd0}, end of load {fd_end}, 10 s after {fd_after} -> {back}")
PY
