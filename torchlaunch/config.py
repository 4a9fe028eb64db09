"""The run's configuration: nested dataclasses, YAML + dotted overrides, validation with clear errors.

Launchers resolve defaults + YAML + overrides once and write RUN_DIR/config.yaml; every rank and every
requeue reads that one file. It is written once, when the run dir has none: a later launch that resolves
to other values is refused with the keys that differ, unless it asks for the change (`--reconfigure`,
settle_resolved), which says from which step the new values apply and which ones a resume cannot use.
This module never reads environment variables and never imports torch, so launchers can validate a
config before anything is started.

Each field carries its own rule in its metadata, next to its default and its docstring:
`field(default=0.1, metadata=above(0, MAX_LR, "e.g. optim.lr=0.1"))` or `metadata=choice(("sgd", "adamw"))`;
`rules()` lists them and `validate` checks them, then the rules that tie two fields together. Every
problem is one ConfigError line: `config error: KEY: PROBLEM (FIX)`.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import os
import re
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from torchlaunch import rundir, suggest
from torchlaunch.base.rules import (  # noqa: F401 - the rule vocabulary, named here too for its readers
    SEED_LIMIT,
    Bound,
    Choice,
    above,
    at_least,
    bound,
    choice,
    interval,
    seed_bound,
    service_address,
)
from torchlaunch.base.untrusted import DepthGuard, TooComplex, check_yaml, quote
from torchlaunch.data import section
from torchlaunch.exit_codes import BadInput, ConfigError
from torchlaunch.stop_signals import STOP_SIGNAL_NAMES

MAX_TIMEOUT_S = 30 * 86400.0
"""The longest process-group timeout: finite (a timedelta and torch's milliseconds must hold it)."""


MAX_WIDTH = 8192
"""Base channel width of the built-in models."""
MAX_LR = 1e30
"""A learning rate is no machine resource: the cap keeps it a number; a diverging one is the loss
check's to report (non-finite loss, exit 2)."""
MAX_EPOCHS = 10**6
MAX_STEPS = 10**12
MAX_BATCH = 2**24
MAX_LEAD_TIME_S = 7 * 86400.0
MIN_TIMEOUT_S = 10.0
"""The shortest process-group timeout: below it a healthy collective (a checkpoint gather, the first
NCCL set-up) fails for want of time, not because a peer is lost."""


DataConfig = section.data_config()
"""The data section: the keys every format shares (torchlaunch.data.section.SharedData) and each
registered format's own section (DataFormat.options), flat under `data.`; composed by the data floor,
which owns the formats (a format registered later joins at the next load: `_hints`)."""


SIMPLE_CNN_SIZES = range(32, 40)
"""Image sides simple_cnn (torchlaunch.worker.models) takes: three 2x max-pools must leave 4x4 for its
linear classifier. Checked here, before any rank starts, not at the first forward pass."""
TORCHVISION_PREFIX = "torchvision."
"""model.name=torchvision.<name> builds torchvision's model <name>; torchlaunch.worker.models checks the
name when it builds the model (this module never imports torch)."""
KNOWN_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT", "SIGCONT")


@dataclass
class ModelConfig:
    name: str = field(
        default="simple_cnn",
        metadata=choice(
            ("simple_cnn", "resnet18", "fastnet", "fastnet93"), open_prefix=TORCHVISION_PREFIX, plugin=True
        ),
    )
    """`simple_cnn`, `resnet18` (CIFAR stem), `fastnet` (airbench-style fast CIFAR net whose first
    layer is a fixed patch-whitening filter computed from the training images), `fastnet93` (fastnet wider
    and deeper, a residual third conv per group: configs/fast93.yaml), or `torchvision.<name>`:
    any torchvision classification model as published, untrained, e.g. `torchvision.resnet18` (ImageNet
    stem; torchvision.models.list_models names them; model.width=0), or your own as an import path
    `pkg.module:factory`, called as factory(num_classes=N), plus width=W when model.width is set
    (imported from the run's working directory or PYTHONPATH; see examples/my_models.py)."""
    width: int = field(default=0, metadata=at_least(0, MAX_WIDTH, "use 0 for the model's default width"))
    """Base channel width (0 = the model's default)."""
    compile: bool = False
    """torch.compile the model (slow first steps; helps long GPU runs)."""
    init_from: str = ""
    """Start a fresh run from these weights: a run folder (its newest valid checkpoint, else its
    model.pt), a checkpoint folder (step-...), or a .pt file holding a state_dict or a checkpoint's
    state.pt; loaded with weights_only on CPU. Ignored (and logged) when the run resumes from its own
    checkpoint. Empty = the model's own initialisation."""
    init_strict: bool = True
    """init_from must match the model exactly (missing, unexpected or differently shaped tensors are
    exit 2). false: load what fits, keep the fresh init for the rest (e.g. a new classifier head for
    another class count) and list every skipped tensor in one block."""


@dataclass
class OptimConfig:
    name: str = field(default="sgd", metadata=choice(("sgd", "adamw")))
    """`sgd` or `adamw`."""
    lr: float = field(default=0.1, metadata=above(0, MAX_LR, "use a positive learning rate such as optim.lr=0.1"))
    """Peak learning rate for the global batch."""
    momentum: float = field(default=0.9, metadata=interval(0, 1, "[)", "e.g. optim.momentum=0.9"))
    """SGD momentum."""
    nesterov: bool = True
    """SGD Nesterov momentum."""
    weight_decay: float = field(default=5e-4, metadata=at_least(0, 10, "e.g. optim.weight_decay=5e-4"))
    """Decoupled for AdamW, L2 for SGD."""
    betas: list[float] = field(
        default_factory=lambda: [0.9, 0.999],
        metadata=bound(
            lambda v: len(v) == 2 and all(0.0 <= b < 1.0 for b in v),
            "must be two numbers in [0, 1)",
            "e.g. optim.betas=[0.9,0.999]",
        ),
    )
    """AdamW betas."""
    schedule: str = field(default="cosine", metadata=choice(("cosine", "linear", "step", "constant")))
    """`cosine`, `linear` (straight down to min_lr_ratio), `step` or `constant` after warmup."""
    warmup_epochs: float = field(default=0.0, metadata=at_least(0, MAX_EPOCHS, "use 0 for no warmup"))
    """Linear warmup length in epochs (fractions allowed)."""
    warmup_start_ratio: float = field(default=0.0, metadata=interval(0, 1, "[]", "e.g. 0.2"))
    """LR at the first warmup step as a fraction of `lr` (0 = ramp from lr/warmup_steps)."""
    norm_lr_scale: float = field(default=1.0, metadata=above(0, 1000, "use 1 for the same LR as the other weights"))
    """LR multiplier for BatchNorm parameters; their weight decay is divided by it, so the decay per step
    is unchanged (airbench's "bias scaler": BatchNorm biases learn much faster than conv weights)."""
    lookahead_every: int = field(default=0, metadata=at_least(0, MAX_STEPS, "use 0 to turn lookahead off, e.g. 5"))
    """Every N steps pull the weights toward a slow exponential average and copy it back; the run ends
    on the average (0 = off). Smooths the end of short, high-LR runs."""
    lookahead_decay: float = field(default=0.7738, metadata=interval(0, 1, "[)", "e.g. 0.7738, that is 0.95**5"))
    """Lookahead: weight of the average at the end of the run; it rises as decay * progress^3."""
    step_epochs: int = field(default=30, metadata=at_least(1, MAX_EPOCHS, "e.g. optim.step_epochs=30"))
    """`step` schedule: epochs between decays."""
    step_gamma: float = field(default=0.1, metadata=interval(0, 1, "(]", "e.g. optim.step_gamma=0.1"))
    """`step` schedule: decay factor."""
    min_lr_ratio: float = field(default=0.0, metadata=interval(0, 1, "[]", "e.g. 0.0"))
    """`cosine` schedule: final LR as a fraction of `lr`."""


@dataclass
class TrainConfig:
    epochs: int = field(default=10, metadata=at_least(1, MAX_EPOCHS, "e.g. train.epochs=10"))
    """Passes over the training set."""
    batch_size: int = field(default=256, metadata=at_least(1, MAX_BATCH, "e.g. train.batch_size=256"))
    """Global batch per optimizer step, summed over all ranks; kept on any world size from 1 to it (ranks'
    shares differ by at most one sample when the world size does not divide it)."""
    micro_batch_size: int = field(default=0, metadata=at_least(0, MAX_BATCH, "use 0 for batch_size / world size"))
    """At most this many samples per rank per forward pass (0 = the rank's whole share of the batch):
    every rank accumulates ceil(largest share / this) micro-batches per step; any value works."""
    exact: bool = False
    """The exact grid (docs/contracts.md): the model's bits do not depend on the world size nor on a
    failure, resume or regroup; fixed micro-batches of train.grid_micro_batches, summed in fixed point."""
    grid_micro_batches: int = field(default=0, metadata=at_least(0, MAX_BATCH, "use 0 for auto"))
    """train.exact: micro-batches per global step, a divisor of batch_size at least the largest world
    size (0 = the smallest divisor >= 8). Each is batch_size / this samples; train.micro_batch_size is
    not used."""
    precision: str = field(default="auto", metadata=choice(("auto", "fp32", "bf16", "fp16")))
    """`fp32`, `bf16`, `fp16` (with GradScaler) or `auto` (bf16 where supported, else fp32)."""
    channels_last: bool = True
    """Use the channels_last memory format (faster convolutions with bf16)."""
    clip_grad_norm: float = field(default=0.0, metadata=at_least(0, 1e6, "use 0 to disable clipping"))
    """Clip the global gradient norm to this value (0 = off)."""
    label_smoothing: float = field(default=0.0, metadata=interval(0, 1, "[)", "e.g. 0.1"))
    """CrossEntropy label smoothing."""
    log_every_steps: int = field(default=20, metadata=at_least(1, MAX_STEPS, "e.g. train.log_every_steps=20"))
    """Progress line and metrics.jsonl record every N steps."""
    max_steps: int = field(default=0, metadata=at_least(0, MAX_STEPS, "use 0 to run all epochs"))
    """Stop after this many optimizer steps in total (0 = run all epochs)."""
    tensorboard: bool = False
    """Also write TensorBoard event files to RUN_DIR/tb (needs the tensorboard package)."""
    tta: str = field(default="none", metadata=choice(("none", "flip", "flip_translate")))
    """Test-time augmentation of the final validation: `none`, `flip` (mean of the image and its mirror)
    or `flip_translate` (also 1-pixel shifts, 6 passes). Earlier epochs validate without it."""


@dataclass
class CheckpointConfig:
    every_steps: int = field(default=0, metadata=at_least(0, MAX_STEPS, "use 0 for epoch-end checkpoints only"))
    """Checkpoint every N optimizer steps (0 = only at epoch ends)."""
    every_epochs: int = field(default=1, metadata=at_least(0, MAX_EPOCHS, "e.g. checkpoint.every_epochs=1"))
    """Checkpoint at the end of every N epochs (0 = never at epoch ends)."""
    keep: int = field(default=2, metadata=at_least(2, 10_000, "keep at least 2 so a corrupt newest one has a fallback"))
    """Newest checkpoints kept (>= 2); the best by validation accuracy is kept too."""
    resume: str = "auto"
    """`auto` (newest checkpoint that verifies), `never`, or the path of a checkpoint folder."""
    async_save: bool = True
    """Write periodic checkpoints in the background; the preemption save is always synchronous."""


@dataclass
class DistConfig:
    timeout_s: float = field(
        default=300.0,
        metadata=bound(
            lambda v: MIN_TIMEOUT_S <= v <= MAX_TIMEOUT_S,
            f"must be at least {MIN_TIMEOUT_S:.0f} and at most {MAX_TIMEOUT_S:.0f} (30 days)",
            "e.g. 300",
        ),
    )
    """Process-group timeout: a lost peer fails the collective after this many seconds. The group's
    start (every rank arriving) waits at least 300 s (torchlaunch.core.dist.START_WAIT_S)."""
    backend: str = field(default="auto", metadata=choice(("auto", "nccl", "gloo")))
    """`auto` (nccl on CUDA, gloo on CPU), `nccl` or `gloo`."""
    pin_cpus: bool = True
    """CPU workers sharing a machine: each local rank runs on its own slice of the cores it may use."""
    shared_memory_reduce: bool = True
    """CPU jobs on one machine: average gradients through /dev/shm instead of gloo's TCP ring (same
    numbers, bit for bit; falls back to gloo by itself where /dev/shm is missing or too small)."""


@dataclass
class PreemptionConfig:
    signals: list[str] = field(default_factory=lambda: list(STOP_SIGNAL_NAMES), metadata=choice(KNOWN_SIGNALS))
    """Signals that mean "checkpoint and stop": the handler only sets a flag."""
    lead_time_s: float = field(default=0.0, metadata=at_least(0, MAX_LEAD_TIME_S, "use 0 when unknown"))
    """Seconds between the signal and the hard kill (Slurm signal delay, k8s grace); 0 = unknown.
    A warning is printed when it is below 3x the measured save time."""


LIVE_BY_DEFAULT = False
"""recovery.live's default: the one switch that makes live recovery every multi-rank run's road (issue
#54). Not flipped yet: Kubernetes still needs recovery.lighthouse (or its rendered Deployment) across
nodes, which launch.local's node agents and Slurm's tasks place by themselves (backends/placed.py)."""


@dataclass
class RecoveryConfig:
    live: bool = LIVE_BY_DEFAULT
    """Live recovery (launch.local and Slurm: one node, or several, the membership service placed on one
    of them through the run dir; Kubernetes with its rendered service or recovery.lighthouse): when a rank's process
    or a whole node is lost, the others keep their processes and state, re-form the group in place and
    re-run the interrupted step on the ranks left (same samples, same augmentation). Off: a lost rank fails the job, which resumes from a checkpoint.
    docs/live.md."""
    heartbeat_timeout_s: float = field(default=1.0, metadata=at_least(0.2, 600, "e.g. 1"))
    """How long the membership service waits for a silent rank's heartbeat before it forms a group
    without it: the bound on noticing a lost rank (heartbeats go every tenth of it)."""
    quorum_timeout_s: float = field(default=60.0, metadata=at_least(1, 3600, "e.g. 60"))
    """How long a survivor waits for the new group to form before it gives up (exit 1)."""
    rejoin: int = field(default=0, metadata=at_least(0, 100, "e.g. 3"))
    """How many times the live agent starts a lost rank again to rejoin the group (0: never). The new
    process builds its model and loaders, waits for the others' next check point (train.log_every_steps)
    and takes its state from a live peer, checked; the others pause about one regroup."""
    lighthouse: str = field(
        default="",
        metadata=bound(
            lambda v: v == "" or service_address(v, ports=2) is not None,
            "must be empty or the membership service's http://HOST:PORT, PORT at most 65534 (PORT+1 is its presence port)",
            "e.g. recovery.lighthouse=http://10.0.0.9:29510, where `python -m launch.lighthouse` serves on a host of its own",
        ),
    )
    """The membership service's address when it runs apart from the training nodes, a service of your
    own. Empty: launch.local places one, beside the ranks of its one node, or across nodes on one of
    the job's nodes through a lease in the run dir (moved when that node is lost)."""


@dataclass
class DebugConfig:
    detect_anomaly: bool = False
    """torch.autograd anomaly detection: finds the op that made a NaN, but is slow."""
    check_model: bool = True
    """Push one fake batch through the model at start-up for clear shape/device errors."""
    trace_batches: bool = False
    """Write each rank's sample indices per step to RUN_DIR/trace/rank<r>.jsonl: an audit of the data
    order across resumes and world-size changes."""


@dataclass
class RunConfig:
    run_dir: str = "runs/default"
    """Checkpoints, metrics, the resolved config and the final model; shared storage on clusters."""
    seed: int = field(default=0, metadata=seed_bound())
    """Seeds model init, data order and augmentation: same seed, same run."""
    data: DataConfig = field(default_factory=lambda: section.data_config()())
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)


