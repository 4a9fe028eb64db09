"""The built-in worker, one rank: config -> process group -> data -> Trainer.fit -> exit code.

It is the default program of every launcher, started in each rank by torchlaunch.runner
(`python -m torchlaunch.runner -m torchlaunch.worker --config RUN_DIR/config.yaml`), which turns
however it ends into the exit code and the launcher's status record: a returned 0 or 75 (a
preemption with a committed checkpoint) is kept, an escaping BadInput is one line and 2, anything
else a traceback and 1.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Callable
from typing import TypeVar

from torchlaunch import config as config_mod
from torchlaunch import config_help
from torchlaunch.base.untrusted import whole
from torchlaunch.exit_codes import OK, ArgumentParser, BadInput, ConfigError
from torchlaunch.worker.folder_cache import finish_prefetch, start_prefetch
from torchlaunch.worker.slow_start import Phases


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m train", description="Train an image classifier (one rank).")
    parser.add_argument("--config", help="recipe YAML or a resolved RUN_DIR/config.yaml")
    parser.add_argument(
        "--help-config", action="store_true", help="list every config key with its default and meaning, and exit"
    )
    parser.add_argument(
        "--reconfigure",
        action="store_true",
        help="let this run change the config of a run dir that has one (RUN_DIR/config.yaml is written once; "
        "a rerun with other values is refused, naming them)",
    )
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, values parsed as YAML")
    return parser.parse_args(argv)


def settle_config(cfg: config_mod.RunConfig, reconfigure: bool, write: bool) -> None:
    """RUN_DIR/config.yaml by the launchers' one rule (config.settle_resolved): a run dir holding another
    config is refused unless `reconfigure`. Checked by every rank before anything is written (`write`
    False), then written by rank 0 once the plug-ins are checked. Under a launcher the file already holds
    this config: no change, nothing said."""
    settled = config_mod.settle_resolved(cfg, reconfigure=reconfigure, write=write)
    if settled.note and write:
        print(settled.note.replace("launch: ", "train: ", 1), file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Train one rank; the exit code (BadInput and failures escape to the runner)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.help_config:
        print(config_help.help_config())
        return OK
    if not args.config:
        raise ConfigError("--config", "missing", "pass a recipe, e.g. --config configs/smoke.yaml")
    cfg = config_mod.load(args.config, args.overrides)
    settle_config(cfg, args.reconfigure, write=False)  # bad input before anything is written
    prefetch = start_prefetch(cfg.data)  # decodes a cold image folder while torch imports
    try:
        code, _ = _run(cfg, prefetch, args.reconfigure)
    finally:
        finish_prefetch(prefetch, wait=False)
    return code


T = TypeVar("T")


def allocating(what: str, build: Callable[[], T]) -> T:
    """`build()`, with an allocation that can never succeed (a model or image size beyond any memory)
    turned into bad input: the same config would fail the same way on every retry."""
    from torchlaunch.worker.debug import is_oom

    try:
        return build()
    except (RuntimeError, MemoryError) as e:
        text = str(e)
        if not (isinstance(e, MemoryError) or is_oom(e) or "can't allocate memory" in text):
            raise
        size = re.search(r"allocate (\d+) bytes", text)
        tried = f" ({int(size.group(1)) / 2**30:.3g} GiB)" if size else ""
        raise BadInput(
            f"memory error: cannot allocate {what}{tried} (use a smaller model.width, data.image_size "
            "or train.micro_batch_size)"
        ) from None


def _run(
    cfg: config_mod.RunConfig, prefetch: subprocess.Popen | None = None, reconfigure: bool = False
) -> tuple[int, str]:
    """Set up, train, tear down. Imports torch lazily so `--help-config` and config errors are fast."""
    from torchlaunch.core import dist
    from torchlaunch.core.checkpoint import latest_valid
    from torchlaunch.core.dist import agreed
    from torchlaunch.core.preemption import PreemptionWatcher
    from torchlaunch.worker import groups
    from torchlaunch.worker.data import load_bundle
    from torchlaunch.worker.debug import anomaly_detection, describe_oom, is_oom
    from torchlaunch.worker.plugins import check_early
    from torchlaunch.worker.trainer import Trainer

    watcher = PreemptionWatcher(cfg.preemption.signals)  # first: a signal during start-up is not lost
    attempt = rejoin_attempt(cfg)
    ctx = dist.setup(cfg.dist.timeout_s, cfg.dist.backend, cfg.dist.pin_cpus, alone=attempt > 0)
    clean = False
    group = None
    try:
        group = groups.form(cfg, ctx, attempt)  # the launcher's group, or live (recovery.live)
        agreed(ctx, lambda: check_early(cfg))  # plug-ins import, init_from exists: before any data work
        if not attempt:  # a rank started again finds the run's config already written
            agreed(ctx, lambda: settle_config(cfg, reconfigure, write=True) if ctx.is_main else None)
        # Local rank 0 prepares the data first (download, decode cache); the other ranks then read it.
        phase = Phases(ctx.rank == 0)  # a phase past a few seconds says so (a slow start is no hang)
        with phase(f"preparing the data (data.name={cfg.data.name}, data.root={cfg.data.root})"):
            finish_prefetch(prefetch)
            data_what = f"the data (data.image_size={cfg.data.image_size})"
            bundle = agreed(
                ctx, lambda: allocating(data_what, lambda: load_bundle(cfg.data)) if ctx.local_rank == 0 else None
            )
            if bundle is None:
                bundle = agreed(ctx, lambda: allocating(data_what, lambda: load_bundle(cfg.data)))
            else:
                agreed(ctx, lambda: None)
        model_what = f"the model (model.name={cfg.model.name}, model.width={cfg.model.width})"
        with phase(f"building {model_what}, its optimizer and loaders"):
            trainer = agreed(ctx, lambda: allocating(model_what, lambda: Trainer(cfg, ctx, bundle, watcher, group)))
        try:
            with anomaly_detection(cfg.debug.detect_anomaly):
                code = trainer.fit()
            ctx = trainer.ctx  # a live group may have been re-formed with fewer ranks
        except Exception as e:
            if not is_oom(e):
                raise
            newest = latest_valid(trainer.ckpt_root)
            report = describe_oom(
                e,
                device=ctx.device,
                batch_size=cfg.train.batch_size,
                micro_batch_size=cfg.train.micro_batch_size,
                world_size=ctx.world_size,
                precision=trainer.precision,
                channels_last=cfg.train.channels_last,
                last_checkpoint=str(newest) if newest else None,
            )
            print(report, file=sys.stderr, flush=True)
            raise BadInput(report.splitlines()[0]) from None  # the same batch would run out again
        clean = True
        return code, "finished" if code == OK else "preempted: checkpoint committed"
    finally:  # bad input too leaves without the barrier: it may be this rank's alone (dist.teardown)
        watcher.restore()
        dist.teardown(ctx, clean=clean)
        if group is not None:
            group.close()


def rejoin_attempt(cfg: config_mod.RunConfig) -> int:
    """>= 1 when the live agent started this rank again (recovery.rejoin): it forms no group at start."""
    from torchlaunch import contract

    value = contract.get(contract.LIVE_JOIN, "") or ""
    return (whole(value, 6) or 0) if cfg.recovery.live is not False else 0


if __name__ == "__main__":
    from torchlaunch import runner

    runner.exit_process(runner.main(["-m", runner.BUILTIN_WORKER, *sys.argv[1:]]))
