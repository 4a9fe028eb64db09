"""Moved to the data floor (the launch side must not import the worker): the dispatch to torchlaunch.data.checks,
each format's pre-check to its module in torchlaunch.data.formats; re-exported here so existing imports keep working."""

from torchlaunch.data.checks import check_data  # noqa: F401
from torchlaunch.data.formats.cifar10 import (  # noqa: F401
    CIFAR10_URL,
    PROBE_ENV,
    PROBE_TIMEOUT_S,
    check_cifar10,
    cifar10_missing_message,
    probe_target,
    socket,
    unreachable_reason,
)
from torchlaunch.data.formats.shards import check_shards  # noqa: F401
