"""What the maths cannot see: units, prefetch lists, collective counts, optimizer
placement, block selection for checkpointing, and memory (torch's FSDPMemTracker)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from agilerl.distributed import (
    CPUOffloadAdamW,
    FSDPConfig,
    apply_fsdp2,
    block_kind,
    build_optimizer,
    fsdp_layout,
    set_gradient_sync,
)
from agilerl.utils.tiny import tiny_model
from tests._dist import DistCases, count_calls

cases = DistCases(__name__, nproc=2)

FP32 = dict(param_dtype="float32", reduce_dtype="float32", param_persistence_threshold=0)


def _sharded(config: FSDPConfig, arch: str = "qwen2", gradient_checkpointing: bool = False, **kw):
    model = tiny_model(arch, **kw)
    apply_fsdp2(model, config, gradient_checkpointing=gradient_checkpointing)
    return model


@cases.case
def unit_count_and_names(ctx):
    layout = fsdp_layout(_sharded(FSDPConfig(**FP32), num_layers=4))
    assert layout.unit_names == [
        "model.embed_tokens",
        "model.layers.0",
        "model.layers.1",
        "model.layers.2",
        "model.layers.3",
        "lm_head",
    ]
    layout = fsdp_layout(_sharded(FSDPConfig(**FP32, wrap_every_n_blocks=3), num_layers=4))
    assert layout.unit_names == ["model.embed_tokens", "model.layers.0", "model.layers.3", "lm_head"]
    model = _sharded(FSDPConfig(**FP32, wrap_every_n_blocks=2), num_layers=4)
    # Blocks 0 and 1 share one FSDP state (one all-gather for both).
    assert model.model.layers[0]._get_fsdp_state() is model.model.layers[1]._get_fsdp_state()
    assert model.model.layers[1]._get_fsdp_state() is not model.model.layers[2]._get_fsdp_state()


@cases.case
def tied_embeddings_stay_in_root(ctx):
    model = _sharded(FSDPConfig(**FP32), arch="qwen2", tie_word_embeddings=True)
    layout = fsdp_layout(model)
    assert layout.unit_names == [f"model.layers.{i}" for i in range(4)]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert isinstance(model.lm_head.weight, DTensor)


@cases.case
def the_root_stays_gathered_from_its_forward_to_its_backward(ctx):
    # reshard_after_forward=True reshards every unit but the root (FSDP2's own default for a root):
    # the backward needs it at once, and the trainer's chunked head reads the tied lm_head there
    # without gathering it again.
    model = _sharded(FSDPConfig(**FP32, reshard_after_forward=True), arch="qwen2", tie_word_embeddings=True)
    ids = torch.randint(3, 60, (2, 8))
    out = model(input_ids=ids, labels=ids)
    assert not isinstance(model.lm_head.weight, DTensor)  # the root's gathered copy
    assert isinstance(model.model.layers[0].mlp.up_proj.weight, DTensor)  # a block: resharded
    # the head read again after the forward, as the trainer's chunked head does: a plain tensor
    extra = torch.nn.functional.linear(out.logits.new_ones(1, model.config.hidden_size), model.lm_head.weight)
    (out.loss + 0.0 * extra.sum()).backward()
    assert isinstance(model.lm_head.weight, DTensor)  # resharded after its backward
    with torch.no_grad():
        model(input_ids=ids)
    assert not isinstance(model.lm_head.weight, DTensor)  # kept until the next backward
    # a checkpoint taken meanwhile still sees the shards
    assert all(isinstance(v, DTensor) for v in model.state_dict().values())


@cases.case
def prefetch_lists(ctx):
    model = _sharded(FSDPConfig(**FP32, prefetch_units=2, backward_prefetch_units=1), num_layers=4)
    layout = fsdp_layout(model)
    states = [u._get_fsdp_state() for u in layout.units]
    index = {id(s): i for i, s in enumerate(states)}
    fwd = [[index[id(s)] for s in st._states_to_forward_prefetch] for st in states]
    bwd = [[index[id(s)] for s in st._states_to_backward_prefetch] for st in states]
    assert fwd == [[1, 2], [2, 3], [3, 4], [4, 5], [5], []]
    assert bwd == [[], [0], [1], [2], [3], [4]]
    model = _sharded(FSDPConfig(**FP32, prefetch_units=1, backward_prefetch_units=3), num_layers=4)
    states = [u._get_fsdp_state() for u in fsdp_layout(model).units]
    index = {id(s): i for i, s in enumerate(states)}
    assert [index[id(s)] for s in states[4]._states_to_backward_prefetch] == [3, 2, 1]
    assert [index[id(s)] for s in states[0]._states_to_forward_prefetch] == [1]


def _count_reduce_scatters(model, micro_batches: int, defer: bool) -> int:
    with count_calls(dist, "reduce_scatter_single", "reduce_scatter_tensor") as calls:
        ids = torch.randint(3, 60, (2 * micro_batches, 8))
        for i, chunk in enumerate(ids.chunk(micro_batches)):
            if defer:
                set_gradient_sync(model, i == micro_batches - 1)
            model(input_ids=chunk, labels=chunk).loss.backward()
    return calls.n


@cases.case
def reduce_scatters_per_step_with_and_without_defer(ctx):
    config = FSDPConfig(**FP32, defer_grad_sync=True)
    model = _sharded(config, num_layers=4)
    num_units = len(fsdp_layout(model).units) + 1  # + root (final norm)
    deferred = _count_reduce_scatters(model, micro_batches=2, defer=True)
    model = _sharded(config.model_copy(update={"defer_grad_sync": False}), num_layers=4)
    eager = _count_reduce_scatters(model, micro_batches=2, defer=False)
    assert deferred == num_units, (deferred, num_units)
    assert eager == 2 * num_units, (eager, num_units)


@cases.case
def optimizer_placement_and_kernel(ctx):
    model = _sharded(FSDPConfig(**FP32, optim_cpu_offload=False))
    opt = build_optimizer(model.parameters(), fsdp_config=fsdp_layout(model).config, lr=1e-3)
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["fused"] is True
    model(input_ids=torch.randint(3, 60, (2, 8)), labels=torch.randint(3, 60, (2, 8))).loss.backward()
    opt.step()
    states = [v for s in opt.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    assert states and all(isinstance(v, DTensor) for v in states)  # beside the shards

    config = FSDPConfig(**FP32, optim_cpu_offload=True)
    model = _sharded(config)
    opt = build_optimizer(model.parameters(), fsdp_config=config, lr=1e-3)
    assert isinstance(opt, CPUOffloadAdamW)
    model(input_ids=torch.randint(3, 60, (2, 8)), labels=torch.randint(3, 60, (2, 8))).loss.backward()
    opt.step()
    inner = [v for s in opt.inner.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    assert inner and all(v.device.type == "cpu" and not isinstance(v, DTensor) for v in inner)
    assert not opt.inner.defaults.get("fused") and not opt.inner.defaults.get("foreach")
    local_elems = sum(p.to_local().numel() for p in model.parameters())
    assert sum(v.numel() for v in inner) == 2 * local_elems  # moments of this rank's shards only
    assert not opt.state  # nothing on the device side
    # None resolves to the device without the planner.
    assert isinstance(build_optimizer(model.parameters(), fsdp_config=FSDPConfig(**FP32), lr=1e-3), torch.optim.AdamW)


def _peak(model, opt, ids):
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    tracker = FSDPMemTracker(model, opt)
    tracker.track_inputs((ids,))
    with tracker:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad()
    snap = tracker.get_tracker_snapshot("peak")
    dev = next(iter(snap))
    return snap[dev]


@cases.case
def reshard_off_holds_more_unsharded_params(ctx):
    # Parameter-dominated: wide layers, short sequences, checkpointing on.
    kw = dict(hidden_size=128, intermediate_size=512, num_layers=4, vocab_size=64)
    ids = torch.randint(3, 60, (1, 4))
    peaks = {}
    for reshard in (True, False):
        config = FSDPConfig(**FP32, reshard_after_forward=reshard)
        model = _sharded(config, gradient_checkpointing=True, **kw)
        opt = build_optimizer(model.parameters(), fsdp_config=config, lr=1e-3)
        _peak(model, opt, ids)  # warm-up: lazy init, optimizer state
        peaks[reshard] = _peak(model, opt, ids)
    on, off = peaks[True], peaks[False]
    assert off["Unsharded Param"] > 2 * on["Unsharded Param"], (on, off)
    assert off["Total"] > on["Total"], (on, off)


@cases.case
def checkpoint_block_selection(ctx):
    from agilerl.distributed import apply_activation_checkpointing

    model = tiny_model("qwen2", num_layers=6)
    config = FSDPConfig(checkpoint_every_n_blocks=2)
    assert apply_activation_checkpointing(model, config) == [0, 2, 4]
    assert block_kind(model.model.layers[0]) == "Qwen2DecoderLayer"
    model = tiny_model("qwen2", num_layers=4)
    # Give two blocks a hybrid kind: skipped by block_type, not class name.
    for i in (1, 3):
        model.model.layers[i].block_type = "linear_attention"
    chosen = apply_activation_checkpointing(model, FSDPConfig(checkpoint_skip_layer_types=("linear_attention",)))
    assert chosen == [0, 2]
    # transformers 5 hybrid models name their blocks' kind in layer_type.
    model = tiny_model("qwen2", num_layers=4)
    for i, kind in enumerate(["linear_attention", "linear_attention", "linear_attention", "full_attention"]):
        model.model.layers[i].layer_type = kind
    assert [block_kind(b) for b in model.model.layers] == ["linear_attention"] * 3 + ["full_attention"]
    chosen = apply_activation_checkpointing(
        model, FSDPConfig(checkpoint_skip_layer_types=("full_attention",), checkpoint_every_n_blocks=2)
    )
    assert chosen == [0, 2]
    model = tiny_model("qwen2", num_layers=4)
    with pytest.raises(ValueError, match="Qwen2DecoderLayer"):
        apply_activation_checkpointing(model, FSDPConfig(checkpoint_skip_layer_types=("moe",)))
    # Checkpointing does not change the state-dict keys (one on-disk layout).
    plain = tiny_model("qwen2", num_layers=4)
    wrapped = copy.deepcopy(plain)
    apply_activation_checkpointing(wrapped, FSDPConfig())
    assert list(plain.state_dict()) == list(wrapped.state_dict())


@cases.case
def errors_name_fields(ctx):
    model = tiny_model("qwen2")
    with pytest.raises(ValueError, match="shard_group_size=3"):
        apply_fsdp2(model, FSDPConfig(shard_group_size=3))
    with pytest.raises(ValueError, match="ep=2 needs packed MoE experts"):
        apply_fsdp2(tiny_model("qwen2"), FSDPConfig(ep=2))
    with pytest.raises(ValueError, match="shard_group_size"):
        apply_fsdp2(tiny_model("qwen2"), FSDPConfig(tp=2, shard_group_size=2))


@cases.case
def bf16_compute_with_fp32_lora_like_replicated_weights(ctx):
    # A replicated fp32 weight next to a sharded bf16 one in the same block runs.
    config = FSDPConfig(param_dtype="bfloat16", param_persistence_threshold=100)
    model = _sharded(config)
    out = model(input_ids=torch.randint(3, 60, (2, 8))).logits
    assert out.dtype == torch.bfloat16 or out.dtype == torch.float32
    bias = model.model.layers[0].self_attn.q_proj.bias
    assert not isinstance(bias, DTensor) and bias.dtype == torch.float32


test_dist = cases.pytest_test()
