"""Live recovery's pure parts (torchlaunch/live, the live agent's exit rule): which errors
mean a lost peer, the seat and the plan on the ranks left, the regroup record, the run dir's fence.
The processes, sockets and the membership service are tests/integration/test_live_recovery.py's."""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

import pytest
import torch

from torchlaunch import config as config_mod
from torchlaunch import contract
from torchlaunch.agent import live as live_agent
from torchlaunch.agent import live_rejoin, live_start
from torchlaunch.agent.commands import NodePlacement, live_argv
from torchlaunch.agent.live_start import live_mode
from torchlaunch.core.sampler import BatchPlan
from torchlaunch.exit_codes import BAD_INPUT, FAILURE, OK, PREEMPTED, BadInput
from torchlaunch.launch.spec import JobSpec
from torchlaunch.live import Fence, Fenced, Member, Quorum, is_peer_lost, minimum, seat
from torchlaunch.live.membership import behind, replica_id_of, sorted_members, source
from torchlaunch.live.pulse import BEAT, Pulse, Watch, main_thread_cpu_s
from torchlaunch.live.replan import Regroup, replan

GLOO_RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:4022: "
    "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application"
)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError(GLOO_RESET),
        RuntimeError("[gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:29500"),
        RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:136] Write error: Broken pipe"),
        ConnectionResetError("Connection reset by peer"),
    ],
)
def test_a_lost_peers_transport_error_is_a_lost_peer(error: BaseException) -> None:
    assert is_peer_lost(error)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 300000ms for recv operation"),
        RuntimeError("Connection reset by peer after the socket timeout"),  # a timeout wins: maybe alive
        RuntimeError("CUDA out of memory"),
        ValueError("connection reset by peer"),  # not a transport exception type
        KeyboardInterrupt(),
    ],
)
def test_timeouts_and_other_errors_are_not(error: BaseException) -> None:
    assert not is_peer_lost(error)


def quorum(*ranks: int, steps: tuple[int, ...] | None = None) -> Quorum:
    members = [
        Member(replica_id_of(r), f"127.0.0.1:{4000 + r}", (steps or (7,) * len(ranks))[i]) for i, r in enumerate(ranks)
    ]
    return Quorum(3, "3-1.000000000", sorted_members(members))


def test_survivors_keep_their_order_and_the_first_one_is_rank_0() -> None:
    assert seat(quorum(1), replica_id_of(1)) == (0, 1)  # rank 0 lost: rank 1 hosts the group now
    assert seat(quorum(0, 2), replica_id_of(2)) == (1, 2)
    assert seat(quorum(12, 3, 7), replica_id_of(12)) == (2, 3)  # ids sort as numbers (zero-padded)
    with pytest.raises(ValueError, match="not in quorum"):
        seat(quorum(0, 2), replica_id_of(1))  # left out: fenced, never trains beside the group


def test_members_a_step_behind_take_the_newest_members_state() -> None:
    assert behind(quorum(0, 1)) == ()
    ahead = quorum(0, 1, 2, steps=(7, 8, 7))  # rank 1's all-reduce completed before the loss
    assert behind(ahead) == (replica_id_of(0), replica_id_of(2)) and source(ahead) == 1


@pytest.mark.parametrize(("batch", "before", "after"), [(16, 2, 1), (64, 4, 3), (10, 4, 3), (7, 3, 2)])
def test_the_ranks_left_train_the_same_samples_with_the_same_draws(batch: int, before: int, after: int) -> None:
    """A global step's samples and augmentation on `after` ranks are exactly those on `before` ranks;
    the loss weights still make the ranks' sum the global mean (count * W / B summed over ranks = W)."""
    base = BatchPlan(batch * 5, batch, seed=3, micro_batch=3)
    perm = base.permutation(1)

    def step(world: int) -> tuple[list[int], list[list[int]]]:
        indices: list[int] = []
        draws: list[list[int]] = [[], [], []]
        for rank in range(world):
            plan = replan(base, rank, world)
            idx, aug = plan.rank_step(perm, 1, 2)
            indices += idx.tolist()
            for part, values in zip(draws, aug, strict=True):
                part += values.tolist()
            assert sum(plan.loss_weight(n) for n in plan.micro_sizes()) == plan.loss_weight(plan.per_rank)
        return indices, draws

    assert step(before) == step(after)
    survivor = replan(replan(base, 1, before), 0, after)
    assert sum(survivor.shares) == batch and survivor.seed == base.seed and survivor.global_batch == batch
    assert sum(replan(base, r, after).loss_weight(replan(base, r, after).per_rank) for r in range(after)) == after


def test_a_regroup_says_which_step_runs_again() -> None:
    line = Regroup(step=12, old_rank=1, old_world=2, rank=0, world=1, generation=2, lost_s=0.9).line()
    assert "lost 1 rank(s) at global step 12" in line and "step 12 runs again" in line and "1 -> 0" in line
    during = Regroup(12, 1, 2, 0, 1, 2, 0.9, during="validation").line()
    assert "lost 1 rank(s) in the validation after step 11" in during and "the validation runs again" in during


def test_a_group_below_the_launchers_minimum_may_not_train_on() -> None:
    least = minimum.Minimum(nodes=2, ranks_per_node=1, said="--nodes 2-3")
    assert least.short(2) is None and least.short(3) is None
    minimum.below_minimum(least, 2)
    minimum.below_minimum(None, 1)  # no range: the group trains on down to one rank
    with pytest.raises(minimum.BelowMinimum) as caught:
        minimum.below_minimum(least, 1)
    assert caught.value.committed(12) == (
        "live: 1 node left, below --nodes 2-3's minimum of 2 nodes: checkpoint committed at global step 12; "
        "exit 75 so that the job is requeued"
    )
    per_node = minimum.Minimum(nodes=2, ranks_per_node=2, said="--nodes 2-4")
    assert per_node.ranks == 4 and per_node.short(4) is None
    assert per_node.short(3) == "3 rank(s) left (2 per node), below --nodes 2-4's minimum of 2 nodes"
    assert per_node.short(2) == "1 node left, below --nodes 2-4's minimum of 2 nodes"


def test_the_minimum_comes_from_the_launchers_env() -> None:
    from torchlaunch import contract

    assert minimum.from_env(4, {}) is None
    env = {contract.LIVE_MIN_NODES: "2", contract.LIVE_NODE_RANGE: "--nodes 2-3\n"}
    assert minimum.from_env(4, env) == minimum.Minimum(2, 4, "--nodes 2-3")
    assert minimum.from_env(1, {contract.LIVE_MIN_NODES: "1"}) == minimum.Minimum(1, 1, "the launch")
    for bad in ("0", "-1", "two", "1" * 40):
        with pytest.raises(BadInput, match=r"is not a node count >= 1") as caught:
            minimum.from_env(1, {contract.LIVE_MIN_NODES: bad})
        assert "\n" not in str(caught.value) and len(str(caught.value)) < 120


def test_each_group_takes_a_newer_generation_and_an_older_one_may_not_commit(tmp_path: Path) -> None:
    first = Fence(tmp_path)
    assert first.current() == 0
    old = first.advance()
    first.check(old)
    new = Fence(tmp_path).advance()  # the regrouped group, another process: the file is the truth
    assert new == old + 1
    Fence(tmp_path).check(new)
    with pytest.raises(Fenced, match=f"generation {old}\\) may not commit") as raised:
        first.check(old)
    assert isinstance(raised.value, BadInput)  # exit 2: never retried beside the live group


