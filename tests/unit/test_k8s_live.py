"""launch.k8s with recovery.live=true (torchlaunch.backends.k8s.live): the golden rendering, each decision
as a pure function, the refusals (exit 2, one line, nothing printed) and hostile service addresses.

No API server runs here: the schemas are checked on the engines floor (tests/engines/test_k8s_live_schemas.py,
kubernetes-validate --strict and checkov), the pod script under a real shell on the integration floor."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO as ROOT
from tests.unit.test_k8s import by_kind, render
from tests.unit.test_k8s_elastic import golden
from tests.unit.test_k8s_wiring import EVIL, kinds
from torchlaunch import config as config_mod
from torchlaunch.agent import options
from torchlaunch.backends.k8s import live as k8s_live
from torchlaunch.backends.k8s import manifest as k8s_manifest
from torchlaunch.backends.k8s import options as k8s_opts
from torchlaunch.exit_codes import BAD_INPUT, OK, BadInput
from torchlaunch.launch.spec import JobSpec
from torchlaunch.live.section import RecoveryConfig

LIVE = [
    "--nodes",
    "2",
    "--gpus-per-node",
    "8",
    "--name",
    "lv",
    "--namespace",
    "ml",
    "--image",
    "reg.example/ddp:1.2",
    "--config",
    "configs/cifar10.yaml",
    "recovery.live=true",
]
KINDS = ["Service", "NetworkPolicy", "NetworkPolicy", "Service", "Deployment", "ConfigMap", "PersistentVolumeClaim"]


def docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def named(text: str, kind: str, name: str) -> dict:
    [doc] = [d for d in docs(text) if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def selects(selector: dict[str, str], pod_labels: dict[str, str]) -> bool:
    """Kubernetes' matchLabels: every pair of the selector is among the pod's labels."""
    return all(pod_labels.get(k) == v for k, v in selector.items())


def script_of(job: dict) -> str:
    return job["spec"]["template"]["spec"]["containers"][0]["args"][0]


def rendered(argv: list[str]) -> str:
    code, out, err = render(argv)
    assert code == OK, err
    return out


def test_live_rendering_matches_golden_and_holds_the_service_apart() -> None:
    out = rendered(LIVE)
    golden("k8s_live.yaml", out)
    assert kinds(out) == [*KINDS, "Job"]  # the service before the Job: the pods wait for it
    deployment = named(out, "Deployment", "lv-lighthouse")
    job = by_kind(out)["Job"]
    pod, worker = deployment["spec"]["template"]["spec"], job["spec"]["template"]["spec"]
    [lighthouse], [trainer] = pod["containers"], worker["containers"]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert lighthouse["image"] == trainer["image"] == "reg.example/ddp:1.2"
    assert lighthouse["args"] == [
        "--bind",
        "0.0.0.0:29510",
        "--heartbeat-timeout-ms",
        "1000",
        "--secret-file",
        "/shared/runs/lv/live/secret",
    ]
    assert lighthouse["command"][-2:] == ["-m", "torchlaunch.live.lighthouse"]
    assert lighthouse["securityContext"] == trainer["securityContext"]  # one owner: k8s/hardening.py
    assert pod["securityContext"] == {k: v for k, v in worker["securityContext"].items() if k != "fsGroup"}
    assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
    sc = lighthouse["securityContext"]
    assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert lighthouse["resources"]["requests"] == lighthouse["resources"]["limits"]
    port_names = {p["name"] for p in lighthouse["ports"]}
    assert lighthouse["readinessProbe"]["tcpSocket"]["port"] in port_names
    assert lighthouse["livenessProbe"]["tcpSocket"]["port"] in port_names
    assert deployment["metadata"]["namespace"] == "ml"


def test_the_service_reads_the_runs_secret_from_the_shared_volume_read_only() -> None:
    """Issue 52: the rendered service took every presence id at its word (no --secret-file: it did not
    mount the run dir), so a stranger's forged ids could hold a regroup. It now mounts the workers' claim
    read-only at their path and is given the run dir's secret (the run dir as --run-dir moves it), with
    no fsGroup: the kubelet changes nothing on the volume for it (a group-readable secret is refused)."""
    out = rendered([*LIVE, "--run-dir", "/shared/exp/../runs/a"])
    deployment = named(out, "Deployment", "lv-lighthouse")
    pod = deployment["spec"]["template"]["spec"]
    [lighthouse], [trainer] = pod["containers"], by_kind(out)["Job"]["spec"]["template"]["spec"]["containers"]
    args = lighthouse["args"]
    assert args[args.index("--secret-file") + 1] == "/shared/runs/a/live/secret"
    [worker_mount] = [m for m in trainer["volumeMounts"] if m["name"] == "shared"]
    [mount] = [m for m in lighthouse["volumeMounts"] if m["name"] == "shared"]
    assert mount == {"name": "shared", "mountPath": worker_mount["mountPath"], "readOnly": True}
    [volume] = [v for v in pod["volumes"] if v["name"] == "shared"]
    claim = by_kind(out)["PersistentVolumeClaim"]
    assert volume["persistentVolumeClaim"] == {"claimName": claim["metadata"]["name"], "readOnly": True}
    assert "fsGroup" not in pod["securityContext"]


def test_labels_let_each_policy_and_service_name_only_its_own_pods() -> None:
    out = rendered(LIVE)
    deployment = named(out, "Deployment", "lv-lighthouse")
    service_pods = deployment["spec"]["template"]["metadata"]["labels"]
    workers = by_kind(out)["Job"]["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == service_pods
    lighthouse_svc, headless = named(out, "Service", "lv-lighthouse"), named(out, "Service", "lv")
    assert lighthouse_svc["spec"]["type"] == "ClusterIP"
    assert lighthouse_svc["spec"]["ports"] == [
        {"name": "lighthouse", "port": 29510, "targetPort": "lighthouse", "protocol": "TCP"},
        {"name": "presence", "port": 29511, "targetPort": "presence", "protocol": "TCP"},
    ]
    assert selects(lighthouse_svc["spec"]["selector"], service_pods)
    assert not selects(lighthouse_svc["spec"]["selector"], workers)
    assert not selects(headless["spec"]["selector"], service_pods)  # no DNS record of the service's pod there
    assert service_pods["app.kubernetes.io/instance"] == workers["app.kubernetes.io/instance"] == "lv"


def test_network_policies_are_least_privilege() -> None:
    out = rendered(LIVE)
    workers = by_kind(out)["Job"]["spec"]["template"]["metadata"]["labels"]
    service_pods = named(out, "Deployment", "lv-lighthouse")["spec"]["template"]["metadata"]["labels"]
    own = named(out, "NetworkPolicy", "lv")["spec"]
    assert selects(own["podSelector"]["matchLabels"], workers)
    assert not selects(own["podSelector"]["matchLabels"], service_pods)
    # every TCP port (each rank's own store on a free port) and UDP (the peer echo), from the job's workers
    assert own["ingress"] == [
        {"from": [{"podSelector": {"matchLabels": workers}}], "ports": [{"protocol": "TCP"}, {"protocol": "UDP"}]}
    ]
    service = named(out, "NetworkPolicy", "lv-lighthouse")["spec"]
    assert selects(service["podSelector"]["matchLabels"], service_pods)
    assert not selects(service["podSelector"]["matchLabels"], workers)
    assert service["ingress"] == [
        {
            "from": [{"podSelector": {"matchLabels": workers}}],
            "ports": [{"protocol": "TCP", "port": 29510}, {"protocol": "TCP", "port": 29511}],
        }
    ]
    assert service["policyTypes"] == ["Ingress", "Egress"] and service["egress"] == []  # it dials nobody


def test_the_job_replaces_a_lost_pod_for_its_index_while_the_others_train_on() -> None:
    spec = by_kind(rendered(LIVE))["Job"]["spec"]
    assert "backoffLimit" not in spec and spec["backoffLimitPerIndex"] == 3  # no Job-wide budget to spend
    on_exit = {"containerName": "trainer", "operator": "In"}
    assert spec["podFailurePolicy"]["rules"] == [
        {"action": "FailIndex", "onExitCodes": {**on_exit, "values": [2]}},  # never retried, its index only
        {"action": "Ignore", "onExitCodes": {**on_exit, "values": [75]}},  # preempted: as without live mode
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    ]  # a signal's code (137, ...) matches none: counted against its own index, the pod replaced
    assert spec["podReplacementPolicy"] == "Failed"  # never two pods of one index at once
    assert spec["successPolicy"] == {"rules": [{"succeededCount": 1}]}  # any index: pod 0 is not special
    assert spec["completions"] == spec["parallelism"] == 2
    assert by_kind(rendered([*LIVE, "--backoff-limit", "5"]))["Job"]["spec"]["backoffLimitPerIndex"] == 5


RANGE = [*LIVE[:1], "2:4", *LIVE[2:]]
"""--nodes 2:4: the live range (launch.local --nnodes MIN:MAX in live mode, docs/live.md)."""


def test_a_range_renders_max_pods_each_with_its_index_and_the_range() -> None:
    out = rendered(RANGE)
    golden("k8s_live_range.yaml", out)
    fixed = rendered([*LIVE[:1], "4", *LIVE[2:]])
    assert kinds(out) == kinds(fixed) == [*KINDS, "Job"]  # the same objects as a fixed count of MAX
    job, fixed_job = by_kind(out)["Job"], by_kind(fixed)["Job"]
    spec = job["spec"]
    assert spec["completions"] == spec["parallelism"] == 4  # MAX pods; fewer nodes: the rest stay Pending
    # The fixed count's policy holds for the range's codes: 75 below MIN is ignored (the index started
    # again, no budget spent, to meet afresh), 2 fails its index, one index ending 0 ends the Job.
    for key in ("backoffLimitPerIndex", "podFailurePolicy", "podReplacementPolicy", "successPolicy"):
        assert spec[key] == fixed_job["spec"][key], key
    assert {"action": "Ignore", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [75]}} in (
        spec["podFailurePolicy"]["rules"]
    )
    assert "succeededIndexes" not in str(spec["successPolicy"])  # not the elastic Job's pod 0
    lines = script_of(job).splitlines()
    assert lines[1] == "python -m torchlaunch.backends.k8s.launch --wait-for lv-lighthouse:29510 --wait-timeout-s 600"
    words = shlex.split(lines[2])
    assert words[words.index("--nnodes") + 1] == "2:4"
    assert words[words.index("--node-rank") + 1] == "$JOB_COMPLETION_INDEX"  # live mode numbers its nodes
    assert words[words.index("--master-addr") + 1] == "$MASTER_ADDR" and "--max-restarts" not in words
    assert "--master-wait-s" not in words  # the service's host: every pod waited for it already
    env = {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    # resolvable while pod 0 is Pending (no DNS record without an IP); the first group's store is on its
    # first sealed node, at the address that node arrived with
    assert env["MASTER_ADDR"] == "lv-lighthouse"
    assert {e["name"]: e.get("value") for e in fixed_job["spec"]["template"]["spec"]["containers"][0]["env"]}[
        "MASTER_ADDR"
    ] == "lv-0.lv"
    # a service of the user's own: its host
    own = by_kind(rendered([*RANGE, "recovery.lighthouse=http://lh.example:29600"]))["Job"]
    assert {e["name"]: e.get("value") for e in own["spec"]["template"]["spec"]["containers"][0]["env"]}[
        "MASTER_ADDR"
    ] == "lh.example"
    # --nodes 2:2 is the fixed count 2, as under torchrun
    assert rendered([*LIVE[:1], "2:2", *LIVE[2:]]).split("\n", 1)[1] == rendered(LIVE).split("\n", 1)[1]


def test_every_pod_waits_for_the_service_and_none_for_pod_zero() -> None:
    script = script_of(by_kind(rendered(LIVE))["Job"])
    lines = script.splitlines()
    assert lines[:2] == [
        "set -eu",
        "python -m torchlaunch.backends.k8s.launch --wait-for lv-lighthouse:29510 --wait-timeout-s 600",
    ]
    assert 'JOB_COMPLETION_INDEX" != 0' not in script and "$MASTER_ADDR:$MASTER_PORT" not in script
    words = shlex.split(lines[2])
    assert words.count("recovery.lighthouse=http://lv-lighthouse:29510") == 1
    assert (
        words[words.index("--nnodes") + 1] == "2" and words[words.index("--node-rank") + 1] == "$JOB_COMPLETION_INDEX"
    )
    assert len(lines) == 3


def test_a_first_launchs_pod_waits_for_pod_0s_name_in_its_launcher_bounded_by_wait_timeout_s() -> None:
    """Pods start in any order: a first-group pod whose launcher runs before pod 0's name has a DNS record
    waits for it (launch.local --master-wait-s) instead of exit 2 (FailIndex); the script itself still
    waits for no pod 0 (a replacement's launcher never looks the name up), and the bound is
    --wait-timeout-s's."""
    words = shlex.split(script_of(by_kind(rendered(LIVE))["Job"]).splitlines()[2])
    assert words[words.index("--master-wait-s") + 1] == "600"
    later = shlex.split(script_of(by_kind(rendered([*LIVE, "--wait-timeout-s", "90"]))["Job"]).splitlines()[2])
    assert later[later.index("--master-wait-s") + 1] == "90"
    restart = [*LIVE[:-1], "recovery.live=false"]
    assert "--master-wait-s" not in script_of(by_kind(rendered(restart))["Job"])  # not live: --wait-for
    assert k8s_opts.WAIT_TIMEOUT_MAX_S == options.MASTER_WAIT_MAX_S  # what a pod is given, it accepts
    code, out, err = render([*LIVE, "--wait-timeout-s", str(k8s_opts.WAIT_TIMEOUT_MAX_S + 1)])
    assert code == BAD_INPUT and not out and err.strip().count("\n") == 0
    assert f"--wait-timeout-s must be at most {k8s_opts.WAIT_TIMEOUT_MAX_S}" in err, err


def test_a_service_of_the_users_own_is_used_and_none_rendered() -> None:
    out = rendered([*LIVE, "recovery.lighthouse=http://10.0.0.9:29600"])
    assert kinds(out) == ["Service", "NetworkPolicy", "ConfigMap", "PersistentVolumeClaim", "Job"]
    job = by_kind(out)["Job"]
    script = script_of(job)
    assert "--wait-for 10.0.0.9:29600 " in script and "lv-lighthouse" not in script
    assert shlex.split(script.splitlines()[-1]).count("recovery.lighthouse=http://10.0.0.9:29600") == 1
    assert job["spec"]["successPolicy"] == {"rules": [{"succeededCount": 1}]}  # still a live Job


def test_live_mode_from_the_recipe_itself(tmp_path: Path) -> None:
    recipe = tmp_path / "live.yaml"
    smoke = (ROOT / "configs" / "smoke.yaml").read_text()
    recipe.write_text(smoke + "\nrecovery:\n  live: true\n  heartbeat_timeout_s: 0.5\n")
    out = rendered(["--name", "lv", "--cpu-only", "--gpus-per-node", "2", "--config", str(recipe)])
    lighthouse = named(out, "Deployment", "lv-lighthouse")["spec"]["template"]["spec"]["containers"][0]
    args = lighthouse["args"]
    assert args[args.index("--heartbeat-timeout-ms") + 1] == "500"  # recovery.heartbeat_timeout_s x 1000


def test_without_live_mode_nothing_changes() -> None:
    out = rendered(["--name", "lv", "--config", "configs/smoke.yaml", "recovery.live=false"])
    assert kinds(out) == ["Service", "NetworkPolicy", "ConfigMap", "PersistentVolumeClaim", "Job"]
    job = by_kind(out)["Job"]["spec"]
    assert job["backoffLimit"] == 6 and "backoffLimitPerIndex" not in job and "successPolicy" not in job
    assert "ports" not in named(out, "NetworkPolicy", "lv")["spec"]["ingress"][0]
    # the pre-flight runs under torchrun in every mode (launch.local): no service for it
    doctor = rendered(["--doctor", "--cpu-only", "--config", "configs/smoke.yaml", "recovery.live=true"])
    assert "Deployment" not in kinds(doctor)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--jobset"], "recovery.live=true is not rendered as a --jobset"),
        (["--nodes", "1:4", "--jobset"], "recovery.live=true is not rendered as a --jobset"),
        (["--nodes", "3:2"], "MIN 3 is more than MAX 2"),
        (["--nodes", "0:2"], "--nodes must be >= 1, got 0"),
        (["--nodes", "2:x"], "--nodes"),
        (["recovery.lighthouse=http://$(id):1"], "recovery.lighthouse"),
        (["recovery.lighthouse=http://h:1;reboot"], "recovery.lighthouse"),
        (["recovery.lighthouse=http://h:1 --x"], "recovery.lighthouse"),
        (["recovery.lighthouse=http://h:70000"], "recovery.lighthouse"),
        ([f"recovery.lighthouse=http://h{EVIL}:1"], "recovery.lighthouse"),
        ([f"recovery.lighthouse=http://h:1{EVIL}"], "recovery.lighthouse"),
    ],
    ids=[
        "jobset",
        "range-jobset",
        "min-above-max",
        "min-zero",
        "range-text",
        "subshell",
        "semicolon",
        "space",
        "port",
        "yaml-host",
        "yaml-port",
    ],
)
def test_what_live_mode_does_not_render_is_one_line_and_exit_2(argv: list[str], needle: str) -> None:
    code, out, err = render(["--config", "configs/smoke.yaml", "recovery.live=true", *argv])
    assert code == BAD_INPUT and out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err, err


