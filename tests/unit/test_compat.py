"""Each private API in torchlaunch.compat, exercised against the installed torch, submitit and
argparse: an upgrade that renames or changes one fails here, by name, not in a running job."""

from __future__ import annotations

import argparse
import importlib.util
import pickle
from pathlib import Path

import pytest
import torch

from torchlaunch import compat


def test_argparse_option_actions_say_which_options_take_a_value() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", type=int)
    parser.add_argument("--dry-run", action="store_true")
    actions = compat.option_actions(parser)
    assert actions["--gpus"].nargs is None and actions["--dry-run"].nargs == 0
    assert set(actions) >= {"--gpus", "--dry-run", "-h", "--help"}


def test_undecorated_reaches_torchs_own_optimizer_methods() -> None:
    for name in ("add_param_group", "zero_grad", "state_dict", "load_state_dict"):
        inner = compat.undecorated(getattr(torch.optim.Optimizer, name))
        assert not hasattr(inner, "__wrapped__") and inner.__name__ == name
        assert inner.__code__.co_filename.endswith("optimizer.py"), inner.__code__.co_filename


def test_fused_kernel_devices_and_mkldnn_bf16() -> None:
    devices = compat.fused_kernel_devices()
    assert devices is not None and "cuda" in devices
    assert isinstance(compat.mkldnn_bf16_supported(), bool)
    assert callable(torch.ops.mkldnn._is_mkldnn_bf16_supported)


def test_submitits_task_module_and_requeue_pickle(tmp_path: Path) -> None:
    assert importlib.util.find_spec(compat.SUBMITIT_TASK_MODULE) is not None
    delayed = compat.delayed_submission(sum)
    delayed.set_timeout(10, 2)
    target = tmp_path / "submitted.pkl"
    with compat.temporary_save_path(target) as tmp:
        delayed.dump(tmp)
    assert target.is_file() and not any(p != target for p in tmp_path.iterdir())
    with open(target, "rb") as fh:
        assert pickle.load(fh).function is sum


def test_the_torchrun_agent_acts_on_its_first_stop_only() -> None:
    import signal

    from torch.distributed.elastic.multiprocessing import SignalException, api

    from torchlaunch import compat

    original = api._terminate_process_handler
    try:
        compat.agent_stops_once()
        handler = api._terminate_process_handler
        assert handler is not original
        with pytest.raises(SignalException):
            handler(signal.SIGTERM, None)
        handler(signal.SIGTERM, None)  # the same stop again: the graceful shutdown goes on
        handler(signal.SIGUSR2, None)
        compat.agent_stops_once()
        assert api._terminate_process_handler is handler  # once per process
    finally:
        api._terminate_process_handler = original