PLUGIN_PATTERN = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
"""module.path:attr — checked here without importing anything; the worker imports it."""


def is_plugin(name: str) -> bool:
    """A `model.name` / `data.name` given as an import path (anything with a colon)."""
    return ":" in str(name)


@functools.cache
def _declared_hints(cls: type) -> dict[str, Any]:
    """typing.get_type_hints of a section, once per class: it evaluates every annotation's string
    again on each call, and a config load asks for every section's several times (start-up)."""
    return typing.get_type_hints(cls)


def _hints(cls: type) -> dict[str, Any]:
    """A section's field types, with the data section as the formats registered now compose it."""
    return {
        name: section.data_config() if section.is_data_section(tp) else tp for name, tp in _declared_hints(cls).items()
    }


def all_keys(cls: type = RunConfig, prefix: str = "") -> list[str]:
    """Every dotted leaf key, for error suggestions and docs."""
    keys: list[str] = []
    for name, tp in _hints(cls).items():
        if dataclasses.is_dataclass(tp):
            keys.extend(all_keys(tp, prefix + name + "."))
        else:
            keys.append(prefix + name)
    return keys


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring: the string literal under it in the class's source, the one place a
    key's meaning is written (Python keeps no attribute docstrings at run time, so it is read back here).
    A composed section (the data section) has no source of its own: its fields' docstrings are read
    from the classes it names in `__sections__`, each format's section from its own module."""
    docs: dict[str, str] = {}
    for source in getattr(cls, section.SECTIONS, (cls,)):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(source)))
        except (OSError, TypeError, SyntaxError):  # no source (a frozen install): keys without meanings
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in zip(body, body[1:], strict=False):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                    docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def first_sentence(text: str, limit: int = 160) -> str:
    """The meaning's first sentence (not cut at "e.g."), at most `limit` characters."""
    found = re.match(r"(.*?(?<!e\.g)(?<!i\.e)\.)(\s|$)", text)
    short = found.group(1) if found else text
    return short if len(short) <= limit else short[: limit - 3] + "..."