def test_a_name_of_52_characters_still_fits() -> None:
    assert "a" * 52 + "-lighthouse" in rendered(
        ["--config", "configs/smoke.yaml", "recovery.live=true", "--name", "a" * 52]
    )


@pytest.mark.parametrize("length", [53, 56])
def test_a_name_that_fits_the_restart_road_fits_the_default_live_one(length: int) -> None:
    """Live by default: the service's name shortens itself (head, digest, suffix) instead of refusing a
    --name that the restart road's objects take (56: `<name>-recipe` is 63)."""
    name = "a" * length
    text = rendered(["--config", "configs/smoke.yaml", "--name", name])
    services = {s for s in re.findall(r"\b(a+-[0-9a-f]{8}-lighthouse)\b", text)}
    assert len(services) == 1 and len(next(iter(services))) == 63, services
    assert f"{name}-lighthouse" not in text
    other = k8s_live.service_name("a" * (length - 1) + "b")
    assert other != next(iter(services)), "two names sharing a head keep their services apart"


def test_an_ipv6_service_address_stays_one_quoted_word() -> None:
    """`[` starts a shell glob: the address reaches the launcher as written, and adds no YAML object."""
    out = rendered([*LIVE, "recovery.lighthouse=http://[fd00::1]:29510"])
    assert kinds(out) == ["Service", "NetworkPolicy", "ConfigMap", "PersistentVolumeClaim", "Job"]
    lines = script_of(by_kind(out)["Job"]).splitlines()
    assert "'recovery.lighthouse=http://[fd00::1]:29510'" in lines[2]
    assert shlex.split(lines[1])[-3] == "fd00::1:29510"  # HOST:PORT of --wait-for, split at the last ':'


