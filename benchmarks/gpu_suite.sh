#!/usr/bin/env bash
# GPU checks in one command: every `gpu`-marked test and the GPU halves of the benchmarks, on the GPU(s) present,
# with one JSON and one markdown summary. Made to fit in under 11 minutes on one GPU.
#
#   benchmarks/gpu_suite.sh [--out DIR] [--budget SECONDS] [--only STEP[,STEP...]] [--full]
#
#   --out DIR     step logs, step reports and summary.{json,md} (default: runs/gpu_suite/<UTC time>)
#   --budget S    wall-clock budget for all steps (default 630); a step gets the smaller of its own limit and what is
#                 left, and a step that no longer fits is recorded as skipped
#   --only LIST   run only these steps (names below), e.g. to rerun the one that failed
#   --full        the benchmarks' full sizes instead of --quick (raise --budget to match)
#   PYTHON        the interpreter to use (default: python)
#
# Steps, in order (name: what, own limit in seconds):
#   gpu_tests:    pytest -m gpu over tests/ (Triton kernels, CUDA events, OOM snapshot, ...)        240
#   fused:        benchmarks/fused.py --device cuda: fused ops vs eager and torch.compile, then the  240
#                 model zoo (ResNet-18, MobileNetV3, ViT, TransformerEncoder, GPT-2 blocks); its own
#                 --budget-s keeps 70 s of the limit free, so it writes its report before the limit
#   onebit:       benchmarks/onebit.py --device cuda: Triton compressor GB/s; NCCL with 2+ GPUs      150
#   cuda_memory:  benchmarks/cuda_memory.py: allocator with / without CudaMemoryManager              150
#   augment:      benchmarks/augment.py --device cuda: GpuAugment vs torchvision on the CPU           90
#   end_to_end:   benchmarks/end_to_end.py --device cuda: the photo job, plain Lightning against the   180
#                 plugins (ResNet-18 at 160 px, bf16 FusedPrecision, nvJPEG into the cache, GpuAugment):
#                 epoch time and NVML GPU utilisation per arm
#
# Without a CUDA device it prints one line and exits 0 having run nothing. A step that fails or runs out of time
# does not stop the others: its status, exit code, seconds and the tail of its log go into the summary. Exit status:
# 0 when every step passed, 1 when any failed, timed out or was skipped, 2 when the interpreter cannot import torch.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
PY="${PYTHON:-python}"
OUT=""
BUDGET=630
ONLY=""
SIZE="--quick"

usage() { sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --out) OUT="${2:?--out needs a directory}"; shift 2 ;;
        --budget) BUDGET="${2:?--budget needs seconds}"; shift 2 ;;
        --only) ONLY="${2:?--only needs step names}"; shift 2 ;;
        --full) SIZE=""; shift ;;
        -h | --help) usage; exit 0 ;;
        *) echo "gpu_suite: unknown argument '$1'; expected --out DIR, --budget SECONDS, --only STEPS or --full." >&2
           exit 2 ;;
    esac
done
if ! [[ "$BUDGET" =~ ^[0-9]+$ ]]; then
    echo "gpu_suite: --budget must be whole seconds, got '$BUDGET'; e.g. --budget 630." >&2
    exit 2
fi
STEP_NAMES="gpu_tests fused onebit cuda_memory augment end_to_end"
for name in ${ONLY//,/ }; do
    if [[ " $STEP_NAMES " != *" $name "* ]]; then
        echo "gpu_suite: --only got an unknown step '$name'; the steps are: ${STEP_NAMES// /, }." >&2
        exit 2
    fi
done

cd "$REPO"
# 3 = torch imports but sees no CUDA device; anything else non-zero = the interpreter itself is broken
cuda_rc=0
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)' >/dev/null 2>&1 || cuda_rc=$?
if [[ $cuda_rc -eq 3 ]]; then
    echo "gpu_suite: no CUDA GPU on this machine (torch.cuda.is_available() is False): nothing ran."
    exit 0
elif [[ $cuda_rc -ne 0 ]]; then
    echo "gpu_suite: '$PY' cannot import torch (exit $cuda_rc): nothing ran. Set PYTHON to the project's interpreter." >&2
    exit 2
fi

OUT="${OUT:-runs/gpu_suite/$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
STEPS_TSV="$OUT/steps.tsv"
printf 'name\tstatus\trc\tseconds\tlimit_s\treport\tlog\tcommand\n' >"$STEPS_TSV"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
START=$SECONDS
MIN_STEP_S=5 # less than this left: the step is skipped instead of started to be killed at once

# run_step NAME LIMIT REPORT COMMAND...: run one step under `timeout`, record one line in steps.tsv, never fail
run_step() {
    local name="$1" limit="$2" report="$3"
    shift 3
    local log="$OUT/$name.log" left=$((BUDGET - (SECONDS - START))) rc=0 status t0
    if [[ -n "$ONLY" && ",$ONLY," != *",$name,"* ]]; then
        return 0
    fi
    if ((left < MIN_STEP_S)); then
        printf '%s\tskipped\t\t0\t0\t%s\t%s\t%s\n' "$name" "$report" "$log" "$*" >>"$STEPS_TSV"
        echo "gpu_suite: $name skipped: the time budget (${BUDGET} s) is spent"
        return 0
    fi
    if ((limit > left)); then
        limit=$left
    fi
    echo "gpu_suite: $name (limit ${limit} s) ..."
    t0=$SECONDS
    # timeout signals the step's whole process group (spawned ranks, workers), then SIGKILLs what is left after 15 s
    timeout --kill-after=15 "$limit" "$@" >"$log" 2>&1 </dev/null || rc=$?
    case $rc in
        0) status=passed ;;
        124 | 137) status=timed_out ;;
        *) status=failed ;;
    esac
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$((SECONDS - t0))" "$limit" "$report" "$log" "$*" \
        >>"$STEPS_TSV"
    echo "gpu_suite: $name $status (exit $rc, $((SECONDS - t0)) s)"
}

run_step gpu_tests 240 "$OUT/gpu_tests.xml" \
    "$PY" -m pytest -m gpu -q -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml" tests
# shellcheck disable=SC2086  # $SIZE is one flag or nothing
run_step fused 240 "$OUT/fused.json" \
    "$PY" benchmarks/fused.py --device cuda $SIZE --budget-s 170 --out "$OUT/fused.json"
# shellcheck disable=SC2086
run_step onebit 150 "$OUT/onebit.json" "$PY" benchmarks/onebit.py --device cuda $SIZE --out "$OUT/onebit.json"
# shellcheck disable=SC2086
run_step cuda_memory 150 "$OUT/cuda_memory.json" "$PY" benchmarks/cuda_memory.py $SIZE --out "$OUT/cuda_memory.json"
# shellcheck disable=SC2086
run_step augment 90 "$OUT/augment.json" "$PY" benchmarks/augment.py --device cuda $SIZE --out "$OUT/augment.json"
# one seed per arm, 3 epochs of 4,000 photos either size: the GPU case has no --quick/--full difference
run_step end_to_end 180 "$OUT/end_to_end.json" \
    "$PY" benchmarks/end_to_end.py --device cuda --quick --out "$OUT/end_to_end.json"

summary_rc=0
"$PY" "$HERE/_gpu_suite.py" "$OUT" --budget "$BUDGET" --wall "$((SECONDS - START))" || summary_rc=$?
echo "gpu_suite: summary in $OUT/summary.md and $OUT/summary.json"
exit "$summary_rc"