def _default_text(f: dataclasses.Field) -> str:
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return text.removesuffix("...").strip()


def key_help(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default as written in YAML, first sentence of its docstring) of every leaf, in
    field order: what `python -m train --help-config` prints."""
    found: list[tuple[str, str, str]] = []
    hints, docs = _hints(cls), field_docs(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            found.extend(key_help(hints[f.name], prefix + f.name + "."))
        else:
            found.append((prefix + f.name, _default_text(f), first_sentence(docs.get(f.name, ""))))
    return found


def help_config() -> str:
    """Every key as `key=DEFAULT  # meaning`, aligned: the text of `--help-config`."""
    rows = [(f"{key}={default}", meaning) for key, default, meaning in key_help()]
    width = min(max(len(left) for left, _ in rows), 48)
    return "\n".join(f"{left:<{width}}  # {meaning}" if meaning else left for left, meaning in rows)


def rules(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, Bound | Choice]]:
    """(dotted key, rule) of every field that carries a bound or a choice in its metadata, in field order."""
    found: list[tuple[str, Bound | Choice]] = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            found.extend(rules(hints[f.name], prefix + f.name + "."))
        found.extend(
            (prefix + f.name, rule)
            for rule in (f.metadata.get("bound"), f.metadata.get("ceiling"), f.metadata.get("choice"))
            if rule
        )
    return found


def known_paths() -> frozenset[str]:
    """Every key an override may name: the leaves and the sections above them (asked per load: a
    format registered since brings its keys)."""
    return frozenset(
        ".".join(parts[:n]) for parts in (k.split(".") for k in all_keys()) for n in range(1, len(parts) + 1)
    )


CHOICES: dict[str, tuple[str, ...]] = {key: rule.allowed() for key, rule in rules() if isinstance(rule, Choice)}
"""Each choice field's named values (a view of the field metadata, which owns them)."""