# ---- the pure decisions -------------------------------------------------------------------------------


def recovery(**values: object) -> RecoveryConfig:
    return config_mod.load(None, [f"recovery.{k}={v}" for k, v in values.items()]).recovery


def test_from_config() -> None:
    two = {"jobset": False, "ranks": 2}
    assert k8s_live.from_config(recovery(live="false"), doctor=False, **two) is None
    assert k8s_live.from_config(recovery(live="true"), doctor=True, **two) is None
    live = k8s_live.from_config(recovery(live="true", heartbeat_timeout_s=2.5), doctor=False, **two)
    assert live == k8s_live.Live(2500, "")
    mine = k8s_live.from_config(recovery(live="true", lighthouse="http://lh:1"), doctor=False, **two)
    assert mine == k8s_live.Live(1000, "http://lh:1")


def test_auto_renders_live_where_the_road_can_be_and_pins_the_restart_road_where_not() -> None:
    """recovery.live=auto (the default): live on a multi-rank Job; a --jobset or one rank takes the restart
    road, and a multi-rank restart road tells the pods' launchers so (their own auto would be live)."""
    auto = recovery()
    assert auto.live == "auto"
    assert k8s_live.from_config(auto, doctor=False, jobset=False, ranks=2) == k8s_live.Live(1000, "")
    for jobset, ranks in ((True, 2), (False, 1)):
        assert k8s_live.from_config(auto, doctor=False, jobset=jobset, ranks=ranks) is None
    assert k8s_live.pinned(auto, None, doctor=False, ranks=2) == ("recovery.live=false",)
    assert k8s_live.pinned(auto, None, doctor=False, ranks=1) == ()
    assert k8s_live.pinned(auto, None, doctor=True, ranks=2) == ()
    assert k8s_live.pinned(recovery(live="false"), None, doctor=False, ranks=2) == ()
    assert k8s_live.pinned(auto, k8s_live.Live(), doctor=False, ranks=2) == ()


