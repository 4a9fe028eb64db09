"""A run's config changes only by an explicit, stated act (issue 38, item 4), and the launcher's host
check quotes what it refuses (item 5).

RUN_DIR/config.yaml is written once, when the run dir has none; a later launch that resolves to other
values is refused in one line naming the keys (and which a resume would not use), before anything is
written, unless it passes --reconfigure, which says from which step the new values apply. In process:
every refusal here comes before a rank is spawned."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO
from torchlaunch import config as config_mod
from torchlaunch import rundir, runlock
from torchlaunch.agent import commands, node
from torchlaunch.exit_codes import BAD_INPUT, BadInput, ConfigError
from torchlaunch.launch import elastic, shape

SMOKE = str(REPO / "configs" / "smoke.yaml")


def started(run_dir: Path, *overrides: str) -> str:
    """A run dir whose first launch resolved `overrides`: its config.yaml text."""
    settled = config_mod.settle_resolved(config_mod.load(SMOKE, [f"run_dir={run_dir}", *overrides]))
    assert settled.note is None and settled.previous is None
    return settled.path.read_text()


def one_refusal(capsys: pytest.CaptureFixture[str]) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_rerun_with_other_overrides_is_refused_naming_them_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: the rerun rewrote config.yaml with optim.lr=0.5, and the resume used the checkpoint's lr."""
    run_dir = tmp_path / "run"
    before = started(run_dir, "optim.lr=0.02")
    code = node.main(["--config", SMOKE, f"run_dir={run_dir}", "optim.lr=0.5", "train.epochs=5", "--device", "cpu"])
    line = one_refusal(capsys)
    assert code == BAD_INPUT and line.startswith("config error: run_dir: "), line
    assert "optim.lr 0.02 -> 0.5" in line and "train.epochs 3 -> 5" in line and "--reconfigure" in line, line
    assert (run_dir / rundir.CONFIG).read_text() == before
    assert not (run_dir / rundir.LOCK).exists()


