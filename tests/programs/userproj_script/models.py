"""This project's own `models`: a tiny MLP trained for a few DDP steps with torchlaunch.api (gloo on CPU)."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchlaunch import api

STEPS = 8


def train_a_few_steps() -> dict:
    """Train, then return what the test checks: losses, world size, backend, a weight checksum."""
    with api.setup() as ctx:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(256, 8, generator=g)
        y = (x[:, :2].sum(1) > 0).long()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        net = DistributedDataParallel(model) if ctx.world_size > 1 else model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        losses = []
        for step in range(STEPS):
            idx = torch.arange(ctx.rank, 256, ctx.world_size)[step * 8 % 128 :][:32]
            loss = nn.functional.cross_entropy(net(x[idx]), y[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        with torch.no_grad():
            full = nn.functional.cross_entropy(model(x), y).item()
        return {
            "world_size": ctx.world_size,
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "losses": losses,
            "full_loss_before_after": [_initial_loss(x, y), full],
            "checksum": float(sum(p.detach().double().sum() for p in model.parameters())),
        }


def _initial_loss(x: torch.Tensor, y: torch.Tensor) -> float:
    torch.manual_seed(0)
    fresh = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    with torch.no_grad():
        return nn.functional.cross_entropy(fresh(x), y).item()