def test_a_group_of_members_all_left_out_takes_no_generation(tmp_path: Path) -> None:
    """A regroup succeeds the newest generation any of its members trained in: members that all come from
    an older one (a node frozen past the bound, woken after the others regrouped without it or finished)
    are fenced, and the generation stays the live group's. A first group (0) and a group with a member
    of the newest one advance (found on Slurm: a woken node retrained the finished run's tail over it)."""
    fence = Fence(tmp_path)
    first = fence.advance(succeeds=0)
    survivors = fence.advance(succeeds=first)  # the group that regrouped without the frozen node
    with pytest.raises(Fenced, match=f"come from generation {first}, but generation {survivors} trains"):
        Fence(tmp_path).advance(succeeds=first)  # the frozen node, woken alone
    assert fence.current() == survivors
    assert fence.advance(succeeds=survivors) == survivors + 1  # the live group regrouping (the woken one within)
    assert fence.advance(succeeds=0) == survivors + 2  # a first group: a requeue, a successor job


def test_a_superseded_group_never_commits_however_the_check_and_the_commit_interleave(tmp_path: Path) -> None:
    """The generation is checked again under the fence's lock around the commit's renames, and a new
    group's advance takes the same lock: no newer generation can appear between check and commit."""
    from torchlaunch.core.checkpoint import store

    fence = Fence(tmp_path)
    old = fence.advance()
    root = tmp_path / "checkpoints"
    store.write_checkpoint(root, 1, {"w": torch.ones(2)}, {}, commit_guard=lambda: fence.holding(old))
    assert store.verify(root / store.step_dir_name(1)) is None, "the live group commits"

    def advance_meanwhile(tmp: Path) -> None:  # a new group forms after the early check, before the renames
        Fence(tmp_path).advance()

    with pytest.raises(Fenced, match=f"generation {old}\\) may not commit"):
        store.write_checkpoint(
            root, 2, {"w": torch.ones(2)}, {}, before_commit=advance_meanwhile, commit_guard=lambda: fence.holding(old)
        )
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [store.step_dir_name(1)]
    assert not [p for p in root.iterdir() if p.name.startswith(store.TMP_PREFIX)], "its temp folder is removed"

    with fence.holding(old + 1):  # while the new group commits, no other group can take a generation
        lock = os.open(tmp_path / "live" / "generation.lock", os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(lock)


@pytest.mark.parametrize(
    ("codes", "expected"),
    [
        ([0, 0], OK),
        ([-9, 0], OK),  # rank 0 lost, the survivor finished: what live mode is for
        ([0, -9], OK),
        ([-9, -9], FAILURE),  # nobody finished
        ([2, -9], BAD_INPUT),
        ([75, -9], PREEMPTED),
        ([0, 1], FAILURE),
    ],
)
def test_the_live_agents_exit_code_is_the_survivors(codes: list[int], expected: int) -> None:
    assert live_agent.job_code(codes) == expected


def test_the_live_agent_gives_each_rank_torchruns_contract_and_the_service() -> None:
    seat = live_agent.NodeSeat(2, master_port=29500)
    env = live_agent.rank_env({"PATH": "/bin"}, 1, seat, "http://127.0.0.1:9", "tl-x", 7)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("1", "1", "2", "2")
    assert env["TORCHLAUNCH_LIGHTHOUSE"] == "http://127.0.0.1:9" and env["TORCHELASTIC_RUN_ID"] == "tl-x"
    assert env["TORCHLAUNCH_LIVE_PULSE_FD"] == "7" and env["TORCHLAUNCH_LIVE_STORE_HOST"] == "127.0.0.1"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["GROUP_RANK"]) == ("127.0.0.1", "29500", "0")
    assert env["PATH"] == "/bin"


