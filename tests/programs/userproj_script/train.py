"""A user's project as nanoGPT lays it out: `train.py` next to its own `models.py` and `utils.py`.

    python -m launch.local --gpus 2 --device cpu -- train.py --out OUT

Its first statement records what the process had imported before any line of this project ran; each rank
then trains a few DDP steps and writes OUT/rank{RANK}.json (utils.write_record)."""

import sys

AT_START = {n: getattr(m, "__file__", None) for n, m in list(sys.modules.items())}
"""Every module this process had imported before this project's first line: name -> file."""

import argparse  # noqa: E402 - after the record, on purpose
import os  # noqa: E402

import models  # noqa: E402 - this project's models.py, not anything of the launcher's
import utils  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import train as itself  # this very file, imported by its module name

    trained = models.train_a_few_steps()
    utils.write_record(
        args.out,
        {
            "at_start": AT_START,
            "file": __file__,
            "train_file": itself.__file__,
            "models_file": models.__file__,
            "utils_file": utils.__file__,
            "cwd": os.getcwd(),
            "path0": sys.path[0],
            **trained,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
