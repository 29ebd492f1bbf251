#!/usr/bin/env bash
# What DCP costs at real scale on one GPU, in under 8 minutes, on a Huginn-0125-shaped model
# (random weights, d_model 5280, 2 + 4 x 32 + 2 blocks, vocabulary 65536) in bfloat16: the chip's
# bf16 matrix rate (an 8192^3 product), the forward's tokens/s and its share of that rate, a
# default DCP run of 128 + 128 sequences x 1024 tokens metered by stage (forwards per token as
# `dcp-lens bench --count` counts them, seconds, synchronisations per batch), peak memory beside
# the estimate and the time per 1M tokens (gpu_check.json, demos/gpu_check.py, rewritten after
# every stage). With BENCH=1, then one batch of the sweep against one forward
# (bench_huginn_bf16.json; not in the 8 minutes). TF32 stays off; TF32=1 passes --tf32.
# Run from the checkout's root:
#     bash demos/gpu_check.sh [OUT_DIR]    # default: $OUT if set, else runs/gpu_check
# On a GPU machine without dcp-lens's dependencies, prepare .whl/ first with demos/gpu_wheels.sh
# (on a machine with pip access) and carry it along: it is installed into /tmp/site here.
# DEVICE=cpu BENCH=1 BENCH_ARGS="--d-model 96 --iterations 2 --vocab 256 --batch-size 1 --seq 8"
# GPU_CHECK_ARGS="--d-model 96 --iterations 2 --vocab 128 --seq 8 --n 8 --matmul 128" runs the
# same steps on a toy size without a GPU (tests/acceptance/test_demos.py does).
set -euo pipefail
out=${1:-${OUT:-runs/gpu_check}}
mkdir -p "$out"
python=${PYTHON:-python3}
if ! "$python" -c "import transformer_lens" 2>/dev/null; then
    if [ -d .whl ]; then
        "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl
        export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
    else
        echo "transformer_lens is not installed and there is no .whl/ (see demos/gpu_wheels.sh)" >&2
        exit 2
    fi
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
device=${DEVICE:-cuda}
if [ "$device" != cpu ]; then
    "$python" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device here'; print(torch.__version__, torch.cuda.get_device_name())"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt" || true
fi
# The acceptance run: matrix rate, forward, a default DCP run (GPU_CHECK_ARGS: toy sizes on a CPU).
# shellcheck disable=SC2086  # GPU_CHECK_ARGS is a list of flags
tf32=()
if [ "${TF32:-0}" = 1 ]; then tf32=(--tf32); fi
"$python" demos/gpu_check.py "$out" --device "$device" ${tf32[@]+"${tf32[@]}"} ${GPU_CHECK_ARGS:-}
if [ "${BENCH:-0}" != 1 ]; then
    exit 0
fi
# r = 32 in bfloat16, 4 x 1024 tokens per batch; the naive sweep (40 extra forwards) is left out.
# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
"$python" -m dcp_lens bench --preset huginn --iterations 32 --dtype bfloat16 --device "$device" \
    --batch-size 4 --seq 1024 --repeats 3 --no-naive --json ${BENCH_ARGS:-} | tee "$out/bench_huginn_bf16.json"
"$python" - "$out/bench_huginn_bf16.json" <<'PY'
import json, sys
b = json.load(open(sys.argv[1]))
print(f"Huginn-shaped, r = {b['model']['n_iterations']}, {b['model']['parameters']:,} parameters, "
      f"{b['dtype']}, batch {b['batch']} x {b['seq']} on {b['device']}:")
print(f"  one forward: {b['forward_seconds_per_million_tokens']:.1f} s per 1M tokens")
print(f"  DCP sweep:   {b['sweep_seconds_per_million_tokens']:.1f} s per 1M tokens "
      f"(calibration + evaluation tokens; {b['sweep_over_forward']:.2f} x one forward per batch)")
print(f"  peak memory ({b['peak_memory_kind']}): {b['peak_memory_mb'] / 1024:.1f} GiB "
      f"({b['sweep_memory_per_batch_token_mb']:.2f} MB per batch token above the weights)")
PY
