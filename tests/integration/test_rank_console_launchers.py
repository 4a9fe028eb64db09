"""test_rank_console_launchers: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_rank_console.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_rank_console import launcher, rank_lines, run_local
from torchlaunch.jobs import ranklog


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


def test_k8s_hang_timeout_refuses_what_is_not_seconds(tmp_path: Path) -> None:
    out = launcher("k8s", "--hang-timeout", "nan", "--", "x.py", cwd=tmp_path)
    assert out.returncode == 2 and "--hang-timeout" in out.stderr, out


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
