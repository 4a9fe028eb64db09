"""Kubernetes' value rules, each as an accept/refuse table; every refusal is one line naming the flag."""

from __future__ import annotations

import pytest

from torchlaunch.backends.k8s import validate as v
from torchlaunch.exit_codes import BadInput


def refused(call, *args, **kwargs) -> str:
    with pytest.raises(BadInput) as caught:
        call(*args, **kwargs)
    message = str(caught.value)
    assert len(message.splitlines()) == 1, message
    assert message.startswith("launch error: ")
    return message


@pytest.mark.parametrize("value", ["prod", "a", "0", "team-a", "a1-b2", "x" * 63, "1abc"])
def test_dns1123_label_accepts(value):
    assert v.dns1123_label(value, "--namespace") == value


@pytest.mark.parametrize(
    "value", ["Prod", "", "-a", "a-", "a_b", "a.b", "a b", "x" * 64, "a\nb", "café", "prod\n---\nkind: X"]
)
def test_dns1123_label_refuses(value):
    message = refused(v.dns1123_label, value, "--namespace")
    assert f"--namespace {value!r}:" in message and "DNS-1123 label" in message


def test_label_refusal_says_the_fix():
    assert refused(v.dns1123_label, "Prod", "--namespace") == (
        "launch error: --namespace 'Prod': must be a DNS-1123 label (lowercase letters, digits, '-'; e.g. prod)"
    )
    assert "e.g. my-team" in refused(v.dns1123_label, "My_Team", "--namespace")


@pytest.mark.parametrize("value", ["run", "a-1", "x" * 63])
def test_dns1035_label_accepts(value):
    assert v.dns1035_label(value, "--name") == value


@pytest.mark.parametrize("value", ["1run", "Run", "-run", "run-", "x" * 64, ""])
def test_dns1035_label_refuses(value):
    assert "DNS-1035 label" in refused(v.dns1035_label, value, "--name")


@pytest.mark.parametrize("value", ["fast-nfs", "a.b.c", "csi.example.com", "0a"])
def test_dns1123_subdomain_accepts(value):
    assert v.dns1123_subdomain(value, "--storage-class") == value


@pytest.mark.parametrize("value", ["Fast", "a..b", ".a", "a.", "a_b", "a" * 254, ""])
def test_dns1123_subdomain_refuses(value):
    assert "DNS-1123 subdomain" in refused(v.dns1123_subdomain, value, "--storage-class")


def test_object_name_leaves_room_for_pod_indexes_and_suffixes():
    assert v.object_name("x" * 56, "--name", nodes=2) == "x" * 56  # 'x...-shared' is 63
    message = refused(v.object_name, "x" * 57, "--name", nodes=2)
    assert "at most 56" in message
    assert "at most" in refused(v.object_name, "x" * 56, "--name", nodes=10**7)


@pytest.mark.parametrize(
    "value", ["10Gi", "500m", "1.5", "1e3", "100", "1Ki", "2Ti", "1E", "1k", "1M", ".5", "5.", "+1", "1e-3", "100n"]
)
def test_quantity_accepts(value):
    assert v.quantity(value, "--storage-size") == value


@pytest.mark.parametrize(
    "value", ["lots", "", "10 Gi", "10gi", "10GB", "Gi", "1.2.3", "1e", "1Gi\n", "e3", "0", "0Gi", "-1Gi", "1KiB"]
)
def test_quantity_refuses(value):
    message = refused(v.quantity, value, "--storage-size")
    assert f"--storage-size {value!r}:" in message and "quantity" in message


@pytest.mark.parametrize("value", [1, 80, 29500, 65535])
def test_port_accepts(value):
    assert v.port(value, "--master-port") == value


@pytest.mark.parametrize("value", [0, -1, 65536, 70000, True, "29500"])
def test_port_refuses(value):
    assert "1..65535" in refused(v.port, value, "--master-port")


@pytest.mark.parametrize(
    "value",
    [
        "torchlaunch",
        "torchlaunch:0.1.0",
        "registry.example.com/torchlaunch:0.1.0",
        "localhost:5000/team/img:latest",
        "Registry.Example.com/a/b",
        "ghcr.io/org/repo_name/sub-dir/img__x:v1.2-rc_3",
        "reg.example/img@sha256:" + "a" * 64,
        "reg.example:443/img:tag@sha256:" + "0" * 64,
        "[::1]:5000/img:1",
    ],
)
def test_image_reference_accepts(value):
    assert v.image_reference(value, "--image") == value