def test_the_live_agent_numbers_ranks_across_nodes() -> None:
    """Node 2 of 3 with 4 ranks each: global ranks 8..11 of 12, node 0 the first group's store."""
    seat = live_agent.NodeSeat(4, nnodes=3, node_rank=2, master_addr="node0", master_port=29500)
    envs = [live_agent.rank_env({}, local, seat, "http://lh:29510", "tl-x", 7, "10.0.0.3") for local in range(4)]
    assert [e["RANK"] for e in envs] == ["8", "9", "10", "11"]
    assert {(e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"], e["GROUP_WORLD_SIZE"]) for e in envs} == {
        ("12", "4", "2", "3")
    }
    assert {(e["MASTER_ADDR"], e["TORCHLAUNCH_LIVE_STORE_HOST"]) for e in envs} == {("node0", "10.0.0.3")}


def test_the_live_agent_gives_out_loopback_on_one_node() -> None:
    """Across nodes it is the source address toward the service (a socket: the netns tests prove it)."""
    assert live_agent.store_host(live_agent.NodeSeat(2), "http://10.9.9.9:29510") == "127.0.0.1"


def test_the_live_agent_across_nodes_needs_a_service_apart_or_the_run_dir_to_place_one() -> None:
    with pytest.raises(SystemExit):
        live_agent.parse_args(["--nproc", "1", "--nnodes", "2", "--master-port", "29500", "--", "x"])
    placed, _ = live_agent.parse_args(
        ["--nproc", "1", "--nnodes", "2", "--master-port", "29500", "--run-dir", "/shared/run", "--", "x"]
    )
    assert (placed.run_dir, placed.lighthouse) == ("/shared/run", "")
    with pytest.raises(SystemExit):
        live_agent.parse_args(["--nproc", "1", "--nnodes", "1:2", "--lighthouse", "http://h:1", "--", "x"])
    args, program = live_agent.parse_args(
        ["--nproc", "1", "--nnodes", "2", "--master-port", "29500", "--lighthouse", "http://h:1", "--", "x"]
    )
    assert (args.nnodes, args.lighthouse, program) == (2, "http://h:1", ["x"])


def test_live_mode_is_on_by_default_for_several_ranks_and_false_is_the_way_out() -> None:
    spec = JobSpec(config="c.yaml", gpus_per_node=2)
    off = config_mod.load(None, ["recovery.live=false"])
    assert off.recovery.live is False and not live_mode(off, spec, NodePlacement(), doctor=False)
    for given in ([], ["recovery.live=auto"], ["recovery.live=true"]):
        on = config_mod.load(None, given)
        assert on.recovery.live == ("auto" if not given or given[0].endswith("auto") else True)
        assert live_mode(on, spec, NodePlacement(), doctor=False), given
        assert not live_mode(on, JobSpec(config="c.yaml", gpus_per_node=1), NodePlacement(), doctor=False)
        assert not live_mode(on, spec, NodePlacement(), doctor=True)  # the pre-flight runs as today
    on = config_mod.load(None, ["recovery.live=true"])
    two_nodes = JobSpec(config="c.yaml", nodes=2, gpus_per_node=1, run_dir="/shared/run")
    assert live_mode(on, two_nodes, NodePlacement(master_addr="h"), False)  # the agents place the service
    placed = live_argv(two_nodes, 1.0, "tl-1", placement=NodePlacement(1, "node0"))
    assert placed[placed.index("--run-dir") + 1] == "/shared/run" and "--lighthouse" not in placed
    apart = config_mod.load(None, ["recovery.live=true", "recovery.lighthouse=http://10.0.0.9:29510"])
    assert live_mode(apart, two_nodes, NodePlacement(1, master_addr="h"), False)
    ranged = JobSpec(config="c.yaml", nodes=2, min_nodes=1, gpus_per_node=1)  # live too (test_live_range.py)
    assert live_mode(apart, ranged, NodePlacement(1, master_addr="h"), False)
    across = live_argv(two_nodes, 1.0, "tl-1", placement=NodePlacement(1, "node0"), lighthouse="http://h:29510")
    tail = across[: across.index("--")]
    assert tail[tail.index("--lighthouse") + 1] == "http://h:29510"
    assert [tail[tail.index(f) + 1] for f in ("--nnodes", "--node-rank", "--master-addr", "--master-port")] == [
        "2",
        "1",
        "node0",
        "29500",
    ]
    argv = live_argv(spec, 0.5, "tl-1")
    assert argv[:3] == ["python", "-m", "torchlaunch.agent.live"]
    assert argv[argv.index("--heartbeat-timeout-ms") + 1] == "500" and argv[argv.index("--") + 1 :][:2] == [
        "-m",
        "torchlaunch.runner",
    ]


def test_live_mode_without_torchft_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(live_start.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(BadInput, match=r"needs torchft .*torchlaunch\[live\]"):
        live_start.require_live_extra()


def test_the_generation_is_never_read_or_written_through_a_link(tmp_path: Path) -> None:
    """RUN_DIR/live is a run-dir folder: a link planted there (or at its generation file) is not
    followed, so a forged generation elsewhere neither vouches for a group nor gets written."""
    from torchlaunch import rundir

    run_dir, outside = tmp_path / "run", tmp_path / "outside"
    run_dir.mkdir()
    outside.mkdir()
    (outside / "generation").write_text("7\n")
    (run_dir / "live").symlink_to(outside)
    with pytest.raises(rundir.LinkedFolder):
        Fence(run_dir).advance()
    with pytest.raises(rundir.LinkedFolder):
        Fence(run_dir).current()
    assert sorted(p.name for p in outside.iterdir()) == ["generation"]
    assert (outside / "generation").read_text() == "7\n"

    (run_dir / "live").unlink()
    (run_dir / "live").mkdir()
    (run_dir / "live" / "generation").symlink_to(outside / "generation")
    assert Fence(run_dir).current() == 0  # the planted link is not read: it vouches for no group
    with pytest.raises(Fenced):
        Fence(run_dir).check(7)
    assert Fence(run_dir).advance() == 1  # the link itself is replaced by the real file
    assert not (run_dir / "live" / "generation").is_symlink() and (outside / "generation").read_text() == "7\n"
    assert "live" in rundir.FOLDERS  # refused at start by rundir.check_folders, like every run-dir folder


def pulse_pipe(watch: Watch, rank: int, bound_s: float = 1.0) -> Pulse:
    read_fd, write_fd = os.pipe()
    watch.add(rank, read_fd)
    return Pulse.for_bound(write_fd, bound_s)


def test_a_rank_that_stops_beating_is_silent_after_the_bound_and_only_then() -> None:
    """The agent's clock is passed in: no sleeps. A rank is judged from its first beat on."""
    watch = Watch(bound_s=1.0)
    beating, frozen, starting = pulse_pipe(watch, 0), pulse_pipe(watch, 1), pulse_pipe(watch, 2)
    beating._write(BEAT)
    frozen._write(BEAT)
    assert watch.silent(now=100.0) == {}
    beating._write(BEAT)  # rank 0 beats on; rank 1 is frozen; rank 2 never beat (still starting)
    assert watch.silent(now=100.9) == {}, "within the bound"
    beating._write(BEAT)
    assert watch.silent(now=101.5) == {1: pytest.approx(1.5)}
    assert set(watch.ranks) == {0, 1, 2}
    watch.close()
    for pulse in (beating, frozen, starting):
        pulse.stop()  # the agent's ends are closed: the rank's goodbye is dropped without an error


def test_a_rank_whose_main_thread_runs_is_slow_not_silent_and_a_frozen_one_is_silent_at_the_bound() -> None:
    """Beats stop while a call holds the GIL: a regroup's full gc.collect() on a survivor held to a fifth
    of a loaded CPU ran past the bound and its agent killed it. The main thread's CPU time (read through
    `cpu_s`, passed in here with the clock) tells that slow rank from a frozen one."""
    ran = {10: 5.0, 11: 5.0, 12: 5.0}
    watch = Watch(bound_s=1.0, cpu_s=ran.get)
    slow, frozen, waiting, unknown = (pulse_pipe(watch, rank) for rank in range(4))
    for rank, pid in ((0, 10), (1, 11), (2, 12)):  # rank 3's process is not known: beats alone judge it
        watch.follow(rank, pid)
    for pulse in (slow, frozen, waiting, unknown):
        pulse._write(BEAT)
    assert watch.silent(now=100.0) == {}
    judged = {}
    for tick in range(1, 31):  # 3 s without a beat, read every 0.1 s
        ran[10] += 0.002  # 2% of the time: a slow rank's gc.collect, holding the GIL
        ran[12] += 0.00005  # 0.05%: a thread that only waits for the GIL wakes every 5 ms
        for rank, seconds in watch.silent(now=100.0 + tick / 10).items():
            judged.setdefault(rank, (tick / 10, seconds))
    assert 0 not in judged, "running, though not beating: slow, not silent"
    assert {rank: round(at, 1) for rank, (at, _) in judged.items()} == {1: 1.1, 2: 1.1, 3: 1.1}, judged
    watch.close()
    for pulse in (slow, frozen, waiting, unknown):
        pulse.stop()


def test_the_main_threads_cpu_time_is_read_from_proc_and_none_for_a_process_gone() -> None:
    """The agent's reader, on this process (a unit test starts none: a stopped rank's standing still is
    test_live_recovery's SIGSTOP test, fenced at the bound)."""
    first = main_thread_cpu_s(os.getpid())
    mine = time.thread_time()
    while time.thread_time() - mine < 0.05:
        pass
    assert first is not None and main_thread_cpu_s(os.getpid()) >= first + 0.04
    assert main_thread_cpu_s(2**22 + 1) is None, "no such process (above pid_max's ceiling): beats alone judge it"


def test_a_rank_that_says_goodbye_or_dies_is_no_longer_watched() -> None:
    watch = Watch(bound_s=1.0)
    leaving, dying = pulse_pipe(watch, 0), pulse_pipe(watch, 1)
    leaving.start()  # the first beat at once, then a thread
    dying._write(BEAT)
    assert watch.silent(now=time.monotonic()) == {}
    leaving.stop()  # BYE, then its end closed
    os.close(dying.fd)  # a rank that died: its end of the pipe closed by its kernel
    assert watch.silent(now=time.monotonic() + 60) == {}, "gone on purpose or dead: not silent"
    assert watch.ranks == {}


def test_a_rank_never_waits_on_its_agent() -> None:
    """An agent that stopped reading (itself stopped) fills the pipe: the rank's beats are dropped,
    its writes never block; an agent that is gone ends the beats."""
    read_fd, write_fd = os.pipe()
    pulse = Pulse(write_fd, 0.1)
    for _ in range(200_000):  # far more than a pipe holds (64 KiB on Linux)
        assert pulse._write(BEAT)
    os.close(read_fd)
    assert not pulse._write(BEAT), "the agent's end is closed: nothing left to tell"
    pulse.stop()


def test_the_gradients_live_in_one_flat_buffer_that_backward_fills_in_place() -> None:
    """Live mode averages one flat buffer: each .grad is a view of it with its parameter's strides
    (channels_last included), backward accumulates into it, and an unused parameter adds zeros."""
    from torch import nn

    from torchlaunch.live.grads import FlatGradients

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.LazyLinear(2))
    model(torch.randn(1, 3, 6, 6))
    unused = nn.Linear(2, 2)
    model.add_module("unused", unused)
    model = model.to(memory_format=torch.channels_last)
    assert not model[0].weight.is_contiguous(), "the conv weight is channels_last"
    assert FlatGradients.fits(model.parameters())
    grads = FlatGradients(model.parameters())
    x = torch.randn(2, 3, 6, 6)
    reference = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(64, 2))
    reference.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("unused")})
    for _ in range(2):  # two backward passes accumulate, as micro-batches do
        model[2](model[1](model[0](x))).sum().backward()
        reference(x).sum().backward()
    for (name, p), q in zip(model[:3].named_parameters(), reference.parameters(), strict=True):
        assert p.grad.stride() == p.stride(), name
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    start, end = grads.flat.data_ptr(), grads.flat.data_ptr() + grads.flat.numel() * 4
    assert all(start <= p.grad.data_ptr() < end for p in model.parameters()), "every .grad is a view"
    assert not unused.weight.grad.any(), "an unused parameter adds zeros"
    grads.zero()
    assert not any(p.grad.any() for p in model.parameters())
    assert not FlatGradients.fits([nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2, dtype=torch.float64))])


