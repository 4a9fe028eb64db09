"""`python -m torchlaunch.launch.torchrun ARGS` = `torchrun ARGS`, leaving without interpreter teardown.

Tearing down an interpreter that has imported torch takes ~0.8 s on a 2-core box (measured: 0.04 s
with os._exit), and launch.local waits for torchrun's exit, so every run paid it after the last
worker had already finished. The agent's work is done when its main returns: its workers have
exited, their files are closed. Exit codes and the failure traceback (which launch.local's relay
holds back or prints) are the same as torchrun's.
"""

from __future__ import annotations

import os
import sys
import traceback

from torchlaunch.exit_codes import FAILURE


def main() -> int:
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main()
    except SystemExit as e:
        code = e.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)  # what the interpreter does with a message as exit code
            code = FAILURE
        return code or 0
    except KeyboardInterrupt:
        raise  # the interpreter's own exit by SIGINT
    except BaseException:  # noqa: BLE001 - the interpreter would print it and exit 1: same here
        traceback.print_exc()
        return FAILURE
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
