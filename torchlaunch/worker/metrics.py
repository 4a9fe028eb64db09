"""What a run tells the user: metrics.jsonl (+ optional TensorBoard) and progress lines on rank 0,
the per-rank batch trace. The only files the training loop writes besides checkpoints.

No torch import at module level: the records are plain numbers the loop already read at a log point.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchlaunch import contract, rundir
from torchlaunch.exit_codes import ConfigError
from torchlaunch.jobs import ranklog
from torchlaunch.jobs.state import WORLD_EVENT  # status reads the event back

if TYPE_CHECKING:
    from torchlaunch.core.dist import DistContext
    from torchlaunch.core.sampler import BatchPlan


@dataclass(frozen=True)
class WorldSize:
    """The ranks an attempt runs on, and its nodes when the env contract tells them (every node runs
    LOCAL_WORLD_SIZE ranks); None when it does not (an old checkpoint, uneven nodes)."""

    ranks: int
    nodes: int | None = None

    @classmethod
    def of(cls, ctx: DistContext) -> WorldSize:
        local = ctx.local_world_size
        return cls(ctx.world_size, ctx.world_size // local if local >= 1 and ctx.world_size % local == 0 else None)


def world_change_line(step: int, now: WorldSize, was: WorldSize, plan: BatchPlan) -> str:
    """The one line rank 0 prints when a run resumes on another world size, e.g.
    `node lost: continuing on 1 of 2 nodes from step 480, global batch 48 kept as 1 x 48`."""
    ranks = f"{now.ranks} rank{'s' if now.ranks != 1 else ''} (was {was.ranks})"
    if now.nodes is not None and was.nodes is not None and now.nodes != was.nodes:
        moved = abs(was.nodes - now.nodes)
        which = "node" if moved == 1 else f"{moved} nodes"
        if now.nodes < was.nodes:
            head = f"{which} lost: continuing on {now.nodes} of {was.nodes} nodes"
        else:
            head = f"{which} joined: continuing on {now.nodes} nodes (was {was.nodes})"
        if now.ranks != now.nodes or was.ranks != was.nodes:
            head += f", {ranks}"
    else:
        head = f"world size changed: continuing on {ranks}"
    shares = plan.shares_text()
    kept = f"shares {shares}" if "/" in shares else shares
    passes = f" in {plan.accumulation} micro-steps" if plan.accumulation > 1 else ""
    return f"{head} from step {step}, global batch {plan.global_batch} kept as {kept}{passes}"


class MetricsLog:
    """A JSON-lines file; on resume, lines past the checkpoint are dropped so a resumed run's log
    reads like one uninterrupted run."""

    def __init__(
        self,
        path: Path,
        enabled: bool,
        resume_step: int | None,
        tensorboard_dir: Path | None = None,
        real_folder: bool = False,
    ) -> None:
        """`real_folder`: the file's folder is one of the run dir's (trace/), never a link: refused in one
        line (rundir.check_real_folder) before it is made or written in. Opened once: a link planted
        later is not followed (the file stays open)."""
        self.path, self.enabled = path, enabled
        self.tb = None
        if not enabled:
            return
        if real_folder:
            rundir.check_real_folder(
                path.parent,
                prefix="config error: run_dir: ",
                what=f"RUN_DIR/{path.parent.name}",
                fix="remove the link (nothing is written through one), or pick another run_dir",
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        if tensorboard_dir is not None:
            self.tb = open_tensorboard(tensorboard_dir, purge_step=resume_step + 1 if resume_step is not None else None)
        if resume_step is not None and path.is_file():
            kept = [
                ln
                for ln in path.read_text().splitlines()
                if _line_step(ln) is not None and _line_step(ln) <= resume_step
            ]
            rundir.write_text(path, "".join(ln + "\n" for ln in kept), real_folder=real_folder)
        elif resume_step is None and path.is_file():
            path.unlink()
        # Through ranklog.open_log: a FIFO or a symlink under the name is replaced, never blocked on or written through.
        self._fh = os.fdopen(ranklog.open_log(str(path)), "a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            self._fh.write(json.dumps(record) + "\n")
            if self.tb is not None:
                for key, value in record.items():
                    if key not in ("step", "epoch") and isinstance(value, (int, float)):
                        self.tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self.enabled:
            self._fh.close()
            if self.tb is not None:
                self.tb.close()


def require_tensorboard():  # noqa: ANN201 - SummaryWriter, imported only when asked for
    """The SummaryWriter class, or one clear line when the optional package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(
            "train.tensorboard",
            "the tensorboard package is not installed",
            "pip install -e '.[tensorboard]', or set train.tensorboard=false",
        ) from None
    return SummaryWriter


