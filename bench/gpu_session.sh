#!/usr/bin/env bash
# One short GPU session (issue 15, items 3-4): the airbench peer table on one GPU, in <= 8 minutes.
# docs/GPU.md says how to call it. Here (the CPU box), once, from the repository root:
#     mkdir -p .cache/gpu-data && cp /work/shared/data/cifar10-train.tar.gz .cache/gpu-data/
#     # optional, held-out test images as test/<class>/*.png|jpg: .cache/gpu-data/cifar10-test.tar.gz
# On the device machine (the run tool; carry [".cache/gpu-data"], timeout_s 540):
#     bash bench/gpu_session.sh
# Worst case 15 + 45 + 30 + 30 + 60 + 300 s = 8.0 min; expected ~4. Installs nothing (airbench is imported
# from bench/wheels/), unpacks into /tmp, puts every stage under `timeout`, and writes session.log, gpu-rates.json, peer-airbench.md and peer-airbench.json to $OUT.
set -u -o pipefail
OUT=${OUT:-/tmp/gpu-session-out}
DATA=${GPU_DATA:-.cache/gpu-data}
EXTRA=${GPU_EXTRA:-fast93.yaml:train.epochs=32}   # one more project run: a shorter fast93 for the 20 s budget
PEERS=${GPU_PEERS-airbench94 airbench96}          # GPU_PEERS="" runs the project's side alone (a CPU dry run)
read -r -a project_overrides <<< "${GPU_PROJECT_OVERRIDES:-}"  # e.g. "train.max_steps=2" for a dry run
if [ ! -f "$DATA/cifar10-train.tar.gz" ]; then
    echo "gpu_session: $DATA/cifar10-train.tar.gz is missing (copy /work/shared/data/cifar10-train.tar.gz there and carry $DATA)" >&2
    exit 2
fi
mkdir -p "$OUT"
exec > >(tee -a "$OUT/session.log") 2>&1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
start=$SECONDS

stage() {  # stage SECONDS COMMAND...: bounded, logged with its exit code and duration
    local limit=$1 t0=$SECONDS rc
    shift
    echo "== $(date -u +%T) [${limit}s] $*"
    timeout -k 10 "$limit" "$@"
    rc=$?
    echo "== rc=$rc in $((SECONDS - t0)) s"
    return "$rc"
}

stage 15 nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
stage 45 python3 -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__, 'cuda', torch.cuda.is_available())" || exit 1
rm -rf /tmp/c10 && mkdir -p /tmp/c10
stage 30 tar xzf "$DATA/cifar10-train.tar.gz" -C /tmp/c10 || exit 1
test_args=()
if [ -f "$DATA/cifar10-test.tar.gz" ]; then
    stage 30 tar xzf "$DATA/cifar10-test.tar.gz" -C /tmp/c10 && test_args=(--test-root /tmp/c10/test)
fi
# the project's training step alone (no data loading): images/s of fastnet, fastnet93 and resnet18, eager
stage 60 python3 -m bench.gpu --no-compile --steps 30 --out "$OUT/gpu-rates.json"
# pack + fast.yaml, airbench94, fast93.yaml, airbench96, then $EXTRA; the JSON is rewritten after every run
# shellcheck disable=SC2086  # PEERS is a word list
stage 300 python3 -m bench.gpu --peer-airbench --data-root /tmp/c10/train "${test_args[@]}" \
    --work-dir /tmp/airbench-work --cache-dir /tmp/torchlaunch-cache --out-dir "$OUT" \
    --stage-timeout 100 --extra "$EXTRA" --peers $PEERS --project-overrides "${project_overrides[@]}"
rc=$?
echo "== session: $((SECONDS - start)) s, bench exit $rc"
exit "$rc"