def test_a_rerun_of_the_same_config_resumes_and_a_respelled_run_dir_is_no_change(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    started(run_dir, "optim.lr=0.02")
    again = config_mod.settle_resolved(config_mod.load(SMOKE, [f"run_dir={run_dir}/.", "optim.lr=0.02"]))
    assert again.note is None and "run_dir: " + f"{run_dir}/." in again.path.read_text()


def test_how_a_run_runs_may_change_on_a_rerun_and_is_said(tmp_path: Path) -> None:
    """data.num_workers, train.micro_batch_size (the resume's own advice for memory), ...: a resume is exact
    across them (tests/integration/test_resume_resized.py changes the worker count), so no --reconfigure, one line."""
    run_dir = tmp_path / "run"
    before = started(run_dir, "data.num_workers=1")
    cfg = config_mod.load(SMOKE, [f"run_dir={run_dir}", "data.num_workers=2", "train.micro_batch_size=64"])
    settled = config_mod.settle_resolved(cfg, resumes_at=lambda: 8, running=1)
    assert settled.previous == before and settled.path.read_text() == config_mod.dump(cfg)
    assert settled.note == (
        f"launch: updated how the run runs in {settled.path} (data.num_workers 1 -> 2, train.micro_batch_size "
        "0 -> 64): the new values apply from step 8, where it resumes"
    )
    mixed = config_mod.load(SMOKE, [f"run_dir={run_dir}", "data.num_workers=3", "seed=4"])
    with pytest.raises(ConfigError) as info:
        config_mod.settle_resolved(mixed)
    assert "seed 0 -> 4" in str(info.value) and "num_workers" not in str(info.value)


def test_with_a_checkpoint_the_refusal_says_which_values_a_resume_would_not_use(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    started(run_dir)
    cfg = config_mod.load(SMOKE, [f"run_dir={run_dir}", "optim.lr=0.5", "train.epochs=2"])
    with pytest.raises(ConfigError) as info:
        config_mod.settle_resolved(cfg, resumes_at=lambda: 16)
    assert "optim.lr 0.02 -> 0.5 (not used: restored from the checkpoint)" in str(info.value)
    assert "train.epochs 3 -> 2" in str(info.value) and "train.epochs 3 -> 2 (not used" not in str(info.value)


def test_the_pre_flight_checks_its_own_copy_and_never_rewrites_the_runs_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--doctor` with other overrides on a run dir: before, it rewrote config.yaml; now its ranks read
    RUN_DIR/doctor-config.yaml (the command printed) and the run's file stays as it was."""
    run_dir = tmp_path / "run"
    before = started(run_dir, "optim.lr=0.02")
    argv = ["--config", SMOKE, f"run_dir={run_dir}", "--device", "cpu", "--doctor", "--dry-run", "optim.lr=0.5"]
    assert node.main(argv) == 0
    printed = capsys.readouterr().out  # the dry run prints the recipe as typed (runnable as printed)
    assert "optim.lr=0.5" in printed and "config.yaml " not in printed
    assert (run_dir / "config.yaml").read_text() == before


def test_reconfigure_changes_it_and_says_from_which_step(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    before = started(run_dir)
    cfg = config_mod.load(SMOKE, [f"run_dir={run_dir}", "optim.lr=0.5", "train.epochs=2"])
    settled = config_mod.settle_resolved(cfg, reconfigure=True, resumes_at=lambda: 16)
    assert settled.previous == before and settled.path.read_text() == config_mod.dump(cfg)
    assert settled.note is not None and "from step 16" in settled.note
    assert "optim.lr 0.02 -> 0.5 (not used: restored from the checkpoint)" in settled.note
    assert config_mod.restore_resolved(settled) and settled.path.read_text() == before


def test_reconfigure_refuses_what_the_resume_would_refuse_before_writing(tmp_path: Path) -> None:
    """Before: a refused resume (exit 2) had already rewritten config.yaml, so the documented rerun
    (--config RUN_DIR/config.yaml) failed every time."""
    run_dir = tmp_path / "run"
    before = started(run_dir)
    cfg = config_mod.load(SMOKE, [f"run_dir={run_dir}", "train.batch_size=64"])
    with pytest.raises(ConfigError, match=r"^config error: train.batch_size: --reconfigure cannot change it"):
        config_mod.settle_resolved(cfg, reconfigure=True, resumes_at=lambda: 16)
    assert (run_dir / rundir.CONFIG).read_text() == before
    settled = config_mod.settle_resolved(cfg, reconfigure=True, resumes_at=lambda: None)  # no checkpoint yet
    assert settled.note is not None and "from step 0" in settled.note


def test_an_unreadable_config_yaml_is_refused_not_replaced(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / rundir.CONFIG).write_text("optim: [\n")
    cfg = config_mod.load(SMOKE, [f"run_dir={run_dir}"])
    with pytest.raises(ConfigError, match="cannot be read"):
        config_mod.settle_resolved(cfg)
    assert (run_dir / rundir.CONFIG).read_text() == "optim: [\n"


def test_a_launcher_joining_a_running_elastic_job_with_another_config_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: the second launcher joined through the same rendezvous and rewrote config.yaml under the
    running job (optim.lr=0.9 in the file, 0.02 in training). The first member holds its slot here."""
    run_dir = tmp_path / "run"
    before = started(run_dir, "optim.lr=0.02")
    port = 29731
    job = elastic.job_key(commands.run_id(str(run_dir)), "127.0.0.1", port)
    member = runlock.acquire(run_dir, job=job)
    try:
        argv = ["--config", SMOKE, f"run_dir={run_dir}", "--device", "cpu", "--nnodes", "1:2"]
        argv += ["--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "1"]
        assert node.main([*argv, "optim.lr=0.9"]) == BAD_INPUT
        assert "optim.lr 0.02 -> 0.9" in one_refusal(capsys)
        assert node.main([*argv, "optim.lr=0.9", "--reconfigure"]) == BAD_INPUT
        assert "--reconfigure while 1 other launcher(s)" in one_refusal(capsys)
        assert (run_dir / rundir.CONFIG).read_text() == before
        assert sorted(p.name for p in (run_dir / rundir.LOCK_NODES).iterdir()) == ["node-0.json"]
    finally:
        member.release()


# ------------------------------------------------------------------ item 5: --master-addr


@pytest.mark.parametrize("addr", ["127.0.0.1\n", "node0\nlaunch: forged", "\n127.0.0.1"])
def test_a_host_with_a_line_break_is_refused_quoted_on_one_line(addr: str) -> None:
    """`$` matched before a trailing newline: 127.0.0.1\\n passed, and its error line was cut."""
    with pytest.raises(BadInput) as info:
        shape.master_addr("--master-addr", addr, timeout_s=1.0)
    text = str(info.value)
    assert "\n" not in text and "is not a host name or address" in text and repr(addr)[:-1] in text


def test_the_launcher_refuses_a_master_addr_with_a_newline_in_one_quoted_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = node.main(["--config", SMOKE, "--nnodes", "2", "--master-addr", "127.0.0.1\n", "--device", "cpu"])
    line = one_refusal(capsys)
    assert code == BAD_INPUT and line == (
        "launch error: --master-addr '127.0.0.1\\n' is not a host name or address "
        "(e.g. --master-addr node0 or 10.0.0.1)"
    )


# ------------------------------------------------------------------ item 4: another job's rendezvous store


def test_every_key_the_rule_names_is_a_config_key() -> None:
    named = config_mod.OPERATIONAL | config_mod.KEPT_AT_RESUME | config_mod.FIXED_AT_RESUME
    assert named <= set(config_mod.all_keys()), named - set(config_mod.all_keys())


# ---- every writer of RUN_DIR/config.yaml applies the one rule (the worker, launch.slurm) -----------


def no_training(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The worker's set-up and training replaced by a record of the config it would train on."""
    from torchlaunch.worker import run

    trained: list[str] = []
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(run, "_run", lambda cfg, *a: (trained.append(config_mod.dump(cfg)), (0, "finished"))[1])
    return trained


def test_python_m_train_on_a_run_dir_started_with_another_config_is_refused_before_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: `python -m train --config X run_dir=R` wrote its own config over the run's (rank 0's
    write_resolved), whatever the run had been started with."""
    from torchlaunch.worker import run

    trained = no_training(monkeypatch)
    run_dir = tmp_path / "run"
    before = started(run_dir, "optim.lr=0.02")
    with pytest.raises(ConfigError) as refused:
        run.main(["--config", SMOKE, f"run_dir={run_dir}", "optim.lr=0.5"])
    line = str(refused.value)
    assert len(line.splitlines()) == 1 and "optim.lr 0.02 -> 0.5" in line and "--reconfigure" in line, line
    assert trained == [] and (run_dir / rundir.CONFIG).read_text() == before
    assert sorted(p.name for p in run_dir.iterdir()) == [rundir.CONFIG]
    assert run.main(["--config", SMOKE, f"run_dir={run_dir}", "optim.lr=0.02"]) == 0  # the same config runs
    assert run.main(["--config", SMOKE, f"run_dir={run_dir}", "optim.lr=0.5", "--reconfigure"]) == 0
    assert len(trained) == 2 and "lr: 0.5" in trained[1]


def test_the_worker_writes_the_config_by_the_rule_and_says_a_reconfigure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 0's write (after the plug-in checks) is settle_resolved's: a first start writes, a rerun of
    the same config changes nothing, a reconfigure rewrites and says so in one line."""
    from torchlaunch.worker import run

    run_dir = tmp_path / "run"
    cfg = config_mod.load(SMOKE, [f"run_dir={run_dir}", "optim.lr=0.02"])
    run.settle_config(cfg, False, write=False)
    assert not run_dir.exists()  # the check before anything is written
    run.settle_config(cfg, False, write=True)
    before = (run_dir / rundir.CONFIG).read_text()
    other = config_mod.load(SMOKE, [f"run_dir={run_dir}", "optim.lr=0.5"])
    with pytest.raises(ConfigError, match="optim.lr 0.02 -> 0.5"):
        run.settle_config(other, False, write=True)
    assert (run_dir / rundir.CONFIG).read_text() == before
    run.settle_config(other, True, write=True)
    assert (run_dir / rundir.CONFIG).read_text() == config_mod.dump(other)
    [note] = capsys.readouterr().err.strip().splitlines()
    assert note.startswith("train: reconfigured ") and "optim.lr 0.02 -> 0.5" in note, note


def slurm_call(argv: list[str]) -> tuple[int, str, str]:
    import contextlib
    import io

    from torchlaunch.backends.slurm import launch as slurm

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = slurm.main(argv)
    return code, out.getvalue(), err.getvalue()


def test_launch_slurm_refuses_a_run_dir_started_with_another_config_before_rendering(tmp_path: Path) -> None:
    """Before: launch.slurm rendered and submitted the job, whose rank 0 rewrote config.yaml with the
    new values. The dry run applies the same refusal; --reconfigure renders and still writes nothing."""
    run_dir = tmp_path / "run"
    before = started(run_dir, "optim.lr=0.02")
    code, out, err = slurm_call(["--config", SMOKE, f"run_dir={run_dir}", "optim.lr=0.5", "--dry-run"])
    assert code == BAD_INPUT and out == "", (out, err)
    assert len(err.strip().splitlines()) == 1 and "optim.lr 0.02 -> 0.5" in err and "--reconfigure" in err, err
    code, out, err = slurm_call(["--config", SMOKE, f"run_dir={run_dir}", "optim.lr=0.02", "--dry-run"])
    assert code == 0 and "#SBATCH" in out, err
    code, out, err = slurm_call(["--config", SMOKE, f"run_dir={run_dir}", "optim.lr=0.5", "--dry-run", "--reconfigure"])
    assert code == 0 and "#SBATCH" in out, err
    assert (run_dir / rundir.CONFIG).read_text() == before


def test_launch_slurm_settles_the_config_under_the_lock_at_submit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At submit (the cluster stood in for): refused without --reconfigure, nothing written and the run
    dir free; with it rewritten and said; a refused submission puts the previous file back."""
    from torchlaunch.backends.slurm import launch as slurm

    class Job:
        job_id = "4242"

    run_dir = tmp_path / "run"
    before = started(run_dir, "optim.lr=0.02")
    argv = ["--config", SMOKE, f"run_dir={run_dir}", "optim.lr=0.5"]
    spec, options, _ = slurm.parse_args(argv)
    cfg = config_mod.load(SMOKE, [f"run_dir={run_dir}", "optim.lr=0.5"])
    monkeypatch.setattr(slurm, "_submit", lambda *a: pytest.fail("submitted"))
    with pytest.raises(ConfigError, match="optim.lr 0.02 -> 0.5"):
        slurm.submit(spec, options, cfg)
    assert (run_dir / rundir.CONFIG).read_text() == before and not (run_dir / rundir.LOCK).exists()

    def refused(*a: object) -> Job:
        raise BadInput("sbatch refused")

    monkeypatch.setattr(slurm, "_submit", refused)
    with pytest.raises(BadInput, match="sbatch refused"):
        slurm.submit(spec, options, cfg, reconfigure=True)
    assert (run_dir / rundir.CONFIG).read_text() == before
    monkeypatch.setattr(slurm, "_submit", lambda *a: Job())
    slurm.submit(spec, options, cfg, reconfigure=True)
    assert (run_dir / rundir.CONFIG).read_text() == config_mod.dump(cfg)


def test_launch_k8s_carries_reconfigure_to_each_pods_launcher() -> None:
    """The pods run launch.local, which refuses a changed config: --reconfigure is the pods' too."""
    from tests.unit.test_k8s import render

    code, out, err = render(["--config", "configs/smoke.yaml", "--reconfigure"])
    assert code == 0 and "torchlaunch.agent" in out and " --reconfigure " in out, err
    code, out, _ = render(["--config", "configs/smoke.yaml"])
    assert code == 0 and "--reconfigure" not in out
    code, out, err = render(["--reconfigure", "--", "script.py"])
    assert code == BAD_INPUT and out == "" and "a program after -- has none" in err
