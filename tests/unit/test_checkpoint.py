"""Checkpoint commit protocol, verification, fallback, safe loading, retention and disk-full handling."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pickle
import textwrap
from pathlib import Path

import pytest
import torch

from torchlaunch.core import checkpoint as ckpt


def state(value: float = 1.0) -> dict:
    return {"format_version": ckpt.FORMAT_VERSION, "w": torch.full((64, 64), value), "step": int(value)}


def test_commit_writes_state_and_marker_and_verifies(tmp_path: Path) -> None:
    info = ckpt.write_checkpoint(tmp_path, 12, state(), {"epoch": 0})
    assert info.path == tmp_path / "step-000000012"
    assert (info.path / ckpt.STATE_FILE).is_file() and (info.path / ckpt.MARKER_FILE).is_file()
    assert ckpt.verify(info.path) is None
    marker = ckpt.read_marker(info.path)
    assert marker["step"] == 12 and marker["bytes"] == (info.path / ckpt.STATE_FILE).stat().st_size
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_step_numbers_are_integers_not_text(tmp_path: Path) -> None:
    for step in (9, 10, 100):
        ckpt.write_checkpoint(tmp_path, step, state(step), {})
    (tmp_path / "step-99").mkdir()  # an odd, unpadded name still sorts by its number
    assert [s for s, _ in ckpt.candidates(tmp_path)] == [100, 99, 10, 9]
    assert ckpt.parse_step("step-000000100") == 100 and ckpt.parse_step("step-abc") is None


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_marker", "marker_garbage"])
def test_damaged_newest_falls_back_with_warning(tmp_path: Path, damage: str) -> None:
    ckpt.write_checkpoint(tmp_path, 1, state(1), {})
    newest = ckpt.write_checkpoint(tmp_path, 2, state(2), {}).path
    f = newest / ckpt.STATE_FILE
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[:-100])
    elif damage == "flip":
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x01
        f.write_bytes(bytes(data))
    elif damage == "no_marker":
        (newest / ckpt.MARKER_FILE).unlink()
    else:
        (newest / ckpt.MARKER_FILE).write_text("{not json")
    warnings: list[str] = []
    path, loaded = ckpt.find_latest(tmp_path, on_skip=warnings.append)
    assert path.name == "step-000000001" and loaded["step"] == 1
    assert len(warnings) == 1 and str(f) in warnings[0] and "falling back" in warnings[0]


@pytest.mark.parametrize("where", ["tensor bytes", "zip directory"])
def test_corruption_is_rejected_although_the_load_runs_alongside(tmp_path: Path, where: str, monkeypatch) -> None:
    """load_state hashes in a thread while torch.load parses the file: whatever the load makes of the
    bad bytes (a plausible state, or an error), the checksum mismatch decides and nothing is returned."""
    info = ckpt.write_checkpoint(tmp_path, 1, state(1.0), {})
    f = info.path / ckpt.STATE_FILE
    data = bytearray(f.read_bytes())
    if where == "tensor bytes":  # inside w's 16 KiB of float32 ones: torch.load alone still succeeds
        data[data.index(torch.ones(8).numpy().tobytes()) + 100] ^= 0x40
    else:  # the zip end-of-central-directory record: torch.load alone fails
        data[data.rindex(b"PK\x05\x06") + 1] ^= 0xFF
    f.write_bytes(bytes(data))
    loads: list[str] = []
    real_load = torch.load

    def spy(*args, **kwargs):
        try:
            out = real_load(*args, **kwargs)
        except Exception:
            loads.append("raised")
            raise
        loads.append("loaded")
        return out

    monkeypatch.setattr(torch, "load", spy)
    with pytest.raises(ckpt.InvalidCheckpoint, match=r"^checksum mismatch \(corrupted bytes\)$"):
        ckpt.load_state(info.path)
    assert loads == ["loaded" if where == "tensor bytes" else "raised"]  # the new path: it did load
    assert ckpt.verify(info.path) == ckpt.CHECKSUM_MISMATCH


def test_malicious_pickle_is_refused_and_nothing_executes(tmp_path: Path) -> None:
    ckpt.write_checkpoint(tmp_path, 1, state(1), {})
    canary = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {canary}",))

    evil = tmp_path / "step-000000005"
    evil.mkdir()
    torch.save({"format_version": 1, "x": Exploit()}, evil / ckpt.STATE_FILE)
    # A forged, fully valid marker: only the safe loader stands between the file and execution.
    import hashlib
    import json

    data = (evil / ckpt.STATE_FILE).read_bytes()
    (evil / ckpt.MARKER_FILE).write_text(json.dumps({"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}))
    warnings: list[str] = []
    path, loaded = ckpt.find_latest(tmp_path, on_skip=warnings.append)
    assert not canary.exists()
    assert path.name == "step-000000001"
    assert "refused by the safe loader" in warnings[0] and "nothing executed" in warnings[0]
    with pytest.raises(Exception, match="not a valid checkpoint: refused"):
        ckpt.resolve_resume(str(evil), tmp_path)
    assert not canary.exists()
    assert isinstance(pickle.dumps(1), bytes)


def test_resume_modes(tmp_path: Path) -> None:
    assert ckpt.resolve_resume("auto", tmp_path) is None  # first run: nothing to resume, same command
    ckpt.write_checkpoint(tmp_path, 3, state(3), {})
    assert ckpt.resolve_resume("never", tmp_path) is None
    assert ckpt.resolve_resume("auto", tmp_path)[1]["step"] == 3
    explicit = ckpt.resolve_resume(str(tmp_path / "step-000000003" / "state.pt"), tmp_path)
    assert explicit[0].name == "step-000000003"
    with pytest.raises(Exception, match="does not exist"):
        ckpt.resolve_resume(str(tmp_path / "nope"), tmp_path)


def test_retention_keeps_newest_k_and_best(tmp_path: Path) -> None:
    accs = {1: 0.5, 2: 0.9, 3: 0.6, 4: 0.7, 5: 0.65}
    for step, acc in accs.items():
        ckpt.write_checkpoint(tmp_path, step, state(step), {"val_acc": acc})
        ckpt.apply_retention(tmp_path, keep=2)
    assert sorted(s for s, _ in ckpt.candidates(tmp_path)) == [2, 4, 5]


def test_same_step_is_kept_unless_replaced(tmp_path: Path) -> None:
    first = ckpt.write_checkpoint(tmp_path, 7, state(1), {})
    again = ckpt.write_checkpoint(tmp_path, 7, state(2), {})
    assert again.checksum == first.checksum  # an identical step is not rewritten
    replaced = ckpt.write_checkpoint(tmp_path, 7, state(3), {"val_acc": 1.0}, replace=True)
    assert replaced.checksum != first.checksum
    assert ckpt.load_state(replaced.path)["step"] == 3
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_interrupted_replace_is_repaired_at_start(tmp_path: Path) -> None:
    done = ckpt.write_checkpoint(tmp_path, 7, state(1), {}).path
    aside = tmp_path / f"{ckpt.REPLACED_PREFIX}{done.name}-deadbeef"
    os.rename(done, aside)  # as if the process died between the two renames of a replace
    (tmp_path / f"{ckpt.TMP_PREFIX}step-000000007-1-x").mkdir()
    ckpt.clean_stale(tmp_path)
    assert ckpt.verify(done) is None and not aside.exists()
    assert [p.name for p in tmp_path.iterdir()] == [done.name]


CRASH_WRITER = textwrap.dedent("""
    import sys, torch
    from pathlib import Path
    from torchlaunch.core import checkpoint as ckpt
    root = Path(sys.argv[1])
    def hang(tmp):
        (root / "IN_PROGRESS").write_text(str(tmp))
        sys.stdin.read()  # hold the write open until killed
    ckpt.write_checkpoint(root, 2, {"format_version": 1, "w": torch.ones(256, 256)}, {}, before_commit=hang)
