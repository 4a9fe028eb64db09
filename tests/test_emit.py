"""User text reaches sbatch scripts, manifests and argv lists only through torchlaunch.launch.emit.

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

from tests.conftest import scanner
from torchlaunch.backends.k8s import launch as k8s
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
ROOT = Path(__file__).resolve().parents[1]


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


@pytest.mark.parametrize("text", [t for t in HOSTILE if t])
def test_shell_word_reads_back_verbatim(text, tmp_path):
    out = tmp_path / "out"
    script = f"printf '%s' {emit.shell_word(text)} > {emit.shell_word(str(out))}\n"
    subprocess.run(["bash", "-c", script], cwd=tmp_path, check=True)
    assert out.read_bytes() == text.encode()
    assert not (tmp_path / "F").exists()


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
    syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    env = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}", "OUT": str(tmp_path / "argv")}
    result = subprocess.run(["bash", str(path)], cwd=work, env=env, capture_output=True, text=True)
    return result, work


@pytest.mark.parametrize("hostile", ["x\ntouch F #", "x\rtouch F\n#", "a\n\ntouch F\n", "$(touch F)", "`touch F`"])
def test_hostile_argument_in_sbatch_script_runs_nothing(hostile, tmp_path):
    program = ["script.py", "--note", hostile]
    workdir = tmp_path / "cwd"
    script = render_sbatch(program, str(workdir), escaped=True, job_name="train")
    result, work = run_script(script, tmp_path)
    assert result.returncode == 0, result.stderr
    assert not (work / "F").exists()
    assert not (tmp_path / "F").exists()
    # and the program's arguments arrive verbatim
    assert (tmp_path / "argv").read_bytes().split(b"\0")[:-1] == [a.encode() for a in program]


def test_control_a_hand_formatted_comment_runs_the_injected_command(tmp_path):
    """The harness catches the attack: the same argument in a comment built with shlex.join runs `touch F`."""
    script = render_sbatch(["script.py", "--note", "x\ntouch F #"], str(tmp_path / "cwd"), escaped=False)
    _, work = run_script(script, tmp_path)
    assert (work / "F").exists()


def test_submission_directory_with_a_newline_is_data(tmp_path):
    odd = tmp_path / "dir\ntouch F #"
    odd.mkdir()
    script = render_sbatch(["s.py"], str(odd), escaped=True) + 'pwd > "$OUT.pwd"\n'
    result, work = run_script(script, tmp_path)
    assert result.returncode == 0, result.stderr
    assert Path(str(tmp_path / "argv") + ".pwd").read_text() == f"{odd}\n"
    assert not (work / "F").exists() and not (odd / "F").exists()


@pytest.mark.parametrize("value", ["a\nb", "x\ntouch F\n#", "tab\there", "\x1b[31m", "ls\u2028x"])
def test_sbatch_value_with_a_control_character_is_refused(value):
    with pytest.raises(BadInput) as caught:
        emit.sbatch_value(value, "--job-name")
    message = str(caught.value)
    assert len(message.splitlines()) == 1 and message.startswith("launch error: --job-name ")
    assert "single-line value" in message


@pytest.mark.parametrize("value", ["train", "my job", "a.b-c_d", 4, True])
def test_sbatch_value_carries_printable_values(value):
    assert emit.sbatch_value(value, "--job-name") == value


def test_sbatch_value_refused_before_it_splits_the_directives(tmp_path):
    """The attack itself: rendered by submitit, a job name with a newline puts a command line in the script."""
    from submitit.slurm.slurm import _make_sbatch_string

    raw = _make_sbatch_string(command="true", folder="/r/%j", job_name="x\ntouch F\n#")
    _, work = run_script(raw, tmp_path)
    assert (work / "F").exists()  # the control: unvalidated, it runs
    with pytest.raises(BadInput):
        emit.sbatch_value("x\ntouch F\n#", "--job-name")


@pytest.mark.parametrize("path", ["/runs/%x", "/runs/a%%b", "/runs/100%", "/runs/a\\b", "/runs/a\nb"])
def test_sbatch_path_refuses_pattern_characters(path):
    with pytest.raises(BadInput) as caught:
        emit.sbatch_path(path, "--run-dir")
    assert len(str(caught.value).splitlines()) == 1
    assert "--run-dir" in str(caught.value) and "choose a run dir" in str(caught.value)


def test_sbatch_path_carries_ordinary_paths():
    assert emit.sbatch_path("/shared/runs/exp-1_a.b", "--run-dir") == "/shared/runs/exp-1_a.b"
    assert emit.sbatch_path("/shared/runs/with space", "--run-dir") == "/shared/runs/with space"


@pytest.mark.parametrize("key", ["mail-type", "--mail-user", "exclusive"])
def test_sbatch_key_accepts_option_names(key):
    assert emit.sbatch_key(key) == key.lstrip("-")


@pytest.mark.parametrize("key", ["mail type", "x\ny", "Mail", "a=b", "", "-"])
def test_sbatch_key_refuses_anything_else(key):
    with pytest.raises(BadInput, match="not an sbatch option name"):
        emit.sbatch_key(key)


@pytest.mark.parametrize("path", ["/a:b", "/a,b"])
def test_container_mount_refuses_separators(path):
    with pytest.raises(BadInput, match="container-mounts"):
        emit.container_mount(path, "--run-dir")


# ---- the manifests ------------------------------------------------------------------------------


def hostile_manifests(hostile: str) -> list[dict]:
    spec = JobSpec(program=("train.py", "--note", hostile), nodes=2, gpus_per_node=1, image="reg.example/t:1")
    return k8s.manifests(spec, k8s.K8sOptions(name="run", cpu_only=True), "")


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


@pytest.mark.scanners
def test_manifest_with_hostile_values_passes_kubernetes_validate_strict(tmp_path):
    tool = scanner("kubernetes-validate")
    path = tmp_path / "job.yaml"
    objects = hostile_manifests("x\n---\nkind: ConfigMap #")
    path.write_text(emit.to_yaml(objects, header_for(["x\nkind: Secret"])))
    result = subprocess.run([str(tool), "--strict", str(path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    passed = [line for line in (result.stdout + result.stderr).splitlines() if "passed for resource" in line]
    assert len(passed) == len(objects)  # exactly the objects built, no injected one
