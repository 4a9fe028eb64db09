"""The built-in data formats, one module each, registered in this order (the order `data.name`'s
choices are listed in). A module holds all of one format: its config section (DataFormat.options),
its torch-free pre-check, and its reader and evaluation set named as `module:function` strings
(registry.lazy), so importing this package (the launcher does, for its pre-check) loads neither torch
nor the worker. A new format is one more module here, or one in your own package (docs/EXTENDING.md).
"""

from torchlaunch.data.formats import (  # noqa: F401 - each registers itself
    cifar10,
    imagefolder,
    plugin,  # noqa: F401 - the import-path format, registered last
    shards,
    synthetic,
)
