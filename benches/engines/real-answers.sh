#!/usr/bin/env bash
# real-answers.sh — two real-weights SmolLM2-135M vLLM engines: are the answers the engine's, unchanged by
# routing? (needs `benches/engines/vllm-setup.sh --real` and `cargo build -p kvgate`). The same four chat
# questions at temperature 0 asked of engine A, engine B, and twice through `kvgate serve` (kv policy,
# exact index); prints each answer and how many were equal. Ports 18101/18102 (+10000/+20000 for the
# engines' events), 18180 (kvgate); /tmp for logs and the generated config. Stops everything by pid.
set -uo pipefail
cd "$(dirname "$0")/../.."
pids=()
cleanup(){ for p in "${pids[@]}"; do kill -- -"$p" 2>/dev/null; kill "$p" 2>/dev/null; done; }
trap cleanup EXIT
for i in 1 2; do
  VARIANT=real CPUS=$((i-1)) NAME=smollm2 setsid bash benches/engines/vllm-serve.sh 1810$i > /tmp/real-eng$i.log 2>&1 &
  pids+=($!)
done
t0=$(date +%s)
for i in 1 2; do
  until curl -sf http://127.0.0.1:1810$i/health >/dev/null; do sleep 2; [ $(( $(date +%s)-t0 )) -gt 900 ] && { echo "engine $i not up"; tail -20 /tmp/real-eng$i.log; exit 1; }; done
done
echo "engines up in $(( $(date +%s)-t0 )) s"
cat > /tmp/realcheck.toml <<T
[server]
listen = "127.0.0.1:18180"
[routing]
policy = "kv"
block_size = 32
[[workers]]
url = "http://127.0.0.1:18101"
models = ["smollm2"]
kv_events = "tcp://127.0.0.1:28101"
kv_replay = "tcp://127.0.0.1:38101"
[[workers]]
url = "http://127.0.0.1:18102"
models = ["smollm2"]
kv_events = "tcp://127.0.0.1:28102"
kv_replay = "tcp://127.0.0.1:38102"
T
./target/debug/kvgate serve --config /tmp/realcheck.toml > /tmp/realcheck-gw.log 2>&1 &
pids+=($!)
until curl -sf http://127.0.0.1:18180/ready >/dev/null; do sleep 0.5; done
python3 - <<'PY'
import json, urllib.request
def ask(port, content):
    body = json.dumps({"model":"smollm2","messages":[{"role":"system","content":"You are a concise assistant."},{"role":"user","content":content}],"max_tokens":24,"temperature":0}).encode()
    r = urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body, {"content-type":"application/json"}), timeout=300)
    v = json.load(r)
    return v["choices"][0]["message"]["content"], v["usage"].get("prompt_tokens_details")
same = 0; total = 0
for q in ["What is the capital of France?", "Name three primary colours.", "What is 2 + 2?", "Say hello in Spanish."]:
    a, _ = ask(18101, q); b, _ = ask(18102, q)
    g1, c1 = ask(18180, q); g2, c2 = ask(18180, q)
    ok = a == b == g1 == g2
    same += ok; total += 1
    print(json.dumps({"q": q, "engine_a": a, "engine_b": b, "via_kvgate": g1, "via_kvgate_again": g2, "cached_again": c2, "equal": ok}))
print(f"equal answers: {same}/{total}")
PY
