"""Evaluate a trained checkpoint on a dataset and print one JSON line.

    python -m train.evaluate --run-dir runs/a --data-root path/to/images
    python -m train.evaluate --checkpoint runs/a/checkpoints/step-000000480 --data-root data/cifar10
    python -m train.evaluate --run-dir runs/p          # a run with data.name=pkg.module:factory: its val split
    python -m launch.local ... is not needed: under torchrun each rank takes a contiguous shard and the
    counts are all-reduced, so every sample is counted exactly once whatever the world size.

The checkpoint carries what evaluation needs besides the weights: the resolved config (model, data
split, precision), the class names (checked against the data, so a label mix-up cannot go unnoticed)
and the training set's normalisation. Plug-ins (`model.name` / `data.name` = `pkg.module:factory`) are
imported from the current directory, PYTHONPATH or the installed packages; from the folder the
checkpoint recorded only with --trust-plugin (a checkpoint is data: evaluating someone else's run
never imports code you did not name; without consent it is exit 2 naming the module and the folder).
stdout holds only the JSON line; errors are one line on stderr with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

from torchlaunch import contract, rundir
from torchlaunch.base.untrusted import quote
from torchlaunch.config import from_dict
from torchlaunch.data.formats.cifar10 import CIFAR_FOLDER
from torchlaunch.exit_codes import BAD_INPUT, FAILURE, OK, ArgumentParser, BadInput


def parse_args(argv: list[str]) -> argparse.Namespace:
    from torchlaunch.data import registry

    p = ArgumentParser(
        prog="python -m train.evaluate",
        description="Top-1 accuracy of a checkpoint on CIFAR-10 batches or a folder of "
        "class folders; prints one JSON line.",
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--run-dir", help="run folder: its newest valid checkpoint is evaluated")
    which.add_argument("--checkpoint", help="one checkpoint folder, e.g. RUN_DIR/checkpoints/step-000000480")
    p.add_argument(
        "--data-root",
        default=None,
        help=f"folder holding {CIFAR_FOLDER} (its 10k test batch is used), a shard set (its val/) or a folder of "
        "class folders; default: the run's recorded data.root for shards and cifar10, and for an image folder "
        "with --split val; for a run whose data.name is a plug-in, optional: passed to its factory as root, "
        "and its val split is evaluated",
    )
    p.add_argument(
        "--data-name",
        choices=("auto", *registry.names(evaluable=True)),
        default="auto",
        help=f"auto: cifar10 when DATA_ROOT/{CIFAR_FOLDER} exists, shards when DATA_ROOT/manifest.json does "
        "(its val/ split is evaluated), else imagefolder",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=0,
        help="images per forward pass per rank (0: the same as the training run's validation)",
    )
    p.add_argument(
        "--split",
        choices=("all", "val"),
        default="all",
        help="imagefolder: all images, or the run's seeded validation split (cifar10: the test batch "
        "either way; val also applies the run's data.max_val_samples)",
    )
    p.add_argument(
        "--trust-plugin",
        action="store_true",
        help="import a plug-in model or dataset the checkpoint names from the folder the checkpoint records "
        "(without it, only from the current directory, PYTHONPATH or the installed packages: a checkpoint "
        "is data, and loading it never runs code you did not name)",
    )
    p.add_argument(
        "--tta",
        choices=("auto", "none", "flip", "flip_translate"),
        default="auto",
        help="test-time augmentation (auto: the run's train.tta, as its final validation used)",
    )
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------
# Checkpoint


def pick_checkpoint(args: argparse.Namespace) -> Path:
    """The checkpoint folder to evaluate (rank 0 decides, through the store's one path parser and its
    newest-that-verifies rule; the load verifies again)."""
    from torchlaunch.core import checkpoint as ckpt

    given = args.checkpoint or args.run_dir
    found = ckpt.locate(given)
    if args.checkpoint and (found is None or found.checkpoint is None):
        raise BadInput(
            f"evaluate error: --checkpoint {Path(given).expanduser()} is not a checkpoint folder "
            f"(pass RUN_DIR/checkpoints/step-NNNNNNNNN, or --run-dir RUN_DIR)"
        )
    if found is not None and found.checkpoint is not None:
        return found.checkpoint
    root = found.root if found is not None and found.root is not None else rundir.checkpoints(Path(given).expanduser())
    skipped: list[tuple[Path, str]] = []
    newest = ckpt.latest_valid(root, on_skip=lambda path, reason: skipped.append((path, reason)))
    if newest is None:
        why = f"; skipped: {' | '.join(f'{p.name}: {r}' for p, r in skipped)}" if skipped else ""
        raise BadInput(f"evaluate error: no valid checkpoint under {root}{why} (train first, or pass --checkpoint DIR)")
    for path, reason in skipped:
        ckpt.warn(f"skipping checkpoint {path / ckpt.STATE_FILE}: {reason}; falling back to the previous one")
    return newest


def load_checkpoint(path: Path, trust_plugin: bool = False) -> dict[str, Any]:
    from torchlaunch.core import checkpoint as ckpt

    try:
        state = ckpt.load_state(path, "cpu")
    except ckpt.InvalidCheckpoint as e:
        raise BadInput(f"evaluate error: {path} is not a valid checkpoint: {e} (pick another one)") from None
    missing = [k for k in ("config", "classes", "norm", "model") if k not in state]
    if missing:
        raise BadInput(
            f"evaluate error: {path} lacks {', '.join(missing)} (it was not written by the built-in worker, torchlaunch.worker.trainer)"
        )
    from torchlaunch.worker.plugins import allow_recorded

    config = state["config"] if isinstance(state["config"], dict) else {}
    names = {
        f"{section}.name": str(config[section]["name"])
        for section in ("model", "data")
        if isinstance(config.get(section), dict) and "name" in config[section]
    }
    allow_recorded(names, state.get("plugins"), trust_plugin)  # before anything imports a plug-in
    return state


# ----------------------------------------------------------------------------------------------
# Data


def detect_data_name(root: Path, requested: str) -> str:
    """--data-name, or (auto) the registered format whose `detect` claims the folder, else class folders."""
    from torchlaunch.data import registry

    return registry.detect(root) if requested == "auto" else requested


def load_eval_set(
    train_cfg: dict[str, Any], data_root: str | None, data_name: str, split: str
) -> tuple[Any, list[str]]:
    """(images, class names) to evaluate on, using the run's data settings with data.root replaced; the
    format's evaluation set comes from the data-format registry (torchlaunch.data.registry)."""
    from torchlaunch.data import registry

    cfg = from_dict(train_cfg).data
    trained = registry.get(cfg.name)
    if trained.own_val and trained.eval_set is not None:  # a plug-in dataset: its own val split, as the run validated
        return trained.eval_set(replace(cfg, root=data_root) if data_root else cfg, split)
    data_root, data_name = recorded_root(cfg, data_root, data_name, split)
    root = Path(data_root).expanduser()
    if not root.is_dir():
        raise BadInput(
            f"data error: --data-root {quote(str(root))} does not exist or is not a folder "
            f"(pass a folder holding {CIFAR_FOLDER} or a folder of class folders)"
        )
    fmt = registry.get(detect_data_name(root, data_name))
    if fmt.eval_set is None:
        raise BadInput(
            f"evaluate error: data.name={quote(fmt.name)} has no evaluation set "
            f"(pass --data-name, one of: {', '.join(registry.names(evaluable=True))})"
        )
    images, classes = fmt.eval_set(replace(cfg, root=str(root)), split)
    if split == "val":
        images = images.head(cfg.max_val_samples)
    return images, classes


