"""Run one rank's program with the project's exit-code contract: the only runner (torch-free).

    python -m torchlaunch.runner -m torchlaunch.worker --config RUN_DIR/config.yaml  # the default program
    python -m torchlaunch.runner SCRIPT.py [args]        # as `python SCRIPT.py args` would
    python -m torchlaunch.runner -m package.module [args] # as `python -m package.module args` would

Every launcher (local, Slurm, Kubernetes) starts every rank through this runner, and the built-in
worker is just the default program, so signals, exit codes, restarts and the status record are the
same code for `-m torchlaunch.worker` and a user's script. A user's program runs in this process with
runpy as `__main__`: sys.argv and sys.path[0] are what the plain interpreter would set, and signals go
straight to the program's own handlers. The project's own programs (BUILTINS: the worker and the
pre-flight) are called in-process by their entry function instead, with no extra import, and leave
without interpreter teardown (see exit_process).

However the program ends becomes one exit code, here and nowhere else: SystemExit (or a returned
code) keeps its code, an escaping BadInput is one line and 2, anything else a traceback and 1. The
code and a one-line reason are left for the launcher (torchlaunch/status.py); after a torchrun restart
of a launch that already hit bad input the runner exits 2 at once instead of failing the same way
again. The launcher never imports the program; `check` finds it on disk only.

A run that got a preemption signal (SIGTERM, SIGINT, SIGUSR1/2, SIGHUP) and then ended 0 or with a
bare `SystemExit` is not reported finished unless the program declared it (torchlaunch.status.
declare_finished; the built-in programs' own 0 counts): it exits 75, so the scheduler runs it again
and a framework that resumes from its own checkpoint continues. The runner learns of the signal even
when the program installed its own handler, through `signal.set_wakeup_fd` (SignalWatch). A user's
traceback starts at the user's frame: the runner's and runpy's frames are left out.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import pkgutil
import runpy
import signal
import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from torchlaunch import (
    contract,
    joined,
    startup,  # noqa: F401 - before any heavy import: its clock fallback (no /proc) starts here
    status,
    stop_signals,
)
from torchlaunch.base import storage
from torchlaunch.exit_codes import BAD_INPUT, FAILURE, OK, PREEMPTED, BadInput

USAGE = "pass SCRIPT.py [args] or -m package.module [args] after --"
BUILTIN_WORKER = "torchlaunch.worker"
"""The default program of every launcher: the built-in image-classifier worker."""
PREFLIGHT = "torchlaunch.tools.preflight"
"""What every launcher's --doctor runs in each rank instead of the program."""
BUILTINS = {BUILTIN_WORKER: "torchlaunch.worker.run:main", PREFLIGHT: "torchlaunch.tools.preflight:main"}
"""The project's own programs: module -> entry function taking the argv and returning an exit code."""


PREEMPTION_SIGNALS = stop_signals.STOP_SIGNALS
"""What schedulers and a Ctrl-C send before a stop; what launch.local forwards (stop_signals owns it)."""


class SignalWatch:
    """Which preemption signals reached this process while the program ran, whoever handles them.

    CPython's C-level signal handler writes the signal number to the wakeup fd before any Python
    handler runs, so the program's own handlers (Lightning's, a user's) keep working unchanged. A
    signal the program leaves at SIG_DFL ends the process anyway, and one at SIG_IGN did nothing."""

    def __init__(self) -> None:
        self._fds: tuple[int, int] | None = None
        self._previous = -1
        self._seen: list[int] = []
        try:
            read_fd, write_fd = os.pipe()
        except OSError:
            return
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        try:
            self._previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:  # not the main thread: nothing to watch with
            os.close(read_fd)
            os.close(write_fd)
            return
        self._fds = (read_fd, write_fd)

    def seen(self) -> list[int]:
        """The preemption signals received so far, in order (without repeats)."""
        if self._fds is not None:
            while True:
                try:
                    chunk = os.read(self._fds[0], 512)
                except (BlockingIOError, OSError):
                    break
                if not chunk:
                    break
                for number in chunk:
                    if number in PREEMPTION_SIGNALS and number not in self._seen:
                        self._seen.append(number)
        return list(self._seen)

    def close(self) -> None:
        if self._fds is None:
            return
        self.seen()
        try:
            if signal.set_wakeup_fd(self._previous, warn_on_full_buffer=False) != self._fds[1]:
                signal.set_wakeup_fd(-1)  # the program replaced ours and did not restore it: leave none
        except ValueError:
            pass
        for fd in self._fds:
            os.close(fd)
        self._fds = None


