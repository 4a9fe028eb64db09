"""Moved to torchlaunch.data.checks (the launch side must not import the worker); re-exported here
so existing imports keep working."""

from torchlaunch.data.checks import (  # noqa: F401
    CIFAR10_URL,
    PROBE_ENV,
    PROBE_TIMEOUT_S,
    check_cifar10,
    check_data,
    check_shards,
    cifar10_missing_message,
    probe_target,
    socket,
    unreachable_reason,
)
