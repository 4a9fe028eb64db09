"""test_premove_checkpoint: the tests on the unit floor (in-process only: no process started, no network).

The rest of them, and the helpers both halves share, are in tests/integration/test_premove_checkpoint_resume.py.
"""

from __future__ import annotations

from tests.integration.test_premove_checkpoint_resume import CHECKPOINT, EXPECTED, pickled_modules
from torchlaunch.core import checkpoint as ckpt


def test_the_old_checkpoint_verifies_and_loads_as_plain_data() -> None:
    state = ckpt.load_state(CHECKPOINT, "cpu")  # checksum verified, weights_only
    assert state["progress"]["global_step"] == 4 and state["world_size"] == 1
    assert set(state["model"]) == set(EXPECTED["final_model_sha256_16"])
    modules = pickled_modules(CHECKPOINT / "state.pt")
    assert modules and all(m.split(".")[0] in ("torch", "collections", "builtins") for m in modules), modules
