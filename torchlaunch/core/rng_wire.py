"""A rank's RNG states (checkpointer.capture_rng's dict) as plain JSON and back, checked on arrival.

Why: rank 0 gathers every rank's RNG states into each checkpoint. They used to cross ranks through
torch's object gather, which unpickles what a peer sends: a peer that is not the run's own rank
(a stranger seated in a live group) ran code in rank 0. JSON names no code; the shape of every field is
checked before anything is built from it, so a wrong value is one line, never a crash in set_rng_state.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import torch

MAX_STATE_BYTES = 1 << 16
"""Longest torch/CUDA generator state accepted (CPU: 5,056 bytes; a CUDA generator's: 16)."""
MT_WORDS = 624
"""numpy's MT19937 key."""
PY_WORDS = 625
"""random.getstate()'s internal tuple: the Mersenne Twister's 624 words and its position."""


class RngStateError(ValueError):
    """A peer's RNG states are not of the shape capture_rng makes."""


def _bytes_of(tensor: torch.Tensor | None) -> str | None:
    if tensor is None:
        return None
    return base64.b64encode(tensor.detach().cpu().contiguous().numpy().tobytes()).decode("ascii")


def _tensor_of(text: object, field: str, optional: bool = False) -> torch.Tensor | None:
    if text is None and optional:
        return None
    if not isinstance(text, str) or len(text) > MAX_STATE_BYTES * 4 // 3 + 4:
        raise RngStateError(f"{field}: not a generator state")
    try:
        data = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise RngStateError(f"{field}: not base64") from None
    if not data:
        raise RngStateError(f"{field}: empty")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def _words(value: object, count: int, field: str, low: int = 0, high: int = 2**32 - 1) -> list[int]:
    if not (isinstance(value, list) and len(value) == count):
        raise RngStateError(f"{field}: not {count} words")
    if not all(type(w) is int and low <= w <= high for w in value):
        raise RngStateError(f"{field}: a word out of {low}..{high}")
    return value


def _number(value: object, field: str, kinds: tuple[type, ...] = (int,)) -> Any:
    if type(value) not in kinds:
        raise RngStateError(f"{field}: not a number")
    return value


def rng_to_json(state: dict[str, Any]) -> dict[str, Any]:
    """capture_rng's dict as JSON values (generator states base64, Mersenne keys as lists of ints)."""
    name, key, pos, has_gauss, cached = state["numpy"]
    version, internal, gauss = state["python"]
    return {
        "torch": _bytes_of(state["torch"]),
        "cuda": _bytes_of(state.get("cuda")),
        "numpy": [str(name), [int(w) for w in key.tolist()], int(pos), int(has_gauss), float(cached)],
        "python": [int(version), [int(w) for w in internal], gauss],
    }


def rng_from_json(value: object) -> dict[str, Any]:
    """rng_to_json's inverse, every field checked: RngStateError naming the first that is not as
    capture_rng makes it."""
    if not (isinstance(value, dict) and set(value) == {"torch", "cuda", "numpy", "python"}):
        raise RngStateError("not the four generators' states")
    numpy_state, python_state = value["numpy"], value["python"]
    if not (isinstance(numpy_state, list) and len(numpy_state) == 5 and numpy_state[0] == "MT19937"):
        raise RngStateError("numpy: not an MT19937 state")
    if not (isinstance(python_state, list) and len(python_state) == 3):
        raise RngStateError("python: not random.getstate()")
    key = _words(numpy_state[1], MT_WORDS, "numpy")
    internal = _words(python_state[1], PY_WORDS, "python")
    gauss = python_state[2]
    if gauss is not None:
        _number(gauss, "python gauss", (float, int))
    return {
        "torch": _tensor_of(value["torch"], "torch"),
        "cuda": _tensor_of(value["cuda"], "cuda", optional=True),
        "numpy": [
            "MT19937",
            torch.tensor(key, dtype=torch.int64),
            _number(numpy_state[2], "numpy pos"),
            _number(numpy_state[3], "numpy has_gauss"),
            float(_number(numpy_state[4], "numpy cached", (float, int))),
        ],
        "python": (_number(python_state[0], "python version"), tuple(internal), gauss),
    }


def rank_news(value: object) -> tuple[dict[str, Any], str | None, str | None]:
    """What each rank sends rank 0 at a save (Checkpointer.save): [its RNG states as rng_to_json made
    them, the previous commit's failure or None, why the run dir is refused or None], checked."""
    from torchlaunch.core.dist import PeerValueError

    if not (isinstance(value, list) and len(value) == 3):
        raise PeerValueError("peer error: a rank's save news is not [rng, failure, refusal]")
    rng, previous, refused = value
    if not all(v is None or isinstance(v, str) for v in (previous, refused)):
        raise PeerValueError("peer error: a rank's save news holds a message that is not text")
    try:
        return rng_from_json(rng), previous, refused  # type: ignore[return-value]
    except RngStateError as e:
        raise PeerValueError(f"peer error: a rank's RNG states are refused ({e})") from None
