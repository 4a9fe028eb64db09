"""The ranks' console: `--rank-prefix` and `--console-ranks` on every launcher, torchrun's log flags
answered in one line naming ours, and the per-rank files keeping every line whatever the console shows.

The end-to-end cases run a plain script (no torch) under the real launch.local on 2 ranks and with
`--gpus 1`; Slurm and Kubernetes get the same options into their tasks and pods (asserted on the
artefacts here, on the real cluster in tests/test_slurm_ops_cluster.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import launcher_argv
from torchlaunch.backends.k8s import launch as k8s
from torchlaunch.backends.slurm import launch as slurm
from torchlaunch.jobs import ranklog
from torchlaunch.launch import cli

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "custom_loop.py"
"""A real Python program for the parsers that check the program after --."""

SCRIPT = """\
import os, sys
rank = os.environ["RANK"]
print(f"out of {rank}", flush=True)
print(f"err of {rank}", file=sys.stderr, flush=True)
sys.stdout.write(f"bar {rank} 1/2\\rbar {rank} 2/2\\n")
sys.stdout.flush()
"""


# ---------------------------------------------------------------------------------------------
# Pure parts


@pytest.mark.parametrize(
    ("text", "ranks"),
    [("0", {0}), ("0,3", {0, 3}), ("1-3,7", {1, 2, 3, 7}), (" none ", set()), ("NONE", set()), ("2-2", {2})],
)
def test_console_ranks_parse(text: str, ranks: set[int]) -> None:
    assert ranklog.parse_ranks(text) == frozenset(ranks)


@pytest.mark.parametrize("text", ["", "a", "-1", "3-1", "1,,2", "0-99999999", "1;rm -rf /", "0x1", "1.5", "١"])
def test_console_ranks_refuse_what_is_not_a_rank_list(text: str) -> None:
    with pytest.raises(ValueError, match="e.g."):
        ranklog.parse_ranks(text)


def test_console_env_round_trips_and_defaults_to_everything() -> None:
    for console in (
        ranklog.Console(),
        ranklog.Console(prefix=True),
        ranklog.Console(ranks=frozenset()),
        ranklog.Console(prefix=True, ranks=frozenset({0, 5})),
    ):
        assert ranklog.Console.from_env(console.env()) == console
    assert ranklog.Console().env() == {}
    forged = {ranklog.CONSOLE_RANKS_ENV: "$(reboot)", ranklog.PREFIX_ENV: "yes"}
    assert ranklog.Console.from_env(forged) == ranklog.Console()  # not the launcher's writing: show all


def test_console_writer_prefixes_every_line_start_while_streaming() -> None:
    read, write = os.pipe()
    try:
        writer = ranklog.ConsoleWriter(write, b"[rank 3] ")
        for chunk in (b"first li", b"ne\nsecond\n", b"\n", b"50%\r", b"100%\rdone\nhalf"):
            writer.write(chunk)
        os.close(write)
        write = -1
        data = os.read(read, 65536)
    finally:
        os.close(read)
        if write >= 0:
            os.close(write)
    assert (
        data
        == b"[rank 3] first line\n[rank 3] second\n[rank 3] \n[rank 3] 50%\r[rank 3] 100%\r[rank 3] done\n[rank 3] half"
    )


def test_console_writer_without_a_label_copies_bytes_unchanged() -> None:
    read, write = os.pipe()
    writer = ranklog.ConsoleWriter(write, b"")
    writer.write(b"\xff\xfe raw\r\nbytes")
    os.close(write)
    assert os.read(read, 100) == b"\xff\xfe raw\r\nbytes"
    os.close(read)


# ---------------------------------------------------------------------------------------------
# The launchers' front


def run_local(tmp_path: Path, *options: str, gpus: int = 2) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "hello.py"
    script.write_text(SCRIPT)
    out = subprocess.run(
        launcher_argv(
            "launch.local",
            "--gpus",
            str(gpus),
            "--device",
            "cpu",
            "--run-dir",
            str(tmp_path / "run"),
            *options,
            "--",
            str(script),
        ),
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        timeout=180,
    )
    # Decoded by hand: text mode's universal newlines would turn the progress bar's \r into \n.
    return subprocess.CompletedProcess(out.args, out.returncode, out.stdout.decode(), out.stderr.decode())


def launcher(launcher: str, *argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`python -m launch.LAUNCHER ARGV` as a user types it, from `cwd`."""
    return subprocess.run(
        [sys.executable, "-m", f"launch.{launcher}", *argv],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )


def rank_lines(out: str, marker: str) -> list[str]:
    return [line for line in out.splitlines() if marker in line]


@pytest.mark.parametrize(
    ("flag", "names"),
    [
        ("--tee=3", "--rank-prefix"),
        ("--redirects=3", "--console-ranks none"),
        ("--log-dir=/tmp/x", "--run-dir"),
        ("--log_dir=/tmp/x", "--run-dir"),
        ("--local-ranks-filter=0", "--console-ranks"),
        ("--local_ranks_filter=0", "--console-ranks"),
    ],
)
@pytest.mark.parametrize("launcher_name", ["local", "slurm", "k8s"])
def test_torchruns_log_flags_are_answered_with_ours(launcher_name: str, flag: str, names: str, tmp_path: Path) -> None:
    out = launcher(launcher_name, flag, "--dry-run", "--", "x.py", cwd=tmp_path)
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("launch error: " + flag.partition("=")[0]), out.stderr
    assert names in lines[0] and "rank-N.log" in lines[0] or names == "--console-ranks", lines