class Stopped(BaseException):
    """Raised in the program's main thread by the runner's own handler: a stop signal reached a program
    that has no handler for it. A BaseException, so a program's `except Exception` does not swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


OWNED_SIGNALS = tuple(s for s in PREEMPTION_SIGNALS if s != signal.SIGINT)
"""What the runner handles where the program does not: SIGINT keeps Python's KeyboardInterrupt."""


def foreign(handler: object) -> bool:
    """A handler the runner replaces: the default action (the process dies, saying nothing) or
    submitit's (it checkpoints the task from wherever the program is, and forked DataLoader workers
    inherit it and race that checkpoint)."""
    return (
        handler == signal.SIG_DFL
        or str(getattr(handler, "__module__", "")).startswith("submitit")
        or isinstance(handler, stop_signals.EarlyStop)
    )


class SignalOwner:
    """The runner's handler for every stop signal the program leaves to the default or to submitit, on
    every launcher: one path, one outcome (exit 75 with what happened said). In this process it raises
    Stopped; in a forked child (a DataLoader worker) it does nothing: the rank decides the stop and ends
    its own children. A program's own handler, installed later, replaces it as before."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.received: int | None = None
        self._previous: dict[int, object] = {}
        for sig in OWNED_SIGNALS:
            try:
                if foreign(signal.getsignal(sig)):
                    self._previous[sig] = signal.signal(sig, self._handle)
                    early = stop_signals.taken_over(self._previous[sig])
                    if early is not None and self.received is None:
                        self.received = early  # a stop during start-up: the program is not started
            except ValueError:  # not the main thread
                return

    def _handle(self, signum: int, frame: object) -> None:
        if os.getpid() != self.pid:
            return  # a forked worker never runs the rank's stop
        if signal.getsignal(signum) != self._handle:
            return  # called by the program's own handler chaining its predecessor (Lightning's): theirs decides
        if self.received is None:
            self.received = signum
            raise Stopped(signum)

    def close(self) -> None:
        for sig, previous in self._previous.items():
            with_ours = signal.getsignal(sig) == self._handle
            if with_ours:
                signal.signal(sig, previous)  # type: ignore[arg-type]
        self._previous.clear()


RESUME_FLAGS = (
    ("timm", "timm's train.py resumes with --resume RUN/last.pth.tar"),
    ("transformers", "a transformers Trainer resumes with trainer.train(resume_from_checkpoint=True)"),
    ("lightning", 'Lightning resumes with trainer.fit(..., ckpt_path="last")'),
    ("pytorch_lightning", 'Lightning resumes with trainer.fit(..., ckpt_path="last")'),
    ("accelerate", "Accelerate resumes with accelerator.load_state(DIR)"),
)
"""Frameworks recognisable from what the program imported, and how each resumes from its checkpoint."""


def resume_hint() -> str:
    """How this program resumes, where it is recognisable from sys.modules; else a general word."""
    for module, hint in RESUME_FLAGS:
        if module in sys.modules:
            return hint
    return "pass the program's own resume option, if it has one"


def stopped_reason(program: Program, signum: int) -> str:
    name = signal.Signals(signum).name
    return (
        f"{program.name} had no {name} handler and was stopped by it (exit 75: the run is requeued, but it "
        f"continues only if the same command resumes from a checkpoint: {resume_hint()})"
    )


@dataclass(frozen=True)
class Program:
    """What to run in every rank: a script path or a module name, and its arguments."""

    script: str | None = None
    module: str | None = None
    args: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.module or self.script or "?"

    @property
    def builtin(self) -> bool:
        """One of the project's own programs (the worker, the pre-flight), not the user's."""
        return self.module in BUILTINS

    def argv(self) -> list[str]:
        """The runner's arguments, which are also what would follow `python`."""
        head = ["-m", self.module] if self.module else [str(self.script)]
        return [*head, *self.args]

    def absolute(self, cwd: str) -> Program:
        """The same program with the script path independent of the working directory (Slurm)."""
        if self.script is None:
            return self
        return Program(script=os.path.normpath(os.path.join(cwd, self.script)), args=self.args)


def parse(argv: Sequence[str]) -> Program:
    """`SCRIPT [args]` or `-m MODULE [args]` (a leading `--` is allowed); BadInput when empty."""
    items = list(argv)
    if items[:1] == ["--"]:
        items = items[1:]
    if not items:
        raise BadInput(f"launch error: no program given ({USAGE})")
    if items[0] == "-m":
        if len(items) < 2 or not items[1] or items[1].startswith("-"):
            raise BadInput(f"launch error: -m needs a module name ({USAGE})")
        return Program(module=items[1], args=tuple(items[2:]))
    if items[0].startswith("-m") and len(items[0]) > 2:  # -mpkg.mod, as python accepts
        return Program(module=items[0][2:], args=tuple(items[1:]))
    if items[0].startswith("-"):
        raise BadInput(f"launch error: program {items[0]!r} looks like an option ({USAGE})")
    return Program(script=items[0], args=tuple(items[1:]))


