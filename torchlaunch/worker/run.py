"""The built-in worker, one rank: config -> process group -> data -> Trainer.fit -> exit code.

It is the default program of every launcher, started in each rank by torchlaunch.runner
(`python -m torchlaunch.runner -m torchlaunch.worker --config RUN_DIR/config.yaml`), which turns
however it ends into the exit code and the launcher's status record: a returned 0 or 75 (a
preemption with a committed checkpoint) is kept, an escaping BadInput is one line and 2, anything
else a traceback and 1.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from torchlaunch import config as config_mod
from torchlaunch.exit_codes import OK, BadInput, ConfigError
from torchlaunch.worker.folder_cache import finish_prefetch, start_prefetch


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m train", description="Train an image classifier (one rank).")
    parser.add_argument("--config", help="recipe YAML or a resolved RUN_DIR/config.yaml")
    parser.add_argument("--help-config", action="store_true", help="list every config key and exit")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, values parsed as YAML")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Train one rank; the exit code (BadInput and failures escape to the runner)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.help_config:
        print("\n".join(config_mod.all_keys()))
        return OK
    if not args.config:
        raise ConfigError("--config", "missing", "pass a recipe, e.g. --config configs/smoke.yaml")
    cfg = config_mod.load(args.config, args.overrides)
    prefetch = start_prefetch(cfg.data)  # decodes a cold image folder while torch imports
    try:
        code, _ = _run(cfg, prefetch)
    finally:
        finish_prefetch(prefetch, wait=False)
    return code


def _run(cfg: config_mod.RunConfig, prefetch: subprocess.Popen | None = None) -> tuple[int, str]:
    """Set up, train, tear down. Imports torch lazily so `--help-config` and config errors are fast."""
    from torchlaunch.core import dist
    from torchlaunch.core.checkpoint import latest_valid
    from torchlaunch.core.dist import agreed
    from torchlaunch.core.preemption import PreemptionWatcher
    from torchlaunch.tools.debug import anomaly_detection, describe_oom, is_oom
    from torchlaunch.worker.data import load_bundle
    from torchlaunch.worker.plugins import check_early
    from torchlaunch.worker.trainer import Trainer

    watcher = PreemptionWatcher(cfg.preemption.signals)  # first: a signal during start-up is not lost
    ctx = dist.setup(cfg.dist.timeout_s, cfg.dist.backend, cfg.dist.pin_cpus)
    clean = False
    try:
        agreed(ctx, lambda: check_early(cfg))  # plug-ins import, init_from exists: before any data work
        if ctx.is_main:
            config_mod.write_resolved(cfg)
        # Local rank 0 prepares the data first (download, decode cache); the other ranks then read it.
        finish_prefetch(prefetch)
        bundle = agreed(ctx, lambda: load_bundle(cfg.data) if ctx.local_rank == 0 else None)
        if bundle is None:
            bundle = agreed(ctx, lambda: load_bundle(cfg.data))
        else:
            agreed(ctx, lambda: None)
        trainer = agreed(ctx, lambda: Trainer(cfg, ctx, bundle, watcher))
        try:
            with anomaly_detection(cfg.debug.detect_anomaly):
                code = trainer.fit()
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
    except BadInput:
        clean = True  # every rank agreed (or it was raised in lockstep): leaving together is safe
        raise
    finally:
        watcher.restore()
        dist.teardown(ctx, clean=clean)


if __name__ == "__main__":
    from torchlaunch import runner

    runner.exit_process(runner.main(["-m", runner.BUILTIN_WORKER, *sys.argv[1:]]))
