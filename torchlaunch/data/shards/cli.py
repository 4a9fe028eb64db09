"""`python -m train.shards write|index|verify`: the command front (one-line refusals, exit 2)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from torchlaunch.base.storage import is_storage, refusal
from torchlaunch.exit_codes import BAD_INPUT, OK, ArgumentParser, BadInput, _bounded

MAX_SEED = (1 << 63) - 1
DEFAULT_VAL_FRACTION = 0.02
"""Held out as DIR/val when neither --val-from nor --val-fraction is given (issue 51 item 6: a set written
without a val split was refused by training). Why hold out rather than refuse: the first write should give
a set that trains; 2% keeps 98% for training and still validates on 1,000 CIFAR-10 or 25,600 ImageNet
images, and the fixed --split-seed makes every rerun continue the same split."""


def parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="python -m train.shards", description="Tar shards (webdataset layout) with an offset index."
    )
    p.error_prefix = "shards error: "
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="class folders -> DIR/train/*.tar, DIR/val/*.tar, indexes, manifest")
    w.error_prefix = "shards error: "
    w.add_argument(
        "--from",
        dest="src",
        type=Path,
        required=True,
        metavar="CLASS_FOLDERS",
        help="the training images: a folder with one sub-folder of images per class",
    )
    w.add_argument(
        "--out", type=Path, required=True, metavar="DIR", help="the shard set to write (train with data.root=DIR)"
    )
    val = w.add_mutually_exclusive_group()
    val.add_argument(
        "--val-from",
        type=Path,
        metavar="CLASS_FOLDERS",
        help="the validation images, with the same class folders as --from (written to DIR/val)",
    )
    val.add_argument(
        "--val-fraction",
        type=float,
        metavar="F",
        help=f"hold out this fraction of --from as DIR/val, drawn with --split-seed "
        f"(default without --val-from: {DEFAULT_VAL_FRACTION}; training needs a val split)",
    )
    w.add_argument("--max-side", type=int, metavar="PX", help="resize the long side to PX (aspect kept)")
    w.add_argument(
        "--quality", type=int, default=90, metavar="Q", help="JPEG quality of re-encoded images (default 90)"
    )
    w.add_argument("--shard-size-mb", type=float, default=256, metavar="MB", help="target shard size (default 256)")
    w.add_argument(
        "--split-seed",
        type=int,
        default=0,
        metavar="S",
        help="seed of the --val-fraction hold-out (default 0: the same split on every rerun)",
    )
    w.add_argument(
        "--workers", type=int, default=None, metavar="N", help="processes writing shards (default: the cores)"
    )
    for name, text in (
        ("index", "build indexes for shards written by other tools"),
        ("verify", "full checksum + decode check"),
    ):
        c = sub.add_parser(name, help=text)
        c.error_prefix = "shards error: "
        c.add_argument("dir", type=Path, metavar="DIR")
        if name == "index":
            c.add_argument(
                "--accept-changed",
                action="store_true",
                help="index shards whose bytes differ from their index or the writer's record, as they are now",
            )
            c.add_argument(
                "--label",
                default="cls",
                metavar="SOURCE",
                help="where each sample's class index is: cls (KEY.cls digits, default), another extension, or "
                "EXT:FIELD for a JSON member's integer field (json:label); train with the same data.shard_label",
            )
    return p


def check(args) -> None:
    if args.val_fraction is not None and not 0 < args.val_fraction < 1:
        raise BadInput(f"shards error: --val-fraction must be between 0 and 1, got {args.val_fraction} (e.g. 0.1)")
    if args.max_side is not None and not 16 <= args.max_side <= 65535:
        raise BadInput(f"shards error: --max-side must be 16-65535 pixels, got {args.max_side} (e.g. 512)")
    if args.workers is not None and not 1 <= args.workers <= 1024:
        raise BadInput(f"shards error: --workers must be 1-1024, got {args.workers} (e.g. 8)")
    if not 1 <= args.quality <= 100:
        raise BadInput(f"shards error: --quality must be 1-100, got {args.quality} (e.g. 90)")
    if not 0.01 <= args.shard_size_mb <= 1 << 20:
        raise BadInput(f"shards error: --shard-size-mb must be 0.01-1048576, got {args.shard_size_mb} (e.g. 256)")
    if not 0 <= args.split_seed <= MAX_SEED:
        raise BadInput(f"shards error: --split-seed must be 0-{MAX_SEED}, got {args.split_seed} (e.g. 0)")


def run(argv: list[str] | None) -> int:
    args = parser().parse_args(argv)
    try:
        return command(args)
    except OSError as e:
        if not is_storage(e):
            raise
        what, folder = ("--out", args.out) if args.command == "write" else ("shard folder", args.dir)
        path = e.filename if e.filename is not None else folder  # a failed write() names no file
        if os.path.basename(os.fsdecode(path)).endswith(".tmp"):  # a temp name means nothing to the user
            path = os.path.dirname(os.fsdecode(path))
        raise refusal(e, path, prefix="shards error: ", what=what) from None


def command(args) -> int:
    if args.command == "write":
        check(args)
        from torchlaunch.data.shards.writer import write

        held_out = args.val_from is None and args.val_fraction is None
        if held_out:
            args.val_fraction = DEFAULT_VAL_FRACTION
        write(
            args.src.expanduser(),
            args.out.expanduser(),
            val_from=args.val_from,
            val_fraction=args.val_fraction,
            max_side=args.max_side,
            quality=args.quality,
            shard_size_mb=args.shard_size_mb,
            split_seed=args.split_seed,
            workers=args.workers or len(os.sched_getaffinity(0)),
        )
        if held_out:  # said after the write: a refusal stays one line
            print(
                f"shards: held out {DEFAULT_VAL_FRACTION:.0%} of --from as {args.out}/val (--split-seed "
                f"{args.split_seed}); --val-from or --val-fraction choose otherwise",
                file=sys.stderr,
                flush=True,
            )
        return OK
    from torchlaunch.data.shards.verify import index_folder, verify_folder

    if args.command == "index":
        n = index_folder(
            args.dir.expanduser(),
            log=lambda m: print(m, file=sys.stderr, flush=True),
            label=args.label,
            accept_changed=args.accept_changed,
        )
        print(f"shards: {n} shard index(es) built under {args.dir}", file=sys.stderr)
        return OK
    bad = 0
    for line in verify_folder(args.dir.expanduser()):
        print(line, file=sys.stderr, flush=True)
        bad += 1
    if bad:
        return BAD_INPUT
    print(f"shards: {args.dir} verified: every shard and member is good", file=sys.stderr)
    return OK


def main(argv: list[str] | None = None) -> int:
    try:
        return run(argv)
    except BadInput as e:
        # one line whatever a path or name in it holds: line breaks escaped, not cut (exit_codes._bounded)
        print(_bounded(str(e), 2400) if str(e) else type(e).__name__, file=sys.stderr)
        return BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
