"""Engine ranks of their own in a fresh `torchrun` of agilerl.train: nothing made a process group
before (the multi-rank cases of test_populations_multirank share a launch, whose earlier cases
had made them).

torch names a group made by its own ranks from how many groups each process has made, so every
rank of a group must have made as many before it; in another order they wait in ``new_group``
for ever, which is how these launches hung before their first step.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "trainers, members, ranks",
    [(2, 1, 3), (1, 2, 4)],
    ids=["two trainers and an engine", "two members of a trainer and an engine"],
)
def test_a_fresh_launch_with_engine_ranks_trains(tmp_path, trainers, members, ranks):
    manifest = {
        "algorithm": {
            "name": "GRPO",
            "model_name": "tiny:qwen2?hidden_size=32&intermediate_size=64&num_layers=2",
            "group_size": 2,
            "max_output_tokens": 2,
            "dtype": "float32",
            "gradient_checkpointing": False,
        },
        "training": {
            "rollout_batch_size": 2,
            "training_gpus_per_agent": trainers,
            "rollout_engines_per_agent": 1,
            "population_size": members,
            "max_steps": 2,
        },
        "lora": {"r": 2, "alpha": 4},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(manifest))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        "-m",
        "agilerl.train",
        str(tmp_path / "run.yaml"),
        "--device",
        "cpu",
    ]
    try:
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, start_new_session=True)
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"the launch hung: {(err.stdout or b'')[-2000:]!r}") from None
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-3000:]
    assert log.count("served 2 rollouts") == members, log[-3000:]