def fp16_on_cpu_message() -> str:
    return str(
        ConfigError(
            "train.precision",
            "fp16 on CPU is emulated, ~17x slower than bf16",
            "use train.precision=bf16, or train.precision=fp32 where bf16 is slow: "
            "`make doctor` measures both on this machine",
        )
    )


def refuse_fp16_on_cpu(precision: str, on_cpu: bool) -> None:
    """BadInput for fp16 on CPU. A rule of the config that needs the device, so it lives here: launchers
    check it before spawning and the worker at start, and neither imports the other."""
    if on_cpu and precision == "fp16":
        raise BadInput(fp16_on_cpu_message())


def _describe(tp: Any) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    if tp in names:
        return names[tp]
    if typing.get_origin(tp) is list:
        return f"a list of {_describe(typing.get_args(tp)[0]).removeprefix('a ').removeprefix('an ')}s"
    return str(tp)


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Convert a YAML value to the field's type, or raise ConfigError saying what was expected."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(key, value, args[0])
    example = f"{key}=<{_describe(tp)}>"
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(key, f"expected true or false, got {quote(value)}", f"write {key}=true or {key}=false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(key, f"expected an integer, got {quote(value)}", f"write a whole number, e.g. {key}=10")
    if tp is float:
        number: float | None = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value) if abs(value) < 1e308 else math.copysign(math.inf, value)
        elif isinstance(value, str):
            try:
                number = float(value)  # YAML 1.1 reads "1e-3" as a string
            except ValueError:
                pass
        if number is None:
            raise ConfigError(key, f"expected a number, got {quote(value)}", f"write a number, e.g. {key}=0.1")
        if not math.isfinite(number):
            raise ConfigError(key, f"must be a finite number, got {number}", f"write a number, e.g. {key}=0.1")
        return number
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(key, f"expected a string, got {quote(value)}", f"write {example}")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(key, f"expected a list, got {quote(value)}", f"write e.g. {key}=[a,b]")
        return [_coerce(key, v, item_tp) for v in value]
    raise ConfigError(key, f"unsupported type {tp}", "this is a bug in torchlaunch; please report it")


