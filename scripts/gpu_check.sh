#!/usr/bin/env bash
# The GPU checks of docs/gpu.md in one run: localspec's kernel tests, the engine and drafter
# tests with the shared models offloaded, and the speed of plain and speculative decoding with
# every target layer on the GPU (cost table, host overhead per step, head cost per level,
# n-grams / EAGLE-3 / auto against plain on Spec-Bench prompts).
#
# Needs python3 that imports localspec and a CUDA (or Metal) build of llama-cpp-python
# (docs/gpu.md says how to build one), and the default model (`localspec models where`).
#
# Usage: scripts/gpu_check.sh OUT_DIR DATASET [PER_CATEGORY] [TEST_WORKERS]
#   OUT_DIR       every step's log, the cost table and the JSON reports go here
#   DATASET       Spec-Bench question.jsonl (or any file in its format)
#   PER_CATEGORY  prompts per category of the speed runs (default 5)
#   TEST_WORKERS  pytest-xdist workers (default 4; 0 = one process)
# Each step has its own time limit (seconds, STEP_SCALE multiplies them) and a failed step
# does not stop the next; a line per step gives its exit status and time. STEPS="info versus"
# runs only the steps named; VERSUS (default ngram,eagle3,auto) and REPEATS (default 1) set the
# drafters and rounds per prompt of the versus steps.
set -u
out=${1:?usage: scripts/gpu_check.sh OUT_DIR DATASET [PER_CATEGORY] [TEST_WORKERS]}
data=${2:?usage: scripts/gpu_check.sh OUT_DIR DATASET [PER_CATEGORY] [TEST_WORKERS]}
per=${3:-5}
workers=${4:-4}
scale=${STEP_SCALE:-1}
py=${PYTHON:-python3}
ngl=${NGL:--1}
versus=${VERSUS:-ngram,eagle3,auto}
repeats=${REPEATS:-1}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

step() {  # step NAME LIMIT_S CMD...: CMD's output in OUT_DIR/NAME.log, one line of result
    local name=$1 limit=$(( $2 * scale )) t0 rc
    shift 2
    if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return 0; fi
    t0=$(date +%s)
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    echo "== $name: exit $rc in $(( $(date +%s) - t0 )) s (limit $limit s)"
    tail -n 4 "$out/$name.log" | cut -c1-300
}

xdist=()
[ "$workers" -gt 0 ] && xdist=(-n "$workers" --dist loadfile)

step info 60 "$py" -c "
import os, platform, llama_cpp, localspec
from localspec.backend._llama import system_info
from localspec.models import default_model_path
print('python', platform.python_version(), 'cpus', os.cpu_count(), localspec.__file__, llama_cpp.__file__)
print('gpu offload', llama_cpp.llama_supports_gpu_offload())
print(system_info())
print('model', default_model_path())
"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv >>"$out/info.log" 2>&1

# speed with every target layer offloaded, most telling first: the decode cost table and the
# host's time per step, then plain / n-grams / EAGLE-3 / auto on Spec-Bench prompts
step bench-host 90 "$py" -m localspec bench host -ngl "$ngl" --nodes 16 --json
costs() { cp "$("$py" -c 'from localspec.paths import cache_dir; print(cache_dir())')/costs.json" "$out/costs.json" 2>/dev/null; }
costs
step features 60 "$py" -m localspec bench features -ngl "$ngl" --json
step versus 240 "$py" -m localspec bench drafters -ngl "$ngl" --versus "$versus" --repeats "$repeats" \
    --dataset "$data" --per-category "$per" -n 128 --json
step bench-drafters 90 "$py" -m localspec bench drafters -ngl "$ngl" --rounds 1 --json
# the model tests with the target (and draft) offloaded: exactness tests may differ in near-ties
# on a GPU (docs/gpu.md); losslessness tests must pass
LOCALSPEC_TEST_N_GPU_LAYERS=$ngl step engine-tests 180 "$py" -m pytest -q -p no:cacheprovider "${xdist[@]}" \
    tests/test_engine.py tests/test_exact.py tests/test_eagle3_host.py tests/test_eagle3.py \
    tests/test_batched_drafters.py tests/test_draft_model.py tests/test_scheduler.py tests/test_auto_probes.py
# localspec's own kernels run on the CPU whatever the backend: the same results as numpy
step kernel-tests 60 "$py" -m pytest -q -p no:cacheprovider "${xdist[@]}" \
    tests/test_native.py tests/test_verify.py tests/test_sampling.py
step bench-kernels 30 "$py" -m localspec bench kernels --json
step versus-chat 240 "$py" -m localspec bench drafters -ngl "$ngl" --versus "$versus" --repeats "$repeats" \
    --dataset "$data" --per-category "$per" -n 128 --chat-format --json

# the drafting memory (docs/drafters.md#drafting-memory) where verifying more tokens costs little
step memory 180 "$py" -m localspec bench memory --workloads code,batch --prompts 40 -ngl "$ngl" --json

# the decode cost tables the engines measured (per model, device set and build)
costs
echo "== done"
