"""User text reaches sbatch scripts, manifests and argv lists only through torchlaunch.launch.emit (and
torchlaunch.backends.slurm.sbatch for `#SBATCH` lines).

The attacks: a newline in a program argument written into a `#` comment line of the sbatch script
(the next line runs as a command), a newline in a `#SBATCH` value, `%` in a run dir that Slurm
expands, and the same newline in the header comment of the rendered manifests (an extra object
appears). Each is run for real (bash, PyYAML, kubernetes-validate), with a control that shows the
harness detects the attack when the text is formatted by hand.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from torchlaunch.backends.k8s import manifest as k8s_manifest
from torchlaunch.backends.k8s import options as k8s_opts
from torchlaunch.backends.slurm import sbatch
from torchlaunch.exit_codes import BadInput
from torchlaunch.launch import emit
from torchlaunch.launch.spec import JobSpec

HOSTILE = [
    "x\ntouch F #",
    "x\rtouch F #",
    "x\n---\nkind: ConfigMap\nmetadata:\n  name: evil\n",
    "x\nkind: ConfigMap",
    "x\u2028kind: ConfigMap",
    "x\x85kind: ConfigMap",
    "x\u2029---\nkind: Secret",
    'it\'s "quoted" $(touch F) `touch F` ; touch F',
    "\x1b[2Jclear",
    "trailing space \n",
    "\\n literal backslash-n",
    "- item",
    ": colon #",
    "",
]


# ---- comments and shell words -----------------------------------------------------------------


@pytest.mark.parametrize("text", HOSTILE)
def test_comment_is_one_line_whatever_the_text(text):
    line = emit.comment(f"program: {text}")
    assert line.startswith("# program:")
    assert len(line.splitlines()) == 1
    assert not any(ch in line for ch in "\n\r\x85\u2028\u2029\x1b")


def test_comment_escapes_are_unambiguous():
    assert emit.escape_line("a\nb") == "a\\nb"
    assert emit.escape_line("a\\nb") == "a\\\\nb"  # a literal backslash-n reads differently from a newline
    assert emit.escape_line("\x1b\u2028\U000e0001") == "\\x1b\\u2028\\U000e0001"
    assert emit.escape_line("héllo wörld") == "héllo wörld"  # printable text is kept as is


@pytest.mark.parametrize("call", [emit.shell_word, emit.argv_item])
def test_nul_is_refused_with_one_line(call):
    with pytest.raises(BadInput) as caught:
        call("a\0b", "program argument")
    message = str(caught.value)
    assert len(message.splitlines()) == 1
    assert "program argument 'a\\x00b'" in message and "remove it" in message


def test_argv_items_are_verbatim():
    assert emit.argv_items(["--note", "x\ntouch F #", "$(id)"]) == ["--note", "x\ntouch F #", "$(id)"]


# ---- the sbatch script --------------------------------------------------------------------------


def render_sbatch(program: list[str], cwd: str, *, escaped: bool, **params) -> str:
    """An sbatch script as submitit renders it, with the setup lines slurm.executor_parameters writes."""
    from submitit.slurm.slurm import _make_sbatch_string

    if escaped:
        setup = [
            emit.command_comment("program in every task (launch.program)", program),
            "cd " + emit.shell_word(cwd, "the submission directory"),
        ]
    else:  # by hand: how a comment must not be built
        setup = [f"# program in every task (launch.program): {shlex.join(program)}", f"cd {shlex.quote(cwd)}"]
    setup.append("printf '%s\\0' " + emit.shell_words(program) + ' > "$OUT"')
    return _make_sbatch_string(command="true", folder="/runs/x/slurm/%j", setup=setup, **params)


def run_script(script: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    """bash -n, then bash with a stub srun in PATH, from a fresh cwd; (result, that cwd)."""
    work = tmp_path / "cwd"
    work.mkdir()
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "srun").write_text("#!/bin/sh\nexit 0\n")
    (stub / "srun").chmod(0o755)
    path = tmp_path / "job.sh"
    path.write_text(script)
    syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=60)
    assert syntax.returncode == 0, syntax.stderr
    env = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}", "OUT": str(tmp_path / "argv")}
    result = subprocess.run(["bash", str(path)], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    return result, work


@pytest.mark.parametrize("value", ["a\nb", "x\ntouch F\n#", "tab\there", "\x1b[31m", "ls\u2028x"])
def test_sbatch_value_with_a_control_character_is_refused(value):
    with pytest.raises(BadInput) as caught:
        sbatch.sbatch_value(value, "--job-name")
    message = str(caught.value)
    assert len(message.splitlines()) == 1 and message.startswith("launch error: --job-name ")
    assert "single-line value" in message


@pytest.mark.parametrize("value", ["train", "my job", "a.b-c_d", 4, True])
def test_sbatch_value_carries_printable_values(value):
    assert sbatch.sbatch_value(value, "--job-name") == value


@pytest.mark.parametrize("path", ["/runs/%x", "/runs/a%%b", "/runs/100%", "/runs/a\\b", "/runs/a\nb"])
def test_sbatch_path_refuses_pattern_characters(path):
    with pytest.raises(BadInput) as caught:
        sbatch.sbatch_path(path, "--run-dir")
    assert len(str(caught.value).splitlines()) == 1
    assert "--run-dir" in str(caught.value) and "choose a run dir" in str(caught.value)


def test_sbatch_path_carries_ordinary_paths():
    assert sbatch.sbatch_path("/shared/runs/exp-1_a.b", "--run-dir") == "/shared/runs/exp-1_a.b"
    assert sbatch.sbatch_path("/shared/runs/with space", "--run-dir") == "/shared/runs/with space"


@pytest.mark.parametrize("key", ["mail-type", "--mail-user", "exclusive"])
def test_sbatch_key_accepts_option_names(key):
    assert sbatch.sbatch_key(key) == key.lstrip("-")


@pytest.mark.parametrize("key", ["mail type", "x\ny", "Mail", "a=b", "", "-"])
def test_sbatch_key_refuses_anything_else(key):
    with pytest.raises(BadInput, match="not an sbatch option name"):
        sbatch.sbatch_key(key)


@pytest.mark.parametrize("path", ["/a:b", "/a,b"])
def test_container_mount_refuses_separators(path):
    with pytest.raises(BadInput, match="container-mounts"):
        sbatch.container_mount(path, "--run-dir")


# ---- the manifests ------------------------------------------------------------------------------


def hostile_manifests(hostile: str) -> list[dict]:
    spec = JobSpec(program=("train.py", "--note", hostile), nodes=2, gpus_per_node=1, image="reg.example/t:1")
    return k8s_manifest.manifests(spec, k8s_opts.K8sOptions(name="run", cpu_only=True), "")


def header_for(argv: list[str]) -> list[str]:
    return [f"Generated by `python -m launch.k8s {shlex.join(argv)}`; do not edit, re-render."]


@pytest.mark.parametrize("hostile", HOSTILE)
def test_hostile_values_do_not_add_yaml_objects(hostile):
    objects = hostile_manifests(hostile)
    text = emit.to_yaml(objects, header_for(["--image", hostile, f"opt={hostile}", "--", "train.py", hostile]))
    loaded = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    assert [d["kind"] for d in loaded] == [o["kind"] for o in objects]
    assert loaded == objects  # every value, the pod script included, round-trips verbatim
    assert all(line.startswith("#") for line in text.split("\n---\n", 1)[0].splitlines())


def test_control_a_hand_formatted_header_adds_an_object():
    """The harness catches the attack: a header comment formatted by hand gains a ConfigMap."""
    hostile = "x\n---\napiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: evil\n#"
    objects = hostile_manifests("ok")
    header = f"# Generated by `python -m launch.k8s {shlex.join(['--', 'train.py', '--note', hostile])}`; re-render.\n"
    loaded = [doc for doc in yaml.safe_load_all(header + emit.to_yaml(objects)) if doc is not None]
    assert len(loaded) == len(objects) + 1 and loaded[0]["kind"] == "ConfigMap"