def _unknown_key(key: str, typed: str | None = None) -> ConfigError:
    """`key` (the first unknown part of what was typed) is unknown; the hint is judged on all of `typed`
    (`trian.epochs` is reported at `trian`, and means train.epochs)."""
    near = suggest.closest(typed or key, all_keys())
    hint = f"did you mean {near}?" if near else "see `python -m train --help-config` for valid keys"
    return ConfigError(key, "unknown key", hint)


def _build(cls: type, data: Any, prefix: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            prefix.rstrip(".") or "<root>",
            f"expected a mapping, got {quote(data)}",
            "indent the section's keys under it",
        )
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in data:
        if k not in names:
            raise _unknown_key(prefix + str(k))
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        tp = hints[f.name]
        key = prefix + f.name
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _build(tp, data[f.name], key + ".")
        else:
            kwargs[f.name] = _coerce(key, data[f.name], tp)
    return cls(**kwargs)


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=value` -> ("a.b", value parsed as a YAML scalar)."""
    if "=" not in text:
        raise ConfigError(text, "override is not of the form key=value", f"write e.g. {text}=VALUE")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(text, "override has no key", "write key.sub=value")
    try:
        value = _load_yaml_text(raw, yaml.SafeLoader) if raw.strip() else ""
    except TooComplex as e:
        raise ConfigError(key, f"the value {e}", f"write a plain value, e.g. {key}=10") from None
    except yaml.YAMLError:
        value = raw
    return key, value


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    known = known_paths()
    if key not in known:  # named at its first unknown part; also bounds what a key can build
        parts = key.split(".", 64)
        first = next(n for n in range(1, len(parts) + 1) if ".".join(parts[:n]) not in known)
        raise _unknown_key(".".join(parts[:first]), key)
    node = tree
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise _unknown_key(key)
        node = child
    node[parts[-1]] = value


MAX_CONFIG_BYTES = 256 * 1024
"""Larger config files are refused unread: a config is a few kilobytes, and a huge one would take
minutes and gigabytes to parse before its first error."""


class _SafeLoader(DepthGuard, yaml.SafeLoader):
    """yaml.safe_load with the nesting guard (overrides)."""


def _load_yaml_text(text: str, loader: type) -> Any:
    """YAML text -> value; TooComplex before composing when it nests too deep or its aliases expand to
    too many values (an anchor bomb), so nothing downstream (errors included) sees the expansion."""
    check_yaml(text)
    if loader is yaml.SafeLoader:
        loader = _SafeLoader
    return yaml.load(text, Loader=loader)  # noqa: S506 - a SafeLoader


class DuplicateKey(yaml.YAMLError):
    """A mapping names the same key twice: PyYAML would keep the last one without a word."""


class _UniqueKeyLoader(DepthGuard, yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping, and nesting deeper than any config."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise DuplicateKey(f"key {quote(key)} appears twice (lines {seen[key]} and {line})")
            except TypeError:
                continue  # an unhashable key: SafeLoader reports it
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a YAML mapping, turning a missing file or bad syntax into one clear line."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            "--config", f"file not found: {p}", "pass an existing YAML file, e.g. --config configs/smoke.yaml"
        )
    try:
        with open(p, "rb") as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(
            "--config", f"cannot read {p}: {e.strerror or type(e).__name__}", "pass a readable YAML file"
        ) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(
            "--config",
            f"{p} is larger than {MAX_CONFIG_BYTES // 1024} KiB",
            "a config holds a few sections of key: value pairs; pass the YAML config, not data",
        )
    try:
        data = _load_yaml_text(raw.decode("utf-8"), _UniqueKeyLoader)
    except TooComplex as e:
        raise ConfigError(
            "--config", f"{p} {e}", "write `section:` blocks of `key: value` pairs, without anchors that expand"
        ) from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            "--config", f"{p} is not UTF-8 text (byte {e.start})", "save the file as UTF-8 (plain YAML text)"
        ) from None
    except DuplicateKey as e:
        raise ConfigError("--config", f"{p}: {e}", "keep one of the two entries") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(
            "--config",
            f"{p} is not valid YAML{where}",
            "fix the syntax, e.g. `key: value` pairs with consistent indentation",
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            "--config",
            f"{p} must hold a mapping of keys, got {type(data).__name__}",
            "write `section:` blocks of `key: value` pairs",
        )
    return data


def validate(cfg: RunConfig) -> RunConfig:
    """Check choices and ranges; raise ConfigError on the first problem."""
    flat = to_dict(cfg)
    for key, rule in rules():
        value = _get_dotted(flat, key)
        if isinstance(rule, Choice):
            for item in value if isinstance(value, list) else [value]:
                _check_choice(key, item, rule)
        elif not rule.ok(value):
            raise ConfigError(key, f"{rule.requirement}, got {quote(value)}", rule.fix)
    if cfg.model.name.startswith(TORCHVISION_PREFIX) and cfg.model.width:
        raise ConfigError(
            "model.width", f"{cfg.model.name} has a fixed width, got {cfg.model.width}", "use model.width=0"
        )
    section.check(cfg.data)
    if not str(cfg.run_dir).strip():
        raise ConfigError("run_dir", "must not be empty", "e.g. run_dir=runs/my-run")
    section.check_root(cfg.data)
    if cfg.model.name == "simple_cnn" and cfg.data.image_size not in SIMPLE_CNN_SIZES:
        raise ConfigError(
            "data.image_size",
            f"model.name=simple_cnn takes {SIMPLE_CNN_SIZES.start}-{SIMPLE_CNN_SIZES.stop - 1} px images (its "
            f"classifier is sized for 32x32), got {cfg.data.image_size}",
            "use data.image_size=32, or a model for any size: model.name=resnet18, fastnet or torchvision.<name>",
        )
    return cfg


def _check_choice(key: str, value: Any, rule: Choice) -> None:
    if rule.plugin and is_plugin(value):
        if not re.fullmatch(PLUGIN_PATTERN, str(value)):
            raise ConfigError(
                key,
                f"{quote(value)} is not an import path",
                "write pkg.module:factory, e.g. examples.my_models:tiny_cnn",
            )
        return
    prefix = rule.open_prefix
    if prefix and str(value).startswith(prefix) and len(str(value)) > len(prefix):
        return
    values = rule.allowed()
    if value not in values:
        listed = [
            *values,
            *([f"{prefix}<name>"] if prefix else []),
            *(["pkg.module:factory"] if rule.plugin else []),
        ]
        raise ConfigError(key, f"unknown value {quote(value)}", f"choose one of: {', '.join(listed)}")


def _get_dotted(tree: dict[str, Any], key: str) -> Any:
    node: Any = tree
    for part in key.split("."):
        node = node[part]
    return node


def load(path: str | os.PathLike[str] | None, overrides: typing.Sequence[str] = ()) -> RunConfig:
    """Defaults <- YAML file <- `key=value` overrides, validated."""
    tree = read_yaml(path) if path is not None else {}
    given: set[str] = set()
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
        given.add(key)
    cfg = validate(_build(RunConfig, tree, ""))
    refuse_unread(cfg, given)
    return cfg


def refuse_unread(cfg: RunConfig, given: typing.Collection[str]) -> None:
    """An override the resolved recipe never reads is refused, not dropped without a word: `data.root=DIR`
    on a recipe whose format generates its images would train on them and say nothing. Only what
    was typed is judged (a resolved config.yaml carries every default, data.root included)."""
    section.refuse_unread(cfg.data, given)


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def from_dict(data: dict[str, Any]) -> RunConfig:
    return validate(_build(RunConfig, data, ""))


def dump(cfg: RunConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=None)


def write_resolved(cfg: RunConfig, target: Path | None = None) -> Path:
    """Atomically write RUN_DIR/config.yaml, or `target` in the run dir (the run dir's atomic writer) so
    readers never see half a file."""
    run_dir = Path(cfg.run_dir)
    target = rundir.config(run_dir) if target is None else target
    text = dump(cfg)
    tmp = rundir.temp_name(target)
    rundir.check_folders(run_dir, prefix="config error: run_dir: ")  # a worker started without a launcher
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if target.is_file() and target.read_text() == text:
            return target
        tmp.touch(exist_ok=False)  # where a run dir that cannot be written shows: a config error
    except OSError as e:
        what = "a file, not a folder" if isinstance(e, (FileExistsError, NotADirectoryError)) else e.strerror or e
        raise ConfigError(
            "run_dir", f"cannot write {run_dir}: {what}", "pick a folder you can write, e.g. run_dir=runs/my-run"
        ) from None
    rundir.write_text(target, text, tmp=tmp, mkdir=False)
    return target


# ---- a run's config changes only by an explicit, stated act -------------------------------------

KEPT_AT_RESUME = frozenset(
    {"optim.lr", "optim.momentum", "optim.nesterov", "optim.weight_decay", "optim.betas", "optim.norm_lr_scale"}
)
"""Restored from the checkpoint at a resume (the optimizer's param groups, the LR scheduler's base_lrs):
a new value is written but not used, so a change is said to be one that does not apply."""
FIXED_AT_RESUME = frozenset(
    {
        "model.name",
        "model.width",
        "optim.name",
        "optim.lookahead_every",
        "train.batch_size",
        "train.exact",
        "train.grid_micro_batches",
    }
)
"""Refused by the resume itself (Trainer.load_state_dict): a run with a checkpoint cannot change them."""
OPERATIONAL = frozenset(
    {
        "data.num_workers",
        "data.cache_dir",
        "train.micro_batch_size",
        "train.log_every_steps",
        "train.tensorboard",
        "checkpoint.keep",
        "checkpoint.async_save",
        "dist.timeout_s",
        "dist.backend",
        "dist.pin_cpus",
        "dist.shared_memory_reduce",
        "preemption.lead_time_s",
        "debug.detect_anomaly",
        "debug.check_model",
        "debug.trace_batches",
    }
)
"""How the run runs, not what it trains (neither the model, the optimizer, the global batch nor the
sample order changes with them): a rerun may change them without --reconfigure, and the launcher says
so in one line. train.micro_batch_size is the resume's own advice for memory."""
MAX_LISTED = 6
"""Changed keys named in one line; the rest are counted."""


@dataclass(frozen=True)
class Change:
    """One key whose value differs between RUN_DIR/config.yaml and the launch's resolved config."""

    key: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.key} {quote(self.old, 40)} -> {quote(self.new, 40)}"


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix.rstrip("."): tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}{key}."))
    return out


ABSENT = "<absent>"


def changes(old: dict[str, Any], new: dict[str, Any]) -> list[Change]:
    """The dotted keys whose values differ, sorted (a key on one side only shows ABSENT on the other)."""
    a, b = _flat(old), _flat(new)
    return [
        Change(k, a.get(k, ABSENT), b.get(k, ABSENT))
        for k in sorted(set(a) | set(b))
        if a.get(k, ABSENT) != b.get(k, ABSENT)
    ]


def listed(found: typing.Sequence[Change], kept: bool) -> str:
    """`optim.lr 0.02 -> 0.5 (not used: restored from the checkpoint), ...`, at most MAX_LISTED named."""
    words = [
        f"{c}{' (not used: restored from the checkpoint)' if kept and c.key in KEPT_AT_RESUME else ''}" for c in found
    ]
    more = f", and {len(words) - MAX_LISTED} more" if len(words) > MAX_LISTED else ""
    return ", ".join(words[:MAX_LISTED]) + more


@dataclass(frozen=True)
class Settled:
    """What settle_resolved did: the file, the line to print (a reconfigure), the text it replaced."""

    path: Path
    note: str | None = None
    previous: str | None = None
    """config.yaml's text before a reconfigure: restore_resolved puts it back if the resume refuses."""


def newest_step(run_dir: str | os.PathLike[str]) -> int | None:
    """The step a resume of `run_dir` starts from (its newest checkpoint that verifies: the store's
    latest_valid, what `status` reports too), None without one. Asked only when a launch's config
    differs from the run's: the checkpoint store loads torch, so only where a checkpoint folder exists."""
    root = rundir.checkpoints(Path(run_dir))
    if not root.is_dir():
        return None
    from torchlaunch.core import checkpoint as ckpt

    try:
        path = ckpt.latest_valid(root)
    except (OSError, ValueError):
        return None
    step = None if path is None else ckpt.parse_step(path.name)
    return None if path is None else (step if step is not None else 0)


def settle_resolved(
    cfg: RunConfig,
    *,
    reconfigure: bool = False,
    resumes_at: typing.Callable[[], int | None] | None = None,
    running: int = 0,
    write: bool = True,
) -> Settled:
    """RUN_DIR/config.yaml for a launch of `cfg`, the one rule of every writer of that file (launch.local
    under the run-dir lock, launch.slurm at submit, the worker's rank 0): written when the run dir has
    none (or the same values); a differing one is refused (ConfigError naming the keys, nothing written)
    unless `reconfigure`, which rewrites it and says from which step (`resumes_at`, default newest_step:
    asked only then) the new values apply and which do not. Refused as well: a reconfigure while `running`
    other launchers of the job use the file, and one of a key the resume itself refuses (FIXED_AT_RESUME).
    `write=False` applies the same refusals and writes nothing (a dry run, the ranks other than 0)."""
    target = rundir.config(cfg.run_dir)
    if resumes_at is None:
        resumes_at = lambda: newest_step(cfg.run_dir)  # noqa: E731 - deferred: imports torch
    if not target.exists() and not target.is_symlink():
        return Settled(write_resolved(cfg) if write else target)
    try:
        old = read_yaml(target)
    except ConfigError as e:
        if not reconfigure:
            raise ConfigError(
                "run_dir",
                f"{quote(str(target))} cannot be read ({str(e).partition(': ')[2][:200]})",
                "restore it, or pass --reconfigure to replace it with this launch's config",
            ) from None
        old = {}
    try:  # keys the file lacks (written by an older version) are that version's defaults, not a change
        old = to_dict(from_dict(old))
    except ConfigError:
        pass
    found = [c for c in changes(old, to_dict(cfg)) if c.key != "run_dir"]
    if not found:  # the same values; run_dir may be spelled another way (relative, absolute): the ranks' spelling
        return Settled(write_resolved(cfg) if write else target)
    step = resumes_at()
    trained = [c for c in found if c.key not in OPERATIONAL]
    if trained and not reconfigure:
        raise ConfigError(
            "run_dir",
            f"{quote(str(cfg.run_dir))} was started with another config: {listed(trained, step is not None)}",
            f"to resume it rerun without these changes (--config {quote(str(target))}); to change them pass "
            "--reconfigure; or pick a new run_dir",
        )
    if running and trained:
        raise ConfigError(
            "run_dir",
            f"--reconfigure while {running} other launcher(s) of this elastic job run on it",
            "stop the job first, then reconfigure",
        )
    fixed = [c for c in found if c.key in FIXED_AT_RESUME]
    if fixed and step is not None:
        raise ConfigError(
            fixed[0].key,
            f"--reconfigure cannot change it on a run with checkpoints ({fixed[0]}): the resume would refuse it",
            "start a new run_dir (model.init_from=RUN_DIR/model.pt keeps the weights)",
        )
    readable = target.is_file() and not target.is_symlink() and target.stat().st_size <= MAX_CONFIG_BYTES
    previous = target.read_text(errors="replace") if readable else None
    if write:
        write_resolved(cfg)
    where = f"from step {step}, where it resumes" if step is not None else "from step 0 (no checkpoint yet)"
    what = "reconfigured" if trained else "updated how the run runs in"
    note = f"launch: {what} {target} ({listed(found, step is not None)}): the new values apply {where}"
    return Settled(target, note, previous if write else None)


def restore_resolved(settled: Settled) -> bool:
    """Put back the config.yaml a reconfigure replaced (the resume refused the new one): True if done."""
    if settled.previous is None:
        return False
    rundir.write_text(settled.path, settled.previous)
    return True
