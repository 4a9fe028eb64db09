"""One owner per concept, checked on the source: a run-dir name, an exit code and an environment
variable are each spelled in one module, so the next storage layout or scheduler changes one place.

These read the code (ast), not the behaviour: what they prove is that no second spelling exists.
"""

from __future__ import annotations

import ast
import functools
import re
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from tests.conftest import REPO
from torchlaunch import backends, contract, exit_codes, roads, rundir

PACKAGE = REPO / "torchlaunch"


@functools.cache
def parsed(path: Path) -> ast.Module:
    """A source file's tree, parsed once per process: a dozen checks here walk the same ~160 modules
    (each walk of them all cost ~0.3 s, then ~3 s of the unit floor). The checks only read the trees."""
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def modules(*skip: str) -> Iterator[tuple[Path, ast.AST]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel not in skip:
            yield path, parsed(path)


def where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(REPO)}:{getattr(node, 'lineno', '?')}"


def is_os_path_join(call: ast.Call) -> bool:
    return ast.unparse(call.func) in ("os.path.join", "path.join", "join")


RUN_DIR_NAMES = {
    value
    for name, value in vars(rundir).items()
    if name.isupper() and isinstance(value, str) and name not in ("PathLike",)
}


def test_run_dir_names_are_joined_onto_a_path_only_in_rundir() -> None:
    """`run_dir / "checkpoints"` or os.path.join(run_dir, "status") anywhere else is a second owner."""
    assert {"checkpoints", "status", "logs", "progress", "job", "metrics.jsonl", "model.pt", "config.yaml"} <= (
        RUN_DIR_NAMES
    )
    found = []
    for path, tree in modules("rundir.py"):
        for node in ast.walk(tree):
            parts: list[ast.expr] = []
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
                parts = [node.right]
            elif isinstance(node, ast.Call) and is_os_path_join(node):
                parts = list(node.args[1:])
            for part in parts:
                if isinstance(part, ast.Constant) and part.value in RUN_DIR_NAMES:
                    found.append(f"{where(path, node)}: {ast.unparse(node)}")
    assert not found, "run-dir paths spelled outside torchlaunch/rundir.py:\n" + "\n".join(found)


def test_one_atomic_writer() -> None:
    """os.replace / os.rename of a file, and fsync of a folder, live in rundir.py; a checkpoint's folder
    renames (store), a decoded cache's folder (folder_cache) and tar shards (shards/) keep their own
    protocols, named here."""
    allowed = {
        "rundir.py",
        "core/checkpoint/commit.py",  # folder renames of the commit protocol (the marker goes through rundir)
        "core/checkpoint/discovery.py",  # a crashed replace put back, a folder moved to quarantine
        "core/checkpoint/single_file.py",  # a format's payload is fsynced in the temp folder before the commit
        "worker/folder_cache.py",  # a whole cache folder published by one rename, first writer wins
        "data/shards/fsio.py",
        "data/shards/writer.py",
        "runlock.py",  # the lock record is created exclusively (O_EXCL), never replaced over another's
        "tools/preflight.py",  # measures how long an fsync takes on the run dir's storage
    }
    found = []
    for path, tree in modules(*allowed):
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("os.replace", "os.rename", "os.fsync"):
                found.append(f"{where(path, node)}: {ast.unparse(node)}")
    assert not found, "hand-written atomic writers (use torchlaunch.rundir):\n" + "\n".join(found)


EXIT_CODES = {exit_codes.FAILURE, exit_codes.BAD_INPUT, exit_codes.CANCELLED, exit_codes.PREEMPTED}
EXITS = ("sys.exit", "os._exit", "SystemExit", "leave")


def test_exit_codes_are_named_not_spelled() -> None:
    """`return 75`, `sys.exit(2)`, `code == 75`: every project code is a name from exit_codes."""
    found = []
    for path, tree in modules("exit_codes.py"):
        for node in ast.walk(tree):
            values: list[ast.expr] = []
            if isinstance(node, ast.Call) and ast.unparse(node.func) in EXITS:
                values = list(node.args)
            elif isinstance(node, ast.Return) and node.value is not None:
                values = [node.value]
            elif isinstance(node, ast.Compare) and re.search(r"\b(code|rc|returncode|exit_code)\b", ast.unparse(node)):
                values = list(node.comparators)
            for value in values:
                if isinstance(value, ast.Constant) and type(value.value) is int and value.value in EXIT_CODES:
                    if isinstance(node, ast.Return) and not _returns_exit_code(path, node, tree):
                        continue
                    found.append(f"{where(path, node)}: {ast.unparse(node)}")
    assert not found, "exit codes spelled as numbers (use torchlaunch.exit_codes):\n" + "\n".join(found)


