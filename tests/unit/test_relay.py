"""torchrun's stderr relay: a worker's traceback passes through, torchrun's own report is held.

Workers and the agent share one pipe, so the relay can only tell them apart by the traceback's
exception line; these feed it the interleavings that happen."""

from __future__ import annotations

import io
import os

from torchlaunch.launch.relay import StderrRelay, is_exception_line

WORKER_TRACEBACK = [
    b"Traceback (most recent call last):\n",
    b'  File "/user/train.py", line 3, in <module>\n',
    b'    raise ValueError("HINT: Set devices=1")\n',
    b"ValueError: HINT: Set devices=1\n",
]
AGENT_REPORT = [
    b"Traceback (most recent call last):\n",
    b'  File "/venv/torch/distributed/run.py", line 9, in main\n',
    b"    raise ChildFailedError(\n",
    b"torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n",
    b"============================================================\n",
    b"torchlaunch.runner FAILED\n",
    b"============================================================\n",
]


class Sink(io.StringIO):
    """A text sink without a binary buffer: the relay decodes for it."""


def relay(chunks: list[bytes]) -> tuple[str, list[bytes]]:
    read, write = os.pipe()
    sink = Sink()
    r = StderrRelay(read, sink)
    for chunk in chunks:
        os.write(write, chunk)
    os.close(write)
    r.finish()
    return sink.getvalue(), r.held


def test_a_workers_traceback_passes_and_torchruns_report_is_held() -> None:
    agent_log = b"W1201 13:53:00.123000 42 site-packages/torch/distributed/run.py:1] agent noise\n"
    shown, held = relay([b"epoch 1\n", agent_log, *WORKER_TRACEBACK, *AGENT_REPORT])
    assert shown == "epoch 1\n" + b"".join(WORKER_TRACEBACK).decode()
    assert held == [agent_log, *AGENT_REPORT]


def test_another_ranks_lines_inside_a_traceback_are_kept_in_order() -> None:
    mixed = [*WORKER_TRACEBACK[:2], b"rank 0: step 7\n", *WORKER_TRACEBACK[2:]]
    shown, held = relay(mixed)
    assert shown == b"".join(mixed).decode() and held == []


def test_chained_tracebacks_and_a_cut_off_one_are_all_shown() -> None:
    chained = [
        *WORKER_TRACEBACK,
        b"\n",
        b"During handling of the above exception, another exception occurred:\n",
        b"\n",
        *WORKER_TRACEBACK[:3],  # the writer died before its exception line
    ]
    shown, held = relay(chained)
    assert shown == b"".join(chained).decode() and held == []


def test_progress_bars_keep_flowing_and_bytes_that_are_not_utf8_pass() -> None:
    shown, held = relay([b"50%\r", b"100%\r", b"\xff\xfe done\n"])
    assert shown == "50%\r100%\r\ufffd\ufffd done\n" and held == []


def test_exception_lines() -> None:
    assert is_exception_line(b"ValueError: x\n") and is_exception_line(b"KeyboardInterrupt\n")
    for line in (b"  File 'x'\n", b"    ^^^^\n", b"\n", b"Traceback (most recent call last):\n"):
        assert not is_exception_line(line)
    assert not is_exception_line(b"The above exception was the direct cause of the following exception:\n")
