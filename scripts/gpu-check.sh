#!/usr/bin/env bash
# The CUDA checks and benchmarks behind the README's GPU figures ("GPU" in the README). Run on
# a machine with a CUDA GPU and agentmem's dependencies (the weight package too) importable:
#   bash scripts/gpu-check.sh [kernels] [engine] [blend]    (none named: all three)
# Each step has a time limit; its log (the benchmark's JSON is its last line) goes to
# ${OUT:-gpu-out}/<step>.log, and the step's exit status and seconds are printed.
set -u
out=${OUT:-gpu-out}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

step() {
    local name=$1 limit=$2 start rc
    shift 2
    echo "== $name (limit ${limit} s)"
    start=$(date +%s)
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    rc=$?
    echo "   rc=$rc in $(( $(date +%s) - start )) s"
    tail -n 6 "$out/$name.log" | cut -c1-1500
}

want() { [ $# -eq 0 ] && return 0; for w in "$@"; do [ "$w" = "$step_group" ] && return 0; done; return 1; }
step_group=kernels
if want "$@"; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $py -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
    # the natively compiled kernels (the interpreter tests run on the CPU machines)
    step kernel-tests 150 $py -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "cuda or hopper"
    step kernel-bench 120 $py -m agentmem.cli bench kernels --json
fi
step_group=engine
if want "$@"; then
    step cuda-tests 180 $py -m pytest -q -p no:cacheprovider tests/test_cuda.py
    # compile=auto: the decode step replayed from CUDA graphs, timed beside eager in the same run
    step engine-bench 240 $py -m agentmem.cli bench engine --json --device cuda
fi
step_group=blend
if want "$@"; then
    step blend-bench 180 $py -m agentmem.cli bench blend --json --prompts 10
fi
