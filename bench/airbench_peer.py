"""The project against the PyPI `airbench` package (0.1.8) on one GPU, in one call, on the same images:

    python -m bench.gpu --peer-airbench --data-root /tmp/c10/train [--test-root /tmp/c10/test] --out-dir OUT

1. packs the image folder into airbench's layout, `WORK/cifar10/{train,test}.pt`, each a dict of
   `images` (uint8, N x 32 x 32 x 3, HWC as torchvision's CIFAR10.data), `labels` (int64, N) and `classes`
   (list of str). train.pt is the project's own training split of --data-root (the seeded 90%), so both
   sides learn from the same 45,000 images; test.pt is --test-root when given, else the held-out 10%;
2. runs airbench94 and airbench96 (their own recipes, warm-up step first, as airbench's README says) in
   child processes with the wheel in bench/wheels/ on PYTHONPATH: imported from the zip, nothing is
   installed, and airbench is never a project dependency;
3. runs configs/fast.yaml and configs/fast93.yaml through `python -m launch.local --gpus 1` (one pass per
   1,024-image batch) and, with --test-root, `python -m train.evaluate` on those images;
4. prints the table (test top-1 on the same images, training seconds, images/s, command seconds) and
   writes it with every figure and each side's log tail to OUT/peer-airbench.{md,json}.

Training seconds: airbench's own figure (its timed regions: whitening init, the epochs, the final TTA
evaluation; not its per-epoch evaluations); the project's is `elapsed_s` of the final validation record
in metrics.jsonl (the fit loop: every epoch's validation and checkpoint saves included)."""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
WHEEL = REPO / "bench" / "wheels" / "airbench-0.1.8-py3-none-any.whl"
PEERS = ("airbench94", "airbench96")
PROJECT_CONFIGS = ("fast.yaml", "fast93.yaml")
GPU_OVERRIDES = ("train.micro_batch_size=0",)
"""The recipes split each 1,024-image batch into passes of 128 for CPUs; a GPU takes it in one pass."""


class PeerError(Exception):
    """Bad input for the benchmark: one line, exit code 2."""


# ---------------------------------------------------------------------------------------------- packing


def project_split(data_root: str, cache_dir: str) -> tuple[Any, Any, list[str]]:
    """The project's training and held-out sets of data_root, exactly as fast.yaml and fast93.yaml split
    it (both recipes must agree on the split, or the comparison would not be on the same images)."""
    from torchlaunch import config
    from torchlaunch.worker.data import load_bundle

    cfgs = [
        config.load(REPO / "configs" / name, [f"data.root={data_root}", f"data.cache_dir={cache_dir}"])
        for name in PROJECT_CONFIGS
    ]
    splits = {(c.data.val_fraction, c.data.split_seed, c.data.image_size) for c in cfgs}
    if len(splits) != 1:
        raise PeerError(
            f"bench error: {', '.join(PROJECT_CONFIGS)} hold out different splits {sorted(splits)} "
            f"(give them the same data.val_fraction and data.split_seed)"
        )
    data = cfgs[0].data
    if not Path(data_root).expanduser().is_dir():
        raise PeerError(
            f"bench error: --data-root {data_root} is not a folder (unpack the shared CIFAR-10 "
            f"copy and pass its train/ folder)"
        )
    bundle = load_bundle(data)
    return bundle.train, bundle.val, bundle.classes


def folder_set(root: str, cache_dir: str) -> tuple[Any, list[str]]:
    """Every image under a class-folder tree, decoded (through the project's decode cache)."""
    from torchlaunch.config import DataConfig
    from torchlaunch.worker.data import folder_images

    if not Path(root).expanduser().is_dir():
        raise PeerError(
            f"bench error: --test-root {root} is not a folder (pass a folder of class folders, "
            f"or leave it out to test on the held-out 10% of --data-root)"
        )
    return folder_images(DataConfig(name="imagefolder", root=root, loader="tensor", cache_dir=cache_dir))


