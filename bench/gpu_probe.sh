#!/usr/bin/env bash
# One GPU call (docs/GPU.md): exact resume on CUDA (bench.gpu_probe resume), the GPU-only integration
# test, and where gpu224's end-to-end time goes (bench.gpu_probe probe224). Run with carry
# [".cache/gpu-data"] (the CIFAR-10 tarball), timeout_s >= GPU_BUDGET + 20. Writes to $OUT: session.log,
# resume.json, pytest.log, probe224.json, profile224.txt, shards.log. GPU_CHECK_CPU=1: the dry run on a CPU.
set -u -o pipefail
OUT=${OUT:-/tmp/gpu-probe-out}
DATA=${GPU_DATA:-.cache/gpu-data}
BUDGET=${GPU_BUDGET:-360}
CPU=${GPU_CHECK_CPU:-}
PY=${GPU_PYTHON:-python3}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/session.log") 2>&1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
start=$SECONDS
left() { echo $((BUDGET - (SECONDS - start))); }
stage() {  # stage SECONDS COMMAND...: bounded by SECONDS and the time left, logged with rc and duration
    local limit=$1 t0=$SECONDS rc
    shift
    [ "$(left)" -lt "$limit" ] && limit=$(left)
    if [ "$limit" -lt 15 ]; then echo "== SKIPPED (${limit}s left): $*"; return 124; fi
    echo "== $(date -u +%T) t=$((SECONDS - start))s [${limit}s] $*"
    timeout -k 5 "$limit" "$@"
    rc=$?
    echo "== rc=$rc in $((SECONDS - t0)) s"
    return "$rc"
}
git log -1 --format='HEAD %h %s' 2>/dev/null || true
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || true
# the ImageNet-like JPEGs + shards for stage 3, written on the CPUs while stages 1-2 run
if [ -n "$CPU" ]; then shape="4, 8"; else shape="20, 128"; fi
timeout 200 "$PY" -c "from pathlib import Path; from bench.loader224 import shard_set, write_jpegs
w = Path('/tmp/gpu224-work'); c, n = $shape
print(shard_set(write_jpegs(w / f'jpegs-{c}x{n}', c, n), w / f'shards-{c}x{n}'))" >"$OUT/shards.log" 2>&1 &
shards_pid=$!
rm -rf /tmp/c10 /tmp/gpu-probe-resume && mkdir -p /tmp/c10
stage 30 tar xzf "$DATA/cifar10-train.tar.gz" -C /tmp/c10 || exit 1

# 1. exact resume on the device: plain x2, preempted + resumed, model.pt compared (+ deterministic mode if plain differ)
if [ -n "$CPU" ]; then
    r=(--device cpu --stop-at-step 3 --budget 150 --always-det -- train.max_steps=8 train.log_every_steps=1
        checkpoint.every_epochs=0 checkpoint.every_steps=0 data.val_fraction=0.02)
else
    r=(--device cuda --stop-at-step 130 --budget 165 --run-timeout 60 -- train.micro_batch_size=0)
fi
stage 175 "$PY" -m bench.gpu_probe resume --data-root /tmp/c10/train --out "$OUT/resume.json" "${r[@]}" \
    data.cache_dir=/tmp/torchlaunch-cache

# 2. the GPU-only integration test (moved from the unit floor; never rerun on a GPU)
stage 45 "$PY" -m pytest -q -rs -p no:cacheprovider tests/integration/test_bad_inputs.py -k more_gpus 2>&1 | tee "$OUT/pytest.log"

# 3. where gpu224's end-to-end time goes
wait "$shards_pid"
echo "== shards writer rc=$? at t=$((SECONDS - start))s"
dry=()
[ -n "$CPU" ] && dry=(--dry-run)
b=$(($(left) - 15))
stage $((b + 10)) "$PY" -m bench.gpu_probe probe224 --budget "$b" --out "$OUT/probe224.json" \
    --profile-out "$OUT/profile224.txt" "${dry[@]}"
echo "== gpu_probe: $((SECONDS - start)) s"