def _returns_exit_code(path: Path, node: ast.Return, tree: ast.AST) -> bool:
    """A `return 1` counts only in a function whose name says it returns an exit code."""
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) and node in ast.walk(fn):
            return fn.name in ("main", "run", "follow", "exit_status") or "code" in fn.name
    return False


def test_the_sbatch_script_uses_the_tables_codes() -> None:
    text = (REPO / "slurm" / "train.sbatch").read_text()
    for name in ("BAD_INPUT", "CANCELLED", "PREEMPTED"):
        assert re.search(rf"^{name}={getattr(exit_codes, name)}$", text, re.MULTILINE), name


def test_the_readme_table_lists_every_code() -> None:
    for page in (REPO / "README.md", REPO / "docs" / "failures.md"):  # the README's table, and the site's copy
        table = page.read_text().split("## Exit codes", 1)[1].split("\n## ", 1)[0]
        for code in exit_codes.TABLE:
            assert re.search(rf"^\| {code} \|", table, re.MULTILINE), (page.name, code)


CONTRACT_NAMES = {v for k, v in vars(contract).items() if k.isupper() and isinstance(v, str)}


def test_the_environment_is_read_only_through_contract() -> None:
    """os.environ.get(X) / os.environ[X] / os.getenv(X) of a contract name (spelled, or through a
    constant such as ATTEMPT_ENV) only in contract.py."""
    assert {"RANK", "TORCHLAUNCH_ATTEMPT_ID", "TORCHELASTIC_RESTART_COUNT", "SLURM_JOB_ID"} <= CONTRACT_NAMES
    found = []
    for path, tree in modules("contract.py"):
        for node in ast.walk(tree):
            key: ast.expr | None = None
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("os.environ.get", "os.getenv") and node.args:
                key = node.args[0]
            elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
                if isinstance(node.ctx, ast.Load):
                    key = node.slice
            if key is None:
                continue
            named = isinstance(key, ast.Attribute | ast.Name) and (
                ast.unparse(key).isupper() or "_ENV" in ast.unparse(key)
            )
            if (isinstance(key, ast.Constant) and key.value in CONTRACT_NAMES) or named:
                found.append(f"{where(path, node)}: {ast.unparse(node)}")
    assert not found, "contract variables read outside torchlaunch/contract.py:\n" + "\n".join(found)


def test_every_project_variable_is_defined_in_contract() -> None:
    """A TORCHLAUNCH_* literal outside contract.py is a second definition (docstrings aside)."""
    found = []
    for path, tree in modules("contract.py"):
        docstrings = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef)
            and n.body
            and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                docstrings.add(id(node.value))  # attribute docstrings
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and re.fullmatch(r"(TORCHLAUNCH|TORCHELASTIC)_[A-Z_]+", node.value)
                and id(node) not in docstrings
            ):
                found.append(f"{where(path, node)}: {node.value}")
    assert not found, "environment names defined outside torchlaunch/contract.py:\n" + "\n".join(found)


