"""`allreduce_steps.py STATE_DIR STEPS`: a script under torchrun's contract whose every step is a gloo
all-reduce, checkpointed after each step by rank 0 and resumed from it, with a result that does not
depend on the world size: each step's ITEMS items are split over the ranks, each rank sums its items'
values, the all-reduce adds the ranks' sums, and the running value folds them in. So an elastic run
that lost a node and finished alone ends with exactly the value of an uninterrupted run (`expected`).
Each start is appended to STATE_DIR/starts.jsonl (rank, world, group rank, agent pid, resumed step)."""

import json
import os
import sys
import time

ITEMS = 12
MODULUS = (1 << 61) - 1


def item(step: int, i: int) -> int:
    return (step * 1_000_003 + i * 7919) % 104_729


def fold(value: int, step_sum: int) -> int:
    return (value * 31 + step_sum) % MODULUS


def expected(steps: int) -> int:
    """The final value of an uninterrupted run (any world size)."""
    value = 0
    for step in range(steps):
        value = fold(value, sum(item(step, i) for i in range(ITEMS)))
    return value


def save(path: str, record: dict) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(json.dumps(record))
    os.replace(path + ".tmp", path)


def main() -> None:
    import torch
    import torch.distributed as dist

    state_dir, steps = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    path = os.path.join(state_dir, "state.json")
    state = json.load(open(path)) if os.path.exists(path) else {"step": 0, "value": 0, "world": 0}
    with open(os.path.join(state_dir, "starts.jsonl"), "a") as starts:
        group = int(os.environ.get("GROUP_RANK", "0"))
        seen = {"rank": rank, "world": world, "group": group, "agent": os.getppid(), "step": state["step"]}
        starts.write(json.dumps(seen) + "\n")
    while state["step"] < steps:
        step = state["step"]
        mine = sum(item(step, i) for i in range(rank, ITEMS, world))
        total = torch.tensor([mine], dtype=torch.int64)
        dist.all_reduce(total)
        state = {"step": step + 1, "value": fold(state["value"], int(total.item())), "world": world}
        if rank == 0:
            save(path, state)  # the checkpoint of this step, committed before the next one starts
        time.sleep(0.1)  # one step of work
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: finished {steps} steps on {world}", flush=True)


if __name__ == "__main__":
    main()