""")


def test_enospc_injected_gives_clear_error_and_keeps_previous(tmp_path: Path, monkeypatch) -> None:
    ckpt.write_checkpoint(tmp_path, 1, state(1), {})

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.write_checkpoint(tmp_path, 2, state(2), {})
    assert "no space left on device" in str(err.value) and "step-000000001 is intact" in str(err.value)
    assert [s for s, _ in ckpt.candidates(tmp_path)] == [1]
    assert ckpt.verify(tmp_path / "step-000000001") is None


def test_async_writer_surfaces_errors_and_serialises(tmp_path: Path) -> None:
    writer = ckpt.AsyncWriter()
    live = {"format_version": 1, "w": torch.zeros(8)}
    snapshot = ckpt.detach_copy(live)
    live["w"].add_(1)  # training goes on mutating the live tensors
    writer.submit(lambda: ckpt.write_checkpoint(tmp_path, 1, snapshot, {}))
    info = writer.wait()
    assert torch.equal(ckpt.load_state(info.path)["w"], torch.zeros(8))

    def boom():
        raise ckpt.CheckpointError("checkpoint error: boom")

    writer.submit(boom)
    with pytest.raises(ckpt.CheckpointError, match="boom"):
        writer.wait()


FINAL_SAVE_FAILS = """
import sys
from torchlaunch.core import checkpoint as ckpt
from torchlaunch.core.checkpoint import store
from torchlaunch.worker import run as worker

