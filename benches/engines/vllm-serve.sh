#!/usr/bin/env bash
# vllm-serve.sh — start one real vLLM 0.32 engine (CPU build, installed by vllm-setup.sh) on loopback,
# set up the way a KV-aware router needs it: automatic prefix caching, cached_tokens in usage, /metrics,
# /tokenize, ZMQ KV events with a replay socket, /reset_prefix_cache. Runs in the foreground (exec), so
# the caller's pid is the engine's API server; its engine-core child exits with it (stop the process
# group to be sure: started with `setsid`, `kill -- -PID`).
#
# Usage:  benches/engines/vllm-serve.sh PORT [extra `vllm serve` args...]
# Env (all optional):
#   VLLM_DIR      the vllm-setup.sh directory (default $KVGATE_ENGINE_CACHE/vllm-0.32.0,
#                 KVGATE_ENGINE_CACHE default ~/.cache/kvgate-engines)
#   VARIANT=tiny  tiny: DIR/model-tiny with --load-format dummy (4 layers, random weights, ~15x faster);
#                 real: DIR/model (SmolLM2-135M-Instruct weights; vllm-setup.sh --real)
#   NAME=smollm2  served model name
#   CPUS=0        CPU id(s) the model threads are pinned to (VLLM_CPU_OMP_THREADS_BIND: "0", "0-1", "nobind")
#   KV_GIB=1      KV cache in GiB (VLLM_CPU_KVCACHE_SPACE); BLOCKS=N overrides it with
#                 --num-gpu-blocks-override N (a small cache makes BlockRemoved flow)
#   BLOCK=32      KV block size (the CPU attention backend accepts only multiples of 32)
#   KV_PORT=$((PORT+10000)), REPLAY_PORT=$((PORT+20000))
#                 vLLM binds its PUB socket only for tcp://*:PORT (for tcp://host:PORT it connects to a
#                 subscriber instead), so the events are published on every interface at KV_PORT; the
#                 replay ROUTER is bound on 127.0.0.1. A router connects to both
#                 (kvgate: kv_events = "tcp://127.0.0.1:KV_PORT", kv_replay = "tcp://127.0.0.1:REPLAY_PORT").
#   TOPIC=kv      first frame of every event message
#   EAGER=1       --enforce-eager: up in ~80 s instead of ~3 min (torch.compile recompiles on every start)
# Ready when GET http://127.0.0.1:PORT/health answers 200.
set -euo pipefail
port=${1:?usage: vllm-serve.sh PORT [vllm serve args...]}; shift
dir=${VLLM_DIR:-${KVGATE_ENGINE_CACHE:-$HOME/.cache/kvgate-engines}/vllm-0.32.0}
[ -x "$dir/venv/bin/vllm" ] || { echo "vllm-serve.sh: no engine in $dir: run benches/engines/vllm-setup.sh" >&2; exit 1; }
variant=${VARIANT:-tiny}
case "$variant" in
  tiny) model=$dir/model-tiny; load=(--load-format dummy) ;;
  real) model=$dir/model; load=()
        [ -f "$model/model.safetensors" ] || { echo "vllm-serve.sh: no real weights: vllm-setup.sh --real" >&2; exit 1; } ;;
  *) echo "vllm-serve.sh: VARIANT must be tiny or real" >&2; exit 2 ;;
esac
kv_port=${KV_PORT:-$((port + 10000))}; replay_port=${REPLAY_PORT:-$((port + 20000))}
blocks=(); [ -n "${BLOCKS:-}" ] && blocks=(--num-gpu-blocks-override "$BLOCKS")
eager=(); [ "${EAGER:-1}" = 1 ] && eager=(--enforce-eager)
export VLLM_TARGET_DEVICE=cpu VLLM_HOST_IP=127.0.0.1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$dir/cache} \
  VLLM_CPU_KVCACHE_SPACE=${KV_GIB:-1} VLLM_CPU_OMP_THREADS_BIND=${CPUS:-0} \
  VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1 VLLM_SERVER_DEV_MODE=1
# vLLM's CPU docs recommend preloading Intel OpenMP (shipped as a wheel in the venv).
[ -f "$dir/venv/lib/libiomp5.so" ] && export LD_PRELOAD=$dir/venv/lib/libiomp5.so${LD_PRELOAD:+:$LD_PRELOAD}
kv_cfg=$(printf '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:%s","replay_endpoint":"tcp://127.0.0.1:%s","topic":"%s"}' \
  "$kv_port" "$replay_port" "${TOPIC:-kv}")
exec "$dir/venv/bin/vllm" serve "$model" "${load[@]}" --host 127.0.0.1 --port "$port" \
  --served-model-name "${NAME:-smollm2}" --dtype bfloat16 --max-model-len 4096 --max-num-seqs 8 \
  --enable-prefix-caching --block-size "${BLOCK:-32}" --enable-prompt-tokens-details \
  --kv-events-config "$kv_cfg" "${blocks[@]}" "${eager[@]}" "$@"