@pytest.mark.parametrize(
    "value",
    [
        "",
        "reg example/img",
        "img:tag ",
        "img\n---\nkind: ConfigMap",
        "Img",
        "reg.example/Img:1",
        "img:",
        "img:-tag",
        "img:" + "t" * 129,
        "img@sha256:abc",
        "/img",
        "img/",
        "reg.example//img",
        "a" * 256,
    ],
)
def test_image_reference_refuses(value):
    message = refused(v.image_reference, value, "--image")
    assert f"--image {value!r}:" in message
    assert "image reference" in message or "at most 255" in message


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("/shared/runs/a", "/shared/runs/a"),
        ("/shared/runs/./a/", "/shared/runs/a"),
        ("/shared/x/../runs/a", "/shared/runs/a"),
        ("runs/a", "/shared/runs/a"),
        ("//shared//runs//a", "/shared/runs/a"),
    ],
)
def test_run_dir_under_normalises(value, expected):
    assert v.run_dir_under(value, "/shared", "--run-dir") == expected


@pytest.mark.parametrize("value", ["/shared/../tmp/run", "/tmp/run", "/shared", "/shared/", "/sharedx/a", "../a", ""])
def test_run_dir_under_refuses_paths_off_the_volume(value):
    message = refused(v.run_dir_under, value, "/shared", "--run-dir")
    assert "--run-dir" in message and "/shared/" in message


def test_run_dir_under_names_where_it_would_land():
    assert "resolves to /tmp/run" in refused(v.run_dir_under, "/shared/../tmp/run", "/shared", "--run-dir")


def test_relative_run_dir_follows_the_workdir():
    assert v.run_dir_under("../shared/r", "/shared", "--run-dir", workdir="/code") == "/shared/r"
    refused(v.run_dir_under, "runs/a", "/shared", "--run-dir", workdir="/code")


# ---- `launch.k8s --validate`: Kubernetes' schemas offline (issue 51 item 10: kubectl's dry run needs a server)


class FakeSchemas:
    """kubernetes_validate's surface as --validate uses it (the package is the engines floor's scanner, not
    in the project's venv): a Job with a string `completions` is refused as the real schema refuses it,
    and a JobSet has no schema (a CRD)."""

    class ValidationError(Exception):
        def __init__(self, message: str, path: tuple) -> None:
            super().__init__(message)
            self.message, self.path = message, path

    class SchemaNotFoundError(Exception):
        pass

    @staticmethod
    def latest_version() -> str:
        return "1.37.0"

    @classmethod
    def validate(cls, obj: dict, version: str, strict: bool = False) -> str:
        assert strict and version == "1.37.0"
        if obj["kind"] == "JobSet":
            raise cls.SchemaNotFoundError(obj["kind"])
        if obj["kind"] == "Job" and not isinstance(obj["spec"].get("completions"), int):
            raise cls.ValidationError("'two' is not of type 'integer', 'null'", ("spec", "completions"))
        return version


def render(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, list[str]]:
    from torchlaunch.backends.k8s.launch import main

    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, [line for line in err.splitlines() if line.strip()]


def test_validate_without_the_schemas_says_how_to_get_them_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "kubernetes_validate", None)  # not installed
    code, out, err = render(["--nodes", "2", "--validate"], capsys)
    assert code == 2 and out == "" and len(err) == 1, err
    assert "pip install kubernetes-validate==1.37.0" in err[0] and err[0].startswith("launch error: --validate")


def test_validate_checks_every_object_and_refuses_before_printing(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    from torchlaunch.backends.k8s import launch, offline_check

    monkeypatch.setitem(sys.modules, "kubernetes_validate", FakeSchemas)
    code, out, err = render(["--nodes", "2", "--validate"], capsys)
    assert code == 0 and "kind: Job" in out
    # live by default: the Job's five and the membership service's Deployment, Service and NetworkPolicy
    assert err == ["k8s: 8 object(s) valid against the Kubernetes 1.37.0 schemas (strict, offline)"]
    code, out, err = render(["--nodes", "2", "--jobset", "--validate"], capsys)
    assert code == 0 and "not checked (no schema in kubernetes-validate: a CRD): JobSet/torchlaunch" in err[0]
    real = launch.to_yaml
    monkeypatch.setattr(launch, "to_yaml", lambda *a: real(*a).replace("completions: 2", "completions: two"))
    code, out, err = render(["--nodes", "2", "--validate"], capsys)
    assert code == 2 and out == "" and len(err) == 1
    assert err[0].startswith("launch error: --validate: Job/torchlaunch: spec.completions: ") and "'two'" in err[0]
    assert offline_check.PIN in offline_check.HOW_TO_GET
