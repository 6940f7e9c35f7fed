#!/usr/bin/env bash
# Latency-model accuracy (NOT part of CI), loopback only: 4 `kvgate sim` workers behind
# `kvgate serve --policy latency`; worker 0 slows down 2x (`--slowdown 2`) from its
# SLOW_AFTER-th request on. A client sends N streamed completions of unique token-id prompts
# (256-2048 tokens, so TTFT varies ~4x; no cache reuse) CONC at a time and scrapes the gateway's
# /metrics every STEP completed requests. It reports:
#   - the TTFT prediction error (`kvgate_ttft_prediction_error_ratio`, |predicted - observed| /
#     observed, per streamed request) per window of requests: the share under 0.2 and the bucket
#     holding the median;
#   - when worker 0's slowdown began (its SLOW_AFTER-th request, from the gateway's per-worker
#     request counts) and how many requests later its fitted prefill throughput
#     (`kvgate_worker_prefill_tokens_per_second`) fell below 2/3 of its value at the onset, and
#     how many until it got at most 1 of 20 requests (an even split gives it 5);
#   - worker 0's share of the traffic in the window before the onset and after it was noticed;
#   - with SLOW_FOR (seconds): the slowdown ends that long after it began (`--slowdown-for`), and
#     the script reports how many requests after the recovery worker 0 got traffic again and its
#     share from then on (the model re-tries a worker it avoided: `routing.latency_relax_after`).
#
# Usage: benches/latency-accuracy.sh
# Env: KVGATE (binary, default target/release/kvgate), N (400), CONC (4), STEP (10),
#      SLOW_AFTER (50), SLOW_FOR (unset: the slowdown never ends), BASE (HTTP port of sim 0, 18700; the gateway takes BASE+90).
# Every process this script starts is stopped by its pid on exit.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
KVGATE=${KVGATE:-$ROOT/target/release/kvgate}
N=${N:-400}
CONC=${CONC:-4}
STEP=${STEP:-10}
SLOW_AFTER=${SLOW_AFTER:-50}
SLOW_FOR=${SLOW_FOR:-}
SLOW_FOR_ARGS=()
[ -n "$SLOW_FOR" ] && SLOW_FOR_ARGS=(--slowdown-for "$SLOW_FOR")
BASE=${BASE:-18700}
GW=$((BASE + 90))
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
wait_http() {
  for _ in $(seq 1 200); do curl -sf "$1" >/dev/null 2>&1 && return 0; sleep 0.05; done
  echo "$1 never answered" >&2; return 1
}

"$KVGATE" sim --workers 4 --base-port "$BASE" --model sim-model --speedup 2 --no-kv-events \
  --num-gpu-blocks 4096 --slowdown 2 --slowdown-after "$SLOW_AFTER" --slowdown-worker 0 \
  "${SLOW_FOR_ARGS[@]}" > /dev/null 2>&1 & PIDS+=($!)
workers=()
for i in 0 1 2 3; do
  wait_http "http://127.0.0.1:$((BASE + i))/health"
  workers+=(--worker "http://127.0.0.1:$((BASE + i))")
done
"$KVGATE" serve --listen "127.0.0.1:$GW" "${workers[@]}" --model sim-model --policy latency \
  --no-request-log --log warn > /dev/null 2>&1 & PIDS+=($!)
wait_http "http://127.0.0.1:$GW/health"

python3 - "$GW" "$BASE" "$N" "$CONC" "$STEP" "$SLOW_AFTER" "${SLOW_FOR:-0}" <<'PY'
import http.client, json, random, re, sys, threading, time

gw, base, n, conc, step, slow_after = (int(a) for a in sys.argv[1:7])
slow_for = float(sys.argv[7])
w0 = f"127.0.0.1:{base}"
names = [f"127.0.0.1:{base + i}" for i in range(4)]
rng = random.Random(7)
lengths = [rng.randint(256, 2048) for _ in range(n)]

def one(i):
    prompt = [1000 + (i * 7919 + t * 31) % 20000 for t in range(lengths[i])]
    body = json.dumps({"model": "sim-model", "prompt": prompt, "max_tokens": 16,
                       "stream": True, "ignore_eos": True})
    c = http.client.HTTPConnection("127.0.0.1", gw, timeout=60)
    c.request("POST", "/v1/completions", body, {"content-type": "application/json"})
    r = c.getresponse()
    text = r.read().decode()
    c.close()
    assert r.status == 200 and "[DONE]" in text, (r.status, text[:300])

def scrape():
    c = http.client.HTTPConnection("127.0.0.1", gw, timeout=10)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    err = {}
    count = 0.0
    per_worker = {w: 0.0 for w in names}
    tps = {w: None for w in names}
    for line in text.splitlines():
        m = re.match(r'kvgate_ttft_prediction_error_ratio_bucket\{le="([^"]+)"\} (\S+)', line)
        if m:
            err[m.group(1)] = float(m.group(2))
        elif line.startswith("kvgate_ttft_prediction_error_ratio_count "):
            count = float(line.split()[1])
        m = re.match(r'kvgate_worker_request_duration_seconds_count\{worker="([^"]+)"\} (\S+)', line)
        if m and m.group(1) in per_worker:
            per_worker[m.group(1)] = float(m.group(2))
        m = re.match(r'kvgate_worker_prefill_tokens_per_second\{worker="([^"]+)"\} (\S+)', line)
        if m and m.group(1) in tps:
            tps[m.group(1)] = float(m.group(2))
    return dict(err=err, count=count, per_worker=per_worker, tps=tps)

