""" "Did you mean ...?": the one suggester of config keys and command-line options.

Why not difflib alone: it compares whole strings by characters, so `optim.learning_rate` came out
nearer to `optim.min_lr_ratio` than to `optim.lr`, and `trian.epochs` (a typo in the section) matched
nothing. Keys are `section.leaf`: the section is corrected first, then the leaf is looked up within it,
by its common other names (ALIASES: what other trainers call it) before its spelling. Options (`--gpu`)
are short words: closest_option compares them without dashes, at a stricter cutoff.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

ALIASES = {
    "learning_rate": "lr",
    "learningrate": "lr",
    "base_lr": "lr",
    "max_lr": "lr",
    "wd": "weight_decay",
    "decay": "weight_decay",
    "bs": "batch_size",
    "batch": "batch_size",
    "global_batch_size": "batch_size",
    "micro_batch": "micro_batch_size",
    "epoch": "epochs",
    "num_epochs": "epochs",
    "n_epochs": "epochs",
    "steps": "max_steps",
    "workers": "num_workers",
    "size": "image_size",
    "img_size": "image_size",
    "resolution": "image_size",
    "path": "root",
    "dir": "root",
    "data_dir": "root",
    "dataset": "name",
    "arch": "name",
    "optimizer": "name",
    "amp": "precision",
    "dtype": "precision",
    "warmup": "warmup_epochs",
}
"""Other trainers' names for a leaf -> ours (section-free: `optim.learning_rate` and a bare
`learning_rate` both find `optim.lr`)."""

CUTOFF = 0.6
"""difflib's similarity below which nothing is suggested (its own default)."""


def closest(word: str, candidates: Iterable[str], *, limit: int = 200) -> str | None:
    """The candidate `word` most likely meant, or None. Dotted candidates are matched section-aware."""
    names = list(candidates)
    if not word or len(word) > limit or not names:
        return None
    if any("." in n for n in names):
        return _closest_key(word, names)
    near = difflib.get_close_matches(word, names, n=1, cutoff=CUTOFF)
    return near[0] if near else None


OPTION_CUTOFF = 0.75
"""Options are short: at difflib's 0.6 `--bogus` was "--gpus"; at 0.75 `--gpu` still is."""


def closest_option(word: str, options: Iterable[str]) -> str | None:
    """The option `word` (`--gpu`, `--gpu=2`) most likely meant, compared without their dashes."""
    bare = {o.lstrip("-"): o for o in options}
    name = word.partition("=")[0].lstrip("-")
    if not name or len(name) > 200:
        return None
    near = difflib.get_close_matches(name, list(bare), n=1, cutoff=OPTION_CUTOFF)
    return bare[near[0]] if near else None


def _closest_key(word: str, keys: list[str]) -> str | None:
    section, _, leaf = word.rpartition(".")
    leaf = ALIASES.get(leaf.lower().replace("-", "_"), leaf.replace("-", "_"))
    sections = sorted({k.rpartition(".")[0] for k in keys})
    if section and section not in sections:
        near = difflib.get_close_matches(section, sections, n=1, cutoff=CUTOFF)
        section = near[0] if near else section
    in_section = [k for k in keys if k.rpartition(".")[0] == section]
    if f"{section}.{leaf}".lstrip(".") in keys:
        return f"{section}.{leaf}".lstrip(".")
    leaves = {k.rpartition(".")[2]: k for k in in_section}
    near = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=CUTOFF)
    if near:
        return leaves[near[0]]
    elsewhere = [k for k in keys if k.rpartition(".")[2] == leaf]  # train.lr -> optim.lr, a bare lr -> optim.lr
    if len(elsewhere) == 1:
        return elsewhere[0]
    near = difflib.get_close_matches(word, keys, n=1, cutoff=CUTOFF)
    return near[0] if near else None
