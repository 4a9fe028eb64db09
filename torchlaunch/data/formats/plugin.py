"""The plug-in data format: every data.name that is an import path `pkg.module:factory` (the user's
own dataset factory, torchlaunch/worker/plugins.py). One module: its registry entry; it has no keys
of its own (the factory is the user's)."""

from __future__ import annotations

from typing import Any

from torchlaunch.data.registry import PLUGIN, DataConfig, DataFormat, lazy, register


def bundle_val(cfg: DataConfig, split: str) -> tuple[Any, list[str]]:
    """A format's own val split through its reader, as the run validated (a plug-in's evaluation set)."""
    bundle = lazy("torchlaunch.worker.data:load_bundle")(cfg)
    return bundle.val, bundle.classes


register(
    DataFormat(
        name=PLUGIN,
        summary="your own dataset factory",
        load=lazy("torchlaunch.worker.data.plugin:load_plugin"),
        eval_set=bundle_val,
        own_val=True,
        root="optional",
    )
)
