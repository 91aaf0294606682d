#!/usr/bin/env bash
# The prepared GPU suite of issue 10 (one H200, under 8 minutes): every stage of benchmarks/gpu_suite.py in its own
# process with its own time limit, its tables appended to $OUT/gpu_suite.md as they come (stderr to gpu_suite.log),
# so a failing or slow stage never costs the others' tables.
#
#   bash benchmarks/gpu_suite.sh                   # on the GPU machine (installs .whl/ first if present)
#   bash benchmarks/gpu_suite.sh --cpu-rehearsal   # every stage at toy shapes on this CPU, a few minutes
#   bash benchmarks/gpu_suite.sh rldf qlora        # only these stages (e.g. to rerun one that failed)
#
# Prepare .whl/ and .fastdllm/ with benchmarks/gpu_wheels.sh. FASTDLLM_DIR (default .fastdllm/llada) is where
# Fast-dLLM's llada/generate.py lives; without it that stage prints a line saying it was skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
REHEARSAL=""
if [[ "${1:-}" == "--cpu-rehearsal" ]]; then REHEARSAL="--cpu-rehearsal"; shift; fi
ONLY=" $* "
OUT_DIR=${OUT:-outputs/gpu_suite}
mkdir -p "$OUT_DIR"
REPORT="$OUT_DIR/gpu_suite.md"
LOG="$OUT_DIR/gpu_suite.log"
export FASTDLLM_DIR=${FASTDLLM_DIR:-$PWD/.fastdllm/llada}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
SUITE_START=$(date +%s)

if [[ -z "$REHEARSAL" && -d .whl ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >>"$LOG" 2>&1 || { echo "wheel install failed (see gpu_suite.log)" | tee -a "$REPORT"; exit 1; }
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

{
    echo "# GPU suite ($(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'))"
    python3 -c "import torch, transformers; print(f'torch {torch.__version__}, transformers {transformers.__version__}, ' + (torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'))" 2>>"$LOG"
    [[ -n "$REHEARSAL" ]] && echo "CPU rehearsal: toy shapes, the same code paths"
} >>"$REPORT"

stage() {  # stage NAME SECONDS: run it, keep whatever it printed, note a failure or the time limit
    local name=$1 budget=$2 start rc
    [[ "$ONLY" == "  " || "$ONLY" == *" $name "* ]] || return 0
    start=$(date +%s)
    echo "=== $name (limit ${budget}s)" >>"$LOG"
    timeout --kill-after=10 "$budget" python3 benchmarks/gpu_suite.py "$name" $REHEARSAL >>"$REPORT" 2>>"$LOG"
    rc=$?
    if [[ $rc -eq 124 || $rc -eq 137 ]]; then
        echo -e "\n_stage $name stopped at its ${budget}s limit; the rows above are what it measured_" >>"$REPORT"
    elif [[ $rc -ne 0 ]]; then
        echo -e "\n_stage $name failed (exit $rc): $(grep -v '^\s*$' "$LOG" | tail -n 1 | cut -c1-300)_" >>"$REPORT"
    fi
    echo "_$name: $(( $(date +%s) - start ))s_" >>"$REPORT"
}

# Limits sum to 695 s (+ wheel install and start-up): most telling stages first. diffusion_gemma_vllm (240 s) runs
# only when named: vLLM is not in the device image and cannot be carried there (docs/vllm.md), so by default it would
# only time our sampler again.
if [[ -n "$REHEARSAL" ]]; then scale=3; else scale=1; fi  # a loaded 2-core CPU starts Python slowly
stage rollout-llada $((100 * scale))
stage fastdllm      $((65 * scale))
stage rldf          $((70 * scale))
stage block         $((60 * scale))
stage qlora         $((70 * scale))
stage rollout-dream $((60 * scale))
stage dppo          $((30 * scale))
stage llada2        $((120 * scale))
stage diffusion_gemma $((120 * scale))
[[ "$ONLY" == *" diffusion_gemma_vllm "* ]] && stage diffusion_gemma_vllm $((240 * scale))  # needs vllm in the image
echo -e "\n_suite: $(( $(date +%s) - SUITE_START ))s_" >>"$REPORT"
cat "$REPORT"