def test_a_rank_started_again_sorts_last_and_takes_the_newest_members_state() -> None:
    """Joining never moves the ranks that train (rank 0 and its logs stay); the state comes from the
    first member at the newest step; a joiner's step (none yet) does not count against agreement."""
    from torchlaunch.live.membership import JOINING_STEP

    ids = [replica_id_of(0), replica_id_of(2), replica_id_of(1, attempt=1), replica_id_of(0, attempt=2)]
    assert sorted(ids) == [replica_id_of(0), replica_id_of(2), replica_id_of(1, attempt=1), replica_id_of(0, attempt=2)]
    members = sorted_members(
        [
            Member(replica_id_of(0), "h:1", 40),
            Member(replica_id_of(1, 1), "h:2", JOINING_STEP),
            Member(replica_id_of(2), "h:3", 40),
        ]
    )
    q = Quorum(3, "3-0", members)
    assert behind(q) == (replica_id_of(1, 1),) and source(q) == 0 and seat(q, replica_id_of(1, 1)) == (2, 3)
    assert source(Quorum(1, "1-0", sorted_members([Member(replica_id_of(1, 1), "h:2", JOINING_STEP)]))) is None
    line = Regroup(41, 0, 2, 0, 3, 4, 0.05, during="rejoin").line()
    assert "1 rank(s) started again joined before global step 41" in line and "checked" in line


def test_only_well_formed_join_requests_count(tmp_path: Path) -> None:
    from torchlaunch.live.group import join_requests

    assert join_requests(tmp_path / "absent") == []
    for name in ("join-rejoin001-rank000001", "join-rank000001", "join-rejoin001-rank000001.tmp", "generation"):
        (tmp_path / name).write_text("")
    assert join_requests(tmp_path) == ["join-rejoin001-rank000001"]


class _Proc:
    """A stand-in for a rank's Popen: its return code (None while it runs)."""

    def __init__(self, code: int | None) -> None:
        self.returncode, self.pid = code, -1

    def poll(self) -> int | None:
        return self.returncode


def test_the_agent_starts_a_lost_rank_again_only_while_another_trains_and_within_the_limit() -> None:
    started: list[int] = []

    def start(rank: int) -> _Proc:
        started.append(rank)
        return _Proc(None)

    ranks = [_Proc(None), _Proc(-9), _Proc(2)]  # rank 1 lost to SIGKILL; rank 2 exited by itself (not lost)
    restarts, replaced = [0, 0, 0], []
    live_rejoin.rejoin(ranks, restarts, 1, {1: "silent 1.0 s"}, replaced, start)  # type: ignore[arg-type]
    assert started == [1] and restarts == [0, 1, 0] and replaced == ["rank 1 (SIGKILL, silent 1.0 s; started again)"]
    ranks[1] = _Proc(-9)  # lost again: the limit (1) is reached
    live_rejoin.rejoin(ranks, restarts, 1, {}, replaced, start)  # type: ignore[arg-type]
    assert started == [1]
    alone = [_Proc(0), _Proc(-9)]  # nobody left to join
    live_rejoin.rejoin(alone, [0, 0], 3, {}, [], start)  # type: ignore[arg-type]
    assert started == [1]
    assert live_rejoin.stop_after_a_failure([_Proc(None), _Proc(75)], None) is None  # a preemption is not a failure
    first = live_rejoin.stop_after_a_failure([_Proc(None), _Proc(1)], None)
    assert first is not None and live_rejoin.stop_after_a_failure([_Proc(None), _Proc(1)], first) == first


def test_a_broken_groups_connections_are_cut_and_nothing_else() -> None:
    """sockets.cut shuts down the recorded connections only (by inode): the peer of a cut one reads the
    end at once (what wakes a member waiting in a broken collective); another connection is untouched."""
    from torchlaunch.live import sockets

    before = set(sockets.open_sockets().values())
    ours, peer = socket.socketpair()
    recorded = frozenset(set(sockets.open_sockets().values()) - before)
    other, other_peer = socket.socketpair()
    try:
        assert len(recorded) == 2
        assert sockets.cut(recorded) == 2
        peer.settimeout(5)
        assert peer.recv(1) == b""  # the end, not a wait
        other.sendall(b"x")
        assert other_peer.recv(1) == b"x"
        assert ours.fileno() >= 0  # the descriptor stays its owner's to close
    finally:
        for s in (ours, peer, other, other_peer):
            s.close()


def test_the_peer_watch_probes_only_a_stalled_group_and_cuts_once_for_a_silent_peer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A whole node frozen or cut off: while training is stalled past a quarter of the bound, each peer is
    probed; the first that does not answer makes this rank cut its group's connections, once."""
    from torchlaunch.live import peers

    now = [100.0]
    monkeypatch.setattr(peers.time, "monotonic", lambda: now[0])
    asked: list[str] = []
    silent = {"10.0.0.2:5"}

    def probe(address: str, timeout_s: float) -> bool:
        asked.append(address)
        return address not in silent

    cuts: list[int] = []
    watch = peers.PeerWatch(1.0, probe)
    watch.watch(("10.0.0.1:4", "10.0.0.2:5"), lambda: cuts.append(1))
    now[0] += 0.2
    assert watch.check() is None and asked == []  # stepping along: nobody is asked
    watch.stepped()
    now[0] += 0.3
    assert watch.check() == "10.0.0.2:5" and cuts == [1] and watch.judged == "10.0.0.2:5"
    assert watch.check() is None and cuts == [1]  # once per group: the next group is watched anew
    silent.clear()
    watch.watch(("10.0.0.1:4",), lambda: cuts.append(2))
    now[0] += 5.0  # a long save on a peer: stalled, but it answers
    assert watch.check() is None and cuts == [1]
    watch.unwatch()  # leaving the group: a regroup waits as long as it takes
    silent.add("10.0.0.1:4")
    assert watch.check() is None and cuts == [1]