def test_a_default_jobset_renders_the_restart_road_and_an_explicit_true_is_refused() -> None:
    text = rendered(["--config", "configs/smoke.yaml", "--jobset", "--nodes", "2"])
    assert "recovery.live=false" in text and "-lighthouse" not in text
    code, out, err = render(["--config", "configs/smoke.yaml", "--jobset", "--nodes", "2", "recovery.live=true"])
    assert code == BAD_INPUT and out == "" and "--jobset" in err


def test_address_endpoint_and_overrides() -> None:
    rendered_service, own = k8s_live.Live(), k8s_live.Live(address="http://[::1]:2")
    assert k8s_live.address("run", rendered_service) == "http://run-lighthouse:29510"
    assert k8s_live.endpoint("run", rendered_service) == "run-lighthouse:29510"
    assert k8s_live.overrides("run", rendered_service) == ["recovery.lighthouse=http://run-lighthouse:29510"]
    assert k8s_live.renders_service(rendered_service) and not k8s_live.renders_service(own)
    assert k8s_live.endpoint("run", own) == "::1:2" and k8s_live.overrides("run", own) == []
    with pytest.raises(BadInput, match="recovery.lighthouse must be http://HOST:PORT"):
        k8s_live.endpoint("run", k8s_live.Live(address="http://a b:1"))
    assert k8s_live.PORT == 29510  # launch.lighthouse's default bind


