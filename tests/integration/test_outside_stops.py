"""Stops delivered from outside, the way schedulers, kubelets and terminals deliver them, with loader
worker processes running: each ends in one agreed checkpoint and exit 75, and the rerun ends bit for bit
where the uninterrupted run ends. Launcher x data path x delivery; no test here uses the in-rank fault
hook (TORCHLAUNCH_FAULT_SIGNAL). Each data path's reference run is shared by its cases.

On main 9d2744e every shard and class-folder case failed: the loader workers died of the signal meant
for their rank ("DataLoader worker (pid N) is killed by signal: Terminated"), exit 1, no checkpoint.
"""

from __future__ import annotations

import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import launcher_argv, run_cmd, run_module
from tests.helpers import assert_models_equal
from tests.stops import Launch
from torchlaunch.exit_codes import CANCELLED, OK, PREEMPTED

pytestmark = pytest.mark.slow

ENV = {"OMP_NUM_THREADS": "1"}
EPOCHS = "3"
USER_SCRIPT = "tests/programs/loader_workers.py"


@pytest.fixture(scope="module")
def folders(cifar_shared: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 real CIFAR-10 JPEGs per class, class folders."""
    root = tmp_path_factory.mktemp("folders") / "train"
    for cls in sorted(p for p in cifar_shared.iterdir() if p.is_dir()):
        (root / cls.name).mkdir(parents=True)
        for jpeg in sorted(cls.iterdir())[:40]:
            shutil.copy(jpeg, root / cls.name / jpeg.name)
    return root


@pytest.fixture(scope="module")
def shards(folders: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shards") / "set"
    code, _, err = run_module(
        "train.shards", ["write", "--from", str(folders), "--out", str(out), "--val-fraction", "0.1", "--workers", "1"]
    )
    assert code == OK, err[-2000:]
    return out


def data_args(path: str, folders: Path, shards: Path) -> list[str]:
    if path == "shards":
        return ["data.name=shards", f"data.root={shards}", "data.train_crop=resized", "data.num_workers=2"]
    return ["data.name=imagefolder", f"data.root={folders}", "data.loader=pil", "data.num_workers=2"]


def argv(path: str, run_dir: Path, folders: Path, shards: Path) -> list[str]:
    if path == "user script":
        return launcher_argv(
            "torchlaunch.backends.local.launch", "--gpus", "2", "--device", "cpu", "--run-dir", str(run_dir), "--",
            USER_SCRIPT, "--run-dir", str(run_dir), "--epochs", EPOCHS,
        )  # fmt: skip
    return launcher_argv(
        "torchlaunch.backends.local.launch", "--gpus", "2", "--device", "cpu", "--config", "configs/smoke.yaml",
        f"run_dir={run_dir}", "data.image_size=32", "train.batch_size=32", f"train.epochs={EPOCHS}",
        "checkpoint.every_steps=1000", *data_args(path, folders, shards),
    )  # fmt: skip


def weights(path: str, run_dir: Path) -> Path:
    return run_dir / "model.pt"


_references: dict[str, Path] = {}


def reference(path: str, folders: Path, shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run of a data path, once per module."""
    if path not in _references:
        run_dir = tmp_path_factory.mktemp("reference") / "run"
        code, _, err = run_cmd(argv(path, run_dir, folders, shards), timeout=400, env=ENV)
        assert code == OK, err[-3000:]
        _references[path] = weights(path, run_dir)
    return _references[path]


CASES = [
    ("shards", "pid", signal.SIGTERM),  # docker stop, a kubelet: SIGTERM to PID 1
    ("shards", "group", signal.SIGINT),  # Ctrl-C
    ("shards", "every", signal.SIGUSR2),  # Slurm's --signal to every process, torchrun's agent included
    ("class folders", "every", signal.SIGTERM),  # Slurm's preemption, scancel --signal=TERM
    ("user script", "every", signal.SIGTERM),
]
"""Each delivery and each data path at least once (CI's budget): SIGHUP, and the remaining pairs of
delivery and path, were measured with the same test on 2026-12-02 (docs/RELIABILITY.md)."""


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("path", "how", "sig"), CASES, ids=[f"{p}-{h}-{s.name}" for p, h, s in CASES])
def test_a_stop_from_outside_checkpoints_once_and_the_rerun_is_exact(
    path: str, how: str, sig: signal.Signals, folders: Path, shards: Path, tmp_path: Path, tmp_path_factory
) -> None:
    expected = reference(path, folders, shards, tmp_path_factory)
    run_dir = tmp_path / "run"
    with Launch(argv(path, run_dir, folders, shards), env=ENV) as launch:
        launch.wait_for_step(run_dir, 1)
        signalled = time.monotonic()
        reached = launch.deliver(how, sig)
        code, out, err = launch.finish()
        took = time.monotonic() - signalled
    assert code == PREEMPTED, err[-3000:]
    assert "DataLoader worker" not in err and "Traceback" not in err, err[-3000:]
    said = re.search(r"preempted with a committed checkpoint \(exit 75\) at step (\d+)", err)
    assert said is not None, err[-2000:]
    committed = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert committed[-1] == f"step-{int(said[1]):09d}", committed  # the agreed one is the newest
    assert not (run_dir / "model.pt").exists()  # stopped mid-run, not finished
    if how == "every":
        assert len(reached) > 6, reached  # launcher, agent, 2 ranks, their tees and loader workers
    print(f"{path} {how} {sig.name}: signal -> launcher exit 75 in {took:.2f} s at {committed[-1]}")
    code, out, err = run_cmd(argv(path, run_dir, folders, shards), timeout=400, env=ENV)
    assert code == OK, err[-3000:]
    assert_models_equal(weights(path, run_dir), expected)


@pytest.mark.timeout(600)
def test_a_second_ctrl_c_ends_the_run_at_once(folders: Path, shards: Path, tmp_path: Path) -> None:
    """The first Ctrl-C asks for the agreed checkpoint; a second one means "now": the tree is killed and
    the launcher says so in one line (exit 3, cancelled: never requeued); no loader worker swallows it."""
    run_dir = tmp_path / "run"
    with Launch(argv("shards", run_dir, folders, shards), env=ENV) as launch:
        launch.wait_for_step(run_dir, 1)
        launch.deliver("group", signal.SIGINT)
        launch.wait_for_log(run_dir, "received SIGTERM")  # the first one reached the ranks: a person's pause
        launch.deliver("group", signal.SIGINT)
        code, out, err = launch.finish()
    assert code == CANCELLED, err[-3000:]
    assert "second Ctrl-C" in err and "Traceback" not in err, err[-3000:]


SLURM_CASES = [
    ("--signal=USR2", "--full"),  # the batch shell, srun and every task, loader workers included
    ("--signal=TERM", "--batch"),  # the batch shell alone (#SBATCH --signal=B:TERM@T): it must pass it on
]
"""`--full --signal=TERM` is not here: srun ends its step on SIGTERM (Slurm's design, docs/SLURM.md)."""


@pytest.mark.timeout(300)
def test_a_stop_during_start_up_is_75_with_nothing_lost(folders: Path, shards: Path, tmp_path: Path) -> None:
    """SIGTERM to the launcher once its ranks exist but before any step: exit 75 in one line, no
    checkpoint (nothing was trained), never the retryable 1."""
    run_dir = tmp_path / "run"
    with Launch(argv("shards", run_dir, folders, shards), env=ENV) as launch:
        launch.wait_for_log(run_dir, "")  # rank 0's log exists: its process started
        launch.deliver("pid", signal.SIGTERM)
        code, out, err = launch.finish()
    assert code == PREEMPTED, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").glob("step-*"))
