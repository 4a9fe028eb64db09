"""Every command in the code blocks of README.md and of the docs site's pages (docs/*.md) is run here,
or listed as not runnable with the reason, so neither the README nor the docs can drift from the code.

What counts as a command: each line of an indented code block, or of a fenced block tagged bash, sh,
shell or console (untagged fences are diagrams, ```python blocks are code excerpts); `# comments`
and a leading `$ ` are dropped, `\\`-continued lines joined. The pages are read at test time, so the
coordinator's edits are checked as they are: README.md first, then the docs pages in the site's nav
order (mkdocs.yml), then any page the nav lacks. A command that appears on several pages (or twice on
one) runs once, where it first appears: the CI budget is tight and a second run proves nothing new.

Each command must match a RULE (first match wins): run it as written, run it with the stated
rewrite (placeholders such as /path/to/train become a small image folder made here; overrides keep
it smoke-sized), or skip it with the reason (a GPU, the internet, a Kubernetes cluster, or the
command is a whole CI stage). A command that matches no rule fails test_every_command_has_a_rule,
which names it and its page. The commands run in order, in one scratch copy of the working tree (a fresh clone in
CI), sharing one shell environment (so `eval "$(slurm/dev-cluster.sh env)"` reaches the next line),
with `python` = this interpreter.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import REPO

README = REPO / "README.md"
DOCS = REPO / "docs"
MKDOCS = REPO / "mkdocs.yml"
SHELL_FENCES = ("bash", "sh", "shell", "console")
COMMAND_TIMEOUT_S = 420
SMOKE = "train.max_steps=3 train.epochs=1"
"""Appended where a recipe would train for minutes: a few steps prove the command works end to end."""


# ------------------------------------------------------------------ extracting the commands


def strip_comment(line: str) -> str:
    """Drop a trailing `# comment` that is outside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def readme_commands(text: str) -> list[str]:
    """The shell commands of a Markdown document, in order (see the module docstring)."""
    raw: list[str] = []
    fence: str | None = None
    previous_blank, in_indented = True, False
    for line in text.splitlines():
        stripped = line.strip()
        if fence is not None:
            if stripped.startswith("```"):
                fence = None
            elif fence in SHELL_FENCES:
                raw.append(stripped)
            continue
        if stripped.startswith("```"):
            fence = stripped[3:].strip().lower()
            in_indented = False
            continue
        if line.startswith("    ") and stripped and (previous_blank or in_indented):
            in_indented = True
            raw.append(stripped)
        elif stripped:
            in_indented = False
        previous_blank = not stripped
    commands: list[str] = []
    pending = ""
    for line in raw:
        line = strip_comment(line.removeprefix("$ "))
        if not line:
            continue
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        commands.append(pending + line)
        pending = ""
    return commands


def nav_pages(nav: object) -> list[str]:
    """The page files of an mkdocs nav (nested lists of `title: file` maps), in reading order."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in nav_pages(value)]
    if isinstance(nav, list):
        return [page for item in nav for page in nav_pages(item)]
    return []


def documentation_pages(repo: Path = REPO) -> list[Path]:
    """README.md, then the docs pages in the site's nav order, then any docs page the nav lacks."""
    import yaml

    nav = yaml.safe_load((repo / "mkdocs.yml").read_text(encoding="utf-8")).get("nav", [])
    docs = repo / "docs"
    ordered = [docs / name for name in nav_pages(nav) if name.endswith(".md")]
    rest = sorted(set(docs.glob("*.md")) - set(ordered))
    return [repo / "README.md", *ordered, *rest]


def all_commands(pages: list[Path] | None = None) -> list[tuple[str, str]]:
    """(page, command) for every command of the pages, in order, each command once (its first page)."""
    seen: set[str] = set()
    found: list[tuple[str, str]] = []
    for page in documentation_pages() if pages is None else pages:
        for cmd in readme_commands(page.read_text(encoding="utf-8")):
            if cmd not in seen:
                seen.add(cmd)
                found.append((page.name, cmd))
    return found


