"""The imagefolder data format: a folder of class folders (torchlaunch.data.folders reads it the one
way every part of the project does). One module: its config section, pre-check and registry entry."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from torchlaunch.base.rules import bound
from torchlaunch.data.registry import DataConfig, DataFormat, lazy, register
from torchlaunch.exit_codes import BadInput


def check_imagefolder(cfg: DataConfig, local: bool) -> None:
    """At least 2 images under the class folders: one to train on, one to hold out."""
    from torchlaunch.data.folders import scan_imagefolder  # PIL: loaded when a launcher checks, not at import

    _, files, _ = scan_imagefolder(Path(cfg.root).expanduser())
    if len(files) < 2:
        raise BadInput(
            f"data error: {cfg.root} has only {len(files)} image(s); need at least 2 to hold "
            f"out a validation split (add images)"
        )


@dataclass
class ImagefolderOptions:
    """imagefolder's own keys."""

    val_fraction: float = field(
        default=0.1, metadata=bound(lambda v: 0.0 < v < 1.0, "must be between 0 and 1", "e.g. data.val_fraction=0.1")
    )
    """imagefolder only: fraction of images held out for validation (fixed by split_seed)."""


register(
    DataFormat(
        name="imagefolder",
        summary="a folder of class folders",
        load=lazy("torchlaunch.worker.data.imagefolder:load_imagefolder"),
        precheck=check_imagefolder,
        eval_set=lazy("torchlaunch.worker.data.imagefolder:imagefolder_eval_set"),
        held_out=("val",),
        gpu_decode=True,
        options=ImagefolderOptions,
    )
)
