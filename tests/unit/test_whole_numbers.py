"""Whole numbers read from a command line, the environment, a run dir's files or the network: ASCII
digits only (base.untrusted.whole), so a superscript or another script's digits is one line and exit 2
where it was a traceback (int('\u00b2') raises) or a number nobody typed ('\u0665' reads as 5)."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchlaunch import contract
from torchlaunch.base.untrusted import whole
from torchlaunch.exit_codes import BadInput

HOSTILE = ["\u00b2", "\u0665", "\uff13", "1\u00b2", " 1", "-1", "+1", "1e3", "", "9" * 30]


@pytest.mark.parametrize(("text", "expected"), [("0", 0), ("007", 7), ("29510", 29510), *((h, None) for h in HOSTILE)])
def test_whole_takes_ascii_digits_only_and_bounds_their_count(text: str, expected: int | None) -> None:
    assert whole(text) == expected
    assert whole("123456", max_digits=5) is None


@pytest.mark.parametrize("value", ["\u00b2", "\u0665", "9" * 30])
def test_a_rendezvous_timeout_in_other_digits_is_one_line(value: str) -> None:
    from torchlaunch.launch import elastic

    with pytest.raises(BadInput, match="must be a whole number") as refused:
        elastic.parse_rdzv_conf(f"last_call_timeout={value}")
    assert len(str(refused.value).splitlines()) == 1 and len(str(refused.value)) < 200


@pytest.mark.parametrize("endpoint", ["pod-0:\u00b2", "pod-0:\u0665", "pod-0:" + "9" * 5000])
def test_a_k8s_wait_for_port_in_other_digits_is_one_bounded_line(endpoint: str) -> None:
    from torchlaunch.backends.k8s import launch as k8s_launch

    with pytest.raises(BadInput, match="--wait-for needs HOST:PORT") as refused:
        k8s_launch.render(["--wait-for", endpoint])
    assert len(str(refused.value).splitlines()) == 1 and len(str(refused.value)) < 300


@pytest.mark.parametrize("value", ["\u00b2", "\u0665", "1\u00b2"])
def test_the_launchers_env_in_other_digits_is_bad_input(value: str) -> None:
    from torchlaunch.live import minimum

    with pytest.raises(BadInput, match="is not a node count"):
        minimum.from_env(1, {contract.LIVE_MIN_NODES: value})
    with pytest.raises(BadInput, match="is not RANK/WORLD"):
        contract.live_first_group({contract.LIVE_FIRST_GROUP: f"{value}/3"})


def test_a_fence_file_in_other_digits_reads_as_missing(tmp_path: Path) -> None:
    from torchlaunch.live.fence import Fence

    fence = Fence(tmp_path)
    fence.folder.mkdir(parents=True)
    (fence.folder / "generation").write_text("\u00b2\n")
    assert fence.current() == 0


def test_patterns_that_read_numbers_take_ascii_digits_only() -> None:
    """Python's \\d matches every script's digits: '\u0665\u0660\u0661' passed as a Slurm job id (then
    scancel's argv), 'step-\u0661\u0660' as a checkpoint folder, '--nnodes \u0661:\u0662' as a node range."""
    from torchlaunch.backends.k8s import validate
    from torchlaunch.backends.slurm.follow import TASK_LINE
    from torchlaunch.backends.slurm.states import SLURM_ID
    from torchlaunch.core.checkpoint.store import STEP_DIR
    from torchlaunch.jobs.ranklog import NAME
    from torchlaunch.launch.shape import RANGE
    from torchlaunch.live.group import JOIN_NAME

    assert SLURM_ID.match("501_2") and not SLURM_ID.match("\u0665\u0660\u0661")
    assert STEP_DIR.match("step-000000010") and not STEP_DIR.match("step-\u0661\u0660")
    assert RANGE.match("1:2") and not RANGE.match("\u0661:\u0662")
    assert NAME.match("rank-0.log") and not NAME.match("rank-\u0660.log")
    assert JOIN_NAME.fullmatch("join-rejoin001-rank000001") and not JOIN_NAME.fullmatch(
        "join-rejoin\u0660\u0660\u0661-rank000001"
    )
    assert not TASK_LINE.search("slurm task: rank \u0661/2 local 0 on n1")
    assert validate._QUANTITY.fullmatch("2Gi") and not validate._QUANTITY.fullmatch("\u0662Gi")
