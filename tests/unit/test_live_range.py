"""launch.local --nnodes MIN:MAX in live mode, its pure and file-level parts: the first group's
rendezvous in the run dir (agent/first_group.py), the live agent's range and first seat, the
launcher's refusals, the rank's first-group contract and what `status` reads. The processes are
tests/integration/test_live_range_two_nodes.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO
from torchlaunch import contract
from torchlaunch.agent import first_group as fg
from torchlaunch.agent import live as live_agent
from torchlaunch.agent import live_start, outcome
from torchlaunch.agent import node as agent_node
from torchlaunch.agent.commands import NodePlacement, live_argv
from torchlaunch.exit_codes import BAD_INPUT, OK, BadInput
from torchlaunch.jobs.state import RankBeat, WorldChange, _world_size
from torchlaunch.launch.shape import NodeRange
from torchlaunch.launch.spec import JobSpec

SMOKE = str(REPO / "configs" / "smoke.yaml")
LIVE = ["recovery.live=true", "recovery.lighthouse=http://127.0.0.1:29510"]


def arrival(node: int, token: str, when: float = 0.0, host: str = "10.0.0.1") -> fg.Arrival:
    return fg.Arrival(node, host, token, when)


def test_one_arrival_per_node_rank_the_earliest_in_node_order() -> None:
    """A second launch of a node is not a second seat: it finds the seal without itself and joins (where
    the group refuses it as a second one of its node)."""
    got = fg.distinct([arrival(2, "c", 3.0), arrival(0, "a", 2.0), arrival(2, "b", 1.0)])
    assert [(a.node, a.token) for a in got] == [(0, "a"), (2, "b")]


@pytest.mark.parametrize(
    ("arrived", "since", "now", "expected"),
    [
        (3, None, 0.0, True),  # every node of 1:3: at once
        (2, None, 0.0, False),  # MIN reached, the last call not started yet
        (2, 10.0, 14.9, False),  # within the last call (5 s)
        (2, 10.0, 15.0, True),  # the last call is over
        (1, 10.0, 99.0, False),  # below MIN, however long
    ],
)
def test_the_first_group_is_sealed_at_max_or_after_the_last_call_past_min(
    arrived: int, since: float | None, now: float, expected: bool
) -> None:
    assert fg.ready(arrived, NodeRange(2, 3), since, now, 5.0) is expected


def test_a_seal_is_current_while_one_of_its_launchers_lives_joined_ones_included() -> None:
    sealed = fg.Sealed((arrival(0, "a"), arrival(1, "b")), joined=("c",))
    assert fg.current(sealed, {"b"}) and fg.current(sealed, {"c"})
    assert not fg.current(sealed, {"z"}) and not fg.current(None, {"a"})
    assert sealed.seat("b") == fg.FirstSeat(1, 2, "10.0.0.1", (0, 1))
    assert sealed.seat("c") is None  # joined later: no seat in the first group


def test_seal_records_round_trip_and_a_damaged_one_counts_as_none() -> None:
    sealed = fg.Sealed((arrival(0, "a", 1.5), arrival(3, "d", 2.0, "10.0.0.4")), ("e",), 7)
    assert fg.parse_seal(json.dumps(fg.seal_record(sealed)).encode()) == sealed
    for raw in (b"", b"[]", b'{"nodes": []}', b'{"nodes": [{"node": "0"}]}', b'{"nodes": 3}', b"\xff"):
        assert fg.parse_seal(raw) is None, raw


class Launchers:
    """Launchers of one job as the meeting sees them: who is alive (runlock's node slots), and the run
    dir's generation (the fence)."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.alive, self.gen = folder, set[str](), 0

    def meeting(self, node: int, token: str, host: str = "10.0.0.1") -> fg.Meeting:
        self.alive.add(token)
        return fg.Meeting(self.folder, arrival(node, token, host=host), lambda: set(self.alive), lambda: self.gen)

    def arrive(self, node: int, token: str, when: float = 0.0) -> None:
        """Another launcher waiting in the meeting (its arrival record, as meet() writes it)."""
        self.alive.add(token)
        self.folder.mkdir(exist_ok=True)
        record = fg.arrival_record(arrival(node, token, when, f"10.0.0.{node + 1}"))
        (self.folder / f"{fg.ARRIVED}{token}.json").write_text(json.dumps(record))


def test_every_node_in_seals_at_once_and_each_gets_its_seat(tmp_path: Path) -> None:
    job = Launchers(tmp_path / "live")
    job.arrive(0, "a")
    met = job.meeting(1, "b", host="10.0.0.2").meet(NodeRange(1, 2), last_call_s=600, join_timeout_s=5)
    assert met == fg.FirstSeat(1, 2, "10.0.0.1", (0, 1))  # node 0's host holds the first group's store
    assert job.meeting(0, "a").meet(NodeRange(1, 2), 600, 5) == fg.FirstSeat(0, 2, "10.0.0.1", (0, 1))
    assert not list(job.folder.glob(f"{fg.ARRIVED}*")), "each launcher withdraws its arrival once it met"


def test_a_node_after_the_seal_joins_and_keeps_the_job_current_alone(tmp_path: Path) -> None:
    """MIN=1 met alone after the last call: node 0 is the first group. Node 1 then finds the seal without
    itself: it joins (recorded in the seal). Node 0's launcher lost, node 1 trains on alone: a node 0
    started again joins too, never seals a group of its own beside it."""
    job = Launchers(tmp_path / "live")
    first = job.meeting(0, "a").meet(NodeRange(1, 2), last_call_s=0, join_timeout_s=5)
    assert first == fg.FirstSeat(0, 1, "10.0.0.1", (0,))
    job.gen = 1  # the first group formed
    late = job.meeting(1, "b")
    met = late.meet(NodeRange(1, 2), 0, 5)
    assert met == fg.Joins(0, (0,)) and late.wait_formed(met, timeout_s=0)
    job.alive.discard("a")
    assert job.meeting(0, "a2").meet(NodeRange(1, 2), 0, 5) == fg.Joins(0, (0,))


def test_a_previous_launchs_seal_is_ignored_and_sealed_again(tmp_path: Path) -> None:
    job = Launchers(tmp_path / "live")
    job.arrive(0, "old0")
    job.arrive(1, "old1")
    assert job.meeting(0, "old0").meet(NodeRange(2, 2), 0, 5).seat == 0  # type: ignore[union-attr]
    job.alive.clear()  # that launch ended (exit 75 below its minimum, say)
    job.gen = 3
    job.arrive(0, "new0")
    met = job.meeting(1, "new1").meet(NodeRange(2, 3), last_call_s=0, join_timeout_s=5)
    assert met == fg.FirstSeat(1, 2, "10.0.0.1", (0, 1))
    assert fg.parse_seal((job.folder / fg.SEAL).read_bytes()).generation == 3  # type: ignore[union-attr]


def test_fewer_than_min_nodes_time_out_and_a_stop_ends_the_wait(tmp_path: Path) -> None:
    job = Launchers(tmp_path / "live")
    with pytest.raises(TimeoutError, match=r"1 of the 2 node\(s\) needed arrived within 0 s"):
        job.meeting(0, "a").meet(NodeRange(2, 3), last_call_s=0, join_timeout_s=0)
    assert job.meeting(0, "b").meet(NodeRange(2, 3), 0, 600, stopped=lambda: True) is None
    assert not list(job.folder.glob(f"{fg.ARRIVED}*")) and not (job.folder / fg.SEAL).exists()


def test_the_agent_takes_the_range_and_gives_each_rank_its_first_seat_and_min() -> None:
    """Node 2 of --nnodes 1:3, 2 ranks each, seat 1 of a first group of 2 nodes (node 1 never came):
    RANK stays node-based (4, 5 of 6: its files and ids), the first group is ranks 2, 3 of 4."""
    argv = ["--nproc", "2", "--nnodes", "1:3", "--node-rank", "2", "--master-port", "29500"]
    argv += ["--lighthouse", "http://h:1", "--first-seat", "1", "--first-nodes", "2", "--", "x"]
    args, _ = live_agent.parse_args(argv)
    assert (args.nnodes, args.min_nodes, args.first_seat, args.first_nodes) == (3, 1, 1, 2)
    seat = live_agent.NodeSeat(2, 3, 2, "10.0.0.1", 29500, 1, 1, 2)
    envs = [live_agent.rank_env({}, local, seat, "http://h:1", "tl", 7, "10.0.0.3") for local in range(2)]
    assert [(e["RANK"], e["WORLD_SIZE"]) for e in envs] == [("4", "6"), ("5", "6")]
    assert [e[contract.LIVE_FIRST_GROUP] for e in envs] == ["2/4", "3/4"]
    assert {(e[contract.LIVE_MIN_NODES], e[contract.LIVE_NODE_RANGE]) for e in envs} == {("1", "--nnodes 1:3")}
    fixed = live_agent.rank_env({}, 0, live_agent.NodeSeat(2, 2, 1, "n0", 29500), "http://h:1", "tl", 7)
    assert contract.LIVE_FIRST_GROUP not in fixed and contract.LIVE_MIN_NODES not in fixed


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--nnodes", "1:3", "--first-seat", "2", "--first-nodes", "2"], "--first-seat 2 outside 0..1"),
        (["--nnodes", "2:3", "--first-nodes", "1"], "--first-nodes 1 outside --nnodes 2:3"),
        (["--nnodes", "2", "--first-seat", "0"], "come with --nnodes MIN:MAX"),
        (["--nnodes", "1:2", "--node-rank", "2"], "--node-rank 2 outside 0..1"),
    ],
)
def test_the_agent_refuses_a_first_seat_that_does_not_fit(
    extra: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as ended:
        live_agent.parse_args(["--nproc", "1", "--master-port", "1", "--lighthouse", "http://h:1", *extra, "--", "x"])
    assert ended.value.code == 2 and words in capsys.readouterr().err


def test_the_launchers_agent_command_carries_the_range_and_the_seat() -> None:
    spec = JobSpec(config="c.yaml", nodes=3, min_nodes=1, gpus_per_node=2, master_port=29500)
    placement = NodePlacement(2, "node0")
    first = fg.FirstSeat(1, 2, "10.0.0.1", (0, 2))
    argv = live_argv(spec, 1.0, "tl", placement=placement, lighthouse="http://h:1", first=first)
    head = argv[: argv.index("--")]
    flags = ("--nnodes", "--node-rank", "--master-addr", "--first-seat", "--first-nodes")
    assert [head[head.index(f) + 1] for f in flags] == ["1:3", "2", "10.0.0.1", "1", "2"]
    args, _ = live_agent.parse_args(argv[3:])
    assert (args.first_seat, args.first_nodes, args.min_nodes) == (1, 2, 1)
    joiner = live_argv(spec, 1.0, "tl", placement=placement, lighthouse="http://h:1", join_attempt=3)
    assert "--first-seat" not in joiner and joiner[joiner.index("--join-attempt") + 1] == "3"
    dry = live_argv(spec, 1.0, "tl", placement=placement, lighthouse="http://h:1")  # nobody met: every node
    assert "--first-seat" not in dry and live_agent.parse_args(dry[3:])[0].first_nodes == 3


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--nnodes", "1:2", "--node-rank", "2", "--master-addr", "127.0.0.1", *LIVE], "--node-rank 2 outside 0..1"),
        (["--nnodes", "2:1", "--node-rank", "0", "--master-addr", "127.0.0.1", *LIVE], "MIN 2 is more than MAX 1"),
        (["--nnodes", "0:2", "--node-rank", "0", "--master-addr", "127.0.0.1", *LIVE], "--nnodes"),
        (["--nnodes", "1:2", "--node-rank", "0", *LIVE], "needs --master-addr HOST"),
        (
            [
                "--nnodes",
                "1:2",
                "--node-rank",
                "0",
                "--master-addr",
                "127.0.0.1",
                "--rdzv-conf",
                "keep_alive_interval=1",
                *LIVE,
            ],
            "--rdzv-conf keep_alive_interval: the live road has no torchrun rendezvous",
        ),  # fmt: skip
        (  # the restart road's rule (recovery.live=false): torchrun's rendezvous numbers the nodes
            ["--nnodes", "1:2", "--node-rank", "0", "--master-addr", "127.0.0.1", "recovery.live=false"],
            "node ranks come from the rendezvous",
        ),
        (  # issue 52: its presence port would be 65536; passed the launch, then a traceback in every rank
            [
                "--nnodes",
                "1:2",
                "--node-rank",
                "0",
                "--master-addr",
                "127.0.0.1",
                "recovery.live=true",
                "recovery.lighthouse=http://127.0.0.1:65535",
            ],
            "PORT at most 65534 (PORT+1 is its presence port)",
        ),  # fmt: skip
    ],
)
def test_bad_range_input_is_one_line_and_exit_2_before_anything_is_written(
    args: list[str], words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The --node-rank case is torchrun's elastic mode (no live): its nodes are numbered by its rendezvous."""
    options = [a for a in args if not a.startswith("recovery.")]
    overrides = [a for a in args if a.startswith("recovery.")]
    run_dir = tmp_path / "run"
    rc = agent_node.main([*options, "--device", "cpu", "--config", SMOKE, f"run_dir={run_dir}", *overrides])
    err = capsys.readouterr().err.splitlines()
    assert rc == BAD_INPUT and len(err) == 1 and words in err[0], err
    assert not run_dir.exists(), "nothing written before the refusal"


def test_a_live_range_dry_run_prints_the_agent_with_the_range(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--nnodes", "1:2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--rdzv-conf", "last_call_timeout=3"]
    rc = agent_node.main([*argv, "--device", "cpu", "--config", SMOKE, "--dry-run", f"run_dir={tmp_path}", *LIVE])
    out = capsys.readouterr().out
    assert rc == OK and "torchlaunch.agent.live" in out and "--nnodes 1:2 --node-rank 1" in out, out


def test_a_rank_reads_its_first_group_seat_and_refuses_a_malformed_one() -> None:
    assert contract.live_first_group({}) is None
    assert contract.live_first_group({contract.LIVE_FIRST_GROUP: "2/4"}) == (2, 4)
    for bad in ("4/4", "x/2", "1", "-1/2", "1/2/3"):
        with pytest.raises(BadInput, match="is not RANK/WORLD"):
            contract.live_first_group({contract.LIVE_FIRST_GROUP: bad})


def test_status_takes_a_live_runs_world_from_its_last_change() -> None:
    """A late node joined the first group of one rank: nothing was lost, but the world grew in place."""
    head = RankBeat(0, 0, "l", "h", 1, None, 1, 0.0, 40, 64, 0, None, None, None, None, world_size=1)
    grown = WorldChange(step=24, world_size=2, previous_world_size=1, nodes=2, previous_nodes=1)
    assert _world_size(head, grown, lost=False, live=True) == 2
    assert _world_size(head, grown, lost=False, live=False) == 1


def test_min_nodes_arrived_start_after_the_last_call_even_past_the_join_timeout(tmp_path: Path) -> None:
    """Issue 52: `--nnodes 1:2 --rdzv-conf join_timeout=5,last_call_timeout=10` never started though its
    MIN had arrived (the join's deadline came inside the last call). The join timeout bounds the wait
    for MIN nodes; the last call then runs to its end."""
    job = Launchers(tmp_path / "live")
    met = job.meeting(0, "a").meet(NodeRange(1, 2), last_call_s=0.2, join_timeout_s=0)
    assert met == fg.FirstSeat(0, 1, "10.0.0.1", (0,))


class _Slot:
    def __init__(self, slot: int | None) -> None:
        self.slot = slot


def test_a_node_without_node_rank_takes_its_run_dir_slot_and_a_given_one_is_kept() -> None:
    import argparse

    def args(given: bool) -> argparse.Namespace:
        return argparse.Namespace(node_rank_given=given, node_range=NodeRange(1, 2), nnodes=2)

    placement = NodePlacement(0, "127.0.0.1")
    assert live_start.numbered(args(False), placement, _Slot(1)).node_rank == 1  # type: ignore[arg-type]
    assert live_start.numbered(args(True), placement, _Slot(1)).node_rank == 0  # type: ignore[arg-type]
    with pytest.raises(outcome.LaunchEnded) as ended:
        live_start.numbered(args(False), placement, _Slot(2))  # type: ignore[arg-type]
    assert ended.value.code == 1 and "retryable" in ended.value.line
