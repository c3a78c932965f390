"""QLoRA under FSDP2 on 4 gloo ranks: the packed NF4 weights shard four ways and training runs."""

from __future__ import annotations

import math

import pytest

from tests._dist import DistCases
from tests.agilerl.algorithms._common import synthetic_experiences

pytestmark = pytest.mark.qlora

cases = DistCases(__name__, nproc=4)


@cases.case
def fsdp2_qlora_trains_on_four_ranks(ctx):
    from agilerl.distributed import FSDPConfig
    from tests.agilerl.algorithms._common import make_agent
    from tests.agilerl.algorithms._qlora import QLORA, four_bit_layers

    agent = make_agent(
        **QLORA, batch_size=4, fsdp_config=FSDPConfig(param_dtype="bfloat16", param_persistence_threshold=0)
    )
    for layer in four_bit_layers(agent.model).values():
        assert layer.weight.to_local().shape[0] * 4 == layer.weight.shape[0]
    for seed in (1, 2):
        metrics = agent.learn(synthetic_experiences(agent, num_prompts=4, seed=seed)[:3])
        assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0


test_dist = cases.pytest_test()
