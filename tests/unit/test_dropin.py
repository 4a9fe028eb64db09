"""test_dropin: the tests on the unit floor (in-process only: no process started, no network).

The rest of them, and the helpers both halves share, are in tests/integration/test_dropin_torchrun.py.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from tests.integration.test_dropin_torchrun import (
    call,
    script,  # noqa: F401 (fixtures, used by name)
)
from torchlaunch.agent import outcome
from torchlaunch.exit_codes import BAD_INPUT, FAILURE, OK, PREEMPTED


def same_command(script: str, spelling: list[str], reference: list[str]) -> str:
    """The dry-run command of `spelling`, accepted and the same as `reference`'s."""
    code, out, err = call(["--dry-run", "--device", "cpu", *spelling, "--", script])
    assert code == OK, err
    assert out == call(["--dry-run", "--device", "cpu", *reference, "--", script])[1]
    return out


@pytest.mark.parametrize(
    "alias",
    [
        ["--nproc-per-node", "2"],
        ["--nproc_per_node", "2"],
        ["--nproc_per_node=2"],
        ["--num_processes", "2"],
        ["--gpus", "2", "--standalone"],
        ["--gpus", "2", "--max_restarts", "0"],
    ],
)
def test_torchrun_spellings_mean_ours(alias: list[str], script: str) -> None:
    assert "--nproc-per-node 2" in same_command(script, alias, ["--gpus", "2"])


def test_multi_node_spellings_mean_ours(script: str) -> None:
    ours = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "h0", "--master-port", "29511"]
    theirs = ["--nnodes=2", "--node_rank", "1", "--master_addr", "h0", "--master_port=29511"]
    out = same_command(script, ours, theirs)
    assert "--rdzv-endpoint h0:29511" in out and "--node-rank 1" in out


def test_elastic_spellings_mean_ours(script: str) -> None:
    """torchrun's elastic --nnodes MIN:MAX means the same here (launch.elastic): no --node-rank, no is_host."""
    ours = ["--nnodes", "1:2", "--master-addr", "h0", "--master-port", "29511", "--max-restarts", "3"]
    theirs = ["--nnodes=1:2", "--master_addr", "h0", "--master_port=29511", "--max_restarts", "3"]
    out = same_command(script, ours, theirs)
    assert "--nnodes 1:2 " in out and "--rdzv-endpoint h0:29511" in out
    assert "--node-rank" not in out and "is_host" not in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--nnodes", "1:2"], "--nnodes 1:2 needs --master-addr HOST"),
        (["--nnodes=1:2", "--master_addr", "h"], "--nnodes 1:2 with --max-restarts 0"),
        (["--standalone", "--nnodes", "2", "--master-addr", "h"], "--standalone runs one node"),
        (["--tee", "3"], "RUN_DIR/logs/rank-N.log"),
        (["--redirects", "3"], "python -m launch logs RUN_DIR"),
        (["--log-dir", "/nonexistent/torchlaunch-logs"], "choose the folder with --run-dir"),
        (["--local-ranks-filter", "0"], "use --console-ranks RANKS"),
        (["--rdzv-endpoint", "h:1"], "--master-addr HOST"),
    ],
)
def test_torchrun_options_without_an_equivalent_are_one_line(argv: list[str], needle: str, script: str) -> None:
    code, out, err = call(["--dry-run", *argv, "--", script])
    assert code == BAD_INPUT and out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err, err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--nproc-per-node", "auto"], "--nproc-per-node auto: pass the worker count as a number (--gpus N)"),
        (["--nproc_per_node=gpu"], "--nproc_per_node=gpu: pass the worker count as a number"),
        (["--no-python"], "every rank runs a Python program"),
        (["--multi_gpu"], "--gpus N"),
        (["--mixed_precision", "bf16"], "Accelerator(mixed_precision=...)"),
        (["--rank", "1"], "unrecognized arguments: --rank"),  # never an abbreviation of --rank-prefix
        (["--dry", "--rank-prefix"], "unrecognized arguments: --dry"),
    ],
)
def test_torchrun_and_accelerate_habits_are_refused_in_one_line(argv: list[str], needle: str, script: str) -> None:
    code, out, err = call(["--dry-run", *argv, "--", script])
    assert code == BAD_INPUT and out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err, err


