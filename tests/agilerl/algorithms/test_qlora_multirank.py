"""QLoRA data parallel on 2 gloo ranks with real bitsandbytes: the ranks agree, and the update is
LoRA's on the dequantised base (the tolerance of tests/agilerl/algorithms/test_qlora.py)."""

from __future__ import annotations

import math

import pytest

from tests._dist import DistCases
from tests.agilerl.algorithms._common import lora_state, synthetic_experiences

pytestmark = pytest.mark.qlora

cases = DistCases(__name__, nproc=2)


@cases.case
def data_parallel_qlora_ranks_agree_and_match_the_dequantised_twin(ctx):
    from agilerl.distributed import gather_objects
    from tests.agilerl.algorithms._qlora import pair

    qlora, twin = pair(micro_batch_size_per_gpu=2)
    assert qlora.data_parallel_ranks == 2 and not qlora.sharded
    start = lora_state(qlora)
    batch = synthetic_experiences(qlora, seed=3)[:3]  # each rank its own half of the completions
    a, b = qlora.learn(batch), twin.learn(batch)
    assert math.isclose(a["loss"], b["loss"], rel_tol=1e-2), (a, b)
    after, twin_after = lora_state(qlora), lora_state(twin)
    both = gather_objects([{k: v.tolist() for k, v in after.items()}])
    assert both[0] == both[1]  # gradients were all-reduced: one update on both ranks
    for k in after:
        moved = (after[k] - start[k]).abs().mean().item()
        apart = (after[k] - twin_after[k]).abs().mean().item()
        assert moved > 5e-3 and apart < 0.1 * moved, (k, moved, apart)


test_dist = cases.pytest_test()
