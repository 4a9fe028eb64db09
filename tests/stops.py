"""One helper to start a launcher and stop it the way the world does (tests only).

    with Launch(argv) as launch:
        launch.wait_for_step(run_dir, 2)
        launch.deliver("every", signal.SIGTERM)
        code, out, err = launch.finish()

Deliveries: "pid" (the launcher's PID alone: a kubelet, `docker stop`), "group" (the launcher's process
group: Ctrl-C in a terminal, `kill -TERM -PGID`), "every" (every process of the launch, loader workers
and log tees included: Slurm's preemption and `scancel --signal`). The launch runs in a session of its
own, so "group" reaches exactly what a terminal's foreground group would hold, and a test that fails
never leaves a process behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest

from tests.conftest import spawn
from torchlaunch import pdeath

DELIVERIES = ("pid", "group", "every")


class Launch:
    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        timeout_s: float = 300,
        stdout: int | None = subprocess.PIPE,
        stderr: int | None = subprocess.PIPE,
    ) -> None:
        """stdout=None leaves a chatty program's output to the test's own (an unread pipe would fill)."""
        self.deadline = time.monotonic() + timeout_s
        self.proc = spawn(argv, env=env, stdout=stdout, stderr=stderr)

    def __enter__(self) -> Launch:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.kill()
            self.proc.communicate()

    def kill(self) -> None:
        """SIGKILL to the launcher and every process below it (a test that fails leaves none behind)."""
        for pid in [self.proc.pid, *pdeath.descendants(self.proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def read_until(self, prefix: str) -> list[str]:
        """stdout's lines up to the first that starts with `prefix`; the launch is killed at the deadline,
        so one that never prints it ends the read and fails the test with what it printed."""
        assert self.proc.stdout is not None
        watchdog = threading.Timer(max(0.0, self.deadline - time.monotonic()), self.kill)
        watchdog.start()
        seen: list[str] = []
        try:
            for line in self.proc.stdout:
                seen.append(line)
                if line.startswith(prefix):
                    return seen
        finally:
            watchdog.cancel()
        pytest.fail(f"no line {prefix!r} from the launch ({self.proc.poll()}):\n{''.join(seen)[-3000:]}")

    def wait_for_step(self, run_dir: Path, step: int) -> int:
        """Until rank 0's heartbeat says `step` or later (polled: no event exists for it); the step seen."""
        beat = Path(run_dir) / "progress" / "rank-0.json"
        while time.monotonic() < self.deadline:
            if self.proc.poll() is not None:
                out, err = self.proc.communicate()
                pytest.fail(f"the launch ended ({self.proc.returncode}) before step {step}:\n{err[-3000:]}")
            try:
                seen = int(json.loads(beat.read_text()).get("step") or 0)
            except (OSError, ValueError):
                seen = 0
            if seen >= step:
                return seen
            time.sleep(0.05)
        pytest.fail(f"no step {step} within the deadline")

    def wait_until(self, ready: Callable[[], bool], what: str) -> None:
        """Until `ready()` (polled under the deadline: a rank's mark on disk has no event to wait on)."""
        while not ready():
            if self.proc.poll() is not None:
                out, err = self.proc.communicate()
                pytest.fail(f"the launch ended ({self.proc.returncode}) before {what}:\n{(err or '')[-3000:]}")
            if time.monotonic() > self.deadline:
                pytest.fail(f"no {what} within the deadline")
            time.sleep(0.05)

    def wait_for_log(self, run_dir: Path, words: str) -> None:
        """Until rank 0's log holds `words` (polled under the deadline)."""
        log = Path(run_dir) / "logs" / "rank-0.log"
        while time.monotonic() < self.deadline and self.proc.poll() is None:
            if log.exists() and words in log.read_text(errors="replace"):
                return
            time.sleep(0.05)
        pytest.fail(f"{words!r} never reached {log}")

    def deliver(self, how: str, sig: int) -> list[int]:
        """Send `sig` as `how` says; the pids it reached."""
        if how == "pid":
            targets = [self.proc.pid]
            os.kill(self.proc.pid, sig)
        elif how == "group":
            targets = [self.proc.pid]
            os.killpg(self.proc.pid, sig)
        elif how == "every":
            targets = [self.proc.pid, *pdeath.descendants(self.proc.pid)]
            for pid in targets:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        else:
            raise ValueError(how)
        return targets

    def finish(self) -> tuple[int, str, str]:
        try:
            out, err = self.proc.communicate(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.__exit__()
            pytest.fail("the launch did not end within the deadline")
        return self.proc.returncode, out, err