def test_accelerate_spellings_mean_ours(script: str) -> None:
    ours = ["--device", "cpu", "--nnodes", "2", "--node-rank", "1", "--master-addr", "h0", "--master-port", "29511"]
    theirs = ["--cpu", "--num_machines", "2", "--machine_rank", "1", "--main_process_ip", "h0"]
    a = call(["--dry-run", *ours, "--", script])
    b = call(["--dry-run", *theirs, "--main_process_port=29511", "--", script])
    assert a[0] == OK and a[1] == b[1], b[2]


@pytest.mark.parametrize(
    ("argv", "fixed"),
    [
        (["--nproc_per_node=2", "SCRIPT"], "--nproc_per_node=2 -- SCRIPT"),
        (["--gpus", "2", "SCRIPT", "--epochs", "1", "--device", "cpu"], "--gpus 2 -- SCRIPT --epochs 1 --device cpu"),
        (["--gpus", "2", "-m", "my_pkg.train", "--lr", "1"], "--gpus 2 -- -m my_pkg.train --lr 1"),
    ],
)
def test_a_program_without_the_split_is_one_line_showing_it(argv: list[str], fixed: str, script: str) -> None:
    """torchrun's habit: the program's own options must never be read as the launcher's (--device)."""
    code, out, err = call([script if a == "SCRIPT" else a for a in argv])
    assert code == BAD_INPUT and out == "", err
    assert len(err.strip().splitlines()) == 1, err
    assert f"python -m launch.local {fixed.replace('SCRIPT', script)}" in err and "after --" in err


def test_program_arguments_are_never_translated(tmp_path: Path, script: str) -> None:
    code, out, err = call(["--dry-run", "--device", "cpu", "--", script, "--nproc_per_node", "3", "--tee", "1"])
    assert code == OK, err
    assert out.rstrip().endswith(f"{script} --nproc_per_node 3 --tee 1")


def test_signal_watch_sees_a_signal_the_program_handles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torchlaunch import runner

    # The program runs in this process as the runner runs it: sys.path[0], argv and __main__ become the
    # program's, so keep pytest's own for the tests that follow (spawned children unpickle from them).
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setitem(sys.modules, "__main__", sys.modules["__main__"])

    prog = tmp_path / "h.py"
    prog.write_text(
        "import os, signal\nsignal.signal(signal.SIGHUP, lambda s, f: None)\nos.kill(os.getpid(), signal.SIGHUP)\n"
    )
    watch = runner.SignalWatch()
    try:
        code, _ = runner.outcome(runner.parse([str(prog)]))
        seen = watch.seen()
    finally:
        watch.close()
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
    assert code == OK and seen == [signal.SIGHUP]
    assert runner.after_signal(runner.parse([str(prog)]), code, "finished", seen)[0] == PREEMPTED


def test_combine_after_a_signal() -> None:
    from torchlaunch.status import Record

    undeclared = [Record(0, OK, "finished", False), Record(1, OK, "finished", False)]
    declared = [Record(0, OK, "finished", True), Record(1, OK, "finished", True)]
    assert outcome.combine_exit_codes(1, [0, 0], 2, signalled=True, records=undeclared) == PREEMPTED
    assert outcome.combine_exit_codes(0, [0, 0], 2, signalled=True, records=declared) == OK
    assert outcome.combine_exit_codes(0, [0, 0], 2, signalled=False, records=undeclared) == OK
    assert outcome.combine_exit_codes(1, [0], 2, signalled=True, records=undeclared[:1]) == FAILURE
    assert outcome.combine_exit_codes(-15, [], 2, signalled=True) == PREEMPTED  # stopped during start-up
    assert outcome.combine_exit_codes(1, [], 2, signalled=False) == FAILURE