real = store.write_checkpoint


def failing(root, step, state, meta, **kwargs):
    if step == {final}:
        raise ckpt.CheckpointError("checkpoint error: injected: no space left on device")
    return real(root, step, state, meta, **kwargs)


store.write_checkpoint = failing  # the module the Checkpointer commits through
sys.exit(worker.main(sys.argv[1:]))
"""


def test_settling_the_writer_forgets_only_the_refusal_it_is_told_to() -> None:
    """A live regroup settles rank 0's background commit: a fence refusal (the group re-formed while
    it committed) is forgotten, the caller saves again; any other failure stays for the next save."""

    class Refused(Exception):
        pass

    writer = ckpt.AsyncWriter()

    def refuse() -> ckpt.CommitInfo:
        raise Refused("superseded")

    writer.submit(refuse)
    assert writer.settle(drop=Refused) is True
    assert writer.wait() is None
    writer.submit(lambda: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    assert writer.settle(drop=Refused) is False
    with pytest.raises(OSError, match="No space left"):
        writer.wait()


# ---- the live commit's fence (issue #51 item 2, issue #52 item 6) -----------------------------------


def _fence_lock_descriptors() -> list[int]:
    """This process's descriptors open on a fence's generation.lock."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").endswith("/live/generation.lock"):
                found.append(int(name))
        except OSError:
            continue  # listdir's own descriptor, closed by now
    return found


def _lock_is_free(run_dir: Path) -> bool:
    probe = os.open(run_dir / "live" / "generation.lock", os.O_RDWR)
    try:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(probe)


@pytest.mark.timeout(30)
def test_a_copy_of_the_fence_lock_kept_by_a_child_does_not_hold_it_after_the_commit(
    tmp_path: Path, monkeypatch
) -> None:
    """Issue #51: a loader worker forked while the background writer committed under the fence kept the
    lock (a flock belongs to the open file description, which fork shares) after the writer closed its
    descriptor; the next commit waited on it until the hang watchdog. A dup of the writer's descriptor,
    made mid-commit and kept, is that child's copy, in-process."""
    from torchlaunch.live import fence as fence_mod

    monkeypatch.setattr(fence_mod, "LOCK_BOUND_S", 2.0, raising=False)
    fence = fence_mod.Fence(tmp_path)
    generation = fence.advance()
    copies: list[int] = []

    @contextlib.contextmanager
    def guard_and_fork():  # the commit's guard, and a child forked while it is held
        with fence.holding(generation):
            copies.extend(os.dup(fd) for fd in _fence_lock_descriptors())
            yield

    root = tmp_path / "checkpoints"
    try:
        ckpt.write_checkpoint(root, 1, state(1), {}, commit_guard=guard_and_fork)
        assert copies, "the commit held the fence's lock"
        assert _lock_is_free(tmp_path), "the lock outlived the commit in a copy of its descriptor"
        ckpt.write_checkpoint(root, 2, state(2), {}, commit_guard=lambda: fence.holding(generation))
        assert fence.advance() == generation + 1  # and a regroup takes it at once
    finally:
        for fd in copies:
            os.close(fd)
    assert sorted(s for s, _ in ckpt.candidates(root)) == [1, 2]