def test_the_fixed_group_leaves_a_lost_peer_to_the_launcher_and_the_live_group_names_it() -> None:
    """A transport error is the run's in torchrun's fixed group (the launcher restarts the ranks from
    the last checkpoint) and a regroup's cue in the live one; a timeout is the run's in both."""
    from torchlaunch.worker.groups import FixedGroup
    from torchlaunch.worker.groups.live import LiveTrainingGroup

    lost = RuntimeError("[gloo/transport] Connection closed by peer [127.0.0.1]:4321\nmore")
    fixed = FixedGroup()
    assert fixed.lost(lost) is None

    def attempt() -> None:
        raise lost

    with pytest.raises(RuntimeError, match="Connection closed"):
        fixed.surviving(None, None, "checkpoint", attempt)  # type: ignore[arg-type]
    live = LiveTrainingGroup(None)  # type: ignore[arg-type] - lost() reads no seat
    assert live.lost(lost) == "[gloo/transport] Connection closed by peer [127.0.0.1]:4321"
    assert live.lost(RuntimeError("Timed out waiting 300000ms for recv operation")) is None


def test_a_state_taken_mid_fit_moves_every_holder_of_the_progress(tmp_path: Path) -> None:
    """A live rank a step behind loads a peer's state in the middle of fit, whose loops hold the
    progress in locals: loading must move that same object (a new one left fit on the old position:
    the rank validated twice and its peer waited out dist.timeout_s)."""
    from tests.helpers import small_trainer
    from torchlaunch.worker.groups.live import SHARED_STATE_WORLD

    trainer = small_trainer(tmp_path / "run")
    held = trainer.progress  # what fit's `p` is
    state = {**trainer.state_dict(), "world_size": SHARED_STATE_WORLD}  # what LiveTrainingGroup._share_state sends
    state["progress"] = {**state["progress"], "global_step": 13, "step_in_epoch": 1, "val_pending": True}
    trainer.load_state_dict(state)
    assert trainer.progress is held
    assert (held.global_step, held.step_in_epoch, held.val_pending) == (13, 1, True)


def test_a_rank_started_again_that_fails_before_joining_leaves_the_others_training() -> None:
    """A joiner that exits non-zero before it joined (no group in the quorum timeout) is given up on:
    the others are not stopped and the job's code stays theirs; once joined, a failure is the job's."""
    ranks = [_Proc(None), _Proc(1)]
    abandoned: set[int] = set()
    live_rejoin.abandon_failed_joiners(ranks, live_rejoin.Joiners(0, [0, 1]), set(), abandoned)
    assert abandoned == {1}
    assert live_rejoin.stop_after_a_failure(ranks, None, abandoned) is None  # rank 0 is not stopped
    ranks[0].returncode = 0
    assert live_agent.job_code([c for r, c in enumerate([0, 1]) if r not in abandoned]) == OK
    given_up: set[int] = set()
    live_rejoin.abandon_failed_joiners([_Proc(None), _Proc(1)], live_rejoin.Joiners(0, [0, 1]), {1}, given_up)
    assert given_up == set(), "a rank that joined and then failed fails the job"
    live_rejoin.abandon_failed_joiners([_Proc(None), _Proc(1)], live_rejoin.Joiners(0, [0, 0]), set(), given_up)
    assert given_up == set(), "a first-start rank's failure is the job's"


def test_a_launcher_that_joins_before_the_founder_recorded_its_run_is_not_a_replacement(tmp_path: Path) -> None:
    """A run dir trained before (its founded record an earlier launch's, generations grown past it): the
    founder of the new launch records its run only once its config is settled, and a launcher that joins
    meanwhile waits for that record instead of reading the old one and taking itself for a lost node's
    replacement. When the founder leaves without recording, the joiner founds the run itself."""
    import threading

    from torchlaunch import runlock

    old = Fence(tmp_path)
    old.found("an-earlier-launch")
    old.advance()
    old.advance()  # the earlier launch's groups
    job = "job-key"
    first = runlock.RunLock(tmp_path, job=job).acquire()
    second = runlock.RunLock(tmp_path, job=job).acquire()
    try:
        assert first.founded and not second.founded
        founder = threading.Timer(0.3, live_start.replaces_a_lost_node, (first, str(tmp_path)))
        founder.start()  # the founder settles its config, then records
        try:
            assert live_start.replaces_a_lost_node(second, str(tmp_path)) == 0, "read the earlier launch's record"
        finally:
            founder.join()
        assert Fence(tmp_path).founder() == first.holder.token == second.holder.incarnation
    finally:
        second.release()
        first.release()
    first = runlock.RunLock(tmp_path, job=job).acquire()
    second = runlock.RunLock(tmp_path, job=job).acquire()
    first.release()  # the founder was refused (say, its config) and left without recording
    try:
        Fence(tmp_path).advance()
        assert live_start.replaces_a_lost_node(second, str(tmp_path)) == 0
        assert Fence(tmp_path).founder() == second.holder.incarnation and not Fence(tmp_path).formed_since_founded()
    finally:
        second.release()
    # The founder lost after its run's groups formed (node 0 SIGKILLed whole): its replacement joins the
    # run the founder recorded, through a member that is still alive.
    first = runlock.RunLock(tmp_path, job=job).acquire()
    second = runlock.RunLock(tmp_path, job=job).acquire()
    try:
        assert live_start.replaces_a_lost_node(first, str(tmp_path)) == 0
        Fence(tmp_path).advance()  # the first group
        first.release()  # node 0 lost
        replacement = runlock.RunLock(tmp_path, job=job).acquire()
        try:
            assert not replacement.founded and replacement.holder.incarnation == first.holder.token
            generation = Fence(tmp_path).current()
            assert live_start.replaces_a_lost_node(replacement, str(tmp_path)) == generation + 1
        finally:
            replacement.release()
    finally:
        second.release()


def test_a_launcher_that_joins_a_job_whose_group_formed_replaces_a_lost_node(tmp_path: Path) -> None:
    """The launcher that founds the job's run records the generation; one that joins later replaces a
    lost node only once a group formed since (a late node of the first launch never does), and its
    ranks' attempt is past every generation. A founded record planted as a link vouches for nothing."""
    from torchlaunch import runlock

    job = "job-key"
    first = runlock.RunLock(tmp_path, job=job).acquire()
    second = runlock.RunLock(tmp_path, job=job).acquire()
    try:
        assert first.founded and not second.founded
        assert live_start.replaces_a_lost_node(first, str(tmp_path)) == 0
        assert live_start.replaces_a_lost_node(second, str(tmp_path)) == 0, "no group yet: a first launch"
        fence = Fence(tmp_path)
        fence.advance()  # the first group formed
        fence.advance()  # and a regroup after a loss
        assert live_start.replaces_a_lost_node(second, str(tmp_path)) == 3
        assert live_start.replaces_a_lost_node(None, str(tmp_path)) == 0, "one node: nothing shared"
    finally:
        second.release()
        first.release()
    again = runlock.RunLock(tmp_path, job=job).acquire()  # every launcher gone: the next one starts the job
    try:
        assert again.founded and live_start.replaces_a_lost_node(again, str(tmp_path)) == 0
        assert not Fence(tmp_path).formed_since_founded(), "the new run starts from the generation it found"
    finally:
        again.release()
    founded = tmp_path / "live" / "founded"
    founded.unlink()
    founded.symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").write_text("0\n")
    assert not Fence(tmp_path).formed_since_founded()


