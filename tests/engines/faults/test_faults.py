"""Faults against the real launcher on 2 netns nodes: the failure table of ARCHITECTURE.md, asserted.

Where recovery is promised the job finishes with model.pt equal (torch.equal per tensor) to an
uninterrupted run's; where it is not, the attempt fails within a bounded time, the newest checkpoint
verifies, and a rerun with RUN_DIR/config.yaml resumes and finishes equal. Fault points are seeded
(FAULTS_SEED); outcomes are saved as JSON in FAULTS_RESULTS_DIR for faults/report.py when it is set.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from faults import scenarios

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(400)]

FAILURE_BOUND_S = 60  # a node loss must surface as a failure well before torchrun's 300-600 s timeouts


@pytest.fixture(scope="module")
def reference_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from faults import netns

    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(reason)
    from faults.netns import Cluster

    with Cluster() as cluster:
        outcome = scenarios.reference(cluster, tmp_path_factory.mktemp("reference"))
    assert outcome.first_codes == [0, 0] and outcome.model_path is not None
    assert outcome.final_step == scenarios.TOTAL_STEPS
    outcome.model_equal = True
    save(outcome, "reference")
    return outcome.model_path


def save(outcome: scenarios.Outcome, name: str, reference: Path | None = None) -> None:
    """Record the outcome (and whether the model matched) for faults/report.py, before asserting."""
    if reference is not None and outcome.model_path is not None:
        outcome.model_equal = scenarios.models_differ(outcome.model_path, reference) is None
    folder = os.environ.get("FAULTS_RESULTS_DIR")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"{name}.json").write_text(json.dumps(outcome.to_json(), indent=1))


def assert_finished_equal(outcome: scenarios.Outcome, reference: Path) -> None:
    assert outcome.final_step == scenarios.TOTAL_STEPS, outcome
    assert outcome.model_path is not None, outcome
    assert scenarios.models_differ(outcome.model_path, reference) is None


def assert_failed_bounded_then_resumed(outcome: scenarios.Outcome, bound_s: float) -> None:
    assert outcome.failure_s is not None and outcome.failure_s < bound_s, outcome
    assert outcome.newest_checkpoint is not None and outcome.newest_checkpoint_problem is None, outcome
    assert outcome.rerun_codes == [0, 0], outcome
    assert outcome.resumed_from == outcome.newest_checkpoint, outcome


def test_preemption_exits_75_on_both_nodes_and_rerun_resumes_exactly(cluster, tmp_path, reference_model):
    outcome = scenarios.preempt(cluster, tmp_path, scenarios.rng_for("preempt"))
    save(outcome, "preempt", reference_model)
    assert outcome.first_codes == [75, 75], outcome
    assert_failed_bounded_then_resumed(outcome, FAILURE_BOUND_S)
    assert outcome.steps_lost == 0, outcome
    assert_finished_equal(outcome, reference_model)


def test_killed_worker_restarts_the_group_which_resumes(cluster, tmp_path, reference_model):
    outcome = scenarios.kill_worker(cluster, tmp_path, scenarios.rng_for("kill-worker"))
    save(outcome, "kill-worker", reference_model)
    assert outcome.first_codes == [0, 0], outcome  # recovered inside the attempt, no rerun
    assert outcome.resumed_from is not None and outcome.resumed_from % 4 == 0, outcome
    assert outcome.steps_lost < 4, outcome  # at most the steps since the last checkpoint (every 4)
    assert_finished_equal(outcome, reference_model)


def test_killed_node_fails_bounded_and_rerun_resumes(cluster, tmp_path, reference_model):
    outcome = scenarios.kill_node(cluster, tmp_path, scenarios.rng_for("kill-node"))
    save(outcome, "kill-node", reference_model)
    assert outcome.first_codes[1] == -9 and outcome.first_codes[0] == 1, outcome
    assert_failed_bounded_then_resumed(outcome, FAILURE_BOUND_S)
    assert_finished_equal(outcome, reference_model)


def test_short_link_outage_stalls_and_recovers(cluster, tmp_path, reference_model):
    outcome = scenarios.link_down(cluster, tmp_path, scenarios.rng_for("link-down-short"), seconds=3, pg_timeout_s=None)
    save(outcome, "link-down-short", reference_model)
    assert outcome.first_codes == [0, 0] and outcome.resumed_from is None, outcome
    assert outcome.recover_s is not None and 3 <= outcome.recover_s < 30, outcome  # it stalled, then went on
    assert_finished_equal(outcome, reference_model)


# CI's tier ends a network loss within its bound once: the link cut for good below (the watchdog's bound).
@pytest.mark.extended
def test_outage_longer_than_the_process_group_timeout_fails_bounded(cluster, tmp_path, reference_model):
    seconds = 3 * scenarios.PG_TIMEOUT_S
    outcome = scenarios.link_down(
        cluster, tmp_path, scenarios.rng_for("link-down-long"), seconds=seconds, pg_timeout_s=scenarios.PG_TIMEOUT_S
    )
    save(outcome, "link-down-long", reference_model)
    assert outcome.first_codes == [1, 1], outcome
    # Workers fail after dist.timeout_s; node 1's agent can only exit once the link is back.
    assert_failed_bounded_then_resumed(outcome, seconds + 30)
    assert_finished_equal(outcome, reference_model)


def test_link_cut_for_good_ends_both_nodes_within_the_hang_timeout_and_rerun_resumes(
    cluster, tmp_path, reference_model
):
    outcome = scenarios.link_cut(cluster, tmp_path, scenarios.rng_for("link-cut"))
    save(outcome, "link-cut", reference_model)
    # The link stays cut until both launchers ended: each node's watchdog (--hang-timeout), not the
    # network nor dist.timeout_s (300 s), ends the attempt; node 1's agent, blocked on the store, is
    # ended by its launcher after a bounded grace.
    assert outcome.first_codes == [1, 1], outcome  # hung or failed: retryable (never 0, nor 2: never retried)
    assert not any("link restored" in note for note in outcome.notes), outcome
    hung = [f"node{k}" for k, recorded in enumerate(outcome.outcomes or []) if recorded == "hung"]
    assert hung, outcome  # at least one watchdog fired (the other node may fail on its peer's loss)
    for host in hung:
        dumped = [how for path, how in outcome.stacks.items() if f"-{host}-" in path]
        assert "faulthandler" in dumped or "py-spy" in dumped, (host, outcome.stacks)
    assert_failed_bounded_then_resumed(outcome, scenarios.CUT_BOUND_S)
    assert_finished_equal(outcome, reference_model)


def test_crash_mid_checkpoint_write_keeps_the_previous_checkpoint(cluster, tmp_path, reference_model):
    outcome = scenarios.crash_mid_checkpoint(cluster, tmp_path, scenarios.rng_for("crash-mid-checkpoint"))
    save(outcome, "crash-mid-checkpoint", reference_model)
    assert any("uncommitted" in note for note in outcome.notes), outcome
    assert outcome.first_codes[0] == -9 and outcome.first_codes[1] == 1, outcome
    assert_failed_bounded_then_resumed(outcome, FAILURE_BOUND_S)
    assert_finished_equal(outcome, reference_model)
