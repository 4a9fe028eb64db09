"""The one launcher front: argv grammar, `--` split, built-in-vs-program rule, pre-spawn policy, errors.

launch.local, launch.slurm and launch.k8s differ only in where the ranks run; what a user types and
what is refused before anything starts is decided here, once, so the three cannot drift apart:

    python -m launch.X [options] [--config YAML] [key=value ...] [-- SCRIPT.py args | -- -m pkg.mod args]

- Options and key=value overrides mix freely before `--` (`--config X k=v --dry-run k2=v`); everything
  after the first `--` is the program and is never parsed by the launcher.
- Without a program the built-in worker trains the recipe of --config; with one, --config and
  overrides are refused (they would be silently ignored) and the program is found on disk, never
  imported (check_program).
- The same pre-spawn policy (torchlaunch.launch.precheck.check) runs in a run, --dry-run and --doctor.
- A launcher's own refusal is one line prefixed `launch error:`; a config, data or environment
  problem keeps the worker's own line (`config error: ...`), so the launcher and the worker say the
  same thing. Exit 2 either way, never a traceback.
- torchrun's and accelerate's spellings of the same options are accepted (ALIASES: `--nproc-per-node`,
  `--nproc_per_node`, `--num_processes` -> `--gpus`, `--node_rank`, `--master_addr`, ...), `--standalone`
  is a no-op on one node; what means something else here is refused in one line naming ours (REFUSED).
  torchrun's elastic `--nnodes MIN:MAX` means the same here (torchlaunch.launch.elastic).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from collections.abc import Callable, Sequence

from torchlaunch import compat, runner
from torchlaunch.base import storage
from torchlaunch.exit_codes import BAD_INPUT, BadInput, LaunchParser
from torchlaunch.jobs import ranklog, watchdog

PREFIX = LaunchParser.error_prefix
DOMAIN_LINE = re.compile(r"^[a-z][a-z0-9]* error: ")
"""A line that already names its domain (config error:, data error:, env error:, launch error:)."""


def error(message: str) -> BadInput:
    """A launcher's own refusal: `raise cli.error("--nodes must be >= 1, got 0")`."""
    return BadInput(PREFIX + message)


def one_line(problem: BaseException) -> str:
    """The single stderr line for a refusal: its first line, `launch error:` unless it names its domain."""
    line = (str(problem).strip().splitlines() or ["bad input"])[0]
    return line if DOMAIN_LINE.match(line) else PREFIX + line


def split_program(argv: Sequence[str]) -> tuple[list[str], list[str] | None]:
    """Launcher arguments before the first `--`, the program after it (None: the built-in worker)."""
    items = list(argv)
    if "--" not in items:
        return items, None
    cut = items.index("--")
    return items[:cut], items[cut + 1 :]


ALIASES = {
    "--nproc-per-node": "--gpus",
    "--nproc_per_node": "--gpus",
    "--num_processes": "--gpus",
    "--num-processes": "--gpus",
    "--node_rank": "--node-rank",
    "--master_addr": "--master-addr",
    "--master_port": "--master-port",
    "--max_restarts": "--max-restarts",
    "--hang_timeout": "--hang-timeout",
    "--run_dir": "--run-dir",
    "--dry_run": "--dry-run",
    "--num_machines": "--nnodes",
    "--num-machines": "--nnodes",
    "--machine_rank": "--node-rank",
    "--machine-rank": "--node-rank",
    "--main_process_ip": "--master-addr",
    "--main-process-ip": "--master-addr",
    "--main_process_port": "--master-port",
    "--main-process-port": "--master-port",
}
"""torchrun's / accelerate's spelling -> ours, applied where the launcher has our option."""
NOT_PYTHON = "every rank runs a Python program (SCRIPT.py or -m package.module after --); start an executable from one"
CPU = {"--cpu": "--device"}
"""accelerate's --cpu -> ours with its value, where the launcher has it (launch.local's --device cpu)."""
AUTO_COUNTS = ("auto", "cpu", "gpu")
"""torchrun's symbolic --nproc-per-node values: the worker count here is a number."""
LOGS = "every rank's output is in RUN_DIR/logs/rank-N.log (`python -m launch logs RUN_DIR` merges them)"
REFUSED = {
    "--tee": f"{LOGS} and on the console already; drop --tee (--rank-prefix names each line's rank)",
    "--redirects": f"{LOGS}; to keep it off the console use --console-ranks none",
    "--log-dir": f"{LOGS}; choose the folder with --run-dir",
    "--log_dir": f"{LOGS}; choose the folder with --run-dir",
    "--local-ranks-filter": "use --console-ranks RANKS (global ranks; on one node the same numbers)",
    "--local_ranks_filter": "use --console-ranks RANKS (global ranks; on one node the same numbers)",
    "--rdzv-backend": "the launcher runs torchrun's c10d rendezvous itself; pass --master-addr/--master-port",
    "--rdzv_backend": "the launcher runs torchrun's c10d rendezvous itself; pass --master-addr/--master-port",
    "--rdzv-endpoint": "pass --master-addr HOST --master-port PORT",
    "--rdzv_endpoint": "pass --master-addr HOST --master-port PORT",
    "--no-python": NOT_PYTHON,
    "--no_python": NOT_PYTHON,
    "--module": "put the program after --: -- -m package.module [args]",
    "--multi_gpu": "pass the worker count: --gpus N (one rank per GPU)",
    "--multi-gpu": "pass the worker count: --gpus N (one rank per GPU)",
    "--mixed_precision": "mixed precision is the program's choice (Accelerator(mixed_precision=...)); "
    "the built-in worker takes optim.precision=bf16|fp16",
    "--mixed-precision": "mixed precision is the program's choice (Accelerator(mixed_precision=...)); "
    "the built-in worker takes optim.precision=bf16|fp16",
}
"""torchrun options with no equivalent spelling here: one line naming what to use instead."""


