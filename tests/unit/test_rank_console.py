"""The ranks' console: `--rank-prefix` and `--console-ranks` on every launcher, torchrun's log flags
answered in one line naming ours, and the per-rank files keeping every line whatever the console shows.

The end-to-end cases run a plain script (no torch) under the real launch.local on 2 ranks and with
`--gpus 1`; Slurm and Kubernetes get the same options into their tasks and pods (asserted on the
artefacts here, on the real cluster in tests/engines/test_slurm_ops_cluster.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, launcher_argv
from torchlaunch.backends.k8s import launch as k8s
from torchlaunch.backends.k8s import manifest as k8s_manifest
from torchlaunch.backends.slurm import launch as slurm
from torchlaunch.jobs import ranklog
from torchlaunch.launch import cli

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


def test_k8s_pods_inner_launcher_gets_the_console_and_hang_options() -> None:
    args = k8s.parse_args(
        ["--cpu-only", "--hang-timeout", "45", "--rank-prefix", "--console-ranks", "0,2-3", "--", "train.py"]
    )
    spec, opts, _ = k8s.plan(args)
    script = k8s_manifest.pod_script(spec, opts)
    assert "--hang-timeout 45 --rank-prefix --console-ranks 0,2,3 -- train.py" in script
    default = k8s_manifest.pod_script(*k8s.plan(k8s.parse_args(["--cpu-only", "--", "train.py"]))[:2])
    assert "--hang-timeout" not in default and "--rank-prefix" not in default and "--console-ranks" not in default


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
    from torchlaunch.agent import options as agent_options

    args = agent_options.parse_args(["--rank-prefix", "--console-ranks", "none", "--hang-timeout", "0", "--", "x.py"])
    assert isinstance(args, argparse.Namespace) and cli.console_of(args).ranks == frozenset()


# ---------------------------------------------------------------------------------------------
# Real ranks under launch.local
