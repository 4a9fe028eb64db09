"""Live recovery on the Kubernetes rendering, run in Docker (no cluster can run here): the rendered
Lighthouse Deployment becomes a container reached as `<name>-lighthouse` (its Service's name), each
pod of the Indexed Job a container read off the manifest (tests/engines/test_docker_job.py's DockerJob),
and the Job controller a small loop that applies the live Job's own policy: podFailurePolicy,
backoffLimitPerIndex, successPolicy. One pod is SIGKILLed whole (`docker kill`: every process of the
pod at once, as a lost node takes them); the controller replaces it; the replacement's launcher finds
the job training and its rank joins the live group with the survivor's state, in the same pod-0
process. Every step's samples, crops and flips equal an uninterrupted run's. A pod frozen whole (`docker
pause`) or cut off (`docker network disconnect`) past the bound is left behind by the survivor, and fenced
by the run dir's generation when it is back. Kubernetes' API server, scheduler and kubelet are the part
that is not real.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from bench import live
from tests.conftest import REPO as ROOT
from tests.conftest import launcher_argv
from tests.engines.test_docker_job import DockerJob, docker, image, shared_folder  # noqa: F401
from tests.integration.test_live_recovery import step_samples
from tests.unit.test_k8s_elastic import validate
from tests.unit.test_k8s_live import RANGE, rendered
from torchlaunch import config as config_mod
from torchlaunch.backends.k8s import live as k8s_live
from torchlaunch.backends.k8s import manifest as k8s_manifest
from torchlaunch.backends.k8s import options as k8s_opts
from torchlaunch.exit_codes import BAD_INPUT, OK, PREEMPTED
from torchlaunch.launch.spec import JobSpec

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(900)]

OVERRIDES = (
    "train.epochs=4",
    "train.batch_size=16",
    "data.synthetic_val_size=64",
    "train.log_every_steps=8",
    "checkpoint.every_steps=64",
    "debug.trace_batches=true",
)
"""The smoke recipe, 4 epochs of 128 steps: a replaced pod's rank joins ~40 steps after the kill here. No
recovery key: live is the default road of a multi-node manifest (issue #54)."""
KILL_AT = 40
DEADLINE_S = 600.0


@dataclass
class LiveJob(DockerJob):
    """The live rendering's pods, its Lighthouse, and the live Job's failure policy."""

    lighthouse: str = ""
    """The Lighthouse pod's container."""
    ended_logs: list[str] = field(default_factory=list)
    """The logs of the pods replaced so far, in order (a replacement removes its old pod's container)."""

    def start(self, index: int) -> None:
        if docker("inspect", self.container(index), check=False).returncode == 0:
            self.ended_logs.append(f"--- pod {index} (ended)\n{self.logs(index)}")
        super().start(index)

    def start_lighthouse(self, deployment: dict) -> None:
        """The Deployment's one pod, named as its Service is, read off the manifest as the Job's pods are."""
        pod = deployment["spec"]["template"]["spec"]
        c = pod["containers"][0]
        sc = c["securityContext"]
        name = deployment["metadata"]["name"]
        argv = ["run", "-d", "--name", f"{self.prefix}-{name}", "--network", self.network]
        argv += ["--network-alias", name, "--user", f"{sc['runAsUser']}:{sc['runAsGroup']}", "--cap-drop", "ALL"]
        argv += ["--security-opt", "no-new-privileges", "--read-only"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        for mount in c["volumeMounts"]:  # the workers' claim read-only (the run's secret), a tmpfs /tmp
            if "persistentVolumeClaim" in volumes[mount["name"]]:
                argv += ["-v", f"{self.shared}:{mount['mountPath']}:ro"]
            else:
                argv += ["--tmpfs", f"{mount['mountPath']}:rw,mode=1777"]
        for env in c.get("env", []):
            argv += ["-e", f"{env['name']}={env['value']}"]
        argv += ["--entrypoint", c["command"][0], c["image"], *c["command"][1:], *c["args"]]
        docker(*argv)
        self.lighthouse = f"{self.prefix}-{name}"
        deadline = time.monotonic() + 120
        while "lighthouse: serving" not in self.lighthouse_log():
            status = docker("inspect", "-f", "{{.State.Status}}", self.lighthouse).stdout.strip()
            assert status == "running", f"the Lighthouse pod ended:\n{self.lighthouse_log()[-3000:]}"
            assert time.monotonic() < deadline, f"the Lighthouse never served:\n{self.lighthouse_log()[-3000:]}"
            time.sleep(0.2)  # polling a container's log, bounded by the deadline

    def lighthouse_log(self) -> str:
        done = docker("logs", self.lighthouse, check=False)
        return done.stdout + done.stderr

    def run_live(
        self,
        running: set[int],
        kill: int | None,
        lost_node: bool = False,
        kills: tuple[tuple[int, int], ...] = (),
        kept_away: frozenset[int] = frozenset(),
    ) -> None:
        """The controller: replace an ended pod by the policy (per-index budget), until the success
        policy holds and every pod has ended; SIGKILL pod `kill` once its rank traced KILL_AT, then each
        pod of `kills` (index, step) in turn once its rank traced that step. An index never started stays
        Pending (no node for it): the success policy ends the Job without it. With `lost_node`, the killed
        pod's node is gone: its pod is replaced only once another pod has ended (Kubernetes marks a lost
        node's pod failed minutes later, when it gives up on the node). An index of `kept_away` is not
        replaced at all (its node gone, no other for it: its replacement stays Pending, its DNS record
        gone with the pod)."""
        spec = self.job["spec"]
        needed = spec["successPolicy"]["rules"][0]["succeededCount"]
        failures = dict.fromkeys(range(spec["completions"]), 0)
        succeeded: set[int] = set()
        held: set[int] = set()
        to_kill = [*([] if kill is None else [(kill, KILL_AT)]), *kills]
        deadline = time.monotonic() + DEADLINE_S
        while running or held or len(succeeded) < needed:
            assert time.monotonic() < deadline, f"the job did not complete: {self.history}\n{self.all_logs()}"
            if to_kill and live.traced_step(self.run_dir / "trace" / f"rank{to_kill[0][0]}.jsonl") >= to_kill[0][1]:
                docker("kill", self.container(to_kill.pop(0)[0]))  # SIGKILL to the pod's init: every process of it
            ended = self.ended(running)
            for index, code in ended:
                if code == OK:
                    succeeded.add(index)
                    continue
                action = self.action(code)
                if action == "FailIndex" or index in kept_away:
                    continue
                if action == "Count":
                    failures[index] += 1
                    if failures[index] > spec["backoffLimitPerIndex"]:
                        continue
                if lost_node and index == kill and running:
                    held.add(index)
                    continue
                self.start(index)
                running.add(index)
            if held and any(index not in held for index, _ in ended):
                for index in sorted(held):
                    self.start(index)
                running |= held
                held = set()
            time.sleep(0.2)  # polling container states, bounded by the deadline above

    def all_logs(self) -> str:
        return "\n".join(f"--- pod {i}\n{self.logs(i)[-3000:]}" for i in range(self.job["spec"]["completions"]))

    def cleanup(self) -> None:
        if self.lighthouse:
            docker("rm", "-f", self.lighthouse, check=False)
        super().cleanup()


@contextlib.contextmanager
def live_job_of(image: str, tmp_path: Path, spec: JobSpec) -> Iterator[LiveJob]:
    """The live rendering of `spec` (the smoke recipe) on a Docker network, its Lighthouse serving."""
    cfg = config_mod.load(str(ROOT / "configs" / "smoke.yaml"), list(spec.overrides))
    ranks = spec.nodes * spec.gpus_per_node
    live = k8s_live.from_config(cfg.recovery, False, jobset=False, ranks=ranks)
    opts = k8s_opts.K8sOptions(name="lv", cpu_only=True, save_time_s=20, step_time_s=10, live=live)
    recipe = (ROOT / "configs" / "smoke.yaml").read_text()
    objects = k8s_manifest.manifests(spec, opts, recipe)
    job = next(m for m in objects if m["kind"] == "Job")
    deployment = next(m for m in objects if m["kind"] == "Deployment")
    recipe_dir = tmp_path / "recipe"
    recipe_dir.mkdir()
    (recipe_dir / "smoke.yaml").write_text(recipe)
    tmp_path.chmod(0o755)
    recipe_dir.chmod(0o755)
    prefix = "tl" + uuid.uuid4().hex[:6]
    dj = LiveJob(job, recipe_dir, shared_folder(tmp_path / "shared"), prefix, network=f"{prefix}-net")
    docker("network", "create", dj.network)
    try:
        dj.start_lighthouse(deployment)
        yield dj
    finally:
        dj.cleanup()


@pytest.fixture
def live_job(image, tmp_path: Path):  # noqa: F811 - the session fixture imported above
    spec = JobSpec(config="configs/smoke.yaml", nodes=2, gpus_per_node=1, image=image, overrides=OVERRIDES)
    with live_job_of(image, tmp_path, spec) as dj:
        yield dj


def reference_run(work: Path, overrides: tuple[str, ...] = OVERRIDES) -> Path:
    """The same recipe uninterrupted on this host (2 ranks, one node): the plan, so every step's samples,
    crops and flips, does not depend on where the ranks run or how many there are."""
    run_dir = work / "ref"
    overrides = tuple(o for o in overrides if not o.startswith("recovery."))
    argv = launcher_argv("launch.local", "--gpus", "2", "--device", "cpu", "--config", "configs/smoke.yaml")
    done = subprocess.run(
        [*argv, *overrides, f"run_dir={run_dir}"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


def test_a_pod_killed_whole_is_replaced_by_the_job_and_joins_the_live_group(live_job: LiveJob, tmp_path: Path) -> None:
    dj = live_job
    dj.run_live(dj.start_all(), kill=1)
    out = dj.all_logs()
    assert dj.history[0] == (1, 137), dj.history  # the SIGKILLed pod, then both finish
    assert sorted(dj.history[1:]) == [(0, OK), (1, OK)], f"{dj.history}\n{out}"
    assert "launch: this job trains already on its other nodes" in dj.logs(1), out
    assert "live: joined the group at global step" in dj.logs(1), out
    assert "resumed from" not in out, "a pod was restarted from a checkpoint"
    assert "live: lost 1 rank(s)" in dj.logs(0), out  # pod 0's rank regrouped in its own process
    assert step_samples(dj.run_dir) == step_samples(reference_run(tmp_path))
    assert (dj.run_dir / "model.pt").is_file()


SILENT_OVERRIDES = (*OVERRIDES, "dist.timeout_s=30")
"""The silent pod's rank, back, may still sit in the collective it was in when it went silent: it ends within
dist.timeout_s (300 s by default) rather than being cut at once. Samples do not depend on it."""
ALONE_STEPS = 20
"""How many steps the survivor trains alone before the silent pod is back (thawed, or its link restored)."""


def until(condition: Callable[[], object], what: str, dj: LiveJob, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{dj.all_logs()}"
        time.sleep(0.05)  # polling files the pods write, bounded by the deadline


def regroups(run_dir: Path) -> list[dict]:
    path = run_dir / "live" / "events-rank0.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, filter(str.strip, lines)) if e["event"] == "regrouped"]


@pytest.mark.parametrize(
    "fault",
    [
        "pause",
        # the cut side of a partition is CI's on netns nodes (test_live_netns.py's cut-node1); this its pods'
        pytest.param("cut", marks=pytest.mark.extended),
    ],
)
def test_a_pod_silent_past_the_bound_is_left_behind_and_fenced_when_it_is_back(
    image: str,  # noqa: F811 - the session fixture imported above
    tmp_path: Path,
    fault: str,
) -> None:
    """Pod 1 goes silent whole once its rank traced step KILL_AT: `pause`, `docker pause` (the cgroup
    freezer stops every process of the pod at once: its launcher, live agent, rank, echo and loader
    workers, as a hung node); `cut`, `docker network disconnect` (a partition: nothing of the pod reaches
    pod 0 or the Lighthouse; the shared volume stays in reach, so only the run dir's generation fences
    it). No transport error comes: pod 0's rank judges it silent past recovery.heartbeat_timeout_s (its
    echo gives no answer) and regroups alone in its own process. ALONE_STEPS later the pod is back
    (`docker unpause`, or its network and names restored): its rank's group is gone, and the group it
    forms alone comes from a superseded generation, so it leaves with exit 2 without writing (FailIndex:
    not replaced). Before the fix it took a newer generation and trained on beside pod 0. Pod 0 finishes
    0; every step's samples, crops and flips are the uninterrupted run's."""
    spec = JobSpec(config="configs/smoke.yaml", nodes=2, gpus_per_node=1, image=image, overrides=SILENT_OVERRIDES)
    with live_job_of(image, tmp_path, spec) as dj:
        running = dj.start_all()
        trace0, trace1 = (dj.run_dir / "trace" / f"rank{r}.jsonl" for r in (0, 1))
        until(lambda: live.traced_step(trace1) >= KILL_AT or dj.ended(set(running)), f"step {KILL_AT}", dj)
        assert dj.history == [], f"{dj.history}\n{dj.all_logs()}"
        survivor = live.pid_of(dj.run_dir, 0)
        if fault == "pause":
            docker("pause", dj.container(1))
        else:
            docker("network", "disconnect", dj.network, dj.container(1))
        until(lambda: regroups(dj.run_dir), "pod 0's rank to regroup", dj)
        alone = regroups(dj.run_dir)[0]["step"] + ALONE_STEPS
        until(lambda: live.traced_step(trace0) >= alone, f"pod 0 alone to step {alone}", dj)
        state = docker("inspect", "-f", "{{.State.Status}}", dj.container(1)).stdout.strip()
        assert state == ("paused" if fault == "pause" else "running"), state
        if fault == "pause":
            docker("unpause", dj.container(1))
        else:
            name = f"{dj.name}-1"
            docker(
                "network",
                "connect",
                "--alias",
                name,
                "--alias",
                f"{name}.{dj.pod['subdomain']}",
                dj.network,
                dj.container(1),
            )
        dj.run_live(running, kill=None)
        out = dj.all_logs()
        assert sorted(dj.history) == [(0, OK), (1, BAD_INPUT)], f"{dj.history}\n{out}"
        assert "taken for silent (frozen or cut off)" in dj.logs(0), out
        assert "but generation 2 trains" in dj.logs(1) and "left out, this rank leaves without writing" in dj.logs(1), (
            out
        )
        assert "resumed from" not in out, "a pod was restarted from a checkpoint"
    assert [(e["world"], e["rank"]) for e in regroups(dj.run_dir)] == [(1, 0)], regroups(dj.run_dir)
    assert live.pid_of(dj.run_dir, 0) == survivor, "pod 0's rank changed process"
    assert (dj.run_dir / "live" / "generation").read_text().strip() == "2", "a group formed past the survivor's"
    silent = [json.loads(line) for line in trace1.read_text().splitlines() if line.strip().endswith("}")]
    assert {(r["generation"], r["world_size"]) for r in silent} == {(1, 2)}, silent[-2:]  # no step of its own
    assert (dj.run_dir / "model.pt").is_file()
    assert step_samples(dj.run_dir) == step_samples(reference_run(tmp_path, SILENT_OVERRIDES))


# CI: a joiner never looks node 0's name up (tests/integration/test_live_joiner.py) and a killed pod is
# replaced and joins (above); this one, 3 pods end to end, is the extended tier's
@pytest.mark.extended
def test_a_replacement_joins_while_pod_0_is_gone_and_its_name_with_it(image, tmp_path: Path) -> None:  # noqa: F811
    """--nodes 3: pod 0 SIGKILLed whole at step 40 and kept away (its node gone, no other for it: its
    container, and so its DNS name lv-0.lv, gone), then pod 1 SIGKILLed whole once its rank is past the
    regroup. Pod 1's replacement still has MASTER_ADDR=lv-0.lv, which no longer resolves: its launcher
    joins through the service and pod 2's store, never asking pod 0 (before, it refused the name: exit 2,
    FailIndex, index 1 failed for good). Pods 1 and 2 finish 0; every step exact."""
    spec = JobSpec(config="configs/smoke.yaml", nodes=3, gpus_per_node=1, image=image, overrides=OVERRIDES)
    with live_job_of(image, tmp_path, spec) as dj:
        start = time.monotonic()
        dj.run_live(dj.start_all(), kill=0, kills=((1, KILL_AT + 24),), kept_away=frozenset({0}))
        took = time.monotonic() - start
        out = "\n".join(dj.ended_logs) + dj.all_logs()
        assert dj.history[:2] == [(0, 137), (1, 137)], f"{dj.history}\n{out}"
        assert sorted(dj.history[2:]) == [(1, OK), (2, OK)], f"{dj.history}\n{out}"
        assert "launch: this job trains already on its other nodes" in dj.logs(1), out
        assert "live: joined the group at global step" in dj.logs(1), out
        assert "resumed from" not in out, "a pod was restarted from a checkpoint"
        print(f"--nodes 3, pod 0 gone, pod 1 replaced: {dj.history} in {took:.1f} s")
    assert step_samples(dj.run_dir) == step_samples(reference_run(tmp_path))


POD0_LATE_S = 8.0
"""How long after pod 1 the controller starts pod 0 on a first launch (pods start in any order)."""


# CI: the first group's wait for a name that resolves late, through getaddrinfo in a namespace of its own
# (tests/integration/test_live_joiner.py), and the rendering that passes --master-wait-s (golden file)
@pytest.mark.extended
def test_a_first_launchs_pod_1_starts_before_pod_0_and_waits_for_its_name(live_job: LiveJob, tmp_path: Path) -> None:
    """--nodes 2, first launch, pod 1 started POD0_LATE_S before pod 0 (its scheduling or image pull came
    first): pod 0's name lv-0.lv has no DNS record until its container runs. Pod 1's launcher waits for it
    (--master-wait-s, rendered from --wait-timeout-s) instead of exit 2 (FailIndex: index 1 failed for good
    on a normal start, before the fix); both pods train the first group to the end, every step exact."""
    dj = live_job
    start = time.monotonic()
    dj.start(1)
    time.sleep(POD0_LATE_S)  # the controller holds pod 0 back
    assert dj.ended({1}) == [], f"pod 1 ended before pod 0 started:\n{dj.logs(1)}"
    dj.start(0)
    dj.run_live({0, 1}, kill=None)
    took = time.monotonic() - start
    out = dj.all_logs()
    assert sorted(dj.history) == [(0, OK), (1, OK)], f"{dj.history}\n{out}"
    assert "does not resolve" not in out and "resumed from" not in out, out
    assert "this job trains already" not in out, out  # both in the first group: nobody joined late
    assert (dj.run_dir / "model.pt").is_file()
    print(f"--nodes 2, pod 1 started {POD0_LATE_S:.0f} s before pod 0: both exit 0 in {took:.1f} s")
    assert step_samples(dj.run_dir) == step_samples(reference_run(tmp_path))


# ---- a node range: --nodes MIN:MAX -------------------------------------------------------------------


def timeline(dj: LiveJob, index: int) -> str:
    """When pod `index` started, sealed or joined its first group, and ended (the engine's timestamps)."""
    times = docker("inspect", "-f", "{{.State.StartedAt}} {{.State.FinishedAt}}", dj.container(index)).stdout.split()
    done = docker("logs", "-t", dj.container(index), check=False)
    stamped = [line for line in (done.stdout + done.stderr).splitlines() if "first live group" in line]
    seen = datetime.datetime.fromisoformat
    start, end = seen(times[0]), seen(times[1])
    sealed = seen(stamped[0].split()[0]) if stamped else end
    return f"sealed {(sealed - start).total_seconds():.1f} s after its start, ended {(end - sealed).total_seconds():.1f} s later"


@pytest.mark.scanners  # no image, no engine: tests/engines/test_k8s_live_schemas.py checks the fixed count's so
def test_the_range_rendering_passes_the_kubernetes_1_31_schemas(tmp_path: Path) -> None:
    report = validate(tmp_path, [d for d in yaml.safe_load_all(rendered([*RANGE, "--backoff-limit", "2"])) if d])
    for kind in ("deployment/lv-lighthouse", "service/lv-lighthouse", "networkpolicy/lv-lighthouse", "job/lv"):
        assert f"passed for resource {kind} " in report, report
    assert report.count("passed") == 8


RANGE_OVERRIDES = (*OVERRIDES[1:], "train.epochs=2")
"""Half the fixed-count run: 256 steps on one rank."""


def test_a_range_trains_on_min_pods_while_pod_0_stays_pending(image, tmp_path: Path) -> None:  # noqa: F811
    """--nodes 1:2, pod 0 never scheduled (Pending: its name has no DNS record): pod 1 seals the first group
    alone once the last call has passed, trains to the end and exits 0, and the success policy ends the Job
    without pod 0. Every step's samples, crops and flips are the uninterrupted run's."""
    spec = JobSpec(
        config="configs/smoke.yaml", nodes=2, min_nodes=1, gpus_per_node=1, image=image, overrides=RANGE_OVERRIDES
    )
    with live_job_of(image, tmp_path, spec) as dj:
        start = time.monotonic()
        dj.start(1)
        dj.run_live({1}, kill=None)
        took = time.monotonic() - start
        out = dj.logs(1)
        assert dj.history == [(1, OK)], f"{dj.history}\n{out}"
        assert "launch: the first live group of --nnodes 1:2 is node(s) 1; this node's ranks start in it" in out, out
        assert "resumed from" not in out
        assert (dj.run_dir / "model.pt").is_file()
        print(f"range 1:2, pod 0 Pending: pod 1 trained alone to exit 0 in {took:.1f} s; {timeline(dj, 1)}")
    assert step_samples(dj.run_dir) == step_samples(reference_run(tmp_path, RANGE_OVERRIDES))


@pytest.mark.extended  # CI proves the range's rendering with pod 0 Pending (above); this its exit 75
def test_below_min_the_pods_exit_75_and_their_indexes_resume_when_min_are_back(image, tmp_path: Path) -> None:  # noqa: F811
    """--nodes 2:3 on two pods (pod 2 Pending): pod 1's node is lost whole at step 40; pod 0, below MIN,
    commits the last whole step and exits 75, which the Job ignores (its index is started again, no budget
    spent); pod 1's index is replaced once its node is given up on (counted); the two seal the first group
    again at MIN after the last call, resume from the checkpoint and finish 0."""
    spec = JobSpec(config="configs/smoke.yaml", nodes=3, min_nodes=2, gpus_per_node=1, image=image, overrides=OVERRIDES)
    with live_job_of(image, tmp_path, spec) as dj:
        dj.start(0)
        dj.start(1)
        dj.run_live({0, 1}, kill=1, lost_node=True)
        out = "\n".join(dj.ended_logs) + dj.all_logs()
        assert sorted(dj.history[:2]) == [(0, PREEMPTED), (1, 137)], f"{dj.history}\n{out}"
        assert sorted(dj.history[2:]) == [(0, OK), (1, OK)], f"{dj.history}\n{out}"
        assert "below --nnodes 2:3's minimum of 2 nodes: checkpoint committed at global step" in out, out
        assert "resumed from" in dj.logs(0), out
        assert (dj.run_dir / "model.pt").is_file()
    assert step_samples(dj.run_dir) == step_samples(reference_run(tmp_path))