def translate(items: Sequence[str], known: Sequence[str]) -> list[str]:
    """torchrun's and accelerate's spellings rewritten to ours (only where `known` has ours), --standalone
    dropped (one node is standalone already), REFUSED options refused."""
    out: list[str] = []
    standalone = False
    for i, item in enumerate(items):
        name, eq, value = item.partition("=")
        if name == "--standalone" and "--nnodes" in known:
            standalone = True
            continue
        if name in REFUSED:
            raise error(f"{name}: not an option of this launcher; {REFUSED[name]}")
        if name in ALIASES and ALIASES[name] in known:
            name = ALIASES[name]
        if name in CPU and CPU[name] in known and not eq:
            out += [CPU[name], "cpu"]
            continue
        if name == "--gpus":
            shown = value if eq else (items[i + 1] if i + 1 < len(items) else "")
            if shown in AUTO_COUNTS:
                raise error(f"{item if eq else item + ' ' + shown}: pass the worker count as a number (--gpus N)")
        out.append(name + eq + value if eq else name)
    if standalone:
        nodes = [out[i + 1] for i, a in enumerate(out[:-1]) if a == "--nnodes"]
        nodes += [a.partition("=")[2] for a in out if a.startswith("--nnodes=")]
        if any(n != "1" for n in nodes):
            raise error(f"--standalone runs one node, not --nnodes {nodes[-1]}; drop --standalone")
    return out


Parser = LaunchParser
"""Every launcher's parser: argparse's refusals are one `launch error:` line and exit 2, like ours."""


def add_common(parser: argparse.ArgumentParser, *, run_dir_help: str, config_help: str) -> None:
    """The arguments every launcher takes, with the same meaning."""
    parser.add_argument("--config", default=None, help=config_help)
    parser.add_argument("--run-dir", default=None, help=run_dir_help)
    parser.add_argument(
        "--doctor",
        action="store_true",
        help="run the distributed pre-flight (rendezvous, all_reduce, shared storage, ...) instead of training",
    )
    parser.add_argument("--dry-run", action="store_true", help="print what would run or be submitted, start nothing")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides of the built-in worker")


RECONFIGURE_HELP = (
    "let this launch change the config of a run dir that has one (RUN_DIR/config.yaml is written once; "
    "a rerun with other values is refused, naming them): says from which step the new values apply"
)
"""--reconfigure's meaning, the same wherever a user launches the built-in worker (config.settle_resolved)."""


def add_reconfigure(parser: argparse.ArgumentParser) -> None:
    """--reconfigure: the one explicit act that changes a run's RUN_DIR/config.yaml."""
    parser.add_argument("--reconfigure", action="store_true", help=RECONFIGURE_HELP)


def console_ranks(text: str) -> frozenset[int]:
    """The `--console-ranks` option's type."""
    try:
        return ranklog.parse_ranks(text)
    except ValueError as problem:
        raise argparse.ArgumentTypeError(str(problem)) from None


