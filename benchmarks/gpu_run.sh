#!/usr/bin/env bash
# The CUDA checks on a machine with one GPU, in the order they matter, each under its own time limit
# so that one that runs long leaves the others their figures: the gpu-marked tests, then the CUDA
# benchmark entries whose targets are still open (start-up, gpu_pipeline over 5 rounds), the 85M LM
# (the case most sensitive to the host's work per step: a copy on the compute stream held it at
# 0.68-0.89 of the hand loop compiled for a day before a lease ran it), the 1.2B LM, then the rest.
# Usage: bash benchmarks/gpu_run.sh OUT_DIR (from the repository root; xlatrain is imported from
# src/, so nothing needs installing beyond torch and xlatrain's dependencies; the PE recipe needs
# simplejpeg). The limits add up to about 11 minutes; GPU_RUN_ONLY_OPEN=1 stops after the 85M LM
# (about 6).
set -u
out=${1:?usage: gpu_run.sh OUT_DIR}
mkdir -p "$out"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
step() {  # step SECONDS NAME COMMAND...
    local limit=$1 name=$2; shift 2
    echo "=== $name (limit ${limit}s) $(date -u +%T)"
    timeout -k 5 "$limit" "$@"
    echo "=== $name: exit $?"
}
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    $py -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'
    step 60 "gpu tests" $py -m pytest -q -m gpu -p no:cacheprovider -o addopts= tests
    # Whether the PE recipe's step keeps the GPU busy or the host sets its pace (about 20 s packing).
    step 45 "pe profile" $py benchmarks/cuda/pe_profile.py
    step 45 "startup on cuda" $py -c 'import json, benchmarks.startup as s; print("startup_cuda:", json.dumps(s._measure("cuda")))'
    XLATRAIN_GPU_PIPELINE_ROUNDS=5 step 100 gpu_pipeline $py -m benchmarks.run --only gpu_pipeline --out "$out/gpu.json"
    # On an H200: 55 s for both cases (28 s of it compiling).
    XLATRAIN_GPU_LM_SIZES=85m step 120 "gpu_lm 85m" $py -m benchmarks.run --only gpu_lm --out "$out/lm85m.json"
    if [ "${GPU_RUN_ONLY_OPEN:-0}" != 1 ]; then
        # On an H200: 35 s to the eager case's rounds, 89 s to the compiled one's (62 s compiling).
        XLATRAIN_GPU_LM_SIZES=1.2b step "${LM_BIG_LIMIT:-200}" "gpu_lm 1.2b" $py -m benchmarks.run --only gpu_lm --out "$out/lm1b.json"
        step 60 gpu_memory $py -m benchmarks.run --only gpu_memory --out "$out/gpu.json"
        step 45 gpu_overhead $py -m benchmarks.run --only gpu_overhead --out "$out/gpu.json"
    fi
} 2>&1 | tee "$out/gpu_run.log"
