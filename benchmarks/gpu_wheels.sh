#!/usr/bin/env bash
# Prepare what the GPU suite carries to the device machine (run here, in the repo root; both folders are ignored):
#   .whl/       wheels the GPU image lacks (CPython 3.12, manylinux x86_64): trl, datasets and its dill / multiprocess,
#               bitsandbytes. `import dllm_trl` imports trl (and so datasets); the 4-bit stage needs bitsandbytes.
#               Every other requirement (torch, transformers, accelerate, peft, einops, pandas, pyarrow, ...) is in
#               the image. Versions are the ones requirements-cpu.txt pins.
#   .fastdllm/  Fast-dLLM's LLaDA code (llada/generate.py + llada/model/), exported from a fetched copy of
#               github.com/NVlabs/Fast-dLLM: FASTDLLM_SRC=<its git dir or checkout> bash benchmarks/gpu_wheels.sh
#               (never committed; the suite skips its stage when the folder is absent).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
rm -rf .whl && mkdir -p .whl
for requirement in trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 bitsandbytes==0.50.2; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
        -d .whl "$requirement"
done
for wheel in .whl/*.whl; do  # what each one needs; the image has all of it
    echo "$(basename "$wheel"): $(unzip -p "$wheel" '*/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' \
        | sed 's/Requires-Dist: //' | tr '\n' ' ')"
done
du -sh .whl
if [[ -n "${FASTDLLM_SRC:-}" ]]; then
    rm -rf .fastdllm && mkdir -p .fastdllm
    if [[ -d "$FASTDLLM_SRC/llada" ]]; then
        cp -r "$FASTDLLM_SRC/llada" "$FASTDLLM_SRC/LICENSE" .fastdllm/
    else  # a bare git directory, as the fetch tool leaves it
        git --git-dir="$FASTDLLM_SRC" archive HEAD llada/generate.py llada/model LICENSE | tar -x -C .fastdllm
    fi
    du -sh .fastdllm
fi
