"""The built-in trainer's sections: what it trains (`model.*`, `optim.*`, `train.*`), its debug switches
(`debug.*`) and the one rule of `train.precision` that needs the device (fp16 on CPU).

Why beside the config and not in torchlaunch/worker/: the launchers validate these sections
(torchlaunch.config) before any rank starts, without torch and without the worker, and the worker
imports the config: a section inside worker/ would tie the two floors into a circle. The worker's
models, optimizer and trainer read these values in the rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchlaunch.base.rules import MAX_EPOCHS, MAX_STEPS, above, at_least, bound, choice, interval
from torchlaunch.exit_codes import BadInput, ConfigError

MAX_WIDTH = 8192
"""Base channel width of the built-in models."""
MAX_LR = 1e30
"""A learning rate is no machine resource: the cap keeps it a number; a diverging one is the loss
check's to report (non-finite loss, exit 2)."""
MAX_BATCH = 2**24


SIMPLE_CNN_SIZES = range(32, 40)
"""Image sides simple_cnn (torchlaunch.worker.models) takes: three 2x max-pools must leave 4x4 for its
linear classifier. Checked here, before any rank starts, not at the first forward pass."""
TORCHVISION_PREFIX = "torchvision."
"""model.name=torchvision.<name> builds torchvision's model <name>; torchlaunch.worker.models checks the
name when it builds the model (this module never imports torch)."""


@dataclass
class ModelConfig:
    name: str = field(
        default="simple_cnn",
        metadata=choice(
            ("simple_cnn", "resnet18", "fastnet", "fastnet93"), open_prefix=TORCHVISION_PREFIX, plugin=True
        ),
    )
    """`simple_cnn`, `resnet18` (CIFAR stem), `fastnet` (airbench-style fast CIFAR net whose first
    layer is a fixed patch-whitening filter computed from the training images), `fastnet93` (fastnet wider
    and deeper, a residual third conv per group: configs/fast93.yaml), or `torchvision.<name>`:
    any torchvision classification model as published, untrained, e.g. `torchvision.resnet18` (ImageNet
    stem; torchvision.models.list_models names them; model.width=0), or your own as an import path
    `pkg.module:factory`, called as factory(num_classes=N), plus width=W when model.width is set
    (imported from the run's working directory or PYTHONPATH; see examples/my_models.py)."""
    width: int = field(default=0, metadata=at_least(0, MAX_WIDTH, "use 0 for the model's default width"))
    """Base channel width (0 = the model's default)."""
    compile: bool = False
    """torch.compile the model (slow first steps; helps long GPU runs)."""
    init_from: str = ""
    """Start a fresh run from these weights: a run folder (its newest valid checkpoint, else its
    model.pt), a checkpoint folder (step-...), or a .pt file holding a state_dict or a checkpoint's
    state.pt; loaded with weights_only on CPU. Ignored (and logged) when the run resumes from its own
    checkpoint. Empty = the model's own initialisation."""
    init_strict: bool = True
    """init_from must match the model exactly (missing, unexpected or differently shaped tensors are
    exit 2). false: load what fits, keep the fresh init for the rest (e.g. a new classifier head for
    another class count) and list every skipped tensor in one block."""


@dataclass
class OptimConfig:
    name: str = field(default="sgd", metadata=choice(("sgd", "adamw")))
    """`sgd` or `adamw`."""
    lr: float = field(default=0.1, metadata=above(0, MAX_LR, "use a positive learning rate such as optim.lr=0.1"))
    """Peak learning rate for the global batch."""
    momentum: float = field(default=0.9, metadata=interval(0, 1, "[)", "e.g. optim.momentum=0.9"))
    """SGD momentum."""
    nesterov: bool = True
    """SGD Nesterov momentum."""
    weight_decay: float = field(default=5e-4, metadata=at_least(0, 10, "e.g. optim.weight_decay=5e-4"))
    """Decoupled for AdamW, L2 for SGD."""
    betas: list[float] = field(
        default_factory=lambda: [0.9, 0.999],
        metadata=bound(
            lambda v: len(v) == 2 and all(0.0 <= b < 1.0 for b in v),
            "must be two numbers in [0, 1)",
            "e.g. optim.betas=[0.9,0.999]",
        ),
    )
    """AdamW betas."""
    schedule: str = field(default="cosine", metadata=choice(("cosine", "linear", "step", "constant")))
    """`cosine`, `linear` (straight down to min_lr_ratio), `step` or `constant` after warmup."""
    warmup_epochs: float = field(default=0.0, metadata=at_least(0, MAX_EPOCHS, "use 0 for no warmup"))
    """Linear warmup length in epochs (fractions allowed)."""
    warmup_start_ratio: float = field(default=0.0, metadata=interval(0, 1, "[]", "e.g. 0.2"))
    """LR at the first warmup step as a fraction of `lr` (0 = ramp from lr/warmup_steps)."""
    norm_lr_scale: float = field(default=1.0, metadata=above(0, 1000, "use 1 for the same LR as the other weights"))
    """LR multiplier for BatchNorm parameters; their weight decay is divided by it, so the decay per step
    is unchanged (airbench's "bias scaler": BatchNorm biases learn much faster than conv weights)."""
    lookahead_every: int = field(default=0, metadata=at_least(0, MAX_STEPS, "use 0 to turn lookahead off, e.g. 5"))
    """Every N steps pull the weights toward a slow exponential average and copy it back; the run ends
    on the average (0 = off). Smooths the end of short, high-LR runs."""
    lookahead_decay: float = field(default=0.7738, metadata=interval(0, 1, "[)", "e.g. 0.7738, that is 0.95**5"))
    """Lookahead: weight of the average at the end of the run; it rises as decay * progress^3."""
    step_epochs: int = field(default=30, metadata=at_least(1, MAX_EPOCHS, "e.g. optim.step_epochs=30"))
    """`step` schedule: epochs between decays."""
    step_gamma: float = field(default=0.1, metadata=interval(0, 1, "(]", "e.g. optim.step_gamma=0.1"))
    """`step` schedule: decay factor."""
    min_lr_ratio: float = field(default=0.0, metadata=interval(0, 1, "[]", "e.g. 0.0"))
    """`cosine` schedule: final LR as a fraction of `lr`."""


