"""The training loop's decisions (torchlaunch/worker/schedule.py): pure, and importable without torch."""

from __future__ import annotations

from torchlaunch.worker.schedule import LoopSchedule


def _run(schedule: LoopSchedule, start_epoch: int = 0, start_step: int = 0) -> list[tuple[int, str]]:
    """Every decision of a whole run, as (global step, what): the loop's skeleton without a model."""
    events: list[tuple[int, str]] = []
    epoch, step_in_epoch, global_step = start_epoch, start_step, start_epoch * schedule.steps_per_epoch + start_step
    while schedule.training(epoch, global_step):
        while step_in_epoch < schedule.steps_per_epoch:
            step_in_epoch, global_step = step_in_epoch + 1, global_step + 1
            plan = schedule.after_step(global_step, step_in_epoch)
            events += [(global_step, what) for what in ("log", "save") if getattr(plan, what)]
            if plan.last:
                break
        if schedule.final_validation(epoch, global_step, step_in_epoch):
            events.append((global_step, "final validation"))
        else:
            events.append((global_step, "validation"))
        end = schedule.after_validation(epoch, global_step, step_in_epoch)
        if end.finished_epoch:
            epoch, step_in_epoch = epoch + 1, 0
        if end.done:
            events.append((global_step, "final save"))
        elif end.save:
            events.append((global_step, "epoch save"))
    return events


def test_log_every_n_steps_and_at_the_last_step() -> None:
    s = LoopSchedule(steps_per_epoch=10, epochs=1, total_steps=10, log_every=4)
    assert [n for n in range(1, 11) if s.after_step(n, n).log] == [4, 8, 10]


def test_save_every_n_steps_except_at_an_epoch_end() -> None:
    """An epoch's last step saves after validation instead (a validated checkpoint)."""
    s = LoopSchedule(steps_per_epoch=10, epochs=2, total_steps=20, log_every=100, save_every_steps=5)
    saves = [g for g in range(1, 21) if s.after_step(g, (g - 1) % 10 + 1).save]
    assert saves == [5, 15]


def test_save_every_n_epochs_and_the_final_save() -> None:
    s = LoopSchedule(steps_per_epoch=3, epochs=5, total_steps=15, log_every=100, save_every_epochs=2)
    events = _run(s)
    assert [e for e in events if "save" in e[1]] == [(6, "epoch save"), (12, "epoch save"), (15, "final save")]


def test_validation_at_each_epoch_end_and_the_last_one_is_final() -> None:
    s = LoopSchedule(steps_per_epoch=4, epochs=3, total_steps=12, log_every=100)
    events = _run(s)
    assert [e for e in events if "validation" in e[1]] == [
        (4, "validation"),
        (8, "validation"),
        (12, "final validation"),
    ]
    assert s.after_step(4, 4).epoch_end and not s.after_step(3, 3).epoch_end


def test_max_steps_ends_mid_epoch_with_a_final_validation_and_save() -> None:
    s = LoopSchedule(steps_per_epoch=10, epochs=3, total_steps=13, log_every=5, save_every_steps=4)
    plan = s.after_step(13, 3)
    assert plan.last and plan.log and plan.check and not plan.epoch_end
    events = _run(s)
    assert events[-2:] == [(13, "final validation"), (13, "final save")]
    assert not s.after_validation(1, 13, 3).finished_epoch  # the epoch was not finished: no advance
    assert not s.training(1, 13)


def test_check_points_are_log_save_epoch_end_and_last() -> None:
    s = LoopSchedule(steps_per_epoch=10, epochs=1, total_steps=10, log_every=4, save_every_steps=3)
    checks = [g for g in range(1, 11) if s.after_step(g, g).check]
    assert checks == [3, 4, 6, 8, 9, 10]


def test_preemption_flags_are_read_lag_steps_late_or_at_check_points() -> None:
    s = LoopSchedule(steps_per_epoch=10, epochs=1, total_steps=10, log_every=4, agreement_lag=2)
    assert s.agreement_through(3, check=False) == 1  # step 1's flag, read at step 3 on every rank
    assert s.agreement_through(4, check=True) == 4  # a check point reads everything posted so far
    now = LoopSchedule(steps_per_epoch=10, epochs=1, total_steps=10, log_every=4)
    assert now.agreement_through(3, check=False) == 3


def test_resume_mid_epoch_continues_the_same_decisions() -> None:
    s = LoopSchedule(steps_per_epoch=5, epochs=2, total_steps=10, log_every=2, save_every_steps=3)
    whole = _run(s)
    resumed = _run(s, start_epoch=0, start_step=3)
    assert resumed == [e for e in whole if e[0] > 3]


def test_a_run_stopped_after_its_last_step_still_owes_the_final_validation() -> None:
    s = LoopSchedule(steps_per_epoch=4, epochs=2, total_steps=8, log_every=100)
    assert not s.training(1, 8)
    assert s.training(1, 8, val_pending=True)
    end = s.after_validation(1, 8, 4)
    assert end.done and end.finished_epoch  # then epoch 2 of 2: training() is False again
    assert not s.training(2, 8)
