"""Kubernetes' own rules for the values a manifest carries, applied before anything is printed.

The API server refuses a bad name, quantity or port at `kubectl apply` time (or worse, accepts a
run dir that silently lands on the pod's ephemeral disk); checking here turns each into one line
that names the flag and the fix:

    launch error: --namespace 'Prod': must be a DNS-1123 label (lowercase letters, digits, '-'; e.g. prod)

The grammars follow k8s.io/apimachinery (validation.IsDNS1123Label, IsDNS1123Subdomain,
IsDNS1035Label, resource.ParseQuantity, IsValidPortNum) and the distribution reference grammar
(github.com/distribution/reference) for images. Torch-free.
"""

from __future__ import annotations

import posixpath
import re

from torchlaunch.exit_codes import BadInput
from torchlaunch.launch import shape

PREFIX = "launch error: "

LABEL_MAX = 63
SUBDOMAIN_MAX = 253
IMAGE_NAME_MAX = 255

_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN = re.compile(rf"{_DNS1123_LABEL.pattern}(\.{_DNS1123_LABEL.pattern})*")

# resource.Quantity: <signedNumber><suffix>; suffix: binary SI (Ki..Ei), decimal SI (n u m "" k M G T P E)
# or a decimal exponent (e/E followed by a signed integer).
_QUANTITY = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?", re.ASCII)

# github.com/distribution/reference, regexp.go
_ALNUM = r"[a-z0-9]+"
_SEPARATOR = r"(?:[._]|__|[-]+)"
_PATH_COMPONENT = rf"{_ALNUM}(?:{_SEPARATOR}{_ALNUM})*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_IPV6 = r"\[(?:[a-fA-F0-9:]+)\]"
_DOMAIN = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|{_IPV6})(?::[0-9]+)?"
_NAME = rf"(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
_REFERENCE = re.compile(rf"(?P<name>{_NAME})(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?")


def _refuse(flag: str, value: object, rule: str) -> BadInput:
    return BadInput(f"{PREFIX}{flag} {value!r}: {rule}")


def suggest_label(value: str, *, letter_first: bool = False) -> str:
    """A nearby valid label for the error line: lowercase, other characters as '-', trimmed to 63."""
    text = re.sub(r"[^a-z0-9-]+", "-", value.lower()).strip("-")
    if letter_first:
        text = text.lstrip("0123456789-")
    text = text[:LABEL_MAX].rstrip("-")
    return text or "run"


def dns1123_label(value: str, flag: str) -> str:
    """Namespaces and most object names: lowercase letters, digits and '-', alphanumeric at both ends, <= 63."""
    rule = f"must be a DNS-1123 label (lowercase letters, digits, '-'; e.g. {suggest_label(value)})"
    if not isinstance(value, str) or not _DNS1123_LABEL.fullmatch(value):
        raise _refuse(flag, value, rule)
    if len(value) > LABEL_MAX:
        raise _refuse(flag, value, f"must be a DNS-1123 label of at most {LABEL_MAX} characters, got {len(value)}")
    return value


def dns1035_label(value: str, flag: str) -> str:
    """Service names: a DNS-1123 label that also starts with a letter."""
    example = suggest_label(value, letter_first=True)
    rule = f"must be a DNS-1035 label (lowercase letters, digits, '-', starting with a letter; e.g. {example})"
    if not isinstance(value, str) or not _DNS1035_LABEL.fullmatch(value):
        raise _refuse(flag, value, rule)
    if len(value) > LABEL_MAX:
        raise _refuse(flag, value, f"must be a DNS-1035 label of at most {LABEL_MAX} characters, got {len(value)}")
    return value


def dns1123_subdomain(value: str, flag: str) -> str:
    """ConfigMap, PVC, StorageClass names: dot-separated DNS-1123 labels, <= 253 characters."""
    rule = f"must be a DNS-1123 subdomain (lowercase letters, digits, '-', '.'; e.g. {suggest_label(value)})"
    if not isinstance(value, str) or not _DNS1123_SUBDOMAIN.fullmatch(value):
        raise _refuse(flag, value, rule)
    if len(value) > SUBDOMAIN_MAX:
        raise _refuse(flag, value, f"must be a DNS-1123 subdomain of at most {SUBDOMAIN_MAX} characters")
    return value