def recorded_root(cfg: Any, data_root: str | None, data_name: str, split: str) -> tuple[str, str]:
    """(root, data name) to evaluate: --data-root when given, else the root the run recorded in its
    config for a format whose held-out split is known (DataFormat.held_out: a shard set's val/,
    CIFAR-10's test batch, an image folder's seeded val split)."""
    from torchlaunch.data import registry

    if data_root is not None:
        return data_root, data_name
    if split in registry.get(cfg.name).held_out:
        return cfg.root, cfg.name if data_name == "auto" else data_name
    raise BadInput(
        f"evaluate error: --data-root is required: the run trained on data.name={quote(cfg.name)}, whose every "
        f"image it may have trained on (pass a folder holding {CIFAR_FOLDER} or a folder of class folders, "
        "or --split val to score the run's own held-out images)"
    )


def check_classes(data_classes: list[str], ckpt_classes: list[str], root: str) -> None:
    if list(data_classes) != list(ckpt_classes):

        def show(c: list[str]) -> str:
            return f"{len(c)}: {', '.join(c[:12])}{', ...' if len(c) > 12 else ''}"

        raise BadInput(
            f"data error: the classes under {root} ({show(data_classes)}) differ from the "
            f"checkpoint's ({show(ckpt_classes)}) (evaluate on data with the same class folders)"
        )


# ----------------------------------------------------------------------------------------------
# Evaluation