def pack_file(images: torch.Tensor, labels: torch.Tensor, classes: list[str], path: Path) -> None:
    """One airbench file: uint8 NCHW images become torchvision's NHWC `data` layout."""
    if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] != 3:
        raise PeerError(
            f"bench error: images for {path.name} are {tuple(images.shape)} {images.dtype}, "
            f"need uint8 N x 3 x H x W (use data.loader=tensor images of one size)"
        )
    payload = {
        "images": images.permute(0, 2, 3, 1).contiguous(),
        "labels": labels.to(torch.int64).clone(),
        "classes": list(classes),
    }
    tmp = path.with_suffix(".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def pack(data_root: str, test_root: str | None, work: Path, cache_dir: str) -> dict[str, Any]:
    """WORK/cifar10/{train,test}.pt from the project's split (and --test-root); returns what was packed."""
    train, held_out, classes = project_split(data_root, cache_dir)
    source = f"held-out 10% of {data_root}"
    test = held_out
    if test_root:
        test, test_classes = folder_set(test_root, cache_dir)
        if test_classes != classes:
            raise PeerError(
                f"bench error: --test-root {test_root} has classes {test_classes}, the training "
                f"folder {classes} (use the same class folders)"
            )
        source = str(test_root)
    folder = work / "cifar10"
    folder.mkdir(parents=True, exist_ok=True)
    pack_file(train.images, train.labels, classes, folder / "train.pt")
    pack_file(test.images, test.labels, classes, folder / "test.pt")
    return {"train_images": len(train), "test_images": len(test), "test_source": source, "folder": str(folder)}


def check_pack(folder: Path) -> dict[str, tuple[int, ...]]:
    """Reload both files the safe way and check airbench's format: what its CifarLoader indexes."""
    shapes = {}
    for split in ("train", "test"):
        data = torch.load(folder / f"{split}.pt", weights_only=True)
        images, labels = data["images"], data["labels"]
        assert images.dtype == torch.uint8 and images.dim() == 4 and images.shape[3] == 3, images.shape
        assert labels.dtype == torch.int64 and labels.shape == (images.shape[0],), labels.shape
        assert isinstance(data["classes"], list) and int(labels.max()) < len(data["classes"])
        shapes[split] = tuple(images.shape)
    return shapes


# ---------------------------------------------------------------------------------------------- airbench


def parse_airbench_table(text: str) -> dict[str, float]:
    """The `eval` row of airbench's printed table: its TTA accuracy and its own training seconds."""
    header: list[str] | None = None
    for line in text.splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "epoch" in cells and "total_time_seconds" in cells:
            header = cells
        elif header and len(cells) == len(header) and cells[header.index("epoch")] == "eval":
            row = dict(zip(header, cells, strict=True))
            return {"tta_val_acc": float(row["tta_val_acc"]), "total_time_seconds": float(row["total_time_seconds"])}
    return {}


class _Tee(io.StringIO):
    """Keeps what airbench prints (to parse its table) and passes it on to stderr as it comes (the log)."""

    def write(self, text: str) -> int:
        sys.stderr.write(text)
        return super().write(text)


def airbench_child(variant: str) -> int:
    """Runs in WORK (airbench reads ./cifar10/): warm-up, one timed training, one JSON line on stdout."""
    import airbench

    lib = sys.modules[f"airbench.lib_{variant}"]
    number = variant.removeprefix("airbench")
    log = _Tee()
    with redirect_stdout(log):
        getattr(airbench, f"warmup{number}")()
        torch.cuda.synchronize()
        start = time.perf_counter()
        model = getattr(airbench, f"train{number}")()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    hyp = lib.hyp
    batches = len(airbench.CifarLoader("cifar10", train=True, batch_size=hyp["opt"]["batch_size"]))
    images = math.ceil(batches * hyp["opt"]["train_epochs"]) * hyp["opt"]["batch_size"]
    test = airbench.CifarLoader("cifar10", train=False, batch_size=2000)
    accuracy = airbench.evaluate(model, test, tta_level=hyp["net"]["tta_level"])
    own = parse_airbench_table(log.getvalue())
    train_s = own.get("total_time_seconds", wall)
    print(
        json.dumps(
            {
                "name": variant,
                "test_acc": accuracy,
                "test_images": len(test.labels),
                "train_s": train_s,
                "images_per_s": images / train_s,
                "images": images,
                "train_call_s": wall,
                "epochs": hyp["opt"]["train_epochs"],
                "own_table": own,
            }
        )
    )
    return 0


def run_airbench(variant: str, work: Path, timeout_s: float) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(WHEEL)]), "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    try:
        out = subprocess.run(
            [sys.executable, "-m", "bench.airbench_peer", "--child", variant],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as e:
        return {"name": variant, "error": f"timed out after {timeout_s:.0f} s", "log_tail": str(e.stderr)[-3000:]}
    row: dict[str, Any] = {"name": variant, "command_s": time.perf_counter() - start}
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode or not lines:
        row["error"] = f"exit {out.returncode}"
    else:
        row.update(json.loads(lines[-1]))
    row["log_tail"] = out.stderr[-3000:]
    return row


# ---------------------------------------------------------------------------------------------- project


def metrics_summary(run_dir: Path) -> dict[str, Any]:
    """Final validation, training seconds and the median training images/s from RUN_DIR/metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    records = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.is_file() else []
    vals = [r for r in records if "val_acc" in r]
    rates = [r["images_per_s"] for r in records if "images_per_s" in r]
    summary: dict[str, Any] = {}
    if vals:
        summary.update(
            val_acc=vals[-1]["val_acc"],
            train_s=vals[-1].get("elapsed_s"),
            epochs=len(vals),
            tta=vals[-1].get("tta", "none"),
        )
    if rates:
        summary["images_per_s"] = statistics.median(rates[1:] or rates)  # the first window holds the warm-up
    return summary


def run_project(
    config: str,
    overrides: list[str],
    data_root: str,
    test_root: str | None,
    timeout_s: float,
    runs: Path,
    cache_dir: str,
    common: tuple[str, ...] = (),
) -> dict[str, Any]:
    """One recipe through the launcher on one GPU, on the decode cache the packing step filled."""
    runs.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=f"{Path(config).stem}-", dir=runs))
    name = " ".join([config, *overrides])
    argv = [
        sys.executable,
        "-m",
        "torchlaunch.agent",
        "--gpus",
        "1",
        "--config",
        str(REPO / "configs" / config),
        f"run_dir={run_dir}",
        f"data.root={data_root}",
        f"data.cache_dir={cache_dir}",
        *GPU_OVERRIDES,
        *common,
        *overrides,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    try:
        out = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        return {"name": name, "error": f"timed out after {timeout_s:.0f} s", "log_tail": str(e.stderr)[-3000:]}
    row: dict[str, Any] = {
        "name": name,
        "command_s": time.perf_counter() - start,
        "run_dir": str(run_dir),
        **metrics_summary(run_dir),
        "log_tail": (out.stdout + out.stderr)[-3000:],
    }
    if out.returncode:
        row["error"] = f"exit {out.returncode}"
        return row
    row["test_acc"] = row.get("val_acc")
    if test_root:
        ev = subprocess.run(
            [sys.executable, "-m", "torchlaunch.worker.evaluate", "--run-dir", str(run_dir), "--data-root", test_root],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        lines = [ln for ln in ev.stdout.splitlines() if ln.startswith("{")]
        row["test_acc"] = json.loads(lines[-1])["accuracy"] if ev.returncode == 0 and lines else None
        if row["test_acc"] is None:
            row["error"] = f"evaluate exit {ev.returncode}: {ev.stderr.strip()[-300:]}"
    return row


# ---------------------------------------------------------------------------------------------- report


def render_table(rows: list[dict[str, Any]], packed: dict[str, Any]) -> str:
    """Markdown: one row per run, figures the same way for both sides."""

    def num(v: Any, fmt: str) -> str:
        return format(v, fmt) if isinstance(v, int | float) and not isinstance(v, bool) else "-"

    lines = [
        f"Test top-1 on {packed.get('test_images', '?'):,} images ({packed.get('test_source', '?')}); "
        f"every run trains on the same {packed.get('train_images', '?'):,} images.",
        "",
        "| run | test top-1 | training s | images/s | command s | note |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        acc = r.get("test_acc")
        lines.append(
            f"| {r['name']} | {num(acc * 100 if isinstance(acc, float) else None, '.2f')}% "
            f"| {num(r.get('train_s'), '.1f')} | {num(r.get('images_per_s'), ',.0f')} "
            f"| {num(r.get('command_s'), '.1f')} | {r.get('error', '')} |"
        )
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--peer-airbench")
    g.add_argument(
        "--test-root",
        help="held-out test images as class folders (default: the held-out 10%% of "
        "--data-root, which no run trains on)",
    )
    g.add_argument("--out-dir", type=Path, help="where peer-airbench.{md,json} go (default: a temp folder)")
    g.add_argument(
        "--work-dir",
        type=Path,
        help="where cifar10/{train,test}.pt are packed and the project's runs/ go (default: a temp folder)",
    )
    g.add_argument("--cache-dir", default="~/.cache/torchlaunch", help="the project's decode cache")
    g.add_argument("--pack-only", action="store_true", help="pack and check the airbench files, train nothing")
    g.add_argument("--peers", nargs="*", default=list(PEERS), choices=PEERS, help="airbench recipes to run")
    g.add_argument(
        "--extra",
        action="append",
        default=[],
        metavar="CONFIG[:KEY=VALUE,...]",
        help="one more project run, e.g. fast93.yaml:train.epochs=32 (repeatable)",
    )
    g.add_argument(
        "--project-overrides",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="applied to every project run, e.g. train.max_steps=2 for a dry run",
    )
    g.add_argument("--stage-timeout", type=float, default=150, help="seconds for each run (default 150)")


def main(args: argparse.Namespace) -> int:
    from torchlaunch.exit_codes import BadInput

    if not args.data_root:
        print("bench error: --peer-airbench needs --data-root (the unpacked CIFAR-10 train/ folder)", file=sys.stderr)
        return 2
    if not WHEEL.is_file():
        print(f"bench error: the airbench wheel {WHEEL} is missing (restore bench/wheels/ from git)", file=sys.stderr)
        return 2
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="airbench-data-"))
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="peer-airbench-out-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        start = time.perf_counter()
        packed = pack(args.data_root, args.test_root, work, args.cache_dir)
        packed["shapes"] = check_pack(work / "cifar10")
        packed["pack_s"] = time.perf_counter() - start
    except (PeerError, BadInput) as e:
        print(str(e).splitlines()[0], file=sys.stderr)
        return 2
    print(f"packed {packed}", file=sys.stderr, flush=True)
    if args.pack_only:
        print(json.dumps(packed))
        return 0
    if args.peers and not torch.cuda.is_available():
        print(
            "bench error: no CUDA GPU visible (airbench needs one; --pack-only packs without, and --peers with "
            "no names runs only the project's side)",
            file=sys.stderr,
        )
        return 2
    jobs: list[tuple[str, Any]] = []
    for config, peer in zip(PROJECT_CONFIGS, PEERS, strict=True):  # each project recipe next to its peer
        jobs.append(("project", (config, [])))
        if peer in args.peers:
            jobs.append(("peer", peer))
    for extra in args.extra:
        config, _, rest = extra.partition(":")
        jobs.append(("project", (config, [kv for kv in rest.split(",") if kv])))
    rows: list[dict[str, Any]] = []
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU)"
    report = {"gpu": gpu, "torch": torch.__version__, "packed": packed, "runs": rows}
    for kind, what in jobs:
        row = (
            run_project(
                what[0],
                what[1],
                args.data_root,
                args.test_root,
                args.stage_timeout,
                work / "runs",
                args.cache_dir,
                tuple(args.project_overrides),
            )
            if kind == "project"
            else run_airbench(what, work, args.stage_timeout)
        )
        rows.append(row)
        brief = {k: v for k, v in row.items() if k not in ("log_tail", "own_table")}
        print(json.dumps(brief), file=sys.stderr, flush=True)
        table = render_table(rows, packed)  # written after every run: a session cut short keeps what ran
        (out_dir / "peer-airbench.md").write_text(table + "\n")
        (out_dir / "peer-airbench.json").write_text(json.dumps(report, indent=1) + "\n")
    print(table)
    return 0 if not any("error" in r for r in rows) else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        sys.exit(airbench_child(sys.argv[2]))
    print("run it as: python -m bench.gpu --peer-airbench --data-root DIR (see --help)", file=sys.stderr)
    sys.exit(2)