def object_name(name: str, flag: str, *, nodes: int = 1) -> str:
    """The run's name: it names the Job, the headless Service (a DNS-1035 label) and the pod hostnames
    `<name>-<index>`, so `<name>-<nodes-1>` and the longest derived object name must stay labels (live
    mode's `<name>-lighthouse` shortens itself instead: backends.k8s.live.service_name)."""
    dns1035_label(name, flag)
    longest = max(f"{name}-{nodes - 1}", f"{name}-shared", f"{name}-recipe", key=len)
    if len(longest) > LABEL_MAX:
        raise _refuse(
            flag,
            name,
            f"is too long: '{longest}' must fit {LABEL_MAX} characters; pass a name of at most "
            f"{LABEL_MAX - (len(longest) - len(name))}",
        )
    return name


def quantity(value: str, flag: str, *, positive: bool = True) -> str:
    """A resource quantity as the API server parses it: `10Gi`, `500m`, `1.5`, `1e3`."""
    example = "e.g. 100Gi, 500Mi, 1.5, 1e3"
    if not isinstance(value, str) or not _QUANTITY.fullmatch(value):
        raise _refuse(
            flag,
            value,
            f"must be a Kubernetes quantity (a number with an optional suffix Ki Mi Gi Ti, k M G T, m; {example})",
        )
    if positive and (value.startswith("-") or float(re.match(r"[+-]?(\d+(\.\d*)?|\.\d+)", value).group(0)) == 0):
        raise _refuse(flag, value, f"must be a positive quantity ({example})")
    return value


def port(value: int, flag: str) -> int:
    """A TCP port number: 1..65535 (the bound is shape.port's)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _refuse(flag, value, "must be a port number in 1..65535 (e.g. 29500)")
    shape.port(flag, value)
    return value


def image_reference(value: str, flag: str) -> str:
    """A container image reference: `[registry[:port]/]path[:tag][@digest]`, no whitespace."""
    fix = "e.g. registry.example.com/team/torchlaunch:0.1.0 or ...@sha256:<64 hex>"
    if not isinstance(value, str) or not value:
        raise _refuse(flag, value, f"must be a container image reference, not empty ({fix})")
    if any(char.isspace() for char in value):
        raise _refuse(flag, value, f"must be a container image reference without whitespace ({fix})")
    match = _REFERENCE.fullmatch(value)
    if match is None:
        raise _refuse(
            flag,
            value,
            f"must be a container image reference [registry[:port]/]path[:tag][@digest] with a lowercase path ({fix})",
        )
    if len(match.group("name")) > IMAGE_NAME_MAX:
        raise _refuse(flag, value, f"the repository name must be at most {IMAGE_NAME_MAX} characters")
    return value


def run_dir_under(value: str, mount: str, flag: str, *, workdir: str | None = None) -> str:
    """The run dir normalised (`..` resolved the way the kernel resolves it in the pod) and required to
    lie under the shared volume's mount path; a relative one is taken from the pods' working dir."""
    if not isinstance(value, str) or not value.strip():
        raise _refuse(flag, value, f"must be a directory under {mount}/ (e.g. {mount}/runs/a)")
    base = workdir or mount
    absolute = value if value.startswith("/") else posixpath.join(base, value)
    normal = "/" + posixpath.normpath(absolute).lstrip("/")  # POSIX keeps a leading '//'; Linux reads '/'
    root = "/" + posixpath.normpath(mount).lstrip("/")
    if normal == root or not normal.startswith(root.rstrip("/") + "/"):
        raise _refuse(
            flag,
            value,
            f"must stay under {root}/ (the shared volume; it resolves to {normal}), or a pod replacement "
            f"would lose the checkpoints (e.g. {root}/runs/a)",
        )
    return normal