def refuse_worker_options(program: Program, config: str | None, overrides: Sequence[str], prefix: str = "") -> None:
    """--config and key=value overrides configure the built-in worker; with a user's program they would
    be silently ignored, so every launcher refuses them with the same line."""
    if config is not None:
        raise BadInput(
            f"{prefix}--config applies to the built-in worker, not to {program.name} "
            "(pass your program's own arguments after --, or drop the program to train a recipe)"
        )
    if overrides:
        import shlex  # only here: the rank's start-up imports nothing it does not use

        raise BadInput(
            f"{prefix}config overrides ({overrides[0]}) apply to the built-in worker, not to "
            f"{program.name} (pass your program's own arguments after --: "
            f"-- {shlex.join(program.argv())} ...)"
        )


def module_origin(name: str, search_path: Sequence[str]) -> str | None:
    """Where `name` would be imported from, found on disk without importing anything (not even its
    parent packages, whose __init__ may import torch): None when it is nowhere on `search_path`."""
    parts = name.split(".")
    if not all(part.isidentifier() for part in parts):
        return None
    locations: list[str] = list(search_path)
    origin: str | None = None
    for i, part in enumerate(parts):
        if i == 0 and part in sys.builtin_module_names:
            return "built-in" if len(parts) == 1 else None
        spec = importlib.machinery.PathFinder.find_spec(part, locations)
        if spec is None:
            return None
        origin = spec.origin or (list(spec.submodule_search_locations or [""])[0])
        locations = list(spec.submodule_search_locations or [])
        if i < len(parts) - 1 and not locations:
            return None  # a plain module has no submodules
    return origin


def check(program: Program, cwd: str | None = None, search_path: Sequence[str] | None = None) -> None:
    """BadInput (one line) when the script or module cannot be found: before anything is started."""
    cwd = cwd or os.getcwd()
    if program.script is not None:
        path = Path(cwd, program.script)
        if path.is_dir() and (path / "__main__.py").is_file():
            return
        if not path.is_file():
            raise BadInput(
                f"launch error: script {program.script}: no such file in {cwd} "
                f"(pass an existing SCRIPT.py, or -m package.module)"
            )
        refuse_non_python(program.script, str(path))
        return
    paths = [cwd, *os.environ.get("PYTHONPATH", "").split(os.pathsep), *sys.path[1:]]
    if module_origin(str(program.module), [p for p in paths if p] if search_path is None else search_path) is None:
        raise BadInput(
            f"launch error: module {program.module}: not found from {cwd} or PYTHONPATH "
            f"(run from the folder that holds the package, or add it to PYTHONPATH)"
        )


