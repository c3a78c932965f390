"""planner.memory._moe: expert chunk rows, router and expert terms."""

from __future__ import annotations

from agilerl.distributed import FSDPConfig
from planner.memory import Coefficients
from planner.memory._moe import (
    backward_transient_bytes,
    expert_chunk_rows,
    expert_forward_temps,
    merged_stack_saved_bytes,
    routed_experts,
    router_saved_per_token,
)
from planner.memory._units import build_layout

from .conftest import make_context

FP32 = dict(param_dtype="float32", reduce_dtype="float32", param_persistence_threshold=0)


def test_chunk_rows_fit_the_chunk(moe_spec):
    ctx = make_context(moe_spec, fsdp=FSDPConfig(**FP32, routed_expert_chunk_mib=1))
    # 1 MiB over max(2 x 512, 128) x 4 bytes a row.
    assert expert_chunk_rows(ctx, 10_000, 512) == 2**20 // (1024 * 4) == 256
    assert expert_chunk_rows(ctx, 100, 512) == 100
    assert expert_chunk_rows(make_context(moe_spec), 10_000, 512) == 10_000  # no chunk size: every row


def test_router_and_routed_experts(moe_spec, dense_spec):
    ctx = make_context(moe_spec, fsdp=FSDPConfig(**FP32))
    assert routed_experts(ctx, 0) == (2, 512)
    assert routed_experts(make_context(dense_spec), 0) is None
    # Its fp32 input, 8 fp32 scores and the top-2 (3 x 2 x 4 bytes).
    assert router_saved_per_token(ctx, 0) == 128 * 4 + (8 + 3 * 2) * 4


def test_hugging_face_experts_backward(moe_spec):
    ctx = make_context(moe_spec, gpus=1, weights_dtype="float32")  # unsharded: the Hugging Face experts
    layout = build_layout(ctx)
    rows, width = 2 * ctx.sequence_tokens * 2, 512
    merged_down = 8 * 128 * 512  # the merged down stack (LoRA on the stacks)
    expected = max(rows * width + Coefficients().moe_stack_grad * merged_down, 2 * rows * width - merged_down) * 4
    assert backward_transient_bytes(ctx, layout, 2, 0) == int(expected)
    assert merged_stack_saved_bytes(ctx, layout, 0) == (8 * 1024 * 128 + merged_down) * 4


def test_hugging_face_experts_forward_merges_the_stacks_only_with_an_active_adapter(moe_spec):
    ctx = make_context(moe_spec, gpus=1, weights_dtype="float32")
    layout = build_layout(ctx)
    rows = 3 * 5 * 2
    base = expert_forward_temps(ctx, layout, 3, 5, 0, adapters_on=False)
    # gate_up's output, the activation and the product (4 x width) and the gathered row (H) a row;
    # the routing: 8 fp32 logits a token, and a row's top-k choice, sorted id, permutation and
    # inverse (int64) and its weight and the weight's sorted copy (fp32)
    assert base == rows * (4 * 512 + 128) * 4 + 15 * 8 * 4 + rows * (4 * 8 + 2 * 4)
    # With the adapter PEFT merges gate_up's stack at the gate and down's at down, and both stay
    # (parametrize's cache) to the combine: at one token (2 rows) the combine beside the whole
    # merged stack, 8 experts x (1024 x 128 + 128 x 512), is the most (their size is measured below)
    one_token = expert_forward_temps(ctx, layout, 1, 1, 0, adapters_on=True)
    assert one_token == (2 * 4 * 128 + 8 * (1024 * 128 + 128 * 512)) * 4 + 8 * 4 + 2 * (4 * 8 + 2 * 4)
    assert expert_forward_temps(ctx, layout, 1, 1, 0, adapters_on=False) < one_token / 50


def test_row_wise_experts_save_no_merged_stack(moe_spec):
    ctx = make_context(moe_spec, fsdp=FSDPConfig(**FP32, routed_expert_chunk_mib=1))
    assert merged_stack_saved_bytes(ctx, build_layout(ctx), 0) == 0


def _measured_merge(dtype):
    """(bytes an active expert adapter adds to a no-grad forward of a MoE block, the layer's stack
    in elements), measured with a live-tensor tracker on PEFT's LoRA over Hugging Face's packed
    experts: what PEFT builds of the stacks for the forward."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    from agilerl.utils.tiny import tiny_config
    from planner.probe.tracking import LiveBytes

    torch.manual_seed(0)
    config = tiny_config(
        "qwen3_moe", hidden_size=128, moe_intermediate_size=512, num_experts=8, num_experts_per_tok=2,
        num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=1024,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    block = peft_model.get_base_model().model.layers[0].mlp
    x = torch.randn(3, 5, 128, dtype=dtype)
    params = {p.untyped_storage().data_ptr() for p in peft_model.parameters()}

    def peak(adapters_on: bool) -> int:
        live = LiveBytes(params)
        with torch.no_grad(), live:
            if adapters_on:
                block(x)
            else:
                with peft_model.disable_adapter():
                    block(x)
        return live.peak

    stack = sum(p.numel() for n, p in block.named_parameters() if n.endswith(("gate_up_proj", "down_proj")))
    return peak(True) - peak(False), stack


def test_the_merged_expert_stacks_of_a_forward_are_what_peft_builds(moe_spec):
    """Measured, not pinned: the estimate's extra for an active adapter on the stacks
    (expert_forward_temps with and without it) against what PEFT's forward really adds, in
    both dtypes. PEFT 0.21 folds ``W + s B A`` into one copy per stack (one stack in all);
    earlier versions built the delta beside it (8/3 of the stack)."""
    import torch

    for dtype, p in ((torch.float32, 4), (torch.bfloat16, 2)):
        measured, stack = _measured_merge(dtype)
        ctx = make_context(moe_spec, gpus=1, weights_dtype="float32" if p == 4 else "bfloat16")
        layout = build_layout(ctx)
        assert layout.expert_stack[0] == stack  # the estimate's stack is the model's
        on = expert_forward_temps(ctx, layout, 3, 5, 0, adapters_on=True)
        off = expert_forward_temps(ctx, layout, 3, 5, 0, adapters_on=False)
        assert abs((on - off) - measured) <= 0.08 * measured, (dtype, on - off, measured, stack * p)
