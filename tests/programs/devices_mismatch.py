"""Rank 1 fails the way Lightning does on a node with fewer devices than asked for (exit 1)."""

import os

if os.environ["RANK"] == "1":
    raise ValueError("You set devices=2 but this node has 1. HINT: Set devices=1")
print(f"rank {os.environ['RANK']} done", flush=True)