def add_operation(parser: argparse.ArgumentParser, *, hang_help: str) -> None:
    """The options of a running job every launcher takes: the hang watchdog and the ranks' console."""
    parser.add_argument("--hang-timeout", type=watchdog.parse_timeout, default=None, metavar="S", help=hang_help)
    parser.add_argument(
        "--rank-prefix",
        action="store_true",
        help="start every console line of a rank with [rank N] (RUN_DIR/logs/rank-N.log keeps each rank's lines)",
    )
    parser.add_argument(
        "--console-ranks",
        type=console_ranks,
        default=None,
        metavar="RANKS",
        help="only these ranks' output reaches the console: 0, 0,2-3 or none (the rank logs keep every rank's)",
    )


def console_of(args: argparse.Namespace) -> ranklog.Console:
    return ranklog.Console(prefix=bool(getattr(args, "rank_prefix", False)), ranks=getattr(args, "console_ranks", None))


def looks_like_program(item: str) -> bool:
    """A launcher argument that is a program, typed torchrun's way without `--`: `-m` or a script."""
    if item == "-m":
        return True
    if item.startswith("-") or "=" in item:
        return False
    return item.endswith(".py") or os.path.isfile(item)


def refuse_program_without_split(parser: argparse.ArgumentParser, own: Sequence[str], prog: str) -> None:
    """`launch.local --gpus 2 train.py --epochs 1`: torchrun's habit. The program's own options would
    be read as the launcher's (`--device`), so it is one line showing the command with `--`."""
    actions = compat.option_actions(parser)
    for i, item in enumerate(own):
        previous = actions.get(own[i - 1].partition("=")[0]) if i else None
        takes_value = previous is not None and "=" not in own[i - 1] and previous.nargs != 0
        if takes_value or not looks_like_program(item):
            continue
        fixed = shlex.join([*own[:i], "--", *own[i:]])
        raise error(
            f"{item} looks like your program: put it after -- ({prog} {fixed}); everything before -- is the launcher's"
        )


def parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """The one grammar: options and overrides in any order before `--`, the program after it."""
    own, program = split_program(argv)
    refuse_program_without_split(parser, own, parser.prog)
    args = parser.parse_intermixed_args(translate(own, list(compat.option_actions(parser))))
    args.program = program
    for override in args.overrides:
        if "=" not in override or override.startswith("="):
            raise error(f"override {override!r} is not key=value (e.g. optim.lr=0.1)")
    return args


def check_program(
    args: argparse.Namespace,
    *,
    cwd: str | None = None,
    on_disk: bool = True,
    absolute: bool = False,
    run_dir_for_builtin: bool = False,
) -> runner.Program | None:
    """The built-in-vs-program rule; None for the built-in worker. `on_disk`: the program must be
    found from `cwd` (not on Kubernetes, where it lives in the image); `absolute`: a script path made
    independent of the working directory (Slurm tasks); `run_dir_for_builtin`: --run-dir also names
    the built-in worker's run dir (Kubernetes, where it must be on the shared volume)."""
    if args.program is None:
        if args.config is None:
            raise error(
                "--config is required for the built-in worker (pass a recipe such as "
                "--config configs/smoke.yaml, or your own program after --: -- SCRIPT.py [args])"
            )
        if args.run_dir is not None and not run_dir_for_builtin:
            raise error(
                f"--run-dir {args.run_dir} is for a program after --; the built-in worker takes run_dir={args.run_dir}"
            )
        return None
    program = runner.parse(args.program)
    if absolute:
        program = program.absolute(cwd or ".")
    runner.refuse_worker_options(program, args.config, args.overrides, PREFIX)
    if on_disk:
        runner.check(program, cwd)
    return program


def main(body: Callable[[], int]) -> int:
    """Run a launcher's body: a refusal anywhere is its one line on stderr and exit 2, and so is the
    user's storage refusing a write (full, read-only, a name too long: torchlaunch.base.storage)."""
    try:
        return body()
    except BadInput as problem:
        print(one_line(problem), file=sys.stderr, flush=True)
        return BAD_INPUT
    except OSError as error:
        if not storage.is_storage(error):
            raise
        print(one_line(storage.refusal(error)), file=sys.stderr, flush=True)
        return BAD_INPUT