@pytest.mark.parametrize("bad", ["a", "3-1", "1;reboot", ""])
@pytest.mark.parametrize("launcher_name", ["local", "slurm", "k8s"])
def test_a_bad_console_ranks_is_one_line_and_exit_2(launcher_name: str, bad: str, tmp_path: Path) -> None:
    out = launcher(launcher_name, "--console-ranks", bad, "--dry-run", "--", "x.py", cwd=tmp_path)
    assert out.returncode == 2, out
    assert "--console-ranks" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_k8s_pods_inner_launcher_gets_the_console_and_hang_options() -> None:
    args = k8s.parse_args(
        ["--cpu-only", "--hang-timeout", "45", "--rank-prefix", "--console-ranks", "0,2-3", "--", "train.py"]
    )
    spec, opts, _ = k8s.plan(args)
    script = k8s.pod_script(spec, opts)
    assert "--hang-timeout 45 --rank-prefix --console-ranks 0,2,3 -- train.py" in script
    default = k8s.pod_script(*k8s.plan(k8s.parse_args(["--cpu-only", "--", "train.py"]))[:2])
    assert "--hang-timeout" not in default and "--rank-prefix" not in default and "--console-ranks" not in default


def test_k8s_hang_timeout_refuses_what_is_not_seconds(tmp_path: Path) -> None:
    out = launcher("k8s", "--hang-timeout", "nan", "--", "x.py", cwd=tmp_path)
    assert out.returncode == 2 and "--hang-timeout" in out.stderr, out


def test_slurm_tasks_get_the_console_choice(tmp_path: Path) -> None:
    script = tmp_path / "t.py"
    script.write_text("print(1)\n")
    spec, options, _ = slurm.parse_args(
        ["--run-dir", str(tmp_path / "run"), "--rank-prefix", "--console-ranks", "1", "--", str(script)]
    )
    assert options.console == ranklog.Console(prefix=True, ranks=frozenset({1}))
    assert ranklog.Console.from_env(options.console.env()) == options.console


def test_every_launcher_takes_the_same_operation_options() -> None:
    import argparse

    for parse in (
        lambda a: slurm.parse_args([*a, "--run-dir", "/tmp/r", "--", str(EXAMPLE)])[2],
        k8s.parse_args,
    ):
        args = parse(["--rank-prefix", "--console-ranks", "none", "--hang-timeout", "0"])
        assert cli.console_of(args) == ranklog.Console(prefix=True, ranks=frozenset())
        assert args.hang_timeout == 0
    from torchlaunch.backends.local import launch as local

    args = local.parse_args(["--rank-prefix", "--console-ranks", "none", "--hang-timeout", "0", "--", "x.py"])
    assert isinstance(args, argparse.Namespace) and cli.console_of(args).ranks == frozenset()


# ---------------------------------------------------------------------------------------------
# Real ranks under launch.local


def test_rank_prefix_names_every_console_line_and_the_files_stay_plain(tmp_path: Path) -> None:
    out = run_local(tmp_path, "--rank-prefix")
    assert out.returncode == 0, out.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] out of {rank}" in out.stdout.splitlines(), out.stdout
        assert f"[rank {rank}] err of {rank}" in out.stderr.splitlines(), out.stderr
        assert f"[rank {rank}] bar {rank} 1/2\r[rank {rank}] bar {rank} 2/2" in out.stdout, out.stdout
        text = ranklog.log_path(tmp_path / "run", rank).read_text()
        assert f" out of {rank}\n" in text and "[rank" not in text
    for line in rank_lines(out.stdout + out.stderr, " of "):
        assert line.startswith(("[rank 0] ", "[rank 1] ")), line


def test_console_ranks_shows_only_the_chosen_ranks_and_logs_keep_all(tmp_path: Path) -> None:
    out = run_local(tmp_path, "--console-ranks", "1")
    assert out.returncode == 0, out.stderr
    assert "out of 1" in out.stdout and "err of 1" in out.stderr
    assert "out of 0" not in out.stdout and "err of 0" not in out.stderr, out
    assert "out of 0" in ranklog.log_path(tmp_path / "run", 0).read_text()
    assert "out of 1" in ranklog.log_path(tmp_path / "run", 1).read_text()


def test_console_ranks_none_keeps_the_launchers_own_lines(tmp_path: Path) -> None:
    out = run_local(tmp_path, "--console-ranks", "none")
    assert out.returncode == 0, out.stderr
    assert " of " not in out.stdout + out.stderr, out
    assert sorted(ranklog.ranks_present(tmp_path / "run")) == [0, 1]


def test_one_worker_behaves_the_same(tmp_path: Path) -> None:
    out = run_local(tmp_path, "--rank-prefix", gpus=1)
    assert out.returncode == 0, out.stderr
    assert "[rank 0] out of 0" in out.stdout.splitlines() and "[rank 0] err of 0" in out.stderr.splitlines()
    assert "out of 0" in ranklog.log_path(tmp_path / "run", 0).read_text()
