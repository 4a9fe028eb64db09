"""The launcher's side of operating a job (jobs.launcher.Operation) end to end with real torch-free
ranks: record at start, heartbeats and per-rank logs from the ranks, a hang noticed and dumped, the
ranks ended, the launch recorded as hung with exit code 1; and the outcome mapping for every code."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, torchrun_argv
from torchlaunch.exit_codes import FAILURE
from torchlaunch.jobs import cli, launcher, record, watchdog

RANK = """\
import os
from torchlaunch.jobs import launcher, progress

launcher.prepare_rank()
progress.heartbeat(3, total=10)
r, w = os.pipe()


def wait_for_peer():
    print("ready", flush=True)
    os.read(r, 1)


wait_for_peer()
"""


def test_a_hung_node_is_dumped_ended_and_recorded(tmp_path: Path) -> None:
    op = launcher.Operation(
        tmp_path,
        scheduler="local",
        command=["python", "-m", "launch.local"],
        launch_id="H1",
        local_ranks=2,
        hang_timeout=1.0,
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), **op.rank_env()}
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    ranks = []
    try:
        for rank in range(2):
            child_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            ranks.append(
                subprocess.Popen([sys.executable, str(script)], env=child_env, stdout=subprocess.PIPE, text=True)
            )
        assert all(r.stdout is not None and r.stdout.readline() == "ready\n" for r in ranks)

        op.start(lambda verdict, folder, beats: watchdog.kill_ranks(beats))
        codes = [r.wait(timeout=120) for r in ranks]
    finally:
        for r in ranks:
            if r.poll() is None:
                r.kill()
                r.wait(timeout=30)
    assert codes == [-9, -9]  # SIGKILL: a rank stuck in a collective ignores SIGTERM
    assert op.finish(codes[0]) == FAILURE
    recs, _ = record.read_all(tmp_path)
    assert recs[0].outcome == "hung" and "stalled ranks" in (recs[0].reason or "")
    out = io.StringIO()
    assert cli.main(["status", str(tmp_path), "--json", "--no-scheduler"], out=out) == 0
    assert json.loads(out.getvalue())["state"] == "hung"
    (hang,) = (tmp_path / "hangs").iterdir()
    assert "in wait_for_peer" in (hang / "rank-0.txt").read_text()
    assert "in wait_for_peer" in (hang / "rank-1.txt").read_text()
    out = io.StringIO()
    assert cli.main(["logs", str(tmp_path)], out=out) == 0
    assert sorted(out.getvalue().splitlines()) == ["[rank 0] ready", "[rank 1] ready"]


@pytest.mark.slow
def test_a_hang_under_real_torchrun(tmp_path: Path) -> None:
    """The launcher -> torchrun -> ranks chain: the watchdog finds torchrun's workers through their
    heartbeats, dumps them and kills them; torchrun restarts the group once (--max-restarts 1), which
    hangs again and is killed again; torchrun gives up, the launch is recorded hung, exit 1."""
    op = launcher.Operation(tmp_path, scheduler="local", command=["test"], launch_id="T1", hang_timeout=2.0)
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**os.environ, "PYTHONPATH": str(REPO), **op.rank_env(), "OMP_NUM_THREADS": "1"}
    argv = torchrun_argv(2, "--max-restarts", "1", str(script))
    child = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        op.start(lambda verdict, folder, beats: watchdog.kill_ranks(beats))
        child.wait(timeout=240)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
    code = op.finish(child.returncode)
    assert code == FAILURE, child.stderr.read() if child.stderr else ""
    recs, _ = record.read_all(tmp_path)
    assert recs[0].outcome == "hung"
    hangs = sorted((tmp_path / "hangs").iterdir())
    assert len(hangs) == 2  # the first group and the restarted one
    pids = set()
    for hang in hangs:
        for rank in (0, 1):
            text = (hang / f"rank-{rank}.txt").read_text()
            assert "in wait_for_peer" in text
            pids.add(text.split()[3])
    assert len(pids) == 4  # each dump is of the group then running
    out = io.StringIO()
    assert cli.main(["logs", str(tmp_path)], out=out) == 0
    assert sorted(out.getvalue().splitlines()) == ["[rank 0] ready"] * 2 + ["[rank 1] ready"] * 2