def test_a_replacement_nodes_ranks_all_join_and_wait_for_peers_on_other_nodes() -> None:
    """--join-attempt N: every rank of the node joins with attempts from N (a rank it starts again
    later goes on from there); with every rank of a node waiting to join, the ones it waits for train
    on other nodes, so the agent does not end them as orphans. The command carries the attempt."""
    restarts = [0, 0]
    joiners = live_rejoin.Joiners(4, restarts)
    assert joiners(0) and joiners(1) and joiners.attempt(1) == 4
    restarts[1] = 1
    assert joiners.attempt(1) == 5
    first_start = live_rejoin.Joiners(0, [0, 1])
    assert not first_start(0) and first_start(1) and first_start.attempt(1) == 1
    waiting = [_Proc(None), _Proc(None)]
    live_rejoin.end_orphan_joiners(waiting, joiners, set())  # type: ignore[arg-type]
    assert all(p.returncode is None for p in waiting)
    spec = JobSpec(nodes=2, gpus_per_node=1, master_port=29500, config="c.yaml")
    argv = live_argv(spec, 1.0, "rid", placement=NodePlacement(node_rank=1, master_addr="node0"),
                     lighthouse="http://lh:29510", join_attempt=4)  # fmt: skip
    assert argv[argv.index("--join-attempt") + 1] == "4"
    args, _ = live_agent.parse_args(argv[3:])
    assert args.join_attempt == 4
    assert "--join-attempt" not in live_argv(spec, 1.0, "rid", placement=NodePlacement(master_addr="node0"))
    with pytest.raises(SystemExit):  # argparse's exit 2 and one line
        live_agent.parse_args(["--nproc", "1", "--join-attempt", "-3", "--", "-c", "pass"])


def test_a_joiner_seated_at_another_place_writes_its_own_files(tmp_path: Path) -> None:
    """A replacement for node 0 is seated after the survivor (rank 1 of 2) but started as rank 0: its
    trace and events go to the rank-0 files, never into the survivor's, which holds place 1's names."""
    from torchlaunch.worker.metrics import RunLog

    kwargs = {"epochs": 1, "steps_per_epoch": 4, "total_steps": 4, "global_batch": 2, "start_step": 2}
    survivor = RunLog(tmp_path, 0, resume_step=None, tensorboard=False, trace=True, started_as=1, **kwargs)
    survivor.trace(1, 0, 1, [7])
    joiner = RunLog(tmp_path, 1, resume_step=2, tensorboard=False, trace=True, started_as=0, **kwargs)
    joiner.trace(3, 0, 2, [5])
    survivor.trace(3, 0, 2, [6])
    joiner.event({"event": "joined"})
    trace = tmp_path / "trace"
    assert [line.count('"step"') for line in (trace / "rank1.jsonl").read_text().splitlines()] == [1, 1]
    assert '"indices": [5]' in (trace / "rank0.jsonl").read_text()
    assert (tmp_path / "live" / "events-rank0.jsonl").is_file()


def test_a_joiner_with_the_launch_rank_of_a_training_member_is_a_second_launch() -> None:
    from torchlaunch.live.membership import JOINING_STEP, started_as, twin

    assert started_as("rank000007") == 7 and started_as("rejoin012-rank000007") == 7 and started_as("x") is None
    members = (
        Member("rank000000", "a:1", 40),
        Member("rank000001", "b:1", 40),
        Member("rejoin003-rank000001", "c:1", JOINING_STEP),
        Member("rejoin003-rank000002", "d:1", JOINING_STEP),
    )
    quorum = Quorum(5, "t", members)
    assert twin(quorum, "rejoin003-rank000001") == "rank000001"
    assert twin(quorum, "rejoin003-rank000002") is None, "a replacement of a lost rank"
    lost_joiner = Quorum(6, "t", (members[0], members[2], Member("rejoin004-rank000001", "e:1", JOINING_STEP)))
    assert twin(lost_joiner, "rejoin004-rank000001") is None, "a joiner is no twin: it trains nothing yet"
    assert live_agent.job_code([2, 2]) == BAD_INPUT


