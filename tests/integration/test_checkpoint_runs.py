"""End to end: which checkpoint a run continues from, with hostile or damaged folders in its run dir.

- A run whose only checkpoint is corrupt is a fresh run: model.init_from applies (with one warning
  naming the checkpoint), instead of being ignored for a resume that then falls back to random init.
- Newer-numbered folders that do not verify (an interrupted copy of a run dir) or that verify but do not
  load (forged) are moved to quarantine, never counted: a real preemption under torchrun commits its
  step, nothing good is deleted, and the rerun resumes from that step.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.conftest import child_env, run_cmd
from tests.helpers import REPO, assert_models_equal, launcher
from tests.library import RunLibrary
from tests.unit.test_checkpoint_paths import corrupt, forge
from torchlaunch.core import checkpoint as ckpt

pytestmark = pytest.mark.slow

TINY = [
    "data.synthetic_train_size=256",
    "data.synthetic_val_size=64",
    "train.batch_size=64",
    "train.max_steps=2",
    "checkpoint.every_steps=1",
]


def worker(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """One rank of the built-in worker, as the launchers start it."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torchlaunch.worker",
            "--config",
            "configs/smoke.yaml",
            f"run_dir={run_dir}",
            *overrides,
        ],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_corrupt_only_checkpoint_with_init_from_is_a_warm_started_fresh_run(tmp_path: Path) -> None:
    other, this, clean = tmp_path / "other", tmp_path / "this", tmp_path / "clean"
    done = worker(other, *TINY, "seed=1")
    assert done.returncode == 0, done.stderr[-2000:]
    done = worker(this, *TINY)
    assert done.returncode == 0, done.stderr[-2000:]
    own = [p for _, p in ckpt.candidates(this / "checkpoints")]
    assert own, "the first run left no checkpoint"
    for folder in own:
        corrupt(folder)
    (this / "model.pt").rename(tmp_path / "random-init-model.pt")

    # Warm-starting the run dir from another run changes its recorded config: an explicit act (a rerun
    # with other overrides is refused without it, tests/unit/test_rundir_config.py).
    rerun = worker(this, *TINY, f"model.init_from={other}", "--reconfigure")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "ignored: resuming" not in rerun.stdout
    assert f"init_from {other / 'checkpoints'}" in rerun.stdout and "loaded all" in rerun.stdout
    warnings = [ln for ln in rerun.stderr.splitlines() if "no checkpoint of this run verifies" in ln]
    assert len(warnings) == 1 and all(str(folder) in warnings[0] for folder in own), rerun.stderr[-3000:]
    assert "resumed from" not in rerun.stdout

    # The same warm start in a clean run folder (deterministic on CPU) ends with the very same weights.
    done = worker(clean, *TINY, f"model.init_from={other}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert_models_equal(clean / "model.pt", this / "model.pt")
    final = torch.load(this / "model.pt", weights_only=True)
    random_init = torch.load(tmp_path / "random-init-model.pt", weights_only=True)
    assert any(not torch.equal(final[k], random_init[k]) for k in final)  # not what random init trains to


# 1024 samples / batch 64 = 16 steps per epoch; checkpoints every 8 steps (none between 3 and 6).
SMALL = [
    "data.synthetic_train_size=1024",
    "data.synthetic_val_size=128",
    "train.batch_size=64",
    "train.epochs=1",
    "train.max_steps=10",
    "checkpoint.every_steps=8",
    "checkpoint.keep=2",
]


def two_ranks(run_dir: Path, fault: str | None = None) -> subprocess.CompletedProcess:
    env = {"TORCHLAUNCH_FAULT_SIGNAL": fault} if fault else None
    return launcher(["--gpus", "2", "--config", "configs/smoke.yaml", f"run_dir={run_dir}", *SMALL], env=env)


def plant_copies(root: Path, good: Path) -> list[str]:
    """An interrupted copy of a run folder: two newer-numbered folders, markers intact, bytes not."""
    names = []
    for step in (100, 200):
        target = root / ckpt.step_dir_name(step)
        shutil.copytree(good, target)
        corrupt(target)
        names.append(target.name)
    return names


def plant_forgery(root: Path, good: Path) -> list[str]:
    return [forge(root, 999).name]


@pytest.mark.parametrize(
    "plant",
    [
        pytest.param(plant_copies, id="two-corrupt-newer", marks=pytest.mark.extended),
        pytest.param(plant_forgery, id="forged-newer"),
    ],
)
def test_hostile_newer_folders_through_a_real_preemption(
    tmp_path: Path,
    plant,  # noqa: ANN001
    run_library: RunLibrary,
) -> None:
    """The first launch (2 ranks preempted at step 3: exit 75, asserted where it is built) is the same
    for every `plant`: the session's library entry "checkpoint-preempted", copied here to be changed."""
    root = tmp_path / "checkpoints"
    first = run_library.copy("checkpoint-preempted", tmp_path).result
    good = root / ckpt.step_dir_name(committed_step(first))  # the agreed stop: a step or two after the signal
    assert ckpt.verify(good) is None
    planted = plant(root, good)

    second = two_ranks(tmp_path, "at=step,n=6,rank=0")
    assert second.returncode == 75, second.stdout[-2000:] + second.stderr[-2000:]
    out = second.stdout + second.stderr
    assert f"resumed from {good}" in out
    step = committed_step(second)
    assert step > int(good.name.removeprefix("step-"))
    committed = root / ckpt.step_dir_name(step)
    assert ckpt.verify(good) is None and ckpt.verify(committed) is None  # nothing good was deleted
    assert sorted(p.name for p in (root / ckpt.QUARANTINE_DIR).iterdir()) == sorted(planted)
    assert [p for _, p in ckpt.candidates(root)] == [committed, good]

    third = two_ranks(tmp_path)
    assert third.returncode == 0, third.stderr[-2000:]
    assert f"resumed from {committed} at epoch 1/" in third.stdout + third.stderr  # epochs count from 1
    assert f" step {step}/" in third.stdout + third.stderr and f"(global step {step})" in third.stdout + third.stderr
    assert ckpt.find_latest(root)[1]["progress"]["global_step"] == 10


def committed_step(result: subprocess.CompletedProcess) -> int:
    """The global step of the preemption checkpoint a run reported."""
    found = re.search(r"preempted: checkpoint committed at global step (\d+)", result.stdout + result.stderr)
    assert found, (result.stdout + result.stderr)[-2000:]
    return int(found.group(1))


AGREEMENT = textwrap.dedent("""
    import sys
    from pathlib import Path

    import torch

    from torchlaunch.core import checkpoint as ckpt
    from torchlaunch.core import dist
    from torchlaunch.core.checkpoint import store

    ctx = dist.setup()
    checkpointer = ckpt.Checkpointer(ctx, Path(sys.argv[1]), 2, "agreement-test")
    checkpointer.save(1, {"w": torch.ones(2)}, synchronous=True)
    if ctx.is_main:
        def failing(*args, **kwargs):
            raise ckpt.CheckpointError("checkpoint error: injected failure on rank 0")
        store.write_checkpoint = failing
    for mode in ("sync", "async"):
        try:
            checkpointer.save(2, {"w": torch.ones(2)}, synchronous=mode == "sync")
            if mode == "async":
                checkpointer.save(3, {"w": torch.ones(2)})  # the background failure is agreed here
            outcome = "saved"
        except ckpt.CheckpointError as e:
            outcome = f"raised: {e}"
        print(f"rank {ctx.rank} {mode}: {outcome}", flush=True)
    dist.teardown(ctx)
""")


def test_a_failed_commit_on_rank_0_raises_on_every_rank(tmp_path: Path) -> None:
    """No rank reports a checkpoint (exit 75 'committed') that rank 0 failed to write, sync or async."""
    script = tmp_path / "agreement.py"
    script.write_text(AGREEMENT)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    rc, out, err = run_cmd([*argv, str(script), str(tmp_path / "checkpoints")], timeout=240)
    assert rc == 0, err[-3000:]
    for rank in (0, 1):
        for mode in ("sync", "async"):
            assert f"rank {rank} {mode}: raised: checkpoint error: injected failure on rank 0" in out, out
    assert [s for s, _ in ckpt.candidates(tmp_path / "checkpoints")] == [1]


SHARES = textwrap.dedent("""
    import errno
    import sys
    from pathlib import Path

    import torch

    from torchlaunch.core import checkpoint as ckpt
    from torchlaunch.core import dist
    from torchlaunch.core.checkpoint import dcp

    ctx = dist.setup()
    root = Path(sys.argv[1])
    checkpointer = ckpt.Checkpointer(ctx, root, 2, "shares-test", format_name="dcp")
    state = {"a": torch.arange(300.0), "b": torch.full((200,), 2.0), "c": torch.ones(100), "note": "kept by rank 0"}
    checkpointer.save(1, state)  # dcp saves are synchronous on every rank
    if ctx.rank == 1:
        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device (injected on rank 1)")
        dcp.DistributedCheckpoint.write_share = full
    try:
        checkpointer.save(2, {**state, "a": torch.zeros(300)})
        outcome = "saved"
    except ckpt.CheckpointError as e:
        outcome = f"raised {type(e).__name__}: {e}"
    print(f"rank {ctx.rank}: {outcome}", flush=True)
    loaded = checkpointer.load_latest(restore=False)
    same = all(torch.equal(loaded.state[k], state[k]) for k in "abc") and loaded.state["note"] == state["note"]
    print(f"rank {ctx.rank} loaded step {loaded.step} same={same}", flush=True)
    dist.teardown(ctx)
""")


def test_a_dcp_share_that_fails_on_one_rank_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    """checkpoint.format=dcp on 2 ranks: each writes its share of the tensors; a full disk on rank 1
    during its share is a storage error on both ranks, nothing of step 2 is committed or left behind,
    and both ranks load step 1."""
    script = tmp_path / "shares.py"
    script.write_text(SHARES)
    root = tmp_path / "checkpoints"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    rc, out, err = run_cmd([*argv, str(script), str(root)], timeout=240)
    assert rc == 0, err[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: raised CheckpointStorageError: checkpoint error: storage: no space left on device" in out
        assert f"rank {rank} loaded step 1 same=True" in out, out
    assert [s for s, _ in ckpt.candidates(root)] == [1] and not list(root.glob(".tmp-*"))
    marker = ckpt.read_marker(root / "step-000000001")
    assert marker["format"] == "dcp" and marker["shares"] == 2
    assert {"__0.metadata", "__0_0.distcp", "__1.metadata", "__1_0.distcp", "rest.pt"} == set(marker["files"])
