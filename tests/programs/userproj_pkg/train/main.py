"""`python -m train.main --out OUT`: trains a few DDP steps (train.helpers) and records what it imported."""

import argparse
import os
import sys

import utils  # this project's utils.py, next to the train/ package

from train import AT_START, helpers


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    trained = helpers.train_a_few_steps()
    utils.write_record(
        args.out,
        {
            "at_start": AT_START,
            "file": __file__,
            "name": __name__,
            "main_module_file": sys.modules["__main__"].__file__,
            "train_file": sys.modules["train"].__file__,
            "helpers_file": helpers.__file__,
            "utils_file": utils.__file__,
            "cwd": os.getcwd(),
            "path0": sys.path[0],
            **trained,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
