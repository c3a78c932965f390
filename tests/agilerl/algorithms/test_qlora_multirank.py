"""QLoRA on 2 gloo ranks with real bitsandbytes, data parallel and under FSDP2.

Data parallel: the ranks agree, and the update is LoRA's on the dequantised base
(the tolerance of tests/agilerl/algorithms/test_qlora.py). FSDP2: the packed
NF4 weights (uint8) are sharded like any tensor and each module keeps its whole
quantisation state; with the adapters off the logits equal the unsharded QLoRA
model's exactly. With them on, FSDP2 computes the adapters in ``param_dtype``
(bf16) where PEFT on one device computes them in fp32, so the update is
compared with the data-parallel one by the same mean criterion.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

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


BF16 = dict(param_dtype="bfloat16", reduce_dtype="float32", param_persistence_threshold=0)


@cases.case
def fsdp2_qlora_shards_the_packed_weights_and_matches_the_unsharded_model(ctx):
    import bitsandbytes as bnb
    from torch.distributed.tensor import DTensor

    from agilerl.distributed import FSDPConfig, gather_params
    from tests.agilerl.algorithms._common import make_agent
    from tests.agilerl.algorithms._qlora import QLORA, four_bit_layers

    dp = make_agent(**QLORA, micro_batch_size_per_gpu=2)
    sharded = make_agent(**QLORA, micro_batch_size_per_gpu=2, fsdp_config=FSDPConfig(**BF16))
    dp_layers, layers = four_bit_layers(dp.model), four_bit_layers(sharded.model)
    assert layers.keys() == dp_layers.keys() and layers
    for name, layer in layers.items():
        w = layer.weight
        assert isinstance(w, DTensor) and w.dtype == torch.uint8
        assert w.to_local().shape[0] == dp_layers[name].weight.shape[0] // 2  # half the packed rows per rank
        state = layer.quant_state  # whole on every rank
        torch.testing.assert_close(state.absmax, dp_layers[name].weight.quant_state.absmax, atol=0, rtol=0)
        with gather_params(sharded.model, [w]) as [full]:
            assert torch.equal(full, dp_layers[name].weight.data)  # the gathered bytes are the packed weight
            dequantised = bnb.functional.dequantize_4bit(full, state)
        assert torch.equal(
            dequantised, bnb.functional.dequantize_4bit(dp_layers[name].weight.data, dp_layers[name].weight.quant_state)
        )
    ids, masks, _, _ = synthetic_experiences(dp, seed=4)
    attention = dp._attention_mask(ids, masks)
    with torch.no_grad(), dp.model.disable_adapter(), sharded.model.disable_adapter():
        torch.testing.assert_close(
            sharded.token_logprobs(ids, attention), dp.token_logprobs(ids, attention), atol=0, rtol=0
        )
    start = lora_state(dp)
    for k, v in lora_state(sharded).items():
        assert torch.equal(v, start[k]), k
    batch = synthetic_experiences(dp, seed=3)[:3]
    a, b = dp.learn(batch), sharded.learn(batch)
    assert math.isclose(a["loss"], b["loss"], rel_tol=1e-2, abs_tol=1e-6) and b["grad_norm"] > 0, (a, b)
    after, dp_after = lora_state(sharded), lora_state(dp)
    # From zero-initialised B only B moves in the first step (A's gradient is B-weighted).
    moved = sum((dp_after[k] - start[k]).abs().sum().item() for k in after)
    apart = sum((after[k] - dp_after[k]).abs().sum().item() for k in after)
    assert moved > 0 and apart < 0.1 * moved, (moved, apart)
    from agilerl.distributed import full_model_state_dict

    full = full_model_state_dict(sharded.model)  # collective; the base's 4-bit weights come out packed
    for name, layer in dp_layers.items():
        key = f"base_model.model.{name}.weight"
        assert torch.equal(full[key], layer.weight.data), key
    assert all(torch.equal(full[k], v) for k, v in lora_state(sharded).items())
    out, gen_masks = sharded.get_action(["1+2=", "3+4="])
    assert out.shape[0] == 2 * sharded.group_size // 2 and gen_masks.sum() > 0


@cases.case
def fsdp2_qlora_checkpoint_loads_into_data_parallel(ctx):
    from agilerl.distributed import FSDPConfig
    from tests.agilerl.algorithms._common import make_agent
    from tests.agilerl.algorithms._qlora import QLORA

    sharded = make_agent(**QLORA, fsdp_config=FSDPConfig(**BF16))
    sharded.learn(synthetic_experiences(sharded, seed=1)[:3])
    path = ctx.shared_dir / "qlora-ckpt"
    sharded.save_checkpoint(path)
    payload = torch.load(path / "attributes.pt", weights_only=False)
    assert all(".lora_" in k for k in payload["adapters"]["actor"])  # the 4-bit base is never saved
    dp = make_agent(**QLORA, seed=9)
    dp.load_checkpoint(path)
    for k, v in lora_state(sharded).items():
        assert torch.equal(lora_state(dp)[k], v), k


@cases.case
def fsdp2_qlora_from_a_config_without_weights_is_quantised_random(ctx):
    import shutil

    from agilerl.algorithms.core.loading import resolve_model_source
    from agilerl.distributed import FSDPConfig, barrier
    from tests.agilerl.algorithms._common import TINY, make_agent
    from tests.agilerl.algorithms._qlora import QLORA, four_bit_layers

    folder = ctx.shared_dir / "config-only"
    source = resolve_model_source(TINY)  # collective: every rank
    if ctx.rank == 0:
        folder.mkdir(exist_ok=True)
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (Path(source) / name).exists():
                shutil.copy(Path(source) / name, folder / name)
    barrier()
    agent = make_agent(**QLORA, model_name=str(folder), fsdp_config=FSDPConfig(**BF16))
    layers = four_bit_layers(agent.model)
    assert layers and all(
        layer.quant_state is not None and layer.quant_state.absmax.abs().sum() > 0 for layer in layers.values()
    )
    metrics = agent.learn(synthetic_experiences(agent, seed=1)[:3])
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0


test_dist = cases.pytest_test()