@pytest.mark.parametrize(
    "args",
    [
        ["--bind", "127.0.0.1:1\n2"],
        ["--bind", "127.0.0.1:99999"],
        ["--bind", "127.0.0.1:65535"],  # presence takes the next port
        ["--await-ranks", "0"],
        ["--bind", ""],
        ["--bind", "\udcff\udcfe:1"],
        ["--heartbeat-timeout-ms", "nan"],
        ["--heartbeat-timeout-ms", "1e30"],
        ["--heartbeat-timeout-ms", "-1"],
        ["--min-ranks", "0"],
        ["--min-ranks", "9" * 5000],
        ["--join-timeout-ms", "inf"],
        ["--tick-ms", "\u0661\u0662"],
    ],
)
def test_the_membership_services_bad_arguments_are_one_bounded_line_and_exit_2(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from torchlaunch.live import lighthouse

    code = lighthouse.main(args)
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and len(err) < 1200, err
    assert "\x00" not in err and "\n2" not in err.strip()


def test_the_agent_counts_the_ranks_alive_and_in_the_group_for_a_restarted_service() -> None:
    service = live_agent.Service(port=1, heartbeat_timeout_ms=1000)  # never started: keep_up only counts
    ranks = [_Proc(None), _Proc(-9), _Proc(None), _Proc(0)]
    service.keep_up(ranks, lambda rank: rank != 2)  # type: ignore[arg-type]  # rank 2: a joiner on its way in
    assert service.members == 1 and service.restarts == 0
    service.keep_up(ranks, lambda rank: True)  # type: ignore[arg-type]
    assert service.members == 2
    service.keep_up([_Proc(75), _Proc(-9)], lambda rank: True)  # type: ignore[arg-type]  # nobody left: 1
    assert service.members == 1


class _Restarts:
    """A stand-in for lighthouse.Service around its _changed rule: the restarts it asked for."""

    def __init__(self, alive: int, waiting_for: int, min_ranks: int = 1, fails: bool = False, since: float = 9) -> None:
        import time
        from types import SimpleNamespace

        self.args = SimpleNamespace(min_ranks=min_ranks, bind="127.0.0.1:29510", heartbeat_timeout_ms=1000)
        self.presence = SimpleNamespace(alive=lambda: alive)
        self._min, self.fails, self.asked = waiting_for, fails, []
        self._since = time.monotonic() - since  # seconds since the server (re)started

    def restart(self, members: int) -> None:
        if self.fails:
            raise RuntimeError("Address already in use (os error 98)")
        self.asked.append(members)
        self._min = members


@pytest.mark.parametrize(
    ("events", "alive", "waiting_for", "min_ranks", "since", "restarts"),
    [
        ([("lost", "rank000001")], 1, 2, 1, 0, [1]),  # a rank gone: forgotten at once, the server waits for 1
        ([("lost", "rank000001"), ("lost", "rank000002")], 6, 8, 1, 0, [6]),  # two at once: one restart
        ([("lost", "rank000001")], 0, 1, 1, 0, [1]),  # the last one: never below 1
        ([("lost", "rank000001")], 1, 3, 2, 0, [2]),  # never below --min-ranks
        ([("lapsed", "rank000003")], 5, 6, 1, 9, [5]),  # silent, and the server waits for it: restarted
        ([], 1, 2, 1, 9, [1]),  # one never present again after a restart of the service: the same
        ([], 1, 2, 1, 0.2, []),  # ... but not before the ranks had the bound to be present again
        ([("lapsed", "rank000003")], 5, 1, 1, 9, []),  # silent, and the server waits for fewer: torchft's own
        ([], 2, 2, 1, 9, []),  # nothing new
    ],
)
def test_the_service_restarts_for_a_rank_gone_and_for_a_silent_one_it_waits_for(
    events: list[tuple[str, str]], alive: int, waiting_for: int, min_ranks: int, since: float, restarts: list[int]
) -> None:
    from torchlaunch.live import lighthouse

    service = _Restarts(alive, waiting_for, min_ranks, since=since)
    lighthouse.Service._changed(service, events)  # type: ignore[arg-type]
    assert service.asked == restarts


def test_a_service_that_cannot_listen_again_ends_so_that_its_keeper_starts_it_again(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from torchlaunch.live import lighthouse

    def ended(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(lighthouse.os, "_exit", ended)
    with pytest.raises(SystemExit) as exited:
        lighthouse.Service._changed(_Restarts(1, 2, fails=True), [("lost", "rank000001")])  # type: ignore[arg-type]
    assert exited.value.code == 1
    assert capsys.readouterr().err == (
        "lighthouse: cannot listen again on '127.0.0.1:29510': 'Address already in use (os error 98)'\n"
    )


PICKLED_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list")
PICKLED_COLLECTIVES += ("send_object_list", "recv_object_list", "broadcast_object(", "gather_objects(")


def test_no_collective_of_the_package_unpickles_what_a_peer_sends() -> None:
    """torch's *_object collectives unpickle whatever the sender sends: a stranger seated in a live group
    ran code in a rank that way (issue 52). Every exchange goes through core/dist.py's JSON ones."""
    package = Path(__file__).resolve().parents[2] / "torchlaunch"
    found = [
        f"{path.relative_to(package)}:{number}"
        for path in sorted(package.rglob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if any(name in line for name in PICKLED_COLLECTIVES) and not line.lstrip().startswith(("#", '"'))
    ]
    assert found == []
    recovery = package / "core" / "recovery"
    assert [p.name for p in recovery.glob("*.py") if "torch.load(" in p.read_text(encoding="utf-8")] == []


class _RunsCode:
    """What a stranger sends: unpickled, it opens (creates) a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return open, (str(self.marker), "w")


def test_a_pickle_a_peer_sends_is_refused_by_every_decoder_and_never_runs(tmp_path: Path) -> None:
    import pickle

    from torchlaunch.core import rng_wire
    from torchlaunch.core.dist import PeerValueError, decode_json
    from torchlaunch.live import state_wire

    marker = tmp_path / "code-ran"
    payload = pickle.dumps(_RunsCode(marker))
    with pytest.raises(PeerValueError, match="not plain JSON"):
        decode_json(payload)
    forged = {"tree": {"p": payload.hex()}, "tensors": [], "digest": state_wire.digest(b"")}
    with pytest.raises(state_wire.StateWireError, match="tagged"):
        state_wire.unpack(forged, b"")
    with pytest.raises(rng_wire.RngStateError):
        rng_wire.rng_from_json({"torch": payload.hex(), "cuda": None, "numpy": [], "python": []})
    assert not marker.exists()
    pickle.loads(payload).close()  # the payload is live: unpickled, it runs
    assert marker.exists()


def test_a_peer_value_is_bounded_and_of_the_kind_asked_for() -> None:
    from torchlaunch.core.dist import DistContext, PeerValueError, broadcast_json, decode_json, gather_json

    alone = DistContext()
    assert broadcast_json(alone, 7, kinds=(int,)) == 7
    assert gather_json(alone, "a", kinds=(str,)) == ["a"]
    with pytest.raises(PeerValueError, match="expected"):
        broadcast_json(alone, True, kinds=(int,))  # a bool is no generation
    with pytest.raises(PeerValueError, match="bound"):
        decode_json(b"1" * 65, max_bytes=64)
    for hostile in (b"[" * 100_000, b"\xff\xfe", b"NaN", b""):
        with pytest.raises(PeerValueError):
            decode_json(hostile)
    with pytest.raises(ValueError, match="bound"):
        broadcast_json(alone, "x" * 100, max_bytes=64)


def test_a_joiners_state_crosses_as_json_and_tensors_identical_and_a_changed_byte_is_refused() -> None:
    from torchlaunch.core.dist import decode_json, encode_json
    from torchlaunch.live import state_wire

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),  # int keys, tuples (betas), 0-dim step tensors
        "progress": {"best_val_acc": float("-inf"), "last_val": {}, "val_pending": False},
        "half": torch.ones(2, dtype=torch.bfloat16),
    }
    skeleton, blob = state_wire.pack(state)
    wire = decode_json(encode_json(skeleton, state_wire.MAX_SKELETON_BYTES), state_wire.MAX_SKELETON_BYTES)
    back = state_wire.unpack(wire, blob)  # type: ignore[arg-type]
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert list(back["optimizer"]["state"]) == list(state["optimizer"]["state"])
    assert back["progress"] == state["progress"]
    for key, tensor in state["model"].items():
        assert back["model"][key].dtype == tensor.dtype and torch.equal(back["model"][key], tensor)
    assert torch.equal(back["half"], state["half"])
    changed = bytearray(blob)
    changed[-1] ^= 1
    with pytest.raises(state_wire.StateWireError, match="digest"):
        state_wire.unpack(wire, bytes(changed))  # type: ignore[arg-type]
    huge = {**wire, "tensors": [["float32", [1 << 30, 1 << 30]]]}  # type: ignore[dict-item]
    with pytest.raises(state_wire.StateWireError, match="exceed"):
        state_wire.buffer_size(huge)  # refused before anything of that size is allocated
    for bad in ([["object", [1]]], [["float32", [-1]]], [["float32", [True]]]):
        with pytest.raises(state_wire.StateWireError):
            state_wire.buffer_size({**wire, "tensors": bad})  # type: ignore[dict-item]


def test_a_ranks_rng_states_cross_as_json_and_restore_the_same_draws() -> None:
    import random

    import numpy as np

    from torchlaunch.core import rng_wire
    from torchlaunch.core.checkpoint.checkpointer import capture_rng, restore_rng, rng_problem
    from torchlaunch.core.dist import decode_json, encode_json

    state = capture_rng(torch.device("cpu"))
    back = rng_wire.rng_from_json(decode_json(encode_json(rng_wire.rng_to_json(state))))
    assert rng_problem(back) is None
    draws = (torch.rand(3), np.random.rand(3), random.random())
    restore_rng(back, torch.device("cpu"))
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(draws[0], again[0]) and (draws[1] == again[1]).all() and draws[2] == again[2]
    news = [rng_wire.rng_to_json(state), None, None]
    assert rng_wire.rank_news(decode_json(encode_json(news)))[1:] == (None, None)
    wrong = rng_wire.rng_to_json(state)
    wrong["python"][1] = wrong["python"][1][:-1]
    with pytest.raises(BadInput, match="RNG states are refused"):
        rng_wire.rank_news([wrong, None, None])


def test_the_runs_secret_is_made_once_owner_only_and_refused_when_others_may_read_it(tmp_path: Path) -> None:
    from torchlaunch.live import runkey

    first = runkey.load(tmp_path)
    path = tmp_path / "live" / "secret"
    assert path.stat().st_mode & 0o777 == 0o600 and len(path.read_bytes()) == runkey.SECRET_BYTES
    assert runkey.load(tmp_path) == first, "every rank reads the one the first made"
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    path.chmod(0o644)
    with pytest.raises(BadInput, match="nobody else may read"):
        runkey.load(tmp_path)
    path.unlink()
    elsewhere = tmp_path / "planted"
    elsewhere.write_bytes(b"k" * runkey.SECRET_BYTES)
    elsewhere.chmod(0o600)
    path.symlink_to(elsewhere)
    with pytest.raises(BadInput, match="symlink"):
        runkey.load(tmp_path)


def test_a_sealed_address_opens_only_for_its_run_id_and_step_and_a_proof_only_for_its_quorum() -> None:
    from torchlaunch.live.runkey import RunKey

    key, other = RunKey(b"a" * 32), RunKey(b"b" * 32)
    rid = replica_id_of(1, run=key.tag)
    assert rid == f"{key.tag}-rank000001" and key.tag != other.tag
    sealed = key.seal(rid, "127.0.0.1:4242", 7)
    assert "4242" not in sealed and "127.0.0.1" not in sealed, "the service shows no usable address"
    assert key.unseal(rid, sealed, 7) == "127.0.0.1:4242"
    assert key.unseal(replica_id_of(0, run=key.tag), sealed, 7) is None  # copied under another id
    assert key.unseal(rid, sealed, 10**9) is None  # or another step
    assert other.unseal(rid, sealed, 7) is None and key.unseal(rid, "127.0.0.1:4242", 7) is None
    answer = key.proof("3-1.5", rid, "127.0.0.1:4242", 7)
    assert key.proves(answer.encode(), "3-1.5", rid, "127.0.0.1:4242", 7)
    assert not key.proves(answer, "4-1.6", rid, "127.0.0.1:4242", 7), "an answer is good for one quorum"
    assert not other.proves(answer, "3-1.5", rid, "127.0.0.1:4242", 7)


class _Service:
    """A membership service that hands out one quorum, as a stranger and the run's own ranks asked it."""

    def __init__(self, replica_id: str, members: list[Member]) -> None:
        self.replica_id, self.members, self.asked = replica_id, members, []

    def quorum(self, step: int, store_address: str, timeout_s: float) -> Quorum:
        self.asked.append(store_address)
        mine = Member(self.replica_id, store_address, step)
        return Quorum(3, "3-1.5", sorted_members([*self.members, mine]))


def test_a_member_whose_address_is_not_sealed_under_the_runs_secret_is_dropped_from_the_quorum() -> None:
    from torchlaunch.live.group import LiveGroup
    from torchlaunch.live.runkey import RunKey

    key = RunKey(b"s" * 32)
    me, peer = replica_id_of(1, run=key.tag), replica_id_of(2, run=key.tag)
    members = [
        Member("!stranger", "127.0.0.1:9", 10**9),  # sorts first, the newest step: was rank 0 and the source
        Member(replica_id_of(0, run=key.tag), key.seal(replica_id_of(1, run=key.tag), "10.0.0.1:5", 7), 7),  # a copy
        Member(peer, key.seal(peer, "10.0.0.2:6", 7), 7),
    ]
    group = LiveGroup.__new__(LiveGroup)  # the quorum's reading only: no store, no process group
    group.membership, group.key, group.store_address = _Service(me, members), key, "10.0.0.3:7"  # type: ignore[assignment]
    found = group._ask(7, 1.0)
    assert group.membership.asked == [key.seal(me, "10.0.0.3:7", 7)]  # type: ignore[attr-defined]
    assert [(m.replica_id, m.store_address) for m in found.members] == [(me, "10.0.0.3:7"), (peer, "10.0.0.2:6")]


def test_a_service_reads_the_runs_secret_only_once_made_and_only_when_safe(tmp_path: Path) -> None:
    from torchlaunch.live import lighthouse, runkey

    path = tmp_path / "live" / "secret"
    assert runkey.existing(path) is None  # no run dir yet: the service waits for it
    run = runkey.load(tmp_path)
    assert runkey.existing(path) == run and run.presence_key not in (run.secret, b"")
    assert lighthouse.secret_file_key(str(path))() == run.presence_key  # type: ignore[misc]
    path.chmod(0o640)
    with pytest.raises(BadInput, match="nobody else may read"):
        runkey.existing(path)
    assert lighthouse.secret_file_key(str(path))() is None  # type: ignore[misc]
    assert lighthouse.parse_args(["--secret-file", str(path)]).secret_file == str(path)


@pytest.mark.parametrize("bind", ["0.0.0.0:29510", "10.1.2.3:29510", "[::]:29510", "node7:29510"])
def test_a_service_reachable_from_other_hosts_without_the_runs_key_is_refused(
    bind: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 52: a service started apart without --secret-file admitted anyone who reached it (forged
    presence ids were counted, only warned). Where another host can reach it, the run's key is required:
    exit 2 and one line, before it listens; on loopback it may still run without (the ranks warn)."""
    from torchlaunch.live import lighthouse

    monkeypatch.delenv(contract.LIVE_PRESENCE_KEY, raising=False)
    code = lighthouse.main(["--bind", bind])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--secret-file" in err, err
    for local in ("127.0.0.1:29510", "[::1]:29510", "localhost:29510"):
        assert lighthouse.parse_args(["--bind", local]).secret_file is None
    assert lighthouse.parse_args(["--bind", bind, "--secret-file", "/x/live/secret"]).bind == bind
    monkeypatch.setenv(contract.LIVE_PRESENCE_KEY, "ab" * 32)  # the local agent's service: keyed by the launch
    assert lighthouse.parse_args(["--bind", bind]).bind == bind


def test_a_rank_follows_the_road_its_launcher_took(monkeypatch: pytest.MonkeyPatch) -> None:
    """recovery.live=auto: a rank trains live only when a live launcher handed it the membership service
    (Slurm's --image, k8s --jobset: the restart road under auto); an explicit true without one is bad input,
    as it always was; false never. A rank started again (attempt 1) stands for a multi-rank one here."""
    from torchlaunch.core.dist import DistContext
    from torchlaunch.worker import groups
    from torchlaunch.worker.groups import live as live_group

    monkeypatch.delenv(contract.LIGHTHOUSE, raising=False)
    auto, on, off = (config_mod.load(None, o) for o in ([], ["recovery.live=true"], ["recovery.live=false"]))
    assert isinstance(groups.form(auto, DistContext(), attempt=1), groups.FixedGroup)
    with pytest.raises(BadInput, match="no membership service"):
        groups.form(on, DistContext(), attempt=1)
    monkeypatch.setenv(contract.LIGHTHOUSE, "http://127.0.0.1:29510")
    monkeypatch.setattr(live_group, "join", lambda cfg, ctx, attempt: "the live group")
    assert groups.form(auto, DistContext(), attempt=1) == "the live group"
    assert isinstance(groups.form(off, DistContext(), attempt=1), groups.FixedGroup)
    assert isinstance(groups.form(auto, DistContext(), attempt=0), groups.FixedGroup)  # one rank


@pytest.mark.parametrize("value", ["on-demand", 1, "maybe"])
def test_recovery_live_takes_auto_true_or_false_and_names_them(value: object) -> None:
    with pytest.raises(BadInput, match=r"recovery.live: expected one of auto, true, false") as caught:
        config_mod.load(None, [f"recovery.live={value}"])
    assert "\n" not in str(caught.value)


def test_the_live_agents_window_after_a_stop_is_torchruns() -> None:
    """The launcher sets TORCH_ELASTIC_SHUTDOWN_TIMEOUT from the platform's grace (agent/stops.py); the
    live agent ends its ranks past it as torchrun's agent does (tested from outside:
    test_a_stop_whose_checkpoint_never_commits_is_exit_1_with_the_steps_lost, on the default road)."""
    assert live_rejoin.stop_window_s({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "2"}) == 2.0
    assert live_rejoin.stop_window_s({}) == 30.0
    assert live_rejoin.stop_window_s({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "soon"}) == 30.0
    live_rejoin.end_past_the_stop_window([], None, 0.0)  # no stop yet: nothing to end