# ------------------------------------------------------------------ what each command needs


@dataclass(frozen=True)
class Rule:
    pattern: str
    """re.search against the command."""
    action: str
    """`run` or `skip`."""
    reason: str
    """Why it is skipped, or why it is rewritten; empty when it runs exactly as written."""
    rewrite: Callable[[str, Path], str] | None = None
    expect: int = 0
    stderr_has: str = ""
    """re.search against stderr."""
    needs: str = ""
    """`slurm`: runs in test_slurm_commands, on the local Slurm cluster."""


def placeholders(cmd: str, scratch: Path) -> str:
    """README placeholders -> things made here: a class-folder tree of small images, the scratch dir."""
    images = str(scratch / "images")
    for placeholder in ("/path/to/cifar10/train", "/path/to/train", "path/to/images"):
        cmd = cmd.replace(placeholder, images)
    return cmd


def with_args(extra: str) -> Callable[[str, Path], str]:
    """Add config overrides to a `make` command's ARGS (merged into ARGS="..." when it has one)."""

    def rewrite(cmd: str, scratch: Path) -> str:
        cmd = placeholders(cmd, scratch)
        match = re.search(r'ARGS="([^"]*)"', cmd)
        if match:
            return cmd[: match.start()] + f'ARGS="{match.group(1)} {extra}"' + cmd[match.end() :]
        return f'{cmd} ARGS="{extra}"'

    return rewrite


def shard_paths(cmd: str, scratch: Path) -> str:
    """The README's shard commands on data made here: the image tree in, the scratch dir's shard set out."""
    images = str(scratch / "images")
    shards = str(scratch / "in-shards")
    for old, new in (
        ("/data/imagenet/train", images),
        ("/data/imagenet/val", images),
        ("/data/in-shards", shards),
        ("/data/wds-imagenet", shards),
    ):
        cmd = cmd.replace(old, new)
    return cmd


def with_overrides(extra: str) -> Callable[[str, Path], str]:
    return lambda cmd, scratch: f"{placeholders(cmd, scratch)} {extra}"


def scratch_run_dir(cmd: str, scratch: Path) -> str:
    """docs/SLURM.md's run_dir=/tmp/runs/s -> a run dir in the scratch dir (nothing written outside it)."""
    return cmd.replace("run_dir=/tmp/runs/s", f"run_dir={scratch / 'runs-s'}")