@pytest.mark.timeout(30)
def test_a_fence_lock_held_past_the_bound_is_an_error_not_a_hang(tmp_path: Path, monkeypatch) -> None:
    """Whoever holds the lock (a process stuck on its file server, one that kept a copy), a commit or a
    regroup waits for it LOCK_BOUND_S, then fails naming the lock and its holder; the previous
    checkpoint is intact."""
    from torchlaunch.live import fence as fence_mod

    monkeypatch.setattr(fence_mod, "LOCK_BOUND_S", 0.3, raising=False)
    fence = fence_mod.Fence(tmp_path)
    generation = fence.advance()
    root = tmp_path / "checkpoints"
    ckpt.write_checkpoint(root, 1, state(1), {}, commit_guard=lambda: fence.holding(generation))
    holder = os.open(tmp_path / "live" / "generation.lock", os.O_RDWR)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        for attempt in (
            lambda: ckpt.write_checkpoint(root, 2, state(2), {}, commit_guard=lambda: fence.holding(generation)),
            fence.advance,
        ):
            with pytest.raises(fence_mod.FenceBusy) as busy:
                attempt()
            message = str(busy.value)
            assert "generation.lock stayed locked for 0.3 s" in message and f"held by pid {os.getpid()}" in message
            assert "\n" not in message
    finally:
        os.close(holder)
    assert [s for s, _ in ckpt.candidates(root)] == [1] and ckpt.verify(root / "step-000000001") is None
    assert sorted(p.name for p in root.iterdir()) == ["step-000000001"], "no temp folder is left"
    assert fence.current() == generation


def test_a_full_disk_at_a_regroup_is_a_storage_refusal_not_a_member_gone(tmp_path: Path, monkeypatch, capsys) -> None:
    """Issue #52 item 6: the new group's generation could not be written (ENOSPC); the survivor took it for
    a member gone, asked for a new group 27 times and died with a traceback. A storage refusal is one
    line and exit 2 (BadInput), at once; the generation stays the last one written."""
    from torchlaunch import rundir
    from torchlaunch.base.storage import StorageError
    from torchlaunch.live import fence as fence_mod
    from torchlaunch.live.group import LiveGroup
    from torchlaunch.live.membership import Member, Quorum

    fence = fence_mod.Fence(tmp_path)
    before = fence.advance()

    class Service:
        replica_id = "rank000000"
        asked = 0

        def quorum(self, step: int, store_address: str, timeout_s: float) -> Quorum:
            self.asked += 1
            return Quorum(1, "t", [Member(self.replica_id, store_address, step)])

    group = LiveGroup.__new__(LiveGroup)  # the seam only: no store, no service, no process group
    group.membership, group.fence, group.key, group.quorum_timeout_s = Service(), fence, None, 5.0
    group.store_address = "127.0.0.1:1"
    monkeypatch.setattr(group, "_leave", lambda broken: None)
    monkeypatch.setattr(group, "_enter", lambda ctx, quorum: group.fence.advance())

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(rundir, "write_text", full)
    with pytest.raises(StorageError) as refused:
        group._form(None, 12, timeout_s=5.0)
    line = str(refused.value)
    assert line.startswith("live error: storage: ") and "No space left on device" in line and "\n" not in line
    assert str(tmp_path / "live" / "generation") in line and "free space" in line
    assert group.membership.asked == 1 and "a member is gone" not in capsys.readouterr().err
    monkeypatch.undo()
    assert fence.current() == before

    monkeypatch.setattr(fence_mod, "LOCK_BOUND_S", 0.1)  # a lock held past the bound: not a member gone either
    monkeypatch.setattr(group, "_leave", lambda broken: None)
    monkeypatch.setattr(group, "_enter", lambda ctx, quorum: group.fence.advance())
    with fence.holding(before), pytest.raises(fence_mod.FenceBusy):
        group._form(None, 12, timeout_s=5.0)
    assert group.membership.asked == 2 and "a member is gone" not in capsys.readouterr().err