def non_python(path: str) -> str | None:
    """What the file is when python could not run it (an executable, a shell script): None for source.
    Only what is certain: a binary (ELF, NUL bytes) or a `#!` line naming another interpreter."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return None  # python reports an unreadable file itself
    if head.startswith(b"\x7fELF") or b"\0" in head:
        return "a binary executable"
    first = head.split(b"\n", 1)[0]
    if first.startswith(b"#!") and b"python" not in first:
        return f"a script for {first[2:].decode(errors='replace').strip() or 'another interpreter'}"
    return None


def refuse_non_python(shown: str, path: str) -> None:
    """BadInput for a program python cannot run: the launcher says so once (exit 2) instead of every
    rank failing with a SyntaxError (exit 1, which schedulers retry)."""
    kind = non_python(path)
    if kind is not None:
        raise BadInput(
            f"launch error: {shown} is {kind}, not a Python program (the ranks run SCRIPT.py or "
            "-m package.module; start the executable from a Python script, e.g. with subprocess)"
        )


def execute(program: Program, cwd: str | None = None) -> None:
    """Run the program in this process: a builtin by its entry function, anything else as `__main__`
    with sys.argv and sys.path[0] set as python would."""
    cwd = cwd or os.getcwd()
    if program.builtin:
        sys.argv = [str(program.module), *program.args]
        module_name, _, function = BUILTINS[str(program.module)].partition(":")
        code = getattr(importlib.import_module(module_name), function)(list(program.args))
        if code:
            raise SystemExit(code)
        return
    from torchlaunch import rankpath  # only for a user's program: the project stays off its path

    rankpath.scrub()
    if program.module is not None:
        sys.argv = [program.module, *program.args]  # run_module replaces argv[0] with the file
        _set_path0(cwd)  # `python -m` puts the working directory first
        runpy.run_module(program.module, run_name="__main__", alter_sys=True)
    else:
        script = str(program.script)
        sys.argv = [script, *program.args]
        path = os.path.abspath(os.path.join(cwd, script))  # python's __file__: absolute, links kept
        _set_path0(os.path.dirname(os.path.realpath(path)))
        if pkgutil.get_importer(path) is None:  # a source file, as runpy.run_path decides
            refuse_non_python(script, path)  # where the launcher did not look (Kubernetes: in the image)
            _run_file(path)
        else:
            runpy.run_path(script, run_name="__main__")  # a folder or zip archive with __main__.py


def _run_file(path: str) -> None:
    """Run a source file as `python FILE` does: __file__ absolute, sys.argv[0] as typed (runpy.run_path
    sets both to the one path it is given)."""
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    module = types.ModuleType("__main__")
    module.__dict__.update(__file__=path, __cached__=None, __loader__=None, __package__=None, __spec__=None)
    previous = sys.modules.get("__main__")
    sys.modules["__main__"] = module  # pickling, dataclasses, `import __main__` see the program
    try:
        exec(code, module.__dict__)
    finally:
        if previous is not None:
            sys.modules["__main__"] = previous


def _set_path0(entry: str) -> None:
    if sys.path:
        sys.path[0] = entry
    else:
        sys.path.append(entry)


def outcome(program: Program, cwd: str | None = None, owner: SignalOwner | None = None) -> tuple[int, str]:
    """Execute and turn however the program ended into (exit code, one-line reason). After the runner's
    own handler stopped it (`owner`), whatever it ended with is that stop: exit 75, said as such."""
    if owner is not None and owner.received is not None:  # stopped before the program started
        return PREEMPTED, stopped_reason(program, owner.received)
    try:
        result = _outcome(program, cwd)
    except Stopped as stop:
        result = PREEMPTED, stopped_reason(program, stop.signum)
    if owner is not None and owner.received is not None and result[0] != BAD_INPUT:
        return PREEMPTED, stopped_reason(program, owner.received)
    return result


def _outcome(program: Program, cwd: str | None = None) -> tuple[int, str]:
    try:
        execute(program, cwd)
    except SystemExit as e:
        code = e.code
        if code is None:
            code = OK
        elif not isinstance(code, int):
            print(code, file=sys.stderr, flush=True)  # what the interpreter does with a message
            code = FAILURE
        return code, describe(program, code)
    except BadInput as e:
        reason = (str(e).splitlines() or ["bad input"])[0]
        if not status.launched() or status.folder() is None:
            print(reason, file=sys.stderr, flush=True)  # else launch.local prints it once for all ranks
        return BAD_INPUT, reason
    except KeyboardInterrupt as e:
        reason = f"{program.name} interrupted ({e or 'SIGINT without a handler'})"
        print(reason, file=sys.stderr, flush=True)
        return FAILURE, reason
    except Stopped:
        raise
    except BaseException as e:  # noqa: BLE001 - the last line of defence: anything else is exit 1
        if isinstance(e.__context__, Stopped):
            raise e.__context__ from None  # the program failed while unwinding from the stop
        if program.builtin and storage.refused_write(e):  # a full run dir mid-run: exit 2, as at a save
            reason = str(storage.refusal(e, prefix="storage error: ", what="writing")).splitlines()[0]
            if not status.launched() or status.folder() is None:
                print(reason, file=sys.stderr, flush=True)
            return BAD_INPUT, reason
        reason = f"{program.name} failed: {type(e).__name__}: {e}".splitlines()[0]
        peer = status.peer_bad_input(contract.rank())
        if peer is not None:  # failed because that peer left: the launcher's one bad-input line says it all
            return FAILURE, f"{reason} (after rank {peer[0]} found bad input)"
        import traceback

        traceback.print_exception(type(e), e, user_frames(e.__traceback__))
        return FAILURE, reason
    return OK, describe(program, OK)


def user_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback from the first frame that is neither the runner's nor runpy's: where the user's
    program begins, as `python SCRIPT.py` would show it."""
    own = {os.path.normcase(os.path.abspath(f)) for f in (__file__, runpy.__file__)}
    while tb is not None and os.path.normcase(os.path.abspath(tb.tb_frame.f_code.co_filename)) in own:
        tb = tb.tb_next
    return tb


