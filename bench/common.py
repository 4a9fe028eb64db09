"""Shared benchmark machinery: interleaved paired timing, results, data and venv locations.

Why interleaving: the benchmark box is shared, so absolute speeds drift with other people's load.
Running project and baseline alternately (A, B, A, B, ...) and taking the median of the per-round
ratios cancels most of that drift, since both sides of one round see about the same load.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
SHARED_TARBALL_CANDIDATES = (
    Path("/work/shared/data/cifar10-train.tar.gz"),
    REPO.parent / "shared" / "data" / "cifar10-train.tar.gz",
)


@dataclass
class Result:
    """One benchmark figure: the project's number, the baseline's, their ratio and the goal."""

    key: str
    title: str
    project: float
    baseline: float
    unit: str
    ratio: float
    goal: float
    higher_is_better: bool
    command: str
    project_label: str = "project"
    baseline_label: str = "baseline"
    rounds: list[float] = field(default_factory=list)
    notes: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def met(self) -> bool:
        return self.ratio >= self.goal if self.higher_is_better else self.ratio <= self.goal

    def to_dict(self) -> dict:
        d = asdict(self)
        d["met"] = self.met
        return d


def paired_rates(sides: dict[str, Callable[[], float]], rounds: int, warmup: int = 1) -> dict[str, list[float]]:
    """Call every side once per round, in alternating order, and collect their returned rates.

    Each callable measures itself and returns a rate (higher = faster). The order alternates every
    round (A B, B A, ...) so neither side always runs first after the other's cache/thermal effects.
    """
    names = list(sides)
    for _ in range(warmup):
        for name in names:
            sides[name]()
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names if r % 2 == 0 else list(reversed(names))
        for name in order:
            out[name].append(sides[name]())
    return out


def interleaved_steps(
    a: Callable[[], object], b: Callable[[], object], groups: int, per_group: int, warmup: int = 1
) -> tuple[list[float], list[float]]:
    """Alternate single steps of a and b (a b, b a, ...) and return per-group steps/s for each.

    Step-level interleaving cancels load swings of a shared box far better than long rounds."""
    for _ in range(warmup):
        a()
        b()
    rates_a, rates_b = [], []
    for g in range(groups):
        ta = tb = 0.0
        for i in range(per_group):
            first_a = (g * per_group + i) % 2 == 0
            for fn in (a, b) if first_a else (b, a):
                start = time.perf_counter()
                fn()
                spent = time.perf_counter() - start
                if fn is a:
                    ta += spent
                else:
                    tb += spent
        rates_a.append(per_group / ta)
        rates_b.append(per_group / tb)
    return rates_a, rates_b


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def median_ratio(numerator: list[float], denominator: list[float]) -> tuple[float, list[float]]:
    """Median of per-round ratios (paired), plus the per-round ratios for the record."""
    ratios = [a / b for a, b in zip(numerator, denominator, strict=False) if b > 0]
    return (statistics.median(ratios) if ratios else float("nan")), ratios


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def shared_tarball() -> Path | None:
    override = os.environ.get("BENCH_CIFAR_TARBALL")
    for p in ([Path(override)] if override else []) + list(SHARED_TARBALL_CANDIDATES):
        if p.is_file():
            return p
    return None


def unpacked_cifar(work: Path) -> Path | None:
    """The shared CIFAR-10 JPEG copy unpacked under `work` (once); the folder of class folders."""
    target = work / "cifar10-jpeg" / "train"
    if (target / "truck").is_dir():
        return target
    tarball = shared_tarball()
    if tarball is None:
        return None
    (work / "cifar10-jpeg").mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarball) as tf:
        tf.extractall(work / "cifar10-jpeg", filter="data")
    return target


def subset_folder(source: Path, dest: Path, per_class: int) -> Path:
    """A class-folder tree of symlinks to the first `per_class` images of each class."""
    if dest.is_dir():
        return dest
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    for cls in sorted(p for p in source.iterdir() if p.is_dir()):
        (tmp / cls.name).mkdir(parents=True, exist_ok=True)
        for f in sorted(cls.iterdir())[:per_class]:
            os.symlink(f.resolve(), tmp / cls.name / f.name)
    os.rename(tmp, dest)
    return dest


def project_python() -> str:
    return sys.executable


def peers_python() -> Path:
    """The benchmark-only venv with Lightning + matplotlib (never a project dependency)."""
    return REPO / "bench" / ".venv-peers" / "bin" / "python"


PEER_PACKAGES = ("lightning", "accelerate", "matplotlib", "timm==1.0.31", "transformers==5.24.0")
"""timm and transformers: their real scripts under our launchers (a program with no signal handler)."""


def ensure_peers_venv(log: Callable[[str], None] = print) -> Path | None:
    """Create bench/.venv-peers on top of the project's torch (a .pth file), then pip install the
    peers into it: Lightning and HF Accelerate (the frameworks whose real scripts the tests run under
    our launchers, never project dependencies) and matplotlib. None when pip cannot install them
    (offline without an index)."""
    py = peers_python()
    probe = [str(py), "-c", "import lightning, accelerate, matplotlib, timm, transformers"]
    if py.is_file() and subprocess.run(probe, capture_output=True).returncode == 0:
        return py
    venv = py.parent.parent
    log(f"bench: creating {venv} (lightning + accelerate + matplotlib, peers only)")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    site = subprocess.run(
        [str(py), "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True, text=True, check=True
    ).stdout.strip()
    ours = subprocess.run(
        [sys.executable, "-c", "import site; print(site.getsitepackages()[0])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "project-venv.pth").write_text(ours + "\n")
    cmd = [str(py), "-m", "pip", "install", "-q", "-c", str(REPO / "constraints.txt"), *PEER_PACKAGES]
    if subprocess.run(cmd).returncode != 0 or subprocess.run(probe, capture_output=True).returncode != 0:
        log(f"bench: could not install {' '.join(PEER_PACKAGES)} into the peers venv; peer tests and plots skipped")
        return None
    return py


def set_threads(n: int) -> None:
    torch.set_num_threads(n)
    os.environ["OMP_NUM_THREADS"] = str(n)


def load_average() -> str:
    try:
        return " / ".join(f"{v:.1f}" for v in os.getloadavg())
    except OSError:
        return "n/a"
