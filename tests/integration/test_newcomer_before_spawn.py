"""Newcomer paper cuts: bad data and fp16-on-CPU stop before anything is spawned (and
without torch), the dev cluster's missing SLURM_CONF is one line with the fix, the CPU precision of
`auto` is measured once, cached, and recorded in the run so a resume keeps it."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import launcher_argv, run_cmd, run_proc
from torchlaunch.config import DataConfig
from torchlaunch.data.checks import check_data
from torchlaunch.data.formats.cifar10 import unreachable_reason
from torchlaunch.exit_codes import BadInput
from torchlaunch.trainer_sections import fp16_on_cpu_message
from torchlaunch.worker import precision


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released): a connection is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TWO_CPU = ("--gpus", "2", "--device", "cpu")


def launch_in_process(args: list[str], env: dict[str, str], tmp_path: Path) -> tuple[int, list[str], bool]:
    """Run launch.local's main in a fresh interpreter: (exit code, stderr lines, torch imported?)."""
    script = (
        "import sys; from torchlaunch.agent import node; code = node.main(sys.argv[1:]); "
        "print('TORCH', 'torch' in sys.modules); sys.exit(code)"
    )
    code, out, err = run_cmd([sys.executable, "-c", script, *args], timeout=60, env=env)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    return code, lines, "TORCH True" in out


def worker_lines(args: list[str], env: dict[str, str] | None = None) -> tuple[int, list[str]]:
    """The built-in worker (`python -m train ARGS`) alone, without a launcher: (exit code, stderr lines)."""
    code, _, err = run_cmd([sys.executable, "-m", "train", *args], timeout=120, env=env)
    return code, err.splitlines()


# ------------------------------------------------------------------ 1. before spawning


def test_offline_cifar10_stops_before_spawning_without_torch(tmp_path: Path) -> None:
    env = {"TORCHLAUNCH_DOWNLOAD_PROBE": f"127.0.0.1:{closed_port()}"}  # offline by construction
    code, lines, torch_loaded = launch_in_process(
        [
            "--gpus",
            "4",
            "--device",
            "cpu",
            "--config",
            "configs/cifar10.yaml",
            f"run_dir={tmp_path / 'run'}",
            f"data.root={tmp_path / 'data'}",
        ],
        env,
        tmp_path,
    )
    assert code == 2, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith("data error: CIFAR-10 not found under") and "download host unreachable" in lines[0]
    assert "run once with internet access" in lines[0] and "data.name=imagefolder" in lines[0]
    assert not torch_loaded
    assert not (tmp_path / "run").exists()  # nothing written, nothing started


def test_download_off_gives_the_workers_own_line(tmp_path: Path) -> None:
    args = [
        "--config",
        "configs/cifar10.yaml",
        f"run_dir={tmp_path / 'run'}",
        f"data.root={tmp_path / 'data'}",
        "data.download=false",
    ]
    code, lines, torch_loaded = launch_in_process([*TWO_CPU, *args], {}, tmp_path)
    assert code == 2 and len(lines) == 1 and not torch_loaded
    worker_code, worker = worker_lines(args)
    assert worker_code == 2
    assert lines[0] in worker


def test_empty_image_folder_stops_before_spawning(tmp_path: Path) -> None:
    (tmp_path / "images" / "cat").mkdir(parents=True)
    code, lines, torch_loaded = launch_in_process(
        [
            *TWO_CPU,
            "--config",
            "configs/smoke.yaml",
            f"run_dir={tmp_path / 'run'}",
            "data.name=imagefolder",
            f"data.root={tmp_path / 'images'}",
        ],
        {},
        tmp_path,
    )
    assert code == 2 and len(lines) == 1 and not torch_loaded
    assert "has class folders but no images" in lines[0]


def test_probe_tells_a_listening_port_from_a_closed_one() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        assert unreachable_reason("127.0.0.1", server.getsockname()[1]) is None
    reason = unreachable_reason("127.0.0.1", closed_port())
    assert reason is not None and "127.0.0.1" in reason


def test_cifar10_present_or_downloadable_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    batches = tmp_path / "present" / "cifar-10-batches-py"
    batches.mkdir(parents=True)
    (batches / "test_batch").write_bytes(b"x")
    check_data(DataConfig(name="cifar10", root=str(tmp_path / "present"), download=False), local=True)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        monkeypatch.setenv("TORCHLAUNCH_DOWNLOAD_PROBE", f"127.0.0.1:{server.getsockname()[1]}")
        check_data(DataConfig(name="cifar10", root=str(tmp_path / "absent"), download=True), local=True)


