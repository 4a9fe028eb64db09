"""The run-dir rendezvous of a user script's elastic job (launch.rdzv_file, launch.rdzv_torch): compare-and-set
as torch's DynamicRendezvousHandler needs it, a stale token that loses, a state this run did not seal
refused in one line before anything unpickles it, and the torchrun command that uses it."""

from __future__ import annotations

import os
import pickle
from datetime import timedelta
from pathlib import Path

import pytest

from torchlaunch import rundir, runlock
from torchlaunch.agent import commands, node
from torchlaunch.agent.commands import NodePlacement, torchrun_argv
from torchlaunch.exit_codes import BadInput
from torchlaunch.launch import rdzv_file
from torchlaunch.launch.spec import JobSpec
from torchlaunch.live import runkey

NAME = "tl-abc.0123abcd"


def state_file(run_dir: Path, name: str = NAME) -> rdzv_file.StateFile:
    return rdzv_file.StateFile(run_dir, name, runkey.load(run_dir).rendezvous_key)


def test_compare_and_set_writes_on_the_current_token_only(tmp_path: Path) -> None:
    a, b = state_file(tmp_path), state_file(tmp_path)  # two nodes' agents on one run dir
    assert a.get() is None
    first = a.compare_set(b"one", None)
    assert first is not None and first[0] == b"one" and first[2] is True
    assert b.compare_set(b"two", None) == (b"one", first[1], False)  # not absent any more: b loses
    second = b.compare_set(b"two", first[1])
    assert second is not None and second[2] is True and second[1] != first[1]
    assert a.compare_set(b"three", first[1]) == (b"two", second[1], False)  # a's token is stale: it loses
    assert a.get() == (b"two", second[1])
    assert b.compare_set(b"x", "not bytes") == (b"two", second[1], False)
    assert os.stat(a.where).st_mode & 0o777 == 0o600


def test_a_lost_compare_and_set_on_no_state_is_none(tmp_path: Path) -> None:
    assert state_file(tmp_path).compare_set(b"s", b"\0" * 32) is None


def forged_pickle(marker: Path) -> bytes:
    class Boom:
        def __reduce__(self) -> tuple:
            return (open, (str(marker), "w"))  # unpickling it would create `marker`

    return pickle.dumps(Boom())


