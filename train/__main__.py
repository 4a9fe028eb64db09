"""`python -m train --config PATH [key=value ...]`: the command users type for one built-in rank.

A thin command module: the code is torchlaunch.worker, and nothing inside torchlaunch imports this
package (a user's own `train` must never collide with the project's)."""

from torchlaunch.launch import deps

deps.run_module("torchlaunch.worker", "train", deps.TRAINING)