def test_remote_jobs_judge_only_what_this_host_sees(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHLAUNCH_DOWNLOAD_PROBE", f"127.0.0.1:{closed_port()}")
    absent = DataConfig(name="imagefolder", root=str(tmp_path / "only-on-the-cluster"))
    check_data(absent, local=False)  # may exist on the compute nodes
    with pytest.raises(BadInput, match="does not exist"):
        check_data(absent, local=True)
    (tmp_path / "cifar").mkdir()
    check_data(DataConfig(name="cifar10", root=str(tmp_path / "cifar"), download=True), local=False)
    with pytest.raises(BadInput, match="download is off"):
        check_data(DataConfig(name="cifar10", root=str(tmp_path / "cifar"), download=False), local=False)


# ------------------------------------------------------------------ 2. fp16 on CPU


def test_fp16_on_cpu_stops_in_the_launcher_and_in_the_worker(tmp_path: Path) -> None:
    args = ["--config", "configs/smoke.yaml", f"run_dir={tmp_path / 'run'}", "train.precision=fp16"]
    code, lines, torch_loaded = launch_in_process([*TWO_CPU, *args], {}, tmp_path)
    assert code == 2 and len(lines) == 1 and not torch_loaded
    assert "train.precision=bf16" in lines[0] and "train.precision=fp32" in lines[0]
    worker_code, worker = worker_lines(args, {"CUDA_VISIBLE_DEVICES": ""})
    assert worker_code == 2
    assert lines[0] in worker


def test_fp16_on_cpu_stops_slurm_and_k8s_doctor_before_submitting(tmp_path: Path) -> None:
    k8s = launcher_argv(
        "torchlaunch.backends.k8s.launch", "--doctor", "--cpu-only", "--nodes", "2", "train.precision=fp16"
    )
    code, out, err = run_cmd(k8s, timeout=60)
    assert code == 2 and out == ""
    assert err.strip() == fp16_on_cpu_message()
    if shutil.which("sbatch") is None:
        return
    slurm = launcher_argv(
        "torchlaunch.backends.slurm.launch",
        *("--nodes", "1", "--tasks-per-node", "2", "--config", "configs/smoke.yaml"),
        *(f"run_dir={tmp_path}", "train.precision=fp16"),
    )
    code, _, err = run_cmd(slurm, timeout=60)
    assert code == 2
    assert err.strip() == fp16_on_cpu_message()  # the worker's own line, as on every launcher


def test_doctor_json_reports_both_rates() -> None:
    _, out, _ = run_cmd(launcher_argv("torchlaunch.tools.doctor", "--json", "--model", "simple_cnn"), timeout=120)
    rates = json.loads(out)["facts"]["devices"][0]["rates"]
    assert rates["fp32"] > 0 and rates["bf16"] > 0 and rates["auto_picks"] in ("bf16", "fp32")


# ------------------------------------------------------------------ 3. the dev cluster's SLURM_CONF


# ------------------------------------------------------------------ 5. CPU precision by measurement


@pytest.mark.slow
@pytest.mark.extended
def test_auto_on_cpu_is_recorded_and_a_resume_keeps_it_bit_for_bit(tmp_path: Path) -> None:
    """Two ranks through the real launcher: rank 0 measures and picks, the run records it; preempted at
    step 2 and rerun after the cache flipped, it keeps its precision and ends bit for bit where an
    uninterrupted run with that precision named ends (so the measurement left the RNG streams alone)."""
    from tests.helpers import assert_states_equal, final_state

    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    common = [
        *TWO_CPU,
        "--config",
        "configs/smoke.yaml",
        f"data.cache_dir={cache}",
        "train.epochs=2",
        "data.synthetic_train_size=256",
        "data.synthetic_val_size=64",
        "model.width=4",
    ]

    def launch(*extra: str, fault: str | None = None) -> subprocess.CompletedProcess:
        argv = launcher_argv("torchlaunch.agent", *common, *extra)
        return run_proc(argv, timeout=300, env={"TORCHLAUNCH_FAULT_SIGNAL": fault} if fault else None)

    first = launch(f"run_dir={run_dir}", "train.precision=auto", fault="at=step,n=2,rank=0")
    assert first.returncode == 75, first.stderr
    chosen = json.loads((run_dir / "precision.json").read_text())["precision"]
    notes = [ln for ln in first.stderr.splitlines() if ln.startswith("precision: auto ->")]
    assert len(notes) == 1 and f"-> {chosen}" in notes[0] and "measured now" in notes[0]  # rank 0 only
    assert f"({chosen})" in first.stdout + first.stderr  # the run's own start line names the same precision
    entries = json.loads((cache / precision.CACHE_FILE).read_text())
    for entry in entries.values():
        entry["precision"] = "fp32" if chosen == "bf16" else "bf16"
    (cache / precision.CACHE_FILE).write_text(json.dumps(entries))
    again = launch(f"run_dir={run_dir}", "train.precision=auto")
    assert again.returncode == 0, again.stderr
    assert f"precision: auto -> {chosen} (recorded at this run's start" in again.stderr
    resumed = final_state(run_dir)
    assert resumed["config"]["train"]["precision"] == chosen  # train.evaluate validates in it too
    reference = launch(f"run_dir={tmp_path / 'reference'}", f"train.precision={chosen}")
    assert reference.returncode == 0, reference.stderr
    assert_states_equal(resumed, final_state(tmp_path / "reference"))


# ------------------------------------------------------------------ 5. bench names the CPU


def test_preflight_needs_no_data(tmp_path: Path) -> None:
    """`launch.local --doctor` trains nothing, so a missing dataset must not stop it before it starts."""
    argv = launcher_argv(
        "torchlaunch.agent",
        *("--doctor", "--dry-run", "--gpus", "2", "--device", "cpu", "--config", "configs/cifar10.yaml"),
        *(f"data.root={tmp_path / 'none'}", "data.download=false", f"run_dir={tmp_path / 'run'}"),
    )
    code, out, err = run_cmd(argv, timeout=60)
    assert code == 0, err
    assert "torchlaunch.tools.preflight" in out