RULES: tuple[Rule, ...] = (
    Rule(
        r"^make (test|test-all|test-unit|test-integration|test-fast|test-extended)\b",
        "skip",
        "the test suite itself: CI runs it as its own stage (.ci/run)",
    ),
    Rule(
        r"^(FAULTS_SEED=\d+ )?make faults\b",
        "skip",
        "root and network namespaces: CI's fault-injection stage (.ci/run)",
    ),
    Rule(
        r"^\.venv/bin/python -m (pytest tests/engines/faults|faults\.report --run)\b",
        "skip",
        "a part of the fault-injection suite (root, network namespaces; faults.report --run also rewrites "
        "docs/RELIABILITY.md): CI's `make faults` stage runs it",
    ),
    Rule(
        r"^(mount |.*/mnt/t\b)",
        "skip",
        "docs/RELIABILITY.md's session on a 64 KB tmpfs mounted as root; tests/integration/test_rundir_faults_os.py and "
        "tests/unit/test_shards_forged.py cover full and read-only storage without root",
    ),
    Rule(
        r"^(command|carry|timeout_s):",
        "skip",
        "a parameter of a device-tool call in docs/GPU.md (a lent GPU machine), not a shell command",
    ),
    Rule(r"^\|", "skip", "a results table laid out as a code block (docs/GPU.md), not a command"),
    Rule(
        r"^mkdir -p \.cache/gpu-data ",
        "skip",
        "stages the data of docs/GPU.md's GPU session (a lent GPU machine; /work/shared holds the archive)",
    ),
    Rule(
        r"^python -m launch\.slurm \.\.\. ",
        "skip",
        "an elision (`...`: the options of the command above), not a command",
    ),
    Rule(r"^sbatch .*--gpus-per-node", "skip", "needs a Slurm partition with GPUs"),
    Rule(
        r"^sbatch -p high ",
        "skip",
        "a by-hand preemption of the running job (tests/engines/test_slurm_cluster.py preempts jobs on the dev cluster)",
    ),
    Rule(
        r"^slurm/dev-cluster\.sh status \| down$",
        "skip",
        "two alternatives in one line; `down` would stop the cluster the other Slurm tests use",
    ),
    Rule(
        r"^export SLURM_CONF=/tmp/slurm-dev/",
        "skip",
        'the session already exported SLURM_CONF with `eval "$(slurm/dev-cluster.sh env)"` (docs/launchers.md), '
        "which reads the cluster's own folder (SLURM_DEV_DIR)",
    ),
    Rule(
        r"^python -m launch\.slurm .* -- train\.py\b",
        "skip",
        "train.py stands for the user's own script; docs/launchers.md runs examples/custom_loop.py that way "
        "on the dev cluster",
    ),
    Rule(
        r"^python -m launch\.local .*--device cpu --config configs/fast93\.yaml",
        "run",
        "checked and printed (--dry-run): the same recipe on the same images trains smoke-sized through "
        "launch.local in docs/quickstart.md's `make train-local GPUS=2 CONFIG=configs/fast93.yaml` (CI budget)",
        lambda cmd, scratch: f"{placeholders(cmd, scratch)} --dry-run",
    ),
    Rule(
        r"^python -m launch\.local .*data\.name=shards",
        "run",
        "/data/in-shards is the shard set the README's write command leaves in the scratch dir; smoke-sized",
        lambda cmd, scratch: f"{shard_paths(cmd, scratch)} {SMOKE}",
    ),
    Rule(r"^python -m launch (status|logs|list|cancel) ", "run", ""),
    Rule(
        r"^make bench\b", "skip", "~20 minutes of benchmarks; tests/unit/test_bench_smoke.py runs each one smoke-sized"
    ),
    Rule(r"^make (install|lint)$", "run", ""),
    Rule(
        r"^make image\b",
        "skip",
        "builds a Docker image from the public CUDA base image (internet); "
        "tests/engines/test_docker_job.py builds the local variant",
    ),
    Rule(
        r"^make train-local GPUS=4$",
        "run",
        "offline by construction (TORCHLAUNCH_DOWNLOAD_PROBE points at a closed loopback port): the "
        "README promises one line naming the fixes within seconds; online it downloads 170 MB",
        expect=2,
        stderr_has=r"data error: CIFAR-10 not found|GPU\(s\) are visible",
    ),  # GPU hosts: < 4 GPUs
    Rule(r"^make train-local .*CONFIG=configs/smoke\.yaml", "run", "smoke-sized", with_args(SMOKE)),
    Rule(
        r"^make train-local .*CONFIG=configs/fast\.yaml",
        "run",
        "/path/to/cifar10/train is a small class-folder tree made here; smoke-sized (the recipe takes ~15 min)",
        with_args(SMOKE),
    ),
    Rule(
        r"^make train-local .*CONFIG=configs/fast93\.yaml",
        "run",
        "/path/to/cifar10/train is a small class-folder tree made here; smoke-sized (the recipe takes hours on CPU)",
        with_args(SMOKE),
    ),
    Rule(
        r"^python -m bench\.gpu ",
        "skip",
        "needs a CUDA GPU (bench/gpu_session.sh on a lent H200; "
        "tests/integration/test_airbench_peer_cpu_run.py runs its CPU-testable parts)",
    ),
    Rule(
        r"^make train-local .*data\.name=imagefolder",
        "run",
        "/path/to/train is a small class-folder tree made here; smoke-sized",
        with_args(SMOKE),
    ),
    Rule(r"^make (doctor|preflight)\b", "run", ""),
    Rule(
        r"^python -m train --config configs/cifar10\.yaml",
        "run",
        "CI is offline: a class-folder tree of 32x32 images stands in for CIFAR-10's download; smoke-sized",
        with_overrides(f"data.name=imagefolder data.root={{images}} train.batch_size=16 {SMOKE}"),
    ),
    Rule(
        r"^python -m train\.shards ",
        "run",
        "/data/imagenet/{train,val} are the class-folder tree made here; /data/in-shards and /data/wds-imagenet "
        "the shard set the write command leaves in the scratch dir (index rebuilds its indexes)",
        shard_paths,
    ),
    Rule(r"^python -m train\.evaluate ", "run", "path/to/images is the class-folder tree made here", placeholders),
    Rule(
        r"^python -m train\.plot ",
        "run",
        "runs/b: the quick start's run (runs/smoke) is the second run",
        lambda cmd, scratch: cmd.replace("runs/b", "runs/smoke"),
    ),
    Rule(r"^python -m launch\.slurm .*--gpus-per-node", "skip", "needs a Slurm partition with GPUs"),
    Rule(
        r"^python -m launch\.k8s .*kubectl apply",
        "run",
        "the manifests are rendered; `kubectl apply` needs a Kubernetes cluster (tests/engines/test_docker_job.py "
        "runs the rendered Job's pods as real containers)",
        lambda cmd, scratch: cmd.split("&&")[0].strip(),
    ),
    Rule(r"^python -m launch\.k8s ", "run", ""),
    Rule(r"^kubectl ", "skip", "needs a Kubernetes cluster"),
    Rule(r"^python examples/custom_loop\.py ", "run", ""),
    Rule(
        r"^python -m launch\.local --nnodes \d+:\d+ ",
        "run",
        "an elastic job's nodes are other machines (node0): the command is checked and printed (--dry-run); "
        "CIFAR-10's download host is unreachable here, so its recipe checks synthetic data of the same shape",
        lambda cmd, scratch: f"{cmd}{' data.name=synthetic' if 'configs/cifar10.yaml' in cmd else ''} --dry-run",
    ),
    Rule(
        r"^python -m launch\.lighthouse ",
        "skip",
        "a service that serves until stopped, on a host of its own: tests/engines/faults/test_live_netns.py "
        "runs it on a netns node",
    ),
    Rule(
        r"^python -m launch\.local --nnodes \d+ .*recovery\.lighthouse=",
        "skip",
        "one node of several, with the service apart: tests/engines/faults/test_live_netns.py runs it on netns nodes",
    ),
    Rule(r"^python -m launch\.local .*-- ", "run", ""),
    Rule(r"^python -m launch\.local ", "run", ""),
    Rule(r"^python -m train --config configs/smoke\.yaml ", "run", ""),
    Rule(r"^python -m train\.doctor ", "run", ""),
    Rule(r"^slurm/dev-cluster\.sh (up|status)$", "run", "", needs="slurm"),
    Rule(r"^eval \"\$\(slurm/dev-cluster\.sh env\)\"$", "run", "", needs="slurm"),
    Rule(r"^python -m launch\.slurm .*--wait.* -- ", "run", "", needs="slurm"),
    Rule(
        r"^python -m launch\.slurm .*run_dir=/tmp/runs/s\b",
        "run",
        "run_dir=/tmp/runs/s becomes a folder of the scratch dir; smoke-sized",
        lambda cmd, scratch: f"{scratch_run_dir(cmd, scratch)} {SMOKE}",
        needs="slurm",
    ),
    Rule(
        r"^python -m launch\.slurm .*--tasks-per-node",
        "run",
        "waits for the job (so nothing is left running) and is smoke-sized",
        lambda cmd, scratch: f"{cmd}{'' if '--wait' in cmd else ' --wait'} {SMOKE}",
        needs="slurm",
    ),
)