def test_check_refuses_the_jobset_only() -> None:
    k8s_live.check(JobSpec(nodes=4), jobset=False)
    k8s_live.check(JobSpec(nodes=4, min_nodes=2), jobset=False)  # a range: no --max-restarts needed
    for min_nodes in (None, 2):
        with pytest.raises(BadInput, match="--jobset"):
            k8s_live.check(JobSpec(nodes=4, min_nodes=min_nodes), jobset=True)


def test_nodes_args_and_master_addr_of_a_count_and_a_range() -> None:
    index = '"$JOB_COMPLETION_INDEX"'
    assert k8s_live.nodes_args(JobSpec(nodes=4)) == ["--nnodes", "4", "--node-rank", index]
    assert k8s_live.nodes_args(JobSpec(nodes=4, min_nodes=2)) == ["--nnodes", "2:4", "--node-rank", index]
    rendered_service, own = k8s_live.Live(), k8s_live.Live(address="http://[fd00::1]:2")
    assert k8s_live.master_addr("run", JobSpec(nodes=4), rendered_service, "run-0.run") == "run-0.run"
    assert k8s_live.master_addr("run", JobSpec(nodes=4, min_nodes=2), rendered_service, "x") == "run-lighthouse"
    assert k8s_live.master_addr("run", JobSpec(nodes=4, min_nodes=2), own, "x") == "fd00::1"


def test_the_job_transform_keeps_everything_else() -> None:
    spec = JobSpec(config="configs/smoke.yaml", nodes=3, gpus_per_node=2, image="r/i:1")
    plain = k8s_manifest.job(spec, k8s_opts.K8sOptions(name="run"))
    live = k8s_manifest.job(spec, k8s_opts.K8sOptions(name="run", live=k8s_live.Live()))
    assert list(live["spec"]) == [
        "completionMode",
        "completions",
        "parallelism",
        "backoffLimitPerIndex",
        "podReplacementPolicy",
        "podFailurePolicy",
        "template",
        "successPolicy",
    ]
    assert plain["spec"]["backoffLimit"] == 9 and plain["spec"]["podFailurePolicy"]["rules"][0]["action"] == "FailJob"
    assert live["metadata"] == plain["metadata"]
    assert k8s_live.job(plain, 0)["spec"]["backoffLimitPerIndex"] == 0  # --backoff-limit 0: never replaced
