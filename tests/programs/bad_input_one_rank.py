"""Rank 1 finds bad input after the group formed; rank 0 is then waiting in a collective with it."""

import torch
import torch.distributed as dist

from torchlaunch import api

dist.init_process_group("gloo")
value = torch.ones(1)
dist.all_reduce(value)
if dist.get_rank() == 1:
    raise api.BadInput("data error: --data /nonexistent.csv: no such file (pass an existing CSV)")
dist.all_reduce(value)  # rank 0: "Connection closed by peer" once rank 1 has gone