def after_signal(program: Program, code: int, reason: str, signals: Sequence[int]) -> tuple[int, str, bool]:
    """(code, reason, finished) once the program ended: an undeclared 0 after a preemption signal is 75."""
    finished = code == OK and (program.builtin or status.finished_declared())
    if code != OK or finished or not signals:
        return code, reason, finished
    name = signal.Signals(signals[0]).name
    return (
        PREEMPTED,
        f"{program.name} ended with exit 0 after {name} without declaring the run finished "
        "(exit 75: run the same command again to resume from the program's own checkpoint)",
        False,
    )


def describe(program: Program, code: int) -> str:
    if code == OK:
        return "finished"
    if code == PREEMPTED:
        return f"{program.name} exited 75 (preempted)"
    if code == BAD_INPUT:
        return f"{program.name} exited 2 (bad input)"
    return f"{program.name} exited {code}"


last_reason = ""
"""The one-line reason of the program's end in this process (the Slurm task, which runs main in-process,
says it in its requeue line)."""


def stopped_by_runner(reason: str) -> bool:
    """Whether `reason` says the runner's own handler stopped a program that had none (SignalOwner)."""
    return " handler and was stopped by it" in reason


def main(argv: Sequence[str] | None = None, cwd: str | None = None) -> int:
    """Run one rank of a program; the exit code, also left in the launcher's status folder."""
    try:
        program = parse(sys.argv[1:] if argv is None else argv)
    except BadInput as e:
        print(str(e), file=sys.stderr)
        return BAD_INPUT
    if status.earlier_bad_input():
        return BAD_INPUT  # launch.local already has the reason from the first attempt
    from torchlaunch.jobs import launcher as ops_launcher

    ops_launcher.prepare_rank()  # stack dumps on request, the per-rank log (no-op without a launcher)
    stop_signals.shield_forked_children()  # loader workers never die of the stop meant for this rank
    watch = SignalWatch()
    multi_rank = not program.builtin and contract.world_size() > 1
    if multi_rank:
        joined.watch()
    owner = None if program.builtin else SignalOwner()  # the built-in programs handle every stop signal
    try:
        code, reason = outcome(program, cwd, owner)
        code, reason, finished = after_signal(program, code, reason, watch.seen())
    finally:
        if owner is not None:
            owner.close()
        watch.close()
    stopped = owner is not None and owner.received is not None
    if code == PREEMPTED and not finished and not status.launched() and ("without declaring" in reason or stopped):
        print(f"runner: {reason}", file=sys.stderr, flush=True)  # under launch.local it says it once
    if multi_rank and code == OK and not joined.joined() and contract.rank() == 0:
        print(
            f"runner: {program.name} ended 0 on rank 0 of {contract.world_size()} without ever joining a process "
            "group: every rank ran alone, not distributed (call init_process_group; Accelerate on CPU needs "
            "Accelerator(cpu=True))",
            file=sys.stderr,
            flush=True,
        )
    global last_reason
    last_reason = reason
    if not status.report(contract.rank(), code, reason, finished=finished, committed=status.committed_step()):
        if code != OK:  # under launch.local the launcher says it from the record, which a full disk kept out
            print(reason, file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def exit_process(code: int, program: Sequence[str] | None = None) -> NoReturn:
    """Leave with `code`. The project's own programs leave without interpreter teardown: with several
    gloo ranks, C++ threads still winding down at finalisation sometimes abort the process ("terminate
    called without an active exception") after a clean finish, turning exit 0 into a crash; their
    output is flushed and their files fsynced by then. A user's program gets the interpreter's normal
    exit (its atexit handlers, its finalisers). Either way the rank's last lines are on the console
    before it ends (ranklog.drained): the launcher reports the end right after, and a pod or a Slurm
    step that ends with it takes every process still copying output."""
    sys.stdout.flush()
    sys.stderr.flush()
    from torchlaunch.jobs import ranklog

    ranklog.drained()
    try:
        own = program is None or parse(program).builtin
    except BadInput:
        own = False
    if own:
        os._exit(code)
    sys.exit(code)


def run_as_main() -> NoReturn:
    """`python -m torchlaunch.runner PROGRAM...`: run it, then leave as exit_process decides for it.
    The program's words are taken before it runs: running it rewrites sys.argv to its own (runpy), and
    read afterwards they no longer named the built-in worker, so its ranks went through the full
    interpreter teardown (~1.2 s per run after the last step, and the gloo abort at finalisation
    exit_process exists to avoid)."""
    program = sys.argv[1:]
    exit_process(main(program), program)


if __name__ == "__main__":
    from torchlaunch import pdeath

    pdeath.die_with_agent()  # torchrun starts ranks in sessions of their own: end with it
    run_as_main()
