#!/usr/bin/env bash
# Download, on a machine with pip access, the wheels that a GPU machine with PyTorch but without
# dcp-lens's other dependencies needs (Python 3.12, x86-64 Linux), into .whl/ at the checkout's
# root; demos/gpu_check.sh installs them there with --no-index. Run from the checkout's root:
#     bash demos/gpu_wheels.sh            # then carry .whl/ to the GPU machine with the checkout
set -euo pipefail
python=${PYTHON:-python3}
mkdir -p .whl
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
    manylinux1_x86_64; do
    platforms+=(--platform "$tag")
done
# transformer-lens imports datasets (and it dill and multiprocess) when dcp_lens starts; the rest
# of dcp-lens's needs (torch, numpy, pandas, scipy, einops, jaxtyping, tokenizers, tqdm,
# safetensors, transformers) are in a usual PyTorch image.
"$python" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl \
    transformer-lens==4.3.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
ls -l .whl
