"""`python -m launch.k8s ... --validate`: the rendered manifests checked against Kubernetes' own OpenAPI
schemas, offline, before anything is printed.

Why: `kubectl apply --dry-run=client` needs a reachable API server (issue 51 item 10), so a user without
a cluster at hand had no way to check a manifest. kubernetes-validate ships the schemas of every
Kubernetes release inside its package and checks a resource without any server; the engines floor
already runs it (`--strict`, docker/tools.sh pins 1.37.0) on every rendering. It is not a dependency of
the project (nothing else needs it): `--validate` imports it into this Python, and without it says in
one line how to get it (exit 2).

Strict: a field the schema does not know is an error (a typo kubectl would drop with a warning). An
object with no schema in the package (a CRD's kind: JobSet) is named as not checked, never as valid.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchlaunch.base.untrusted import quote
from torchlaunch.launch import cli

PIN = "kubernetes-validate==1.37.0"
"""The version docker/tools.sh installs for the engines floor's scanners."""
HOW_TO_GET = (
    f"--validate needs kubernetes-validate (Kubernetes' schemas, offline) in this Python: "
    f".venv/bin/python -m pip install {PIN}"
)


def check(text: str) -> str:
    """The one summary line for the manifests in `text` (YAML documents); BadInput naming the first
    object and field the schemas refuse, or saying how to get the checker."""
    import yaml

    objects = [doc for doc in yaml.safe_load_all(text) if doc]
    validate = in_process()
    if validate is None:
        raise cli.error(HOW_TO_GET)
    checked, unchecked, version = validate(objects)
    skipped = f"; not checked (no schema in kubernetes-validate: a CRD): {', '.join(unchecked)}" if unchecked else ""
    return f"k8s: {checked} object(s) valid against the Kubernetes {version} schemas (strict, offline){skipped}"


Validator = Callable[[list[dict[str, Any]]], tuple[int, list[str], str]]


def in_process() -> Validator | None:
    """kubernetes_validate imported into this Python, or None where it is not installed."""
    try:
        import kubernetes_validate as kv
    except ImportError:
        return None

    def validate(objects: list[dict[str, Any]]) -> tuple[int, list[str], str]:
        version = kv.latest_version()
        checked, unchecked = 0, []
        for obj in objects:
            try:
                kv.validate(obj, version, strict=True)
            except kv.SchemaNotFoundError:
                unchecked.append(name_of(obj))
                continue
            except kv.ValidationError as e:
                where = ".".join(str(p) for p in getattr(e, "path", ())) or "(the object)"
                message = (str(getattr(e, "message", e)).splitlines() or [""])[0][:300]
                raise cli.error(f"--validate: {name_of(obj)}: {where}: {quote(message)}") from None
            checked += 1
        return checked, unchecked, version

    return validate


def name_of(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{obj.get('kind', '?')}/{meta.get('name', '?')}"
