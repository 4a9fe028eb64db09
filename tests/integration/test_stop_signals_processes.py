"""The stop signals, spelled once, and the rule that only the rank acts on them (torchlaunch.stop_signals),
plus the two places a stop enters from outside without a rank: launch.local's relay and the Slurm batch
shell. Unit level: real forks, real signals, real bash; no launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from torchlaunch import pdeath, stop_signals
from torchlaunch.backends.slurm import render as slurm_render


def blocked(status: str) -> set[int]:
    mask = int(next(ln for ln in status.splitlines() if ln.startswith("SigBlk:")).split()[1], 16)
    return {sig for sig in range(1, 65) if mask >> (sig - 1) & 1}


def test_a_forked_child_blocks_the_stop_signals_and_dies_with_its_parent() -> None:
    """Run in a fresh interpreter: the fork hook is process-wide and must not leak into pytest."""
    code = textwrap.dedent(
        """
        import os, signal, sys
        from torchlaunch import pdeath, stop_signals
        stop_signals.shield_forked_children()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            status = open("/proc/self/status").read()
            os.write(w, (status + "\\nPDEATH " + str(pdeath.get_pdeathsig())).encode())
            os._exit(0)
        os.close(w)
        print(os.read(r, 65536).decode())
        os.waitpid(pid, 0)
        print("PARENT " + open("/proc/self/status").read())
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    child, parent = out.split("PARENT ", 1)
    assert set(stop_signals.STOP_SIGNALS) <= blocked(child)
    assert not set(stop_signals.STOP_SIGNALS) & blocked(parent)  # the rank itself hears every stop
    if pdeath.supported():
        assert f"PDEATH {int(signal.SIGKILL)}" in child


@pytest.mark.timeout(120)
def test_a_loader_worker_outlives_a_sigterm_from_outside() -> None:
    """torch's worker installs a C SIGTERM handler that re-raises the default action for any sender but
    its parent: without the shield, a `kill -TERM` of every process of the job (Slurm) kills it and the
    rank fails with "DataLoader worker (pid N) is killed by signal: Terminated". Fork and spawn."""
    code = textwrap.dedent(
        """
        import os, signal, sys, time
        import torch
        from torchlaunch import api, stop_signals
        stop_signals.shield_forked_children()

        class Slow(torch.utils.data.Dataset):
            def __len__(self): return 40
            def __getitem__(self, i):
                time.sleep(0.01)
                return i

        if __name__ == "__main__":
            signal.signal(signal.SIGTERM, lambda *a: None)  # the rank's own handler
            for context in ("fork", "spawn"):
                init = api.loader_worker_init if context == "spawn" else None
                loader = torch.utils.data.DataLoader(
                    Slow(), batch_size=4, num_workers=2, multiprocessing_context=context, worker_init_fn=init
                )
                it = iter(loader)
                next(it), next(it)  # one batch from each worker: both ran their init (spawn: the shield)
                for w in it._workers:
                    os.kill(w.pid, signal.SIGTERM)  # from outside: not the worker's parent
                print(context, sum(len(b) for b in it) + 8)
        """
    )
    script = Path(os.environ.get("TMPDIR", "/tmp")) / f"shield_{os.getpid()}.py"
    script.write_text(code)
    try:
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=110)
    finally:
        script.unlink()
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["fork", "40", "spawn", "40"], done.stdout


def default_stop_signals() -> None:
    for sig in stop_signals.STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("sent", "seen"), [("USR2", "USR2"), ("USR1", "USR1"), ("TERM", "USR2"), ("INT", "USR2"), ("HUP", "USR2")]
)
def test_the_batch_shell_passes_a_stop_on_to_srun_and_waits(sent: str, seen: str, tmp_path: Path) -> None:
    """The generated sbatch script's srun wrapper under real bash, with a stand-in srun that records the
    signal it gets and exits 75 (the tasks' checkpoint and requeue). Without the wrapper bash dies of the
    signal (exit 128+N) and Slurm ends the job; SIGTERM passed on as SIGTERM makes srun end the step."""
    fake = tmp_path / "bin" / "srun"
    fake.parent.mkdir()
    ready = tmp_path / "ready"
    fake.write_text(
        "#!/bin/bash\n"
        + "".join(f"trap 'echo {s} > {tmp_path}/got; exit 75' {s}\n" for s in ("TERM", "USR1", "USR2"))
        # One line, no `$(...)`: bash 5.2 parses a whole line before running it, and a trap that runs while
        # it parses a command substitution fails ("unexpected EOF while looking for matching `)'") and the
        # stand-in sleeps on (2 of 300 runs here with `$(seq 1200)` on the line after the touch).
        + f"touch {ready}; for _ in {{1..1200}}; do sleep 0.05; done\n"  # bounded: never left behind
    )
    fake.chmod(0o755)
    script = tmp_path / "job.sh"
    script.write_text("\n".join(slurm_render.BATCH_SHELL_STOP) + '\nsrun --fake step\necho "srun said $?"\n')
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    # slurmstepd starts the batch shell with every signal at its default; a test runner started in the
    # background of a non-interactive shell (nohup, `cmd &`) would hand bash SIGINT ignored, and bash
    # cannot trap a signal ignored on entry.
    shell = subprocess.Popen(
        ["bash", str(script)], env=env, stdout=subprocess.PIPE, text=True, preexec_fn=default_stop_signals
    )
    try:
        while not ready.exists():
            assert shell.poll() is None
            os.sched_yield()
        os.kill(shell.pid, getattr(signal, f"SIG{sent}"))
        out, _ = shell.communicate(timeout=30)
    finally:
        if shell.poll() is None:
            pdeath.kill_tree(shell.pid)
    assert shell.returncode == 0, out
    assert "srun said 75" in out
    assert (tmp_path / "got").read_text().strip() == seen