def rule_for(cmd: str) -> Rule | None:
    return next((r for r in RULES if re.search(r.pattern, cmd)), None)


# ------------------------------------------------------------------ running them


def make_images(root: Path, classes: int = 2, per_class: int = 600) -> None:
    """A class-folder tree of 32x32 PNGs, deterministic; 1,080 training images hold fast.yaml's batch of 1,024."""
    rng = np.random.default_rng(0)
    for c in range(classes):
        folder = root / f"class{c}"
        folder.mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / f"{i:03d}.png")


def scratch_copy(target: Path) -> Path:
    """The working tree's files (tracked, and untracked but not ignored: what a commit would hold),
    modification times kept so make sees .venv as installed; .venv itself linked."""
    listing = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.split("\0")
    for name in filter(None, listing):
        source = REPO / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    venv = Path(sys.prefix)
    linked = venv if (venv / "bin" / "python").exists() else REPO / ".venv"
    (target / ".venv").symlink_to(linked)
    installed_as_is(target, linked)
    return target


def installed_as_is(tree: Path, venv: Path) -> None:
    """The copy's `make install` (run by `make train-local`, ...) must never install into the linked
    .venv: it pointed the user's editable install and console scripts at this copy, deleted after the
    test (seen when setup.py's C source was newer than .venv/.installed). The install's prerequisites
    in the copy get a time before .installed's, so make finds the install done."""
    marker = venv / ".installed"
    if not marker.exists():
        return
    rule = next((ln for ln in (tree / "Makefile").read_text().splitlines() if ln.startswith("$(VENV)/.installed:")), "")
    before = marker.stat().st_mtime - 1
    for name in rule.partition(":")[2].split():
        if (tree / name).exists():
            os.utime(tree / name, (before, before))


