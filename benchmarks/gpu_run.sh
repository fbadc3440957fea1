#!/usr/bin/env bash
# The CUDA checks on a machine with one GPU, in the order they matter, each under its own time limit
# so that one that runs long leaves the others their figures: the gpu-marked tests, then the CUDA
# benchmark entries. Usage: bash benchmarks/gpu_run.sh OUT_DIR (from the repository root; xlatrain
# is imported from src/, so nothing needs installing beyond torch and xlatrain's dependencies).
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
    step 75 "gpu tests" $py -m pytest -q -m gpu -p no:cacheprovider -o addopts= tests
    step 150 gpu_pipeline $py -m benchmarks.run --only gpu_pipeline --out "$out/gpu.json"
    step 90 gpu_memory $py -m benchmarks.run --only gpu_memory --out "$out/gpu.json"
    step 45 gpu_overhead $py -m benchmarks.run --only gpu_overhead --out "$out/gpu.json"
    step 45 "startup on cuda" $py -c 'import json, benchmarks.startup as s; print("startup_cuda:", json.dumps(s._measure("cuda")))'
    XLATRAIN_GPU_LM_SIZES=85m step 120 "gpu_lm 85m" $py -m benchmarks.run --only gpu_lm --out "$out/lm85m.json"
    XLATRAIN_GPU_LM_SIZES=1.2b step "${LM_BIG_LIMIT:-150}" "gpu_lm 1.2b" $py -m benchmarks.run --only gpu_lm --out "$out/lm1b.json"
} 2>&1 | tee "$out/gpu_run.log"