def evaluate_model(state: dict[str, Any], data: Any, ctx: Any, batch_size: int, tta: str = "auto") -> dict[str, float]:
    """Loss sum, correct and count over this rank's contiguous shard, all-reduced over ranks.

    Precision, memory format, batching and the loop itself (worker/eval_loop.py) are the training
    run's validation, so the accuracy printed here equals the run's val_acc on the same split."""
    import contextlib

    import torch

    from torchlaunch.config import from_dict
    from torchlaunch.worker import eval_loop
    from torchlaunch.worker.data import Normalizer, eval_batches
    from torchlaunch.worker.models import build_model
    from torchlaunch.worker.precision import resolve_precision

    cfg = from_dict(state["config"])
    tta = cfg.train.tta if tta == "auto" else tta
    classes = list(state["classes"])
    model = build_model(cfg.model.name, len(classes), cfg.model.width)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        raise BadInput(
            f"evaluate error: the checkpoint's weights do not fit model.name={cfg.model.name}: "
            f"{str(e).splitlines()[0]} (the checkpoint is inconsistent; pick another one)"
        ) from None
    memory_format = torch.channels_last if cfg.train.channels_last else torch.contiguous_format
    model = model.to(ctx.device, memory_format=memory_format).eval()
    precision = resolve_precision(cfg.train.precision, ctx.device)
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    autocast = (lambda: torch.autocast(ctx.device.type, dtype=amp_dtype)) if amp_dtype else contextlib.nullcontext
    norm = state["norm"]
    normalize = Normalizer(tuple(norm["mean"]), tuple(norm["std"]), ctx.device, cfg.train.channels_last)
    from torchlaunch.worker.data.augment import val_resize_for

    resize = val_resize_for(cfg.data.image_size, cfg.data.val_resize, cfg.data.train_crop)  # as the run validated
    batches = eval_batches(
        data, ctx.rank, ctx.world_size, batch_size, normalize, ctx.device, cfg.data.image_size, 0, resize
    )
    result = eval_loop.evaluate(model, batches, ctx, autocast, tta)
    assert result is not None  # no stop condition: always a result
    return result


def default_batch_size(train_cfg: dict[str, Any], world_size: int) -> int:
    """The batch the trainer validates with: max(per-rank micro-batch, 256)."""
    t = train_cfg.get("train", {})
    per_rank = int(t.get("batch_size", 256)) // max(1, world_size)
    return max(int(t.get("micro_batch_size", 0) or 0) or per_rank, 256)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from torchlaunch.core import dist

    if args.batch_size < 0:
        raise BadInput(f"evaluate error: --batch-size must be >= 0, got {args.batch_size} (0 = the run's default)")
    ctx = dist.setup()
    clean = False
    try:
        chosen = dist.agreed(ctx, lambda: str(pick_checkpoint(args)) if ctx.is_main else None)
        chosen = dist.broadcast_json(ctx, chosen, kinds=(str,))
        state = dist.agreed(ctx, lambda: load_checkpoint(Path(chosen), args.trust_plugin))

        # Local rank 0 first: it fills the decode cache that the other ranks then read.
        def load() -> tuple[Any, list[str]]:
            return load_eval_set(state["config"], args.data_root, args.data_name, args.split)

        loaded = dist.agreed(ctx, lambda: load() if ctx.local_rank == 0 else None)
        loaded = dist.agreed(ctx, lambda: loaded or load())
        data, classes = loaded
        where = args.data_root or from_dict(state["config"]).data.root
        dist.agreed(ctx, lambda: check_classes(classes, list(state["classes"]), where))
        batch = args.batch_size or default_batch_size(state["config"], ctx.world_size)
        result = evaluate_model(state, data, ctx, batch, args.tta)
        clean = True
    except BadInput:
        clean = True  # raised on every rank together
        raise
    finally:
        dist.teardown(ctx, clean=clean)
    progress = state.get("progress", {})
    return {
        "accuracy": result["correct"] / result["samples"] if result["samples"] else math.nan,
        "samples": int(result["samples"]),
        "loss": result["loss"],
        "checkpoint": str(chosen),
        "step": progress.get("global_step"),
        "classes": len(state["classes"]),
        "rank0": ctx.is_main,
    }


def main(argv: list[str] | None = None) -> int:
    try:
        report = run(parse_args(sys.argv[1:] if argv is None else argv))
    except BadInput as e:
        if contract.is_main():  # every rank holds the same agreed message: print it once
            print(str(e).splitlines()[0], file=sys.stderr, flush=True)
        return BAD_INPUT
    except Exception as e:  # noqa: BLE001 - anything unexpected: traceback and exit 1
        traceback.print_exc()
        print(f"evaluate failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", file=sys.stderr)
        return FAILURE
    if report.pop("rank0"):
        print(json.dumps(report), flush=True)
    return OK


if __name__ == "__main__":
    sys.exit(main())