class Session:
    """Commands run one after another in the copy; each sees the environment the previous one left."""

    def __init__(self, tree: Path, scratch: Path) -> None:
        self.tree, self.scratch = tree, scratch
        bin_dir = Path(sys.executable).parent
        self.env = {
            **os.environ,
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "TORCHLAUNCH_DOWNLOAD_PROBE": f"127.0.0.1:{closed_port()}",
        }
        self.env.pop("PYTHONPATH", None)

    def run(self, cmd: str) -> subprocess.CompletedProcess:
        env_file = self.scratch / "env.out"
        script = f"{cmd}\n__rc=$?\nenv -0 > {env_file}\nexit $__rc\n"
        result = subprocess.run(
            ["bash", "-c", script],
            cwd=self.tree,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
        )
        if env_file.is_file():
            self.env = dict(item.split("=", 1) for item in env_file.read_text().split("\0") if "=" in item)
        return result


def closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_commands(needs: str, tmp_path: Path, pages: list[Path] | None = None) -> list[str]:
    """Run the commands of one kind of `pages` (default: the README and every docs page) in order, each
    once; a report line per command."""
    tree = scratch_copy(tmp_path / "tree")
    scratch = tmp_path / "scratch"
    make_images(scratch / "images")
    session = Session(tree, scratch)
    report, failures = [], []
    for page, cmd in all_commands(pages):
        rule = rule_for(cmd)
        assert rule is not None, f"{page}: command without a rule: {cmd}"
        if rule.needs != needs:
            continue
        if rule.action == "skip":
            report.append(f"skipped ({page}): {cmd}  ({rule.reason})")
            continue
        actual = rule.rewrite(cmd, scratch) if rule.rewrite else cmd
        actual = actual.replace("{images}", str(scratch / "images"))
        started = time.monotonic()
        result = session.run(actual)
        took = time.monotonic() - started  # printed, never asserted: where the CI budget goes
        ok = result.returncode == rule.expect and re.search(rule.stderr_has, result.stderr) is not None
        report.append(f"{'ran' if ok else 'FAILED'} ({page}, {took:.1f} s): {actual}")
        if not ok:
            failures.append(
                f"{page}: {actual}\n  exit {result.returncode} (expected {rule.expect})\n"
                f"  stdout tail: {result.stdout[-1500:]}\n  stderr tail: {result.stderr[-2500:]}"
            )
    print("\n".join(report))
    assert not failures, "documented commands failed:\n" + "\n".join(failures)
    return report