def test_no_branch_on_a_schedulers_name_outside_the_backends() -> None:
    """`scheduler == "slurm"` (or != / in) anywhere else means a backend's knowledge leaked out of
    torchlaunch/backends/: it belongs behind the Backend interface."""
    found = []
    for path, tree in modules():
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("backends/"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and "scheduler" in ast.unparse(node.left).lower():
                if any(_names_a_scheduler(c) for c in node.comparators):
                    found.append(f"{where(path, node)}: {ast.unparse(node)}")
    assert not found, "branches on a scheduler's name (use torchlaunch.backends):\n" + "\n".join(found)


def _names_a_scheduler(node: ast.expr) -> bool:
    """A string literal, or a tuple/list/set of them (`in ("slurm", "k8s")`)."""
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return bool(node.elts) and all(_names_a_scheduler(e) for e in node.elts)
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def test_machine_shape_options_are_declared_only_through_shape() -> None:
    """`--nodes`, `--gpus-per-node`, `--max-restarts` ... are spelled, described and bounded in
    launch/shape.py; a launcher declares them with shape.add, so a bound or a help text changes once."""
    from torchlaunch.launch import shape

    flags = {option.flag for option in shape.OPTIONS.values()}
    found = []
    for path, tree in modules("launch/shape.py"):
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(".add_argument"):
                names = {a.value for a in node.args if isinstance(a, ast.Constant)}
                if names & flags:
                    found.append(f"{where(path, node)} declares {sorted(names & flags)}")
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "shape.within":
                found.append(f"{where(path, node)} bounds a shape option outside shape.OPTIONS")
    assert not found, "\n".join(found)


def test_every_launcher_checks_the_shape_options_it_declares() -> None:
    """A bound in shape.OPTIONS holds on every launcher that takes the option: the same value is refused
    in the same words by launch.local, launch.slurm and launch.k8s."""
    from torchlaunch.agent import options
    from torchlaunch.backends.k8s import launch as k8s
    from torchlaunch.backends.slurm import launch as slurm_launcher
    from torchlaunch.launch import shape

    refused = {
        "local": lambda argv: options.check_placement(options.parse_args([*argv, "--config", "configs/smoke.yaml"])),
        "slurm": lambda argv: slurm_launcher.parse_args([*argv, "--config", "configs/smoke.yaml"]),
        "k8s": lambda argv: k8s.plan(k8s.parse_args([*argv, "--config", "configs/smoke.yaml"])),
    }
    declared = {
        "local": ("gpus", "nnodes", "master_port", "max_restarts"),
        "slurm": ("nodes", "gpus_per_node", "tasks_per_node", "time", "cpus_per_task", "mem_gb", "master_port"),
        "k8s": ("nodes", "gpus_per_node", "master_port", "max_restarts", "cpus_per_gpu", "mem_gb_per_gpu"),
    }
    for launcher, dests in declared.items():
        for dest in dests:
            option = shape.OPTIONS[dest]
            with pytest.raises(exit_codes.BadInput) as refusal:
                refused[launcher]([option.flag, str(option.high + 1)])
            assert option.flag in str(refusal.value) and str(option.high + 1) in str(refusal.value), (
                launcher,
                str(refusal.value),
            )


def imported_names(path: Path) -> list[str]:
    """Every module an import statement in `path` names (`from a import b` gives a and a.b)."""
    found = []
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
    return found


def test_the_operate_side_imports_neither_torch_nor_a_launcher() -> None:
    """status/logs/cancel/list load the registry and every backend's operate module: light, stdlib."""
    paths = [PACKAGE / "backends" / "__init__.py", PACKAGE / "backends" / "launchers.py"]
    paths += sorted((PACKAGE / "backends").glob("*/operate.py"))
    assert len(paths) >= 5
    for path in paths:
        for name in imported_names(path):
            assert name.split(".")[0] not in ("torch", "numpy", "launch", "train"), f"{path}: {name}"
            assert not name.startswith("torchlaunch.launch") and not name.endswith(".launch"), f"{path}: {name}"


def test_no_backend_imports_another_backends_modules() -> None:
    """What two backends share lives in torchlaunch/backends/ itself or lower (launch/, base/, jobs/):
    a backend is one folder that can be read, changed or removed alone."""
    found = []
    folders = [d for d in sorted((PACKAGE / "backends").iterdir()) if (d / "__init__.py").is_file()]
    assert {d.name for d in folders} >= {"local", "slurm", "k8s"}
    for folder in folders:
        others = tuple(f"torchlaunch.backends.{d.name}" for d in folders if d != folder)
        for path in sorted(folder.rglob("*.py")):
            for name in imported_names(path):
                if name.startswith(others) and name.split(".")[2] != folder.name:
                    found.append(f"{path.relative_to(PACKAGE)}: {name}")
    assert not found, "a backend importing another's modules:\n" + "\n".join(found)


def test_one_module_runs_slurms_tools() -> None:
    """squeue, sacct, scontrol, sinfo, sbatch and scancel run through backends/slurm/cluster.py alone (one
    way to call, bounded, one error rule): no other module of the Slurm backend starts a process itself."""
    found = []
    for path in sorted((PACKAGE / "backends" / "slurm").glob("*.py")):
        if path.name == "cluster.py":
            continue
        found += [
            f"{path.relative_to(PACKAGE)}: {n}"
            for n in imported_names(path)
            if n.split(".")[0] == "subprocess" or n.startswith("torchlaunch.base.procs")
        ]
    assert "subprocess" in imported_names(PACKAGE / "backends" / "slurm" / "cluster.py")
    assert not found, "Slurm's tools run outside backends/slurm/cluster.py:\n" + "\n".join(found)


def test_nothing_outside_a_backend_names_its_private_parts() -> None:
    """Outside torchlaunch/backends/, a backend is reached through the registry or its launch module
    (the commands users type), never through a `_private` name of its modules."""
    found = []
    for path, tree in modules():
        if path.relative_to(PACKAGE).as_posix().startswith("backends/"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torchlaunch.backends."):
                found += [f"{where(path, node)}: {a.name}" for a in node.names if a.name.startswith("_")]
    assert not found, "\n".join(found)


# ---- adding a scheduler is one module: an example backend, "a subprocess on this host" ----------------


class HostProcesses:
    """A job is a process on this host, its job id the pid; its exit status is left in the run dir by
    whoever waits for it. Everything `status`, `logs`, `cancel` and `list` need, and nothing else."""

    name = "host-process"
    by_pid = False

    def __init__(self) -> None:
        self.children: dict[str, subprocess.Popen[bytes]] = {}

    def detect(self, env: Mapping[str, str]) -> backends.Detected | None:
        job = env.get("EXAMPLE_HOST_PROCESS_JOB")
        return backends.Detected(self.name, job) if job else None

    def state(self, job_id: str, extra: Mapping[str, str]) -> backends.JobState | None:
        child = self.children.get(job_id)
        if child is None:
            return None
        code = child.poll()
        if code is None:
            return backends.JobState("running", "running")
        word = "finished" if code == 0 else "cancelled" if code == -signal.SIGTERM else "failed"
        return backends.JobState(word, f"exit {code}")

    def alive(self, job_id: str) -> bool:
        child = self.children.get(job_id)
        return child is not None and child.poll() is None

    def cancel(self, run_dir: Path, nodes: Sequence[backends.LaunchRecord]) -> list[backends.Step]:
        return [backends.Step("run", ("kill", "-TERM", str(nodes[0].job_id)))]

    def logs(self, run_dir: Path, job_id: str | None) -> list[Path]:
        return [run_dir / "host-process.out"]

    def claim(self, job_id: str, run_dir: Path) -> None:
        pass


@pytest.fixture
def host_processes() -> Iterator[HostProcesses]:
    backend = HostProcesses()
    backends.register(backend)
    try:
        yield backend
    finally:
        backends.unregister(backend.name)
        for child in backend.children.values():
            if child.poll() is None:
                child.kill()
            child.wait(timeout=30)


def test_the_rank_side_imports_nothing_from_the_launchers_or_the_tools() -> None:
    """The worker, the core and the rank runner sit below launch/ and tools/: an import upward would
    load launcher code into every rank (tools.preflight is started by name, as a program, not imported)."""
    found = []
    for path, tree in modules():
        rel = path.relative_to(PACKAGE).as_posix()
        if not (rel.startswith(("worker/", "core/")) or rel in ("runner.py", "api.py", "backends/slurm/task.py")):
            continue
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            for name in names:
                if name.startswith(("torchlaunch.launch", "torchlaunch.tools")):
                    found.append(f"{where(path, node)}: {name}")
    assert not found, "rank-side code importing launcher or tool modules:\n" + "\n".join(found)


LAUNCHER_MODULES = {
    "torchlaunch.agent",
    "torchlaunch.backends.slurm.launch",
    "torchlaunch.backends.k8s.launch",
    "torchlaunch.launch.torchrun",
    "launch.local",
    "launch.slurm",
    "launch.k8s",
    "launch",
}


def test_the_tests_spell_a_launchers_command_line_only_through_launcher_argv() -> None:
    """`[sys.executable, "-m", "torchlaunch.agent", ...]` in a test is a second spelling of what
    tests/conftest.launcher_argv builds (the one launcher helper, for runs to completion and Popen alike)."""
    found = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        if path.name == "conftest.py" and path.parent == REPO / "tests":
            continue
        for node in ast.walk(parsed(path)):
            if not isinstance(node, ast.List) or len(node.elts) < 3:
                continue
            head = [ast.unparse(e) for e in node.elts[:3]]
            module = node.elts[2].value if isinstance(node.elts[2], ast.Constant) else None
            if head[0] == "sys.executable" and head[1] == "'-m'" and module in LAUNCHER_MODULES:
                found.append(f"{where(path, node)}: {ast.unparse(node)[:80]}")
    assert not found, "\n".join(found)


# ---- a third-party backend is a package: found through the entry-point group, nothing registered --------

THIRD_PARTY_BACKEND = '''
from pathlib import Path

from torchlaunch import backends


class PidOnThisHost:
    """A job is a process on this host; its job id is the pid. Stateless: every answer comes from /proc."""

    name = "pid-on-this-host"
    by_pid = False
    launcher = "pid_backend"

    def detect(self, env):
        job = env.get("PID_BACKEND_JOB")
        return backends.Detected(self.name, job) if job else None

    def state(self, job_id, extra):
        if Path(f"/proc/{job_id}").exists():
            return backends.JobState("running", f"pid {job_id} runs")
        return backends.JobState("finished", f"pid {job_id} ended")

    def alive(self, job_id):
        return Path(f"/proc/{job_id}").exists()

    def cancel(self, run_dir, nodes):
        return [backends.Step("run", ("kill", "-TERM", str(nodes[0].job_id)))]

    def logs(self, run_dir, job_id):
        return []

    def claim(self, job_id, run_dir):
        pass

    def render(self, spec, options):
        return "sleep 600"

    def submit(self, argv):
        return 0


BACKEND = PidOnThisHost()
'''


def install_package(site: Path, entry_points: str) -> None:
    """A package installed the way pip leaves one: its module and a dist-info with entry_points.txt."""
    site.mkdir(parents=True, exist_ok=True)
    (site / "pid_backend.py").write_text(THIRD_PARTY_BACKEND)
    info = site / "pid_backend-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pid-backend\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(entry_points)


def test_backends_load_from_their_one_registry_line() -> None:
    """Each built-in backend is one BUILTIN line naming its operate module; its launcher is its own package's."""
    for target in backends.BUILTIN:
        backend = backends.load(target)
        assert backends.get(backend.name) is backend
        package = target.split(":")[0].rsplit(".", 1)[0]
        assert backend.launcher == f"{package}.launch", (backend.name, backend.launcher)


def test_the_floors_below_the_worker_never_import_it() -> None:
    """The built-in worker is one program on the top floor: the launch side, the backends, the operator
    commands, the data and shard formats, core/ and base/ run without it (a user's script never loads
    it), so none of them imports it. Only tools/ (doctor, pre-flight) runs worker parts; the data
    registry names built-in readers as `module:function` strings, loaded in a rank."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] in ("worker", "tools"):
            continue
        found += [
            f"{path.relative_to(PACKAGE)}: {n}" for n in imported_names(path) if n.startswith("torchlaunch.worker")
        ]
    assert not found, "imports of the worker from a lower floor:\n" + "\n".join(found)


def test_the_trainer_never_asks_which_training_group_it_has() -> None:
    """The trainer talks to one training-group interface (worker/groups/) and never branches on the road
    (../shared/ARCHITECTURE.md, "Live recovery: one road"): it reads no `live` attribute or recovery.live,
    and imports neither the live group nor live's seat, so a road's steps live behind the seam.
    The trainer is class Trainer's modules: trainer.py and the parts it is built of (its bases)."""
    from torchlaunch.worker.trainer import Trainer

    paths = sorted({PACKAGE.parent / f"{c.__module__.replace('.', '/')}.py" for c in Trainer.__mro__[:-1]})
    assert PACKAGE / "worker" / "loop.py" in paths, paths  # the bases are read
    found = []
    behind = ("torchlaunch.worker.groups.live", "torchlaunch.live.group", "torchlaunch.live.replan")
    for path in paths:
        found += [
            f"{where(path, node)}: {ast.unparse(node)}"
            for node in ast.walk(parsed(path))
            if isinstance(node, ast.Attribute) and node.attr == "live"
        ]
        found += [f"{path.relative_to(REPO)}: import {n}" for n in imported_names(path) if n.startswith(behind)]
    assert not found, "the trainer branches on its group's kind:\n" + "\n".join(found)
    loop = (PACKAGE / "worker" / "loop.py").read_text(encoding="utf-8")
    assert "self.group.lost(e)" in loop  # the seam is what it calls instead


def test_the_ground_floor_imports_only_itself_and_the_exit_codes() -> None:
    """base/ (guarded reads, /proc, storage errors, bounded parsing) is imported from every floor, so it
    imports nothing of the project above it: a change upstairs can never make the ground floor circular."""
    allowed = ("torchlaunch.base", "torchlaunch.exit_codes", "torchlaunch.suggest")
    found = []
    for path in sorted((PACKAGE / "base").glob("*.py")):
        found += [
            f"{path.relative_to(PACKAGE)}: {n}"
            for n in imported_names(path)
            if n.startswith("torchlaunch") and n != "torchlaunch" and not n.startswith(allowed)
        ]
    assert not found, "base/ importing from above:\n" + "\n".join(found)


def import_graph(everywhere: bool) -> dict[str, set[str]]:
    """module -> the project modules it imports: `everywhere=False`, only what its body runs when it
    is loaded (not inside functions, not under TYPE_CHECKING: the edges a circle of half-initialised
    modules could run through); `everywhere=True`, every import at load time, inside functions and under
    TYPE_CHECKING alike (a deferred import still makes the importer depend on the imported floor; hiding
    one inside a function moves the circle to run time, it does not remove it)."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("torchlaunch", *path.relative_to(PACKAGE).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def owner(name: str) -> str:
        while name and name not in names:
            name = name.rpartition(".")[0]
        return name

    edges: dict[str, set[str]] = {}
    for name, path in names.items():
        tree = parsed(path)
        found = set()
        for node in ast.walk(tree) if everywhere else tree.body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torchlaunch"):
                found |= {owner(f"{node.module}.{a.name}") for a in node.names} | {owner(node.module)}
            elif isinstance(node, ast.Import):
                found |= {owner(a.name) for a in node.names if a.name.startswith("torchlaunch")}
        edges[name] = {t for t in found if t and t != name and not name.startswith(f"{t}.")}
    return edges


def load_time_imports() -> dict[str, set[str]]:
    return import_graph(everywhere=False)


def test_no_circle_among_the_imports_a_module_runs_when_loaded() -> None:
    edges = load_time_imports()
    assert "torchlaunch.base.files" in edges["torchlaunch.runlock"]  # the graph is read, not empty
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> list[str] | None:
        state[name] = 1
        for nxt in sorted(edges[name]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt] if nxt in path else [*path, nxt]
            if nxt not in state and (circle := visit(nxt, [*path, nxt])):
                return circle
        state[name] = 2
        return None

    for start in sorted(edges):
        if start not in state and (circle := visit(start, [start])):
            pytest.fail("an import circle: " + " -> ".join(circle))


def all_imports() -> dict[str, set[str]]:
    return import_graph(everywhere=True)


def test_no_circle_among_all_imports_of_modules() -> None:
    """No two modules reach each other through any import, inside a function or under TYPE_CHECKING
    too: an import deferred to break a circle at load time still ties the two into one (issue 56:
    backends/slurm/operate.py <-> successor.py, each importing the other inside a function)."""
    edges = all_imports()
    assert "torchlaunch.backends.slurm.cluster" in edges["torchlaunch.backends.slurm.successor"]
    circles = [sorted(c) for c in strongly_connected(edges) if len(c) > 1]
    assert not circles, "module-level import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def folder_circles(edges: dict[str, set[str]], folders: set[str] | None = None) -> list[list[str]]:
    """Circles between folders, at every depth of the package: inside each folder the parts are its
    sub-folders (all their modules together) and its own modules, and a strongly connected set of parts
    that holds a sub-folder is a circle. Modules of one folder may lean on each other (sideways); a
    folder is a floor, and floors only import downward."""
    if folders is None:
        folders = {name for name in edges if (PACKAGE.parent / name.replace(".", "/") / "__init__.py").is_file()}
    found = []
    for folder in sorted(folders):

        def part(module: str, folder: str = folder) -> str | None:
            """The part of `folder` that `module` lies in (None: outside it; the folder's own __init__ too)."""
            if not module.startswith(f"{folder}."):
                return None
            return f"{folder}.{module[len(folder) + 1 :].split('.')[0]}"

        graph: dict[str, set[str]] = {}
        for source, targets in edges.items():
            a = part(source)
            if a is None:
                continue
            graph.setdefault(a, set())
            graph[a] |= {b for t in targets if (b := part(t)) is not None and b != a}
        for circle in strongly_connected(graph):
            if len(circle) > 1 and any(p in folders for p in circle):
                found.append(sorted(circle))
    return found


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components, iterative (no recursion limit on a big package)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                found.append(component)
    return found


def test_folders_are_floors_no_circle_among_all_imports() -> None:
    """Folders are floors (../shared/ARCHITECTURE.md, "Layout (target)"): over every import of the
    package, at load time or inside a function, no two folders (or a folder and a top-level module)
    reach each other. What two floors share lives on the lower one."""
    edges = all_imports()
    assert "torchlaunch.core.checkpoint" in edges["torchlaunch.jobs.gather"]  # function-level imports are read
    circles = folder_circles(edges)
    assert not circles, "folder-level import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_folder_circle_check_finds_a_circle_through_a_function_level_import() -> None:
    """The check itself: a deferred import upward closes a circle it reports."""
    edges = {
        "torchlaunch.low.a": {"torchlaunch.high.b"},  # e.g. an import inside a function of low/a.py
        "torchlaunch.high.b": {"torchlaunch.low.a"},
        "torchlaunch.low": set(),
        "torchlaunch.high": set(),
    }
    found = folder_circles(edges, folders={"torchlaunch", "torchlaunch.low", "torchlaunch.high"})
    assert found == [["torchlaunch.high", "torchlaunch.low"]]


def loads_torch(module: str) -> bool:
    """Whether the module's own body imports torch when it is loaded (not inside a function)."""
    parts = module.split(".")[1:]
    path = PACKAGE.joinpath(*parts)
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    for node in parsed(path).body:
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        if any(n == "torch" or n.startswith("torch.") for n in names):
            return True
    return False


def loaded_with(*roots: str) -> set[str]:
    """Every project module that loading `roots` loads: their load-time imports and each module's
    packages, followed to the end."""
    edges = load_time_imports()
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
        todo += [*edges.get(name, ()), *parents]
    return seen


def test_the_live_agent_starts_without_importing_torch() -> None:
    """The live agent (one per node) starts before its ranks, and a replacement node's whole start-up
    is on the clock (issue #37: restart -> takes part <= 5 s): importing torch there cost ~2 s. Every
    module it loads, and each of their packages, is torch-free at load time."""
    from torchlaunch.live.road import ROAD

    parts = [f"torchlaunch.live.{p}" for p in ROAD.PARTS]
    roots = [target.split(":")[0] for target in roads.BUILTIN]  # the road it asks for, loaded by name
    seen = loaded_with("torchlaunch.agent.live", ROAD.service, *roots, *parts)  # and the parts it reads of it
    assert {"torchlaunch.live.pulse", "torchlaunch.live.placement", "torchlaunch.roads"} <= seen
    assert not [m for m in sorted(seen) if loads_torch(m)], "the live agent loads torch through these"


LAUNCH_SIDE = ("agent/", "backends/", "launch/")


def test_the_launchers_reach_live_recovery_through_the_road_registry() -> None:
    """Issue #54: the node agent, the backends and the launcher front ask torchlaunch.roads for a road and
    read what they need of it; none imports torchlaunch.live itself (the live road's modules are its own)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).as_posix().startswith(LAUNCH_SIDE):
            found += [
                f"{path.relative_to(PACKAGE)}: {n}" for n in imported_names(path) if n.startswith("torchlaunch.live")
            ]
    assert not found, "launch-side imports of torchlaunch.live (ask torchlaunch.roads):\n" + "\n".join(found)
    assert "torchlaunch.roads" in imported_names(PACKAGE / "agent" / "live.py")  # the walk reads the agent


def test_every_road_is_one_registry_line_and_names_its_group() -> None:
    """Each built-in road is one BUILTIN line; a launch chooses by recovery.live (auto, true, false) and
    whether its road can be live; the worker's group is the road's own former, a function of its module."""
    assert roads.names() == ("restart", "live")
    for target in roads.BUILTIN:
        road = roads.load(target)
        assert roads.get(road.name) is road
        module, _, function = road.group.partition(":")
        assert function == "form" and module.startswith("torchlaunch.worker.groups."), road.group
        assert function in {
            n.name
            for n in parsed(PACKAGE.parent / f"{module.replace('.', '/')}.py").body
            if isinstance(n, ast.FunctionDef)
        }
    live, restart = roads.get("live"), roads.RESTART
    assert [roads.choose(v, True) for v in ("auto", True, False)] == [live, live, restart]
    assert [roads.choose(v, False) for v in ("auto", True, False)] == [restart] * 3
    assert live.regroups and not restart.regroups and live.service and not restart.service
    assert live.insisted(True) and not live.insisted("auto") and live.declined(False) and not live.declined("auto")
    with pytest.raises(ValueError, match="built in"):
        roads.register(type(restart)())


def test_a_worker_that_does_not_train_live_loads_neither_the_live_group_nor_the_shard_reader() -> None:
    """Every rank's start-up is on the clock (issue #36: start-up no worse than before the redesign):
    live mode is off by default and most runs read no shards, so the worker's modules load the live
    group (live/group.py, its stores, grads and handover, and the pulse and peers they bring)
    and the shard reader only when a run uses them, not when they are imported."""
    seen = loaded_with("torchlaunch.worker.run", "torchlaunch.worker.trainer", "torchlaunch.worker.data")
    assert "torchlaunch.live.minimum" in seen  # the walk reaches the package
    heavy = (
        *(f"torchlaunch.live.{m}" for m in ("group", "stores", "grads", "handover", "fence")),
        "torchlaunch.data.shards.reader",
    )
    assert not [m for m in heavy if m in seen], sorted(m for m in seen if m.startswith(heavy))


# ---- a third-party backend cannot take the launcher down (issue 52) ---------------------------------------

PLUGINS = {
    "detect_raises": "class B:\n    name = 'detect-raises'\n    by_pid = False\n    launcher = 'x'\n"
    "    def detect(self, env):\n        raise RuntimeError('boom in detect')\n"
    "    def state(self, job_id, extra):\n        import plugin_gate\n        plugin_gate.GATE.wait(60)\n"
    "    def cancel(self, run_dir, nodes):\n        raise SystemExit(3)\nBACKEND = B()\n",
    "import_hangs": "import plugin_gate\nplugin_gate.GATE.wait(60)\nBACKEND = None\n",
    "import_exits": "raise SystemExit(3)\n",
    "impostor": "class B:\n    name = 'slurm'\n    by_pid = False\n    launcher = 'x'\nBACKEND = B()\n",
}


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[types.SimpleNamespace]:
    """A fresh registry whose entry-point group lists PLUGINS (modules on sys.path); their hangs wait on
    a gate released at teardown, so no thread outlives the test by more than that."""
    from torchlaunch.jobs import schedulers

    for name, text in PLUGINS.items():
        (tmp_path / f"{name}.py").write_text(text)
    gate = types.SimpleNamespace(GATE=threading.Event())
    monkeypatch.setitem(sys.modules, "plugin_gate", gate)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(schedulers, "_BACKENDS", {})
    monkeypatch.setattr(schedulers, "_BUILTIN_NAMES", set(), raising=False)
    monkeypatch.setattr(schedulers, "_LOADED", False)
    monkeypatch.setattr(schedulers, "PLUGIN_TIMEOUT_S", 0.5, raising=False)
    monkeypatch.setattr(schedulers, "entry_point_targets", lambda: [f"{name}:BACKEND" for name in PLUGINS])
    try:
        yield gate
    finally:
        gate.GATE.set()
        for name in PLUGINS:
            sys.modules.pop(name, None)


def test_a_plugin_backend_that_fails_hangs_or_impersonates_is_skipped_in_one_line(
    installed: types.SimpleNamespace, capsys: pytest.CaptureFixture[str]
) -> None:
    """An import that hangs or raises SystemExit, and a package naming its backend `slurm`: each one line
    on stderr naming the entry point, the built-in backends untouched; a detect() that raises is one line
    and no answer, not a crashed launch.local; a hook that hangs returns within the bound (`status`)."""
    from torchlaunch.backends.slurm import operate as slurm_operate
    from torchlaunch.jobs import schedulers

    start = time.monotonic()
    assert set(schedulers.names()) == {"local", "slurm", "k8s", "detect-raises"}
    assert schedulers.get("slurm") is slurm_operate.BACKEND
    assert schedulers.detect({}) == schedulers.Detected("local")
    assert schedulers.get("detect-raises").state("7", {}) is None  # type: ignore[union-attr]
    assert time.monotonic() - start < 5  # two 0.5 s bounds, not a hang
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 5, err
    assert "backend 'import_hangs:BACKEND' not loaded: its import did not return within 0.5 s" in err[0]
    assert "backend 'import_exits:BACKEND' not loaded: its import raised SystemExit: 3" in err[1]
    assert "backend 'impostor:BACKEND' not loaded: 'slurm' is a built-in backend's name" in err[2]
    assert "backend 'detect-raises' (detect_raises:BACKEND) detect() raised RuntimeError: boom in detect" in err[3]
    assert "state() did not return within 0.5 s: ignored" in err[4]
    with pytest.raises(exit_codes.BadInput, match=r"backend 'detect-raises' .* cancel\(\) raised SystemExit: 3$"):
        schedulers.get("detect-raises").cancel(Path("/nonexistent"), [])  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="built in"):
        schedulers.register(types.SimpleNamespace(name="local"))  # type: ignore[arg-type]
