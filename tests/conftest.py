"""Shared test helpers: run the real launcher as a subprocess, and the shared CIFAR-10 copy unpacked once.

Other test files reuse these:
    rc, out, err = run_launcher(["--gpus", "2", "--config", "configs/smoke.yaml", f"run_dir={tmp_path}"])
    def test_x(cifar_shared): ...   # Path of the unpacked train/ folder (class folders)
    def test_y(run_library): ...    # finished run dirs built once per session (tests/library.py)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from tests import workdir
from tests.library import RunLibrary

REPO = Path(__file__).resolve().parents[1]
SHARED_TARBALL_NAME = "cifar10-train.tar.gz"
DEFAULT_TIMEOUT_S = 180.0
_STAGE: list[Path] = []
"""The session's stage (tests/workdir.py) once made: the unit floor's working directory."""


def stage() -> Path:
    """The folder unit tests run in: the checkout's files without the user's runs/ (tests/workdir.py)."""
    return _STAGE[0] if _STAGE else REPO


@pytest.fixture(scope="session")
def session_stage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not _STAGE:
        _STAGE.append(workdir.build(REPO, tmp_path_factory.mktemp("stage")))
    return _STAGE[0]


@pytest.fixture(autouse=True)
def checkout_runs_untouched() -> Iterator[None]:
    """Every test fails if it made or removed a run dir in the checkout's runs/, which is the user's
    (the quick start leaves runs/smoke there): tests/workdir.py."""
    before = workdir.runs_listing(REPO)
    yield
    problem = workdir.guard(before, workdir.runs_listing(REPO))
    if problem is not None:
        pytest.fail(problem)


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The test's environment with this checkout first on sys.path (never an installed copy)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


def spawn(
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    cwd: Path = REPO,
    stdout: int | None = subprocess.PIPE,
    stderr: int | None = subprocess.PIPE,
) -> subprocess.Popen[str]:
    """Start argv in a session of its own, this checkout first on sys.path, text pipes: a test can
    signal its process group as a terminal or scheduler would, and kill all of it when it fails."""
    return subprocess.Popen(
        list(argv), cwd=cwd, env=child_env(env), stdout=stdout, stderr=stderr, text=True, start_new_session=True
    )


def run_cmd(
    argv: Sequence[str],
    timeout: float = DEFAULT_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
    cwd: Path = REPO,
) -> tuple[int, str, str]:
    """Run argv to completion in its own process group; (returncode, stdout, stderr).

    On timeout the whole group (launcher, torchrun and its workers) is killed, so a hung test never
    leaves processes behind, and the test fails with what the command printed so far."""
    proc = spawn(argv, env=env, cwd=cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(
            f"{' '.join(argv)} did not finish within {timeout:.0f} s\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
        )
    return proc.returncode, out, err


def run_proc(
    argv: Sequence[str], timeout: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """run_cmd's result as a CompletedProcess, for a test that reads .returncode, .stdout and .stderr."""
    code, out, err = run_cmd(argv, timeout=timeout, env=env)
    return subprocess.CompletedProcess(list(argv), code, out, err)


def launcher_argv(module: str, *args: str, python: str = sys.executable) -> list[str]:
    """`python -m MODULE ARGS`: the one spelling of a launcher's command line in the tests, whether it
    runs to completion (run_cmd, run_launcher) or in the background (Popen, to be signalled). MODULE is
    the launcher's module (torchlaunch.agent|slurm|k8s|torchrun), or the command a user types
    (launch.local, launch.slurm, `launch` for status|logs|cancel|list) where a test checks that spelling."""
    return [python, "-m", module, *args]