# ------------------------------------------------------------------ tests


def test_extraction_reads_indented_and_shell_blocks_only() -> None:
    text = "\n".join(
        [
            "Intro with `make inline` code.",
            "",
            "    make a GPUS=2   # comment",
            "    python -m x --flag='a # b'",
            "",
            "```",
            " make diagram -> not a command",
            "```",
            "```python",
            "x = 1",
            "```",
            "```bash",
            "$ python -m y \\",
            "    --long",
            "# only a comment",
            "```",
            "- a list",
            "    continuation of a list item after no blank line",
        ]
    )
    assert readme_commands(text) == ["make a GPUS=2", "python -m x --flag='a # b'", "python -m y --long"]


def test_every_command_has_a_rule() -> None:
    commands = all_commands()
    assert commands and commands[0][0] == "README.md", "no commands found in README.md"
    missing = [f"{page}: {cmd}" for page, cmd in commands if rule_for(cmd) is None]
    assert not missing, (
        "documented commands neither run nor listed in tests/unit/test_readme_commands.py RULES "
        "(add a rule: run, rewrite with a reason, or skip with a reason): " + "; ".join(missing)
    )
    for page, cmd in commands:
        rule = rule_for(cmd)
        assert rule is not None and (rule.reason or (rule.action == "run" and rule.rewrite is None)), (page, cmd)


def test_every_docs_page_is_read_in_the_sites_order() -> None:
    """The nav's pages in its order after the README, and a page the nav lacks still read (not skipped)."""
    pages = documentation_pages()
    assert pages[0] == README and set(DOCS.glob("*.md")) <= set(pages)
    assert pages.index(DOCS / "quickstart.md") < pages.index(DOCS / "launchers.md") < pages.index(DOCS / "SLURM.md")
    with_commands = {page for page, _ in all_commands()}
    assert {"README.md", "quickstart.md", "launchers.md", "SLURM.md", "KUBERNETES.md"} <= with_commands


def test_a_command_on_several_pages_is_listed_once_where_it_first_appears(tmp_path: Path) -> None:
    first, second = tmp_path / "a.md", tmp_path / "b.md"
    first.write_text("    make doctor\n    make lint\n    make doctor\n")
    second.write_text("text\n\n    make lint\n    make preflight\n")
    assert all_commands([first, second]) == [("a.md", "make doctor"), ("a.md", "make lint"), ("b.md", "make preflight")]


def test_a_command_without_a_rule_is_named_with_its_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    page = tmp_path / "NEW.md"
    page.write_text("    frobnicate --all\n")
    monkeypatch.setattr(sys.modules[__name__], "documentation_pages", lambda: [README, page])
    with pytest.raises(AssertionError, match=r"NEW\.md: frobnicate --all"):
        test_every_command_has_a_rule()


def test_rewrites_keep_the_command_and_say_why(tmp_path: Path) -> None:
    rule = rule_for('make train-local GPUS=2 ARGS="data.name=imagefolder data.root=/path/to/train"')
    assert rule is not None and rule.rewrite is not None and rule.reason
    out = rule.rewrite('make train-local GPUS=2 ARGS="data.name=imagefolder data.root=/path/to/train"', tmp_path)
    assert out == (f'make train-local GPUS=2 ARGS="data.name=imagefolder data.root={tmp_path / "images"} {SMOKE}"')
