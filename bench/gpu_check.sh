#!/usr/bin/env bash
# One GPU call that runs every GPU path of the project once, most valuable first, inside GPU_BUDGET
# seconds (default 520) of command time. docs/GPU.md says how to call it. Here (the CPU box), once:
#     mkdir -p .cache/gpu-data && cp /work/shared/data/cifar10-train.tar.gz .cache/gpu-data/
# On the device machine (the run tool; carry [".cache/gpu-data"], timeout_s 560):
#     bash bench/gpu_check.sh
# Stages: versions; the gpu-marked unit tests; a real fast.yaml run through launch.local on the GPU,
# SIGTERM'd from outside and run again (exit 75, then resume to exit 0); bench.gpu's training rates;
# the airbench peer table; bench/gpu224.py (decode alone, then end to end) with what time is left.
# Every stage is under `timeout`, cut to the time left; a stage that fails or is cut leaves the earlier
# stages' files in $OUT: session.log, pytest.log, preempt.json, gpu-rates.json, peer-airbench.{md,json},
# gpu224-decode.json, gpu224.json (8 files). GPU_CHECK_CPU=1: the dry run of all of it on a CPU.
set -u -o pipefail
OUT=${OUT:-/tmp/gpu-check-out}
DATA=${GPU_DATA:-.cache/gpu-data}
BUDGET=${GPU_BUDGET:-520}
CPU=${GPU_CHECK_CPU:-}
PY=${GPU_PYTHON:-python3}
if [ ! -f "$DATA/cifar10-train.tar.gz" ]; then
    echo "gpu_check: $DATA/cifar10-train.tar.gz is missing (copy /work/shared/data/cifar10-train.tar.gz there and carry $DATA)" >&2
    exit 2
fi
mkdir -p "$OUT"
exec > >(tee -a "$OUT/session.log") 2>&1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
start=$SECONDS

stage() {  # stage SECONDS COMMAND...: bounded by SECONDS and by the time left, logged with rc and duration
    local limit=$1 t0=$SECONDS rc left
    shift
    left=$((BUDGET - (SECONDS - start)))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 15 ]; then
        echo "== SKIPPED (only ${left}s left): $*"
        return 124
    fi
    echo "== $(date -u +%T) t=$((SECONDS - start))s [${limit}s] $*"
    timeout -k 5 "$limit" "$@"
    rc=$?
    echo "== rc=$rc in $((SECONDS - t0)) s"
    return "$rc"
}

# (a) the machine and the versions
stage 15 nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.max.sm --format=csv
stage 45 "$PY" -c "import torch, torchvision, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'torchvision', torchvision.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-', 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else '-')"
git log -1 --format='HEAD %h %s' 2>/dev/null || true
rm -rf /tmp/c10 && mkdir -p /tmp/c10
stage 30 tar xzf "$DATA/cifar10-train.tar.gz" -C /tmp/c10 || exit 1

# (b) the gpu-marked tests (only their files: nothing else collected)
stage 100 "$PY" -m pytest -q -rs -m gpu -p no:cacheprovider tests/unit/test_gpu_decode.py tests/unit/test_host_sync.py \
    tests/unit/test_debug.py tests/integration/test_bad_inputs.py 2>&1 | tee "$OUT/pytest.log"

# (c) a real run through the launcher on the GPU (NCCL, bf16, torchrun): SIGTERM from outside, exit 75, resume
if [ -n "$CPU" ]; then
    preempt=(--device cpu --stop-at-step 2 train.max_steps=6 train.log_every_steps=1 checkpoint.every_epochs=0)
else
    preempt=(--device cuda --stop-at-step 130 train.micro_batch_size=0)
fi
stage 150 "$PY" -m bench.gpu_check preempt --data-root /tmp/c10/train --run-dir /tmp/gpu-check-preempt \
    --first-timeout 55 --stop-timeout 20 --second-timeout 70 --out "$OUT/preempt.json" \
    "${preempt[@]}" data.cache_dir=/tmp/torchlaunch-cache

# (d) the training step alone: images/s of fastnet, fastnet93 and resnet18, eager, data resident on the GPU
[ -z "$CPU" ] && stage 50 "$PY" -m bench.gpu --no-compile --steps 30 --out "$OUT/gpu-rates.json"

# (e) the airbench peer table: fast.yaml, airbench94, fast93.yaml, airbench96 on the same 45,000 images
if [ -n "$CPU" ]; then peer=(--peers --project-overrides train.max_steps=2); else peer=(--peers airbench94 airbench96); fi
stage 210 "$PY" -m bench.gpu --peer-airbench --data-root /tmp/c10/train --work-dir /tmp/airbench-work \
    --cache-dir /tmp/torchlaunch-cache --out-dir "$OUT" --stage-timeout 75 "${peer[@]}"

# (f) ImageNet-scale decode on the GPU: decode alone first (cheap), then the end-to-end ResNet-50 figures
dry=()
[ -n "$CPU" ] && dry=(--dry-run)
stage 90 "$PY" -m bench.gpu_check gpu224 --decode-only --work /tmp/gpu224-work --out "$OUT/gpu224-decode.json" "${dry[@]}"
stage 240 "$PY" -m bench.gpu_check gpu224 --work /tmp/gpu224-work --out "$OUT/gpu224.json" "${dry[@]}"
echo "== gpu_check: $((SECONDS - start)) s"
