"""test_plugins_on_slurm: the tests on the engines floor (they need an engine: the Slurm cluster, dockerd or the scanners).

The rest of them, and the helpers both halves share, are in tests/integration/test_plugins_runs.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engines.test_slurm_cluster import Launch, cluster, trained_steps  # noqa: F401 - cluster is a fixture
from tests.helpers import final_state
from tests.integration.test_plugins_runs import SMALL


@pytest.mark.slurm
@pytest.mark.timeout(400)
@pytest.mark.usefixtures("cluster")
def test_plugin_on_the_slurm_cluster(tmp_path: Path) -> None:
    """submitit runs the worker in-process in each task, from the submission directory: the plug-ins
    import there as they do under torchrun."""
    run_dir = tmp_path / "slurm-plugin"
    launch = Launch(
        run_dir, "--nodes", "1", "--tasks-per-node", "2", "--time", "10", "--config", "configs/smoke.yaml", *SMALL
    )
    assert launch.finish(300) == 0, launch.text()[-3000:]
    assert (run_dir / "model.pt").is_file() and trained_steps(run_dir) == 16
    assert "starting examples.my_models:tiny_cnn on 2 x cpu" in launch.rank0_log()
    assert final_state(run_dir)["plugins"]["data"]["name"] == "examples.my_data:color_blobs"
