"""Data formats behind one registry (torchlaunch.data.registry): reader, pre-check, evaluation set,
GPU-decode capability, registered once per format. Importing this package registers the built-in
formats (torchlaunch.data.formats) and loads neither torch nor the built-in worker.

    registry   DataFormat, register, get, names, detect
    formats    cifar10, imagefolder, shards, synthetic, plug-in (pkg.module:factory)
    checks     the torch-free pre-checks the launchers run before any rank starts
"""

from torchlaunch.data import formats as _builtin  # noqa: F401 - registers the built-in formats
from torchlaunch.data.registry import DataFormat, get, names, register, unregister

__all__ = ["DataFormat", "get", "names", "register", "unregister"]