def open_tensorboard(folder: Path, purge_step: int | None):  # noqa: ANN201
    return require_tensorboard()(log_dir=str(folder), purge_step=purge_step)


def _line_step(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


class Reporter:
    """Rank-0 progress: a tqdm bar on a terminal, plain periodic lines in batch logs."""

    def __init__(self, enabled: bool, total_steps: int, start_step: int) -> None:
        self.enabled = enabled
        self.bar = None
        if enabled and (sys.stderr.isatty() or contract.get(contract.PROGRESS_BAR) == "1"):
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
            except ImportError:
                self.bar = None

    def step(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def line(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class RunLog:
    """One run's outputs: rank 0's metrics and progress, every rank's batch trace (debug.trace_batches).

    Figures arrive as host numbers read at log points; throughput is measured here over the steps
    since the previous training record."""

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        *,
        epochs: int,
        steps_per_epoch: int,
        total_steps: int,
        global_batch: int,
        start_step: int,
        resume_step: int | None,
        tensorboard: bool,
        trace: bool,
        started_as: int | None = None,
        world_size: int | None = None,
    ) -> None:
        """`rank`: this rank's place in the group now (rank 0 writes the run's metrics); `started_as`:
        the rank its launcher started it as (default `rank`), which names its own files: a live joiner
        seated at another place must not write into the files of the member that holds that place."""
        main = rank == 0
        rank = rank if started_as is None else started_as
        self.run_dir, self.rank, self.total_steps = run_dir, rank, total_steps
        self.epochs, self.steps_per_epoch, self.global_batch = epochs, steps_per_epoch, global_batch
        self.metrics = MetricsLog(
            rundir.metrics(run_dir), main, resume_step, rundir.tensorboard(run_dir) if tensorboard else None
        )
        self.batches = MetricsLog(rundir.trace(run_dir) / f"rank{rank}.jsonl", trace, resume_step, real_folder=True)
        self.tracing = trace
        if trace and main and resume_step is not None and world_size is not None:
            self._cut_absent_ranks(world_size, resume_step)
        self.report = Reporter(main, total_steps, start_step)
        self.run_start = self.window_start = time.perf_counter()
        self._startup_note = ""

    def _cut_absent_ranks(self, world_size: int, resume_step: int) -> None:
        """A resume on fewer ranks: the files of ranks this world does not start (rank N >= world size)
        lose their lines past the checkpoint, as each started rank's own file does. Else a step those
        ranks traced and never committed (the step a stop dropped in flight, steps after the last
        checkpoint before a crash) stays beside the resumed run's record of it."""
        for path in rundir.trace(self.run_dir).glob("rank*.jsonl"):
            place = path.name[len("rank") : -len(".jsonl")]
            if place.isascii() and place.isdigit() and int(place) >= world_size:
                MetricsLog(path, True, resume_step, real_folder=True).close()

    def begin(self) -> None:
        """Training starts now: elapsed time and the first throughput window count from here."""
        self.run_start = self.window_start = time.perf_counter()

    def line(self, text: str) -> None:
        self.report.line(text)

    def trace(
        self,
        step: int,
        epoch: int,
        world_size: int,
        indices: list[int],
        augmentation: dict[str, list] | None = None,
        generation: int | None = None,
    ) -> None:
        """One step's samples on this rank, with the augmentation each got (TrainLoader.step_trace). In
        live mode `generation` is the group's (live/fence.py): a step interrupted by a lost rank
        is traced again by the next group, whose records are the ones that trained."""
        record = {"step": step, "epoch": epoch, "world_size": world_size, "indices": indices}
        if generation is not None:
            record["generation"] = generation
        self.batches.write({**record, **(augmentation or {})})

    def event(self, record: dict[str, object]) -> None:
        """A live-recovery event of this rank (regrouped, first step after it), one JSON line in
        RUN_DIR/live/events-rank<r>.jsonl (r: the rank this process started as): what bench/live.py reads."""
        path = rundir.live(self.run_dir) / f"events-rank{self.rank}.jsonl"
        path.parent.mkdir(exist_ok=True)
        # Through ranklog.open_log: a link or FIFO under the name is replaced, never written through.
        with os.fdopen(ranklog.open_log(str(path)), "a") as fh:
            fh.write(json.dumps(record) + "\n")

    def promote(self, step: int) -> None:
        """This rank became rank 0 (the first one was lost): it writes the metrics and progress lines
        from here, after the lines the lost rank 0 wrote up to `step`."""
        self.metrics.close()
        self.metrics = MetricsLog(rundir.metrics(self.run_dir), True, step)
        self.report = Reporter(True, self.total_steps, step)

    def startup(self, step: int, epoch: int, startup_s: float, first_step_s: float) -> None:
        """This process's start-up figures, also shown in its first progress line."""
        self.metrics.write({"step": step, "epoch": epoch, "startup_s": startup_s, "first_step_s": first_step_s})
        self._startup_note = f", start-up {startup_s:.2f} s (process start to first step)"

    def stepped(self) -> None:
        self.report.step()

    def train(self, step: int, epoch: int, step_in_epoch: int, steps: int, loss: float, lr: float) -> None:
        """The training record of the `steps` steps since the previous one; `loss` is their mean."""
        now = time.perf_counter()
        rate = steps * self.global_batch / max(now - self.window_start, 1e-9)
        self.metrics.write(
            {
                "step": step,
                "epoch": epoch,
                "loss": loss,
                "lr": lr,
                "images_per_s": rate,
                "elapsed_s": now - self.run_start,
            }
        )
        self.line(
            f"epoch {epoch + 1}/{self.epochs} step {step_in_epoch}/{self.steps_per_epoch} loss {loss:.4f} "
            f"lr {lr:.4g} {rate:,.0f} img/s{self._startup_note}"
        )
        self._startup_note = ""
        self.window_start = time.perf_counter()

    def world_changed(self, step: int, epoch: int, now: WorldSize, was: WorldSize, plan: BatchPlan) -> None:
        """The run continues on another world size: one line, and an event record in metrics.jsonl."""
        self.line(world_change_line(step, now, was, plan))
        self.metrics.write(
            {
                "step": step,
                "epoch": epoch,
                "event": WORLD_EVENT,
                "world_size": now.ranks,
                "previous_world_size": was.ranks,
                "nodes": now.nodes,
                "previous_nodes": was.nodes,
                "shares": plan.shares_text(),
            }
        )

    def validation(self, step: int, epoch: int, val: dict[str, Any]) -> None:
        self.metrics.write({"step": step, "epoch": epoch, **val, "elapsed_s": time.perf_counter() - self.run_start})
        tta = val.get("tta", "none")
        self.line(
            f"epoch {epoch + 1}/{self.epochs} validation: loss {val['val_loss']:.4f} "
            f"top-1 {val['val_acc']:.4f} ({int(val['val_samples'])} images"
            f"{', test-time augmentation ' + tta if tta != 'none' else ''})"
        )

    def close(self) -> None:
        self.metrics.close()
        self.batches.close()
        self.report.close()
