"""test_emit_shell_words: the tests on the integration floor (they start processes on this machine: launchers, torchrun, subprocesses, loopback).

The rest of them, and the helpers both halves share, are in tests/unit/test_emit.py.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.unit.test_emit import HOSTILE, render_sbatch, run_script
from torchlaunch.backends.slurm import sbatch
from torchlaunch.exit_codes import BadInput
from torchlaunch.launch import emit


@pytest.mark.parametrize("text", [t for t in HOSTILE if t])
def test_shell_word_reads_back_verbatim(text, tmp_path):
    out = tmp_path / "out"
    script = f"printf '%s' {emit.shell_word(text)} > {emit.shell_word(str(out))}\n"
    subprocess.run(["bash", "-c", script], cwd=tmp_path, check=True)
    assert out.read_bytes() == text.encode()
    assert not (tmp_path / "F").exists()


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


def test_sbatch_value_refused_before_it_splits_the_directives(tmp_path):
    """The attack itself: rendered by submitit, a job name with a newline puts a command line in the script."""
    from submitit.slurm.slurm import _make_sbatch_string

    raw = _make_sbatch_string(command="true", folder="/r/%j", job_name="x\ntouch F\n#")
    _, work = run_script(raw, tmp_path)
    assert (work / "F").exists()  # the control: unvalidated, it runs
    with pytest.raises(BadInput):
        sbatch.sbatch_value("x\ntouch F\n#", "--job-name")
