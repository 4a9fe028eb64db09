"""A YAML config file or override value read under bounds: one ConfigError line for a missing file, bad
syntax, a key given twice, too much nesting or an anchor bomb, before anything downstream sees it.

Why on the ground floor: the run's config (torchlaunch.config) reads its files and overrides with
these, and so does the Slurm launcher, which only needs `run_dir` of a config file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from torchlaunch.base.untrusted import DepthGuard, TooComplex, check_yaml, quote
from torchlaunch.exit_codes import ConfigError

MAX_CONFIG_BYTES = 256 * 1024
"""Larger config files are refused unread: a config is a few kilobytes, and a huge one would take
minutes and gigabytes to parse before its first error."""


class _SafeLoader(DepthGuard, yaml.SafeLoader):
    """yaml.safe_load with the nesting guard (overrides)."""


def load_text(text: str, loader: type[yaml.SafeLoader] = _SafeLoader) -> Any:
    """YAML text -> value; TooComplex before composing when it nests too deep or its aliases expand to
    too many values (an anchor bomb), so nothing downstream (errors included) sees the expansion."""
    check_yaml(text)
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
        data = load_text(raw.decode("utf-8"), _UniqueKeyLoader)
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
