"""The run's configuration: the tree of sections, YAML + dotted overrides, validation with clear errors.

Launchers resolve defaults + YAML + overrides once and write RUN_DIR/config.yaml; every rank and every
requeue reads that one file. It is written once, when the run dir has none: a later launch that resolves
to other values is refused with the keys that differ, unless it asks for the change (`--reconfigure`,
settle_resolved), which says from which step the new values apply and which ones a resume cannot use.
This module never reads environment variables and never imports torch, so launchers can validate a
config before anything is started.

Each section lives beside its component (checkpoint: torchlaunch.core.checkpoint.section, recovery:
torchlaunch.live.section, dist and preemption: torchlaunch.core, data: torchlaunch.data.section,
model, optim, train and debug: torchlaunch.trainer_sections), each field with its rule in its metadata
next to its default and its docstring: `field(default=0.1, metadata=above(0, MAX_LR, "e.g. optim.lr=0.1"))`
(torchlaunch.base.rules). `rules()` lists them and `validate` checks them, then the rules that tie two
fields together. Every problem is one ConfigError line: `config error: KEY: PROBLEM (FIX)`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from torchlaunch import rundir, suggest
from torchlaunch.base.rules import PLUGIN_PATTERN, Bound, Choice, is_plugin, seed_bound
from torchlaunch.base.untrusted import TooComplex, quote
from torchlaunch.base.yaml_file import MAX_CONFIG_BYTES, load_text, read_yaml
from torchlaunch.core.checkpoint.section import CheckpointConfig
from torchlaunch.core.dist_section import DistConfig
from torchlaunch.core.preemption_section import PreemptionConfig
from torchlaunch.data import section
from torchlaunch.exit_codes import ConfigError
from torchlaunch.live.section import RecoveryConfig
from torchlaunch.trainer_sections import (
    SIMPLE_CNN_SIZES,
    TORCHVISION_PREFIX,
    DebugConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
)

DataConfig = section.data_config()
"""The data section: the keys every format shares (torchlaunch.data.section.SharedData) and each
registered format's own section (DataFormat.options), flat under `data.`; composed by the data floor,
which owns the formats (a format registered later joins at the next load: `hints`)."""


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


@functools.cache
def _declared_hints(cls: type) -> dict[str, Any]:
    """typing.get_type_hints of a section, once per class: it evaluates every annotation's string
    again on each call, and a config load asks for every section's several times (start-up)."""
    return typing.get_type_hints(cls)


def hints(cls: type) -> dict[str, Any]:
    """A section's field types, with the data section as the formats registered now compose it."""
    return {
        name: section.data_config() if section.is_data_section(tp) else tp for name, tp in _declared_hints(cls).items()
    }


def all_keys(cls: type = RunConfig, prefix: str = "") -> list[str]:
    """Every dotted leaf key, for error suggestions and docs."""
    keys: list[str] = []
    for name, tp in hints(cls).items():
        if dataclasses.is_dataclass(tp):
            keys.extend(all_keys(tp, prefix + name + "."))
        else:
            keys.append(prefix + name)
    return keys


def rules(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, Bound | Choice]]:
    """(dotted key, rule) of every field that carries a bound or a choice in its metadata, in field order."""
    found: list[tuple[str, Bound | Choice]] = []
    typed = hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(typed[f.name]):
            found.extend(rules(typed[f.name], prefix + f.name + "."))
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


def _describe(tp: Any) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    if tp in names:
        return names[tp]
    if typing.get_origin(tp) is typing.Literal:
        return "one of " + ", ".join(_yaml_word(v) for v in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"a list of {_describe(typing.get_args(tp)[0]).removeprefix('a ').removeprefix('an ')}s"
    return str(tp)


def _yaml_word(value: Any) -> str:
    """A value as a recipe or an override writes it (true, not True)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Convert a YAML value to the field's type, or raise ConfigError saying what was expected."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(key, value, args[0])
    example = f"{key}=<{_describe(tp)}>"
    if origin is typing.Literal:  # a few named values, booleans among them (recovery.live: auto, true, false)
        named = typing.get_args(tp)
        found = [v for v in named if v == value and type(v) is type(value)]
        if found:
            return found[0]
        words = [_yaml_word(v) for v in named]
        raise ConfigError(key, f"expected {_describe(tp)}, got {quote(value)}", f"write {key}={words[0]}")
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
    typed = hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in data:
        if k not in names:
            raise _unknown_key(prefix + str(k))
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        tp = typed[f.name]
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
        value = load_text(raw) if raw.strip() else ""
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
        "train.balance",
        "train.log_every_steps",
        "train.tensorboard",
        "checkpoint.keep",
        "checkpoint.async_save",
        "checkpoint.format",
        "dist.timeout_s",
        "dist.backend",
        "dist.pin_cpus",
        "dist.shared_memory_reduce",
        "preemption.lead_time_s",
        "debug.detect_anomaly",
        "debug.check_model",
        "debug.trace_batches",
        "recovery.live",
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
