"""The worker process: config -> process group -> data -> Trainer.fit -> exit code.

Every launcher ends up running this in each rank (`python -m train --config RUN_DIR/config.yaml`).
Errors become exit codes here and only here: 2 for bad input (one line, never retried), 75 for a
preemption with a committed checkpoint, 1 for anything else.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import traceback

from torchlaunch import config as config_mod
from torchlaunch import status
from torchlaunch.exit_codes import BAD_INPUT, FAILURE, OK, BadInput, ConfigError
from torchlaunch.worker.folder_cache import finish_prefetch, start_prefetch

ATTEMPT_ENV = status.ATTEMPT_ENV
"""Set by launch.local: each rank reports its exit code and reason for it (train/status.py), since
torchrun itself exits 1 whatever its workers returned."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m train", description="Train an image classifier (one rank).")
    parser.add_argument("--config", help="recipe YAML or a resolved RUN_DIR/config.yaml")
    parser.add_argument("--help-config", action="store_true", help="list every config key and exit")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, values parsed as YAML")
    return parser.parse_args(argv)


def report_status(run_dir: str | None, rank: int, code: int, reason: str) -> None:
    """Leave this rank's outcome for the launcher that started us (no-op without one)."""
    status.report(rank, code, reason, run_dir)


def earlier_bad_input(run_dir: str) -> str | None:
    """After a torchrun restart within the same launch: a rank already found bad input, so stop at once."""
    return status.earlier_bad_input(run_dir)


def _env_rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.help_config:
        print("\n".join(config_mod.all_keys()))
        return OK
    rank = _env_rank()
    run_dir: str | None = None
    try:
        cfg = config_mod.load(args.config, args.overrides) if args.config else None
        if cfg is None:
            raise ConfigError("--config", "missing", "pass a recipe, e.g. --config configs/smoke.yaml")
        run_dir = cfg.run_dir
        earlier = earlier_bad_input(run_dir)
        if earlier:
            return BAD_INPUT  # launch.local already has the reason from the first attempt
        prefetch = start_prefetch(cfg.data)  # decodes a cold image folder while torch imports
        try:
            code, reason = _run(cfg, prefetch)
        finally:
            finish_prefetch(prefetch, wait=False)
    except BadInput as e:
        code, reason = BAD_INPUT, str(e).splitlines()[0]
        if not status.launched() or status.folder(run_dir) is None:
            print(reason, file=sys.stderr, flush=True)  # else launch.local prints it once
    except KeyboardInterrupt:
        code, reason = FAILURE, "interrupted before a checkpoint could be agreed"
        print(reason, file=sys.stderr, flush=True)
    except Exception as e:  # noqa: BLE001 - the last line of defence turns anything into exit 1
        code, reason = FAILURE, f"{type(e).__name__}: {e}".splitlines()[0]
        traceback.print_exc()
        print(f"rank {rank} failed: {reason}", file=sys.stderr, flush=True)
    report_status(run_dir, rank, code, reason)
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
    sys.exit(main())