def torchrun_argv(nproc: int, *args: str) -> list[str]:
    """Plain torchrun on this machine, as a user runs it without the launcher:
    `python -m torch.distributed.run --standalone --nproc-per-node N ARGS`."""
    return launcher_argv("torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args)


def free_port() -> int:
    """A loopback port nobody listens on now (the kernel's pick), for a test's own service."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_port_pair() -> int:
    """A free loopback port whose next one is free too: a membership service's and its presence's."""
    from torchlaunch.agent.live import free_port_pair as pair

    return pair()


@contextlib.contextmanager
def lighthouse_serving(log: Path, bound_s: float = 60.0) -> Iterator[str]:
    """`python -m launch.lighthouse` on a free loopback port (1 s heartbeat timeout) for one test; its
    address once it says it serves. Its output goes to `log`, a file: torchft's service logs a quorum
    status every tick, which would fill an unread pipe and stall it, and its first line may come
    before ours."""
    port = free_port_pair()
    argv = launcher_argv("launch.lighthouse", "--bind", f"127.0.0.1:{port}", "--heartbeat-timeout-ms", "1000")
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=child_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + bound_s
        while "lighthouse: serving" not in log.read_text() and proc.poll() is None:
            assert time.monotonic() < deadline, f"the lighthouse did not serve within {bound_s:.0f} s"
            time.sleep(0.05)
        assert proc.poll() is None, log.read_text()[-3000:]
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def run_launcher(
    args: Sequence[str], timeout: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None
) -> tuple[int, str, str]:
    """`python -m launch.local ARGS` from the repository root: (returncode, stdout, stderr)."""
    return run_cmd(launcher_argv("torchlaunch.agent", *args), timeout=timeout, env=env)


def run_module(
    module: str, args: Sequence[str], timeout: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None
) -> tuple[int, str, str]:
    """`python -m MODULE ARGS` from the repository root, e.g. run_module("torchlaunch.worker.evaluate", [...])."""
    return run_cmd([sys.executable, "-m", module, *args], timeout=timeout, env=env)


SCANNERS_BIN = Path(os.environ.get("TOOLS_BIN", REPO / ".cache" / "tools-venv" / "bin"))


def scanner(name: str) -> str:
    """The path of one of docker/tools.sh's scanners (hadolint, kubernetes-validate, checkov): in its
    venv beside this checkout, TOOLS_BIN, or on PATH. Missing, the test skips saying how to install it,
    unless TORCHLAUNCH_REQUIRE_SCANNERS is set (CI sets it after installing them): then it fails, so a
    broken install can never pass as a row of skips."""
    found = SCANNERS_BIN / name if (SCANNERS_BIN / name).exists() else shutil.which(name)
    if found:
        return str(found)
    message = f"{name} not installed: run docker/tools.sh (or set TOOLS_BIN to its bin folder)"
    if os.environ.get("TORCHLAUNCH_REQUIRE_SCANNERS"):
        pytest.fail(message)
    pytest.skip(message)


def error_lines(stderr: str) -> list[str]:
    """stderr without blank lines and without torch's harmless start-up warnings."""
    return [ln for ln in stderr.splitlines() if ln.strip() and "UserWarning" not in ln]


def shared_tarball() -> Path:
    """../shared/data/cifar10-train.tar.gz next to the repository (CI and this machine), or
    TORCHLAUNCH_SHARED_DATA (the tarball itself or the folder holding it)."""
    override = os.environ.get("TORCHLAUNCH_SHARED_DATA")
    if override:
        p = Path(override).expanduser()
        return p / SHARED_TARBALL_NAME if p.is_dir() else p
    return REPO.parent / "shared" / "data" / SHARED_TARBALL_NAME


@pytest.fixture(scope="session")
def decode_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One decoded-image cache for the whole session (tests never write to ~/.cache)."""
    return tmp_path_factory.mktemp("decode-cache")


@pytest.fixture(scope="session")
def cifar_shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared CIFAR-10 training images unpacked once per session; the path of its train/ folder."""
    tarball = shared_tarball()
    if not tarball.is_file():
        pytest.skip(f"shared CIFAR-10 copy not found at {tarball} (set TORCHLAUNCH_SHARED_DATA to it)")
    target = tmp_path_factory.mktemp("cifar10-shared")
    with tarfile.open(tarball) as tar:
        tar.extractall(target, filter="data")  # "data": no absolute paths, links or devices
    train = target / "train"
    assert train.is_dir(), f"{tarball} has no train/ folder"
    return train


@pytest.fixture(scope="session")
def run_library(tmp_path_factory: pytest.TempPathFactory) -> RunLibrary:
    """The session's finished run dirs (tests/library.py): each launch starts on its first ask, once."""
    return RunLibrary(tmp_path_factory)