snaps = [(0, scrape())]
times = {0: time.monotonic()}
done = 0
lock = threading.Lock()
next_i = 0
def worker():
    global next_i, done
    while True:
        with lock:
            if next_i >= n:
                return
            i = next_i
            next_i += 1
        one(i)
        with lock:
            done += 1
            if done % step == 0:
                snaps.append((done, scrape()))
                times[done] = time.monotonic()
threads = [threading.Thread(target=worker) for _ in range(conc)]
for t in threads: t.start()
for t in threads: t.join()
if snaps[-1][0] != n:
    snaps.append((n, scrape()))
    times[n] = time.monotonic()
snaps.sort(key=lambda s: s[0])

def window_error(a, b):
    sa, sb = a[1], b[1]
    cnt = sb["count"] - sa["count"]
    if cnt <= 0:
        return None
    cum = {le: sb["err"].get(le, 0) - sa["err"].get(le, 0) for le in sb["err"]}
    under = cum.get("0.2", 0) / cnt
    les = sorted((float(le) if le != "+Inf" else float("inf"), v) for le, v in cum.items())
    median_le = next(le for le, v in les if v >= cnt / 2)
    return cnt, under, median_le

def at(k):
    return min(snaps, key=lambda s: abs(s[0] - k))

print(f"requests {n}, concurrency {conc}, worker 0 slowed 2x from its request {slow_after}")
print("| requests | predictions | share with error <= 0.2 | median error <= |")
print("|---|---:|---:|---:|")
for lo, hi in [(0, 100), (100, 200), (200, n)]:
    r = window_error(at(lo), at(hi))
    if r:
        cnt, under, med = r
        print(f"| {lo}-{hi} | {cnt:.0f} | {under:.2f} | {med} |")

onset = next((s for s in snaps if s[1]["per_worker"][w0] >= slow_after), None)
if onset is None:
    print("worker 0 never reached its slowdown")
    sys.exit(0)
tps0 = onset[1]["tps"][w0]
noticed = next((s for s in snaps if s[0] > onset[0] and s[1]["tps"][w0] is not None
                and tps0 and s[1]["tps"][w0] < tps0 * 2 / 3), None)
print(f"slowdown onset: ~request {onset[0]} (worker 0's fitted prefill {tps0:.0f} tok/s)")
print("after the onset, per scrape: requests, worker 0's requests since the previous scrape, its fitted prefill tok/s")
prev = onset
for s_ in snaps:
    if onset[0] < s_[0] <= onset[0] + 100:
        got = s_[1]["per_worker"][w0] - prev[1]["per_worker"][w0]
        print(f"  {s_[0]}: {got:.0f} of {s_[0] - prev[0]}, {s_[1]['tps'][w0] or 0:.0f}")
        prev = s_
# Traffic noticed: the first 20 requests after the onset of which worker 0 got at most one
# (an even split gives it 5).
traffic = next((b for a, b in zip(snaps, snaps[2:]) if a[0] >= onset[0]
                and b[1]["per_worker"][w0] - a[1]["per_worker"][w0] <= 1), None)
if traffic:
    print(f"traffic moved away (worker 0 got <= 1 of 20 requests) by request {traffic[0]}, "
          f"i.e. within {traffic[0] - onset[0]} requests of the onset")
if noticed:
    print(f"noticed (fitted prefill < 2/3 of that: {noticed[1]['tps'][w0]:.0f} tok/s) by request "
          f"{noticed[0]}, i.e. within {noticed[0] - onset[0]} requests")
else:
    print("never noticed")

def share(a, b):
    tot = sum(b[1]["per_worker"].values()) - sum(a[1]["per_worker"].values())
    mine = b[1]["per_worker"][w0] - a[1]["per_worker"][w0]
    return mine / tot if tot else float("nan"), tot
before = share(at(max(0, onset[0] - 100)), onset)
after_from = noticed if noticed else onset
after = share(after_from, snaps[-1])
print(f"worker 0's share of traffic: {before[0]:.2f} of {before[1]:.0f} requests before the onset, "
      f"{after[0]:.2f} of {after[1]:.0f} after it was noticed (even split: 0.25)")

if slow_for > 0:
    # The sim's slowdown began when worker 0 received its slow_after-th request: between the
    # onset snapshot and the one before it; take the onset snapshot's time (late by < STEP).
    end = times[onset[0]] + slow_for
    rec = next((s_ for s_ in snaps if times[s_[0]] >= end), None)
    if rec is None:
        print(f"the run ended before the slowdown did ({slow_for} s after the onset): raise N")
        sys.exit(0)
    slow = share(after_from, rec)
    print(f"worker 0's share while slow, from when it was noticed: {slow[0]:.2f} of {slow[1]:.0f} "
          "requests (re-tries of a worker the model relaxed towards the fleet's speed)")
    print(f"slowdown over ~{slow_for} s after the onset, by request {rec[0]}; per scrape from there: "
          "requests, worker 0's requests since the previous scrape, its fitted prefill tok/s")
    prev = rec
    back = None
    for s_ in snaps:
        if s_[0] > rec[0]:
            got = s_[1]["per_worker"][w0] - prev[1]["per_worker"][w0]
            print(f"  {s_[0]}: {got:.0f} of {s_[0] - prev[0]}, {s_[1]['tps'][w0] or 0:.0f}")
            if back is None and got >= 2:
                back = s_
            prev = s_
    if back is None:
        print("worker 0 never got its traffic back")
    else:
        r = share(back, snaps[-1])
        print(f"traffic back (>= 2 of {step}) by request {back[0]}, {back[0] - rec[0]} requests after "
              f"the recovery; worker 0's share from there {r[0]:.2f} of {r[1]:.0f} (even split: 0.25); "
              f"fitted prefill {tps0:.0f} tok/s at the onset, {snaps[-1][1]['tps'][w0] or 0:.0f} at the end")
PY