@dataclass
class TrainConfig:
    epochs: int = field(default=10, metadata=at_least(1, MAX_EPOCHS, "e.g. train.epochs=10"))
    """Passes over the training set."""
    batch_size: int = field(default=256, metadata=at_least(1, MAX_BATCH, "e.g. train.batch_size=256"))
    """Global batch per optimizer step, summed over all ranks; kept on any world size from 1 to it (ranks'
    shares differ by at most one sample when the world size does not divide it)."""
    micro_batch_size: int = field(default=0, metadata=at_least(0, MAX_BATCH, "use 0 for batch_size / world size"))
    """At most this many samples per rank per forward pass (0 = the rank's whole share of the batch):
    every rank accumulates ceil(largest share / this) micro-batches per step; any value works."""
    exact: bool = False
    """The exact grid (docs/contracts.md): the model's bits do not depend on the world size nor on a
    failure, resume or regroup; fixed micro-batches of train.grid_micro_batches, summed in fixed point."""
    grid_micro_batches: int = field(default=0, metadata=at_least(0, MAX_BATCH, "use 0 for auto"))
    """train.exact: micro-batches per global step, a divisor of batch_size at least the largest world
    size (0 = the smallest divisor >= 8). Each is batch_size / this samples; train.micro_batch_size is
    not used."""
    balance: bool = True
    """train.exact: a rank found slower than the others computes fewer of the step's micro-batches
    (worker/balance.py); the model's bits do not change, only the step's time."""
    precision: str = field(default="auto", metadata=choice(("auto", "fp32", "bf16", "fp16")))
    """`fp32`, `bf16`, `fp16` (with GradScaler) or `auto` (bf16 where supported, else fp32)."""
    channels_last: bool = True
    """Use the channels_last memory format (faster convolutions with bf16)."""
    clip_grad_norm: float = field(default=0.0, metadata=at_least(0, 1e6, "use 0 to disable clipping"))
    """Clip the global gradient norm to this value (0 = off)."""
    label_smoothing: float = field(default=0.0, metadata=interval(0, 1, "[)", "e.g. 0.1"))
    """CrossEntropy label smoothing."""
    log_every_steps: int = field(default=20, metadata=at_least(1, MAX_STEPS, "e.g. train.log_every_steps=20"))
    """Progress line and metrics.jsonl record every N steps."""
    max_steps: int = field(default=0, metadata=at_least(0, MAX_STEPS, "use 0 to run all epochs"))
    """Stop after this many optimizer steps in total (0 = run all epochs)."""
    tensorboard: bool = False
    """Also write TensorBoard event files to RUN_DIR/tb (needs the tensorboard package)."""
    tta: str = field(default="none", metadata=choice(("none", "flip", "flip_translate")))
    """Test-time augmentation of the final validation: `none`, `flip` (mean of the image and its mirror)
    or `flip_translate` (also 1-pixel shifts, 6 passes). Earlier epochs validate without it."""


def fp16_on_cpu_message() -> str:
    return str(
        ConfigError(
            "train.precision",
            "fp16 on CPU is emulated, ~17x slower than bf16",
            "use train.precision=bf16, or train.precision=fp32 where bf16 is slow: "
            "`make doctor` measures both on this machine",
        )
    )


def refuse_fp16_on_cpu(precision: str, on_cpu: bool) -> None:
    """BadInput for fp16 on CPU. A rule of the config that needs the device, so it lives here: launchers
    check it before spawning and the worker at start, and neither imports the other."""
    if on_cpu and precision == "fp16":
        raise BadInput(fp16_on_cpu_message())


@dataclass
class DebugConfig:
    detect_anomaly: bool = False
    """torch.autograd anomaly detection: finds the op that made a NaN, but is slow."""
    check_model: bool = True
    """Push one fake batch through the model at start-up for clear shape/device errors."""
    trace_batches: bool = False
    """Write each rank's sample indices per step to RUN_DIR/trace/rank<r>.jsonl: an audit of the data
    order across resumes and world-size changes."""