def write_raw(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


@pytest.mark.parametrize(
    "how",
    ["random seal", "another run's secret", "another incarnation", "garbled", "truncated"],
)
def test_a_state_this_run_did_not_seal_is_refused_unread(tmp_path: Path, how: str) -> None:
    marker = tmp_path / "ran"
    payload = forged_pickle(marker)
    target = state_file(tmp_path)
    gen = (7).to_bytes(rdzv_file.GENERATION_BYTES, "big")
    if how == "random seal":
        data = rdzv_file.MAGIC + gen + os.urandom(32) + payload
    elif how == "another run's secret":
        data = rdzv_file.MAGIC + gen + rdzv_file.seal(os.urandom(32), NAME, 7, payload) + payload
    elif how == "another incarnation":  # sealed by this run, for another of its rendezvous: not replayable here
        data = rdzv_file.MAGIC + gen + rdzv_file.seal(target.key, "tl-abc.other", 7, payload) + payload
    elif how == "garbled":
        data = b"\x80\x04garbage" + payload
    else:
        data = rdzv_file.MAGIC + gen[:3]
    write_raw(target.where, data)
    with pytest.raises(BadInput) as refused:
        target.get()
    line = str(refused.value)
    assert "\n" not in line and len(line) < 400 and "refused unread" in line
    with pytest.raises(BadInput):
        target.compare_set(b"mine", None)  # nor overwritten as if absent
    assert not marker.exists()


def test_torch_never_unpickles_a_forged_state(tmp_path: Path) -> None:
    """Through torch's own state holder (what DynamicRendezvousHandler syncs with): the refusal comes
    from get_state, before pickle.loads."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        RendezvousSettings,
        RendezvousTimeout,
        _BackendRendezvousStateHolder,
    )

    from torchlaunch.launch import rdzv_torch

    marker = tmp_path / "ran"
    payload = forged_pickle(marker)
    target = state_file(tmp_path)
    good = rdzv_torch.RunDirBackend(target)
    settings = RendezvousSettings(
        NAME, 1, 2, RendezvousTimeout(), keep_alive_interval=timedelta(seconds=5), keep_alive_max_attempt=3
    )
    holder = _BackendRendezvousStateHolder(good, settings, cache_duration=0)
    holder.mark_dirty()
    assert holder.sync() is True  # a real state, sealed, written and read back through torch
    write_raw(target.where, rdzv_file.MAGIC + (9).to_bytes(8, "big") + os.urandom(32) + payload)
    with pytest.raises(BadInput, match="does not carry this run's seal"):
        holder.sync()
    assert not marker.exists()


def test_a_state_file_that_is_a_link_is_refused(tmp_path: Path) -> None:
    target = state_file(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"x")
    target.where.parent.mkdir(exist_ok=True)
    target.where.symlink_to(elsewhere)
    with pytest.raises(BadInput, match="cannot be opened"):
        target.get()
    assert elsewhere.read_bytes() == b"x"


def test_the_store_file_is_private_and_pinned(tmp_path: Path) -> None:
    path, folder = rdzv_file.store_path(tmp_path, NAME)
    try:
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert os.path.samefile(path, rundir.rdzv(tmp_path) / f"{NAME}.store")
        assert path.startswith("/proc/self/fd/")  # the real folder, whatever its path names later
    finally:
        os.close(folder)


def test_a_founder_sweeps_the_files_of_runs_before(tmp_path: Path) -> None:
    folder = rundir.rdzv(tmp_path)
    folder.mkdir()
    for name in ("tl-a.old.state", "tl-a.old.lock", "tl-a.old.store", "tl-a.new.state", "notes.txt"):
        (folder / name).write_bytes(b"")
    assert rdzv_file.sweep(tmp_path, "new") == 3
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt", "tl-a.new.state"]


@pytest.mark.parametrize("bad", ["../x", "a/b", "", "a.b"])
def test_a_name_that_is_no_plain_word_is_refused(bad: str) -> None:
    with pytest.raises(BadInput, match="is not a rendezvous name"):
        rdzv_file.name_of(bad, "inc")


def program_spec(run_dir: str | None, program: tuple[str, ...] = ("train.py",)) -> JobSpec:
    return JobSpec(program=program, run_dir=run_dir, nodes=2, min_nodes=1, max_restarts=3)


def test_a_user_script_on_a_node_range_meets_in_its_run_dir(tmp_path: Path) -> None:
    spec = program_spec(str(tmp_path))
    placement = NodePlacement(incarnation="f00d")
    argv = torchrun_argv(spec, placement, rdzv_run_id="tl-x")
    at = argv.index("--rdzv-backend")
    assert argv[at : at + 6] == [
        "--rdzv-backend",
        rdzv_file.BACKEND,
        "--rdzv-endpoint",
        str(tmp_path),
        "--rdzv-id",
        "tl-x",
    ]
    assert argv[argv.index("--rdzv-conf") + 1] == "incarnation=f00d"
    assert "--node-rank" not in argv and "--master-addr" not in argv
    same = torchrun_argv(spec, NodePlacement(master_addr="node0"), rdzv_run_id="tl-x")
    assert rdzv_file.BACKEND in same  # --master-addr is still accepted, and not where the nodes meet
    # without a run dir: torchrun's c10d store, which needs --master-addr
    assert "c10d" in torchrun_argv(program_spec(None), NodePlacement(master_addr="h"), rdzv_run_id="tl-x")


def test_another_program_on_the_run_dir_is_another_job_and_refused(tmp_path: Path) -> None:
    ids = {
        commands.rendezvous_id(program_spec(str(tmp_path)), NodePlacement()),
        commands.rendezvous_id(program_spec(str(tmp_path), ("other.py",)), NodePlacement()),
        commands.rendezvous_id(program_spec(str(tmp_path / "b")), NodePlacement()),
    }
    assert len(ids) == 3
    rdzv = commands.rendezvous_id(program_spec(str(tmp_path)), NodePlacement(master_addr="any"))
    assert rdzv in ids  # every node computes it alike, --master-addr or not
    job = node.elastic_job(program_spec(str(tmp_path)), NodePlacement(), rdzv)
    assert job == rdzv_file.job_key(rdzv)
    first = runlock.acquire(tmp_path, command=["a"], job=job)
    try:
        second = runlock.acquire(tmp_path, command=["a"], job=job)  # the job's other node joins
        second.release()
        other = node.elastic_job(program_spec(str(tmp_path), ("other.py",)), NodePlacement(), "tl-other")
        with pytest.raises(BadInput, match="is in use by"):
            runlock.acquire(tmp_path, command=["b"], job=other)
    finally:
        first.release()


def test_a_node_range_of_a_script_needs_a_run_dir_or_a_master_addr(tmp_path: Path) -> None:
    """The command line: `--nnodes 1:2 --run-dir R -- s.py` runs without --master-addr (its --dry-run is
    the run-dir rendezvous), and without either it is one line naming both."""
    from tests.integration.test_dropin_torchrun import call

    script = tmp_path / "s.py"
    script.write_text("")
    base = ["--dry-run", "--device", "cpu", "--nnodes", "1:2", "--max-restarts", "3"]
    code, out, err = call([*base, "--run-dir", str(tmp_path / "run"), "--", str(script)])
    assert code == 0, err
    assert f"--rdzv-backend {rdzv_file.BACKEND} --rdzv-endpoint {tmp_path / 'run'}" in out
    assert not (tmp_path / "run").exists()  # a dry run writes nothing
    code, out, err = call([*base, "--", str(script)])
    assert code == 2 and "--master-addr HOST" in err and "--run-dir DIR" in err and len(err.splitlines()) == 1
