"""Tensor parallelism for dense blocks, alone (2 ranks, tp=2) and under FSDP2 (4 ranks, 2 x 2).

Every sharded run is compared with the same model trained unsharded on the
full batch in one process (``_parity.reference_run``). TP ranks of a group get
the same rows; data-parallel groups get equal slices, so the mean of their
losses is the full-batch loss.

Tolerances (all fp32): TP changes only summation order (a rowwise layer sums
``tp`` partial products over the TP group; FSDP averages over "dp"), about
1e-7 relative per op. Logits and one-step gradients are compared at atol 1e-5
(observed at most 1.3e-6, Gemma's sqrt(hidden)-scaled embeddings being the
largest). Trained weights and losses use ``_parity``'s atol 1e-5 / rtol 1e-4
(3 AdamW steps at lr 1e-3): Adam's normalisation turns rounding-level
differences of near-zero gradient entries into update differences, observed up
to 6.3e-6 for full models (Qwen3) and 1.2e-7 relative for losses. LoRA weights
use 3e-5: the r=4 bottleneck leaves more near-zero gradient entries (observed
8.3e-6). A wrong reduction is off by far more: TP-split gradients averaged over
the world instead of the dp group gave 2.6e-4.

FSDP is composed here directly with a copy of apply_fsdp2's unit layout
(embeddings, each block, lm_head, root) on ``mesh["dp"]``, because apply_fsdp2
does not call apply_tensor_parallel yet. The harness's worker runs the cases of
a module's ``cases`` object; one launch per world size is served from the
``cases`` registry below, which holds the cases of both launches.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from agilerl.distributed import (
    FSDPConfig,
    build_optimizer,
    clip_grad_norm_,
    find_transformer_blocks,
    full_model_state_dict,
    materialize_fsdp2_from_cpu_state,
)
from agilerl.distributed._tp import (
    apply_tensor_parallel,
    build_dp_tp_mesh,
    check_tp_divides,
    parallel_ranks,
    sync_tp_rng,
    tp_layout,
    tp_mesh_layout,
)
from agilerl.utils.tiny import tiny_config, tiny_model
from tests._dist import DistCases
from tests.agilerl.distributed._parity import ATOL, LOSS_RTOL, LR, batches, reference_run

two_ranks = DistCases(__name__, nproc=2)
four_ranks = DistCases(__name__, nproc=4)
cases = SimpleNamespace(cases={})  # what the rank-side worker looks up, for both launches

FP32 = dict(param_dtype="float32", reduce_dtype="float32", param_persistence_threshold=0)
GRAD_ATOL = 1e-5
LORA_ATOL = 3e-5
_MESHES: dict[int, object] = {}


def _case(launch: DistCases):
    def register(fn):
        launch.case(fn)
        cases.cases[fn.__name__] = fn
        return fn

    return register


def _mesh(tp: int = 2):
    if tp not in _MESHES:
        _MESHES[tp] = build_dp_tp_mesh(tp)
    return _MESHES[tp]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    """All-linear LoRA with a trainable "actor" and a frozen "reference" adapter.

    Random B (``init_lora_weights=False``) so that A gets a gradient from step one.
    """
    from peft import LoraConfig, get_peft_model

    from agilerl.algorithms.core.adapters import ACTOR, REFERENCE, mark_trainable

    config = LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False, task_type="CAUSAL_LM"
    )
    model = get_peft_model(model, config, adapter_name=ACTOR)
    model.add_adapter(REFERENCE, config)
    mark_trainable(model, ACTOR)
    return model


def _shard_dp(model: torch.nn.Module, dp_mesh, *, threshold: int = 0) -> list[torch.nn.Parameter]:
    """apply_fsdp2's unit layout on the dp axis; returns the params left replicated."""
    ignored = [p for p in model.parameters() if p.numel() < threshold]
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    kwargs = dict(mesh=dp_mesh, ignored_params=set(ignored) or None, mp_policy=fp32)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head.weight is embed.weight
    if not tied:
        fully_shard(embed, **kwargs)
    for block in find_transformer_blocks(model)[1]:
        fully_shard(block, **kwargs)
    if not tied:
        fully_shard(head, **kwargs)
    fully_shard(model, **kwargs)
    return ignored


def _average_over_dp(params: list[torch.nn.Parameter], dp_group) -> None:
    """What apply_fsdp2's replicated-gradient sync must do under TP: average the
    *local* gradients over the dp group only (TP shards differ per TP rank)."""
    size = dist.get_world_size(dp_group)
    for p in params:
        if p.grad is not None:
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(local, group=dp_group)
            local.div_(size)


def _my_rows(ids: torch.Tensor, mesh) -> torch.Tensor:
    ranks = parallel_ranks(mesh)
    n = ids.shape[0] // ranks.num_dp_ranks
    return ids[ranks.dp_rank * n : (ranks.dp_rank + 1) * n]


def _loss(model, ids):
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def _sharded_train(model, data, mesh, *, micro_batches=1, replicated=(), max_norm=None):
    """Train on this dp rank's rows; return losses averaged over the dp group and the full state."""
    ranks = parallel_ranks(mesh)
    opt = build_optimizer(model.parameters(), fsdp_config=FSDPConfig(**FP32), lr=LR, weight_decay=0.01)
    losses = []
    for ids in data:
        chunks = _my_rows(ids, mesh).chunk(micro_batches)
        opt.zero_grad()
        total = 0.0
        for chunk in chunks:
            loss = _loss(model, chunk) / len(chunks)
            loss.backward()
            total += loss.item()
        _average_over_dp([p for p in replicated if p.requires_grad], ranks.dp_group)
        if max_norm is not None:
            clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_norm)
        opt.step()
        t = torch.tensor([total])
        dist.all_reduce(t, group=ranks.dp_group)
        losses.append(t.item() / ranks.num_dp_ranks)
    return losses, full_model_state_dict(model)


def _assert_trained_like(model0, ref_losses, ref_state, losses, state, *, atol=ATOL):
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=LOSS_RTOL, atol=0)
    assert set(state) == set(ref_state), set(state) ^ set(ref_state)
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, atol=atol, rtol=0, msg=lambda m, k=key: f"{k}: {m}")
    start = model0.state_dict()
    moved = max((ref_state[k] - start[k]).abs().max().item() for k in start)
    assert moved > 10 * ATOL, f"weights barely moved ({moved}); the comparison would be vacuous"


def _assert_grads_like(model, ref, ids, mesh):
    """One backward on this dp rank's rows equals the unsharded full-batch gradient."""
    _loss(model, _my_rows(ids, mesh)).backward()
    _loss(ref, ids).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert set(grads) == set(ref_grads) and all(g is not None for g in grads.values())
    for name, g in grads.items():
        torch.testing.assert_close(
            _full(g), ref_grads[name], atol=GRAD_ATOL, rtol=1e-4, msg=lambda m, k=name: f"{k}: {m}"
        )
    assert max(g.abs().max().item() for g in ref_grads.values()) > 100 * GRAD_ATOL


def _assert_logits_like(model, ref, ids):
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, atol=1e-5, rtol=0)


# -- pure helpers (no process group) ---------------------------------------------------------


def test_tp_mesh_layout():
    assert tp_mesh_layout(8, 2) == (4, 2)
    assert tp_mesh_layout(4, 4) == (1, 4)
    with pytest.raises(ValueError, match=r"tp=3 must divide the 8 ranks \(allowed: 1, 2, 4, 8\)"):
        tp_mesh_layout(8, 3)
    with pytest.raises(ValueError, match="must be positive"):
        tp_mesh_layout(8, 0)


def test_check_tp_divides_names_head_counts():
    check_tp_divides(tiny_config("qwen2"), 2)  # 4 heads, 2 KV heads, 64 MLP columns
    with pytest.raises(ValueError, match=r"num_key_value_heads': 2.*num_attention_heads': 4"):
        check_tp_divides(tiny_config("qwen2"), 4)
    with pytest.raises(ValueError, match=r"not divisible: \{'num_key_value_heads': 1\}"):
        check_tp_divides(tiny_config("llama", num_kv_heads=1), 2)


# -- 2 ranks: tp=2, dp=1 ---------------------------------------------------------------------


@_case(two_ranks)
def structure_qwen2(ctx):
    mesh = _mesh()
    assert mesh.mesh_dim_names == ("dp", "tp") and tuple(mesh.shape) == (1, 2)
    model = tiny_model("qwen2")  # hidden 32, 4 heads x 8, 2 KV heads, MLP 64
    layout = apply_tensor_parallel(model, mesh["tp"])
    assert tp_layout(model) is layout
    assert len(layout.colwise) == 4 * 5 and len(layout.rowwise) == 4 * 2
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    expect = {  # name: (local shape, placement)
        "q_proj.weight": ((16, 32), Shard(0)),
        "q_proj.bias": ((16,), Shard(0)),
        "k_proj.weight": ((8, 32), Shard(0)),
        "k_proj.bias": ((8,), Shard(0)),
        "v_proj.weight": ((8, 32), Shard(0)),
        "v_proj.bias": ((8,), Shard(0)),
        "o_proj.weight": ((32, 16), Shard(1)),
    }
    for name, (shape, placement) in expect.items():
        p = attn.get_parameter(name)
        assert isinstance(p, DTensor) and p.placements == (placement,), name
        assert tuple(p.to_local().shape) == shape, (name, p.to_local().shape)
    mlp_expect = (("gate_proj", (32, 32), Shard(0)), ("up_proj", (32, 32), Shard(0)), ("down_proj", (32, 32), Shard(1)))
    for name, shape, placement in mlp_expect:
        w = getattr(mlp, name).weight
        assert w.placements == (placement,) and tuple(w.to_local().shape) == shape, name
    # q rows of rank r are heads 2r, 2r+1 of the full weight
    full_q = attn.q_proj.weight.full_tensor()
    assert torch.equal(attn.q_proj.weight.to_local(), full_q[16 * ctx.rank : 16 * (ctx.rank + 1)])
    whole = [
        model.model.embed_tokens.weight,
        model.lm_head.weight,
        model.model.norm.weight,
        model.model.layers[0].input_layernorm.weight,
    ]
    assert not any(isinstance(p, DTensor) for p in whole), "embeddings, norms, lm_head stay whole"
    assert layout.head_norms == []


@_case(two_ranks)
def structure_qwen3_head_norms(ctx):
    model = tiny_model("qwen3")
    layout = apply_tensor_parallel(model, _mesh()["tp"])
    assert layout.head_norms == [f"model.layers.{i}.self_attn.{n}" for i in range(4) for n in ("q_norm", "k_norm")]
    w = model.model.layers[0].self_attn.q_norm.weight
    assert isinstance(w, DTensor) and w.placements == (Replicate(),) and w.requires_grad
    # Each rank's gradient covers its own heads (Partial); the hook makes it whole, so
    # code reading the local gradient (replicated-gradient averaging) sees the full sum.
    ids = batches(model.config.vocab_size, steps=1)[0]
    _loss(model, ids).backward()
    assert w.grad.placements == (Replicate(),)
    ref = tiny_model("qwen3")
    _loss(ref, ids).backward()
    torch.testing.assert_close(
        w.grad.to_local(), ref.model.layers[0].self_attn.q_norm.weight.grad, atol=GRAD_ATOL, rtol=1e-4
    )


@_case(two_ranks)
def structure_lora(ctx):
    model = _lora(tiny_model("qwen2"))
    layout = apply_tensor_parallel(model, _mesh()["tp"])
    assert layout.num_lora_layers == 4 * 7
    attn = model.base_model.model.model.layers[0].self_attn
    for adapter in ("actor", "reference"):
        q, o = attn.q_proj, attn.o_proj
        # colwise base [32 -> 32 | 16 local]: B split like the output, A whole
        assert q.base_layer.weight.placements == (Shard(0),)
        assert q.lora_B[adapter].weight.placements == (Shard(0),)
        assert tuple(q.lora_B[adapter].weight.to_local().shape) == (16, 4)
        assert not isinstance(q.lora_A[adapter].weight, DTensor)
        # rowwise base [32 | 16 local -> 32]: A split like the input, B whole
        assert o.base_layer.weight.placements == (Shard(1),)
        assert o.lora_A[adapter].weight.placements == (Shard(1),)
        assert tuple(o.lora_A[adapter].weight.to_local().shape) == (4, 16)
        assert not isinstance(o.lora_B[adapter].weight, DTensor)
    assert q.lora_A["actor"].weight.requires_grad and not q.lora_A["reference"].weight.requires_grad
    assert not q.base_layer.weight.requires_grad


@_case(two_ranks)
def kv_heads_not_divisible_is_a_clear_error(ctx):
    model = tiny_model("llama", num_kv_heads=1)
    with pytest.raises(ValueError, match=r"tp=2 must divide.*'num_key_value_heads': 1"):
        apply_tensor_parallel(model, _mesh()["tp"])
    assert not any(isinstance(p, DTensor) for p in model.parameters()), "nothing split on error"


@_case(two_ranks)
def parallel_ranks_tp_only(ctx):
    ranks = parallel_ranks(_mesh())
    assert (ranks.dp_rank, ranks.num_dp_ranks, ranks.tp_rank, ranks.tp) == (0, 1, ctx.rank, 2)


def _train_parity(arch: str, *, micro_batches: int = 1, checkpointing: bool = False):
    def run(ctx):
        mesh = _mesh()
        model0 = tiny_model(arch)
        data = batches(model0.config.vocab_size)
        ref_losses, ref_state = reference_run(model0, data)
        model = copy.deepcopy(model0)
        if checkpointing:
            from agilerl.distributed import apply_activation_checkpointing

            apply_activation_checkpointing(model, FSDPConfig())
        apply_tensor_parallel(model, mesh["tp"])
        _assert_logits_like(model, model0, data[0])
        losses, state = _sharded_train(model, data, mesh, micro_batches=micro_batches)
        _assert_trained_like(model0, ref_losses, ref_state, losses, state)

    return run


for _arch, _kw in (("qwen2", {}), ("llama", {}), ("qwen3", {"micro_batches": 2}), ("llama", {"checkpointing": True})):
    _fn = _train_parity(_arch, **_kw)
    _fn.__name__ = f"tp2_train_{_arch}" + "".join(f"_{k}" for k in _kw)
    _case(two_ranks)(_fn)


def _grad_parity(arch: str, attn: str = "eager"):
    def run(ctx):
        model0 = tiny_model(arch)
        model0.set_attn_implementation(attn)
        ids = batches(model0.config.vocab_size, steps=1)[0]
        model = copy.deepcopy(model0)
        apply_tensor_parallel(model, _mesh()["tp"])
        _assert_logits_like(model, model0, ids)
        _assert_grads_like(model, model0, ids, _mesh())

    return run


# Gemma: softcapping; Gemma 3: q/k norms; SDPA: the kernel transformers picks by default;
# MoE: attention split, router and packed experts whole.
for _arch, _attn in (
    ("mistral", "eager"),
    ("gemma2", "eager"),
    ("gemma3", "eager"),
    ("qwen2", "sdpa"),
    ("qwen3_moe", "eager"),
    ("mixtral", "eager"),
):
    _fn = _grad_parity(_arch, _attn)
    _fn.__name__ = f"tp2_logits_and_grads_{_arch}_{_attn}"
    _case(two_ranks)(_fn)


def _lora_parity(arch: str):
    def run(ctx):
        from agilerl.algorithms.core.adapters import REFERENCE, use_adapter

        mesh = _mesh()
        model0 = _lora(tiny_model(arch))
        data = batches(model0.config.vocab_size)
        model = copy.deepcopy(model0)
        apply_tensor_parallel(model, mesh["tp"])
        _assert_logits_like(model, model0, data[0])
        with use_adapter(model, REFERENCE), use_adapter(model0, REFERENCE):
            _assert_logits_like(model, model0, data[0])
        _assert_grads_like(model, copy.deepcopy(model0), data[0], mesh)  # cleared by zero_grad
        ref_losses, ref_state = reference_run(model0, data)
        losses, state = _sharded_train(model, data, mesh)
        _assert_trained_like(model0, ref_losses, ref_state, losses, state, atol=LORA_ATOL)

    return run


for _arch in ("qwen2", "llama"):
    _fn = _lora_parity(_arch)
    _fn.__name__ = f"tp2_lora_two_adapters_{_arch}"
    _case(two_ranks)(_fn)


@_case(two_ranks)
def tp_ranks_sample_identical_tokens(ctx):
    model0 = tiny_model("qwen2")
    model = copy.deepcopy(model0)
    tp_mesh = _mesh()["tp"]
    apply_tensor_parallel(model, tp_mesh)
    prompt = batches(model0.config.vocab_size, steps=1, rows=2, seq=4)[0]
    greedy = model.generate(input_ids=prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(greedy, model0.generate(input_ids=prompt, max_new_tokens=6, do_sample=False, pad_token_id=0))
    torch.manual_seed(100 + ctx.rank)  # deliberately different streams ...
    sync_tp_rng(tp_mesh)  # ... made equal within the TP group
    sampled = model.generate(input_ids=prompt, max_new_tokens=6, do_sample=True, top_k=0, pad_token_id=0)
    gathered = [torch.empty_like(sampled) for _ in range(2)]
    dist.all_gather(gathered, sampled, group=tp_mesh.get_group())
    assert torch.equal(gathered[0], gathered[1])


# -- 4 ranks: dp=2 x tp=2, FSDP2 on the dp axis ---------------------------------------------


@_case(four_ranks)
def dp2_tp2_mesh_and_ranks(ctx):
    mesh = _mesh()
    assert tuple(mesh.shape) == (2, 2)
    ranks = parallel_ranks(mesh)
    assert (ranks.dp_rank, ranks.tp_rank) == (ctx.rank // 2, ctx.rank % 2)
    first = 2 * (ctx.rank // 2)
    assert dist.get_process_group_ranks(ranks.tp_group) == [first, first + 1]
    assert dist.get_process_group_ranks(ranks.dp_group) == [ctx.rank % 2, ctx.rank % 2 + 2]


@_case(four_ranks)
def dp2_tp2_fsdp_full_sharding_qwen2(ctx):
    mesh = _mesh()
    model0 = tiny_model("qwen2")
    data = batches(model0.config.vocab_size)
    ref_losses, ref_state = reference_run(model0, data)
    model = copy.deepcopy(model0)
    apply_tensor_parallel(model, mesh["tp"])
    _shard_dp(model, mesh["dp"])
    q = model.model.layers[0].self_attn.q_proj.weight  # [32, 32]: rows / 2 (tp) / 2 (dp)
    assert q.device_mesh.mesh_dim_names == ("dp", "tp") and q.placements[1] == Shard(0)
    assert tuple(q.to_local().shape) == (8, 32)
    embed = model.model.embed_tokens.weight  # whole across TP, sharded over dp
    assert embed.device_mesh.mesh_dim_names == ("dp",) and tuple(embed.to_local().shape) == (32, 32)
    losses, state = _sharded_train(model, data, mesh)
    _assert_trained_like(model0, ref_losses, ref_state, losses, state)


def _replicated_parity(arch: str):
    def run(ctx):
        # Threshold 100 keeps norms (32), Qwen2's q/k/v biases (TP-split) and Qwen3's
        # q/k norms (8, replicated DTensors) out of FSDP; clipping sees 2-D DTensors,
        # TP-only DTensors and plain tensors together.
        mesh = _mesh()
        model0 = tiny_model(arch)
        data = batches(model0.config.vocab_size)
        ref_losses, ref_state = reference_run(model0, data, max_norm=0.5)
        model = copy.deepcopy(model0)
        apply_tensor_parallel(model, mesh["tp"])
        replicated = _shard_dp(model, mesh["dp"], threshold=100)
        attn = model.model.layers[0].self_attn
        small = attn.q_proj.bias if arch == "qwen2" else attn.q_norm.weight
        assert any(p is small for p in replicated) and small.device_mesh.mesh_dim_names == ("tp",)
        losses, state = _sharded_train(model, data, mesh, replicated=replicated, max_norm=0.5)
        _assert_trained_like(model0, ref_losses, ref_state, losses, state)

    return run


for _arch in ("qwen2", "qwen3"):
    _fn = _replicated_parity(_arch)
    _fn.__name__ = f"dp2_tp2_fsdp_replicated_small_params_and_clipping_{_arch}"
    _case(four_ranks)(_fn)


@_case(four_ranks)
def dp2_tp2_fsdp_lora_qwen3(ctx):
    mesh = _mesh()
    model0 = _lora(tiny_model("qwen3"))
    data = batches(model0.config.vocab_size)
    model = copy.deepcopy(model0)
    apply_tensor_parallel(model, mesh["tp"])
    _shard_dp(model, mesh["dp"])
    _assert_grads_like(model, copy.deepcopy(model0), data[0], mesh)  # cleared by zero_grad
    ref_losses, ref_state = reference_run(model0, data)
    losses, state = _sharded_train(model, data, mesh)
    _assert_trained_like(model0, ref_losses, ref_state, losses, state, atol=LORA_ATOL)


@_case(four_ranks)
def dp2_tp2_fsdp_lora_adapters_replicated_over_dp(ctx):
    # Every LoRA matrix under the threshold stays out of FSDP, as the default
    # threshold does for a 7B model's adapters: TP-split halves (colwise B,
    # rowwise A) must be averaged over dp only, whole ones may be.
    mesh = _mesh()
    model0 = _lora(tiny_model("llama"))
    data = batches(model0.config.vocab_size)
    ref_losses, ref_state = reference_run(model0, data)
    model = copy.deepcopy(model0)
    apply_tensor_parallel(model, mesh["tp"])
    replicated = _shard_dp(model, mesh["dp"], threshold=300)
    assert {n for n, p in model.named_parameters() if p.requires_grad} <= {
        n for n, p in model.named_parameters() if any(p is r for r in replicated)
    }
    losses, state = _sharded_train(model, data, mesh, replicated=replicated)
    _assert_trained_like(model0, ref_losses, ref_state, losses, state, atol=LORA_ATOL)


@_case(four_ranks)
def dp2_tp2_apply_fsdp2_moe_with_lora_and_expert_chunks(ctx):
    """apply_fsdp2 with tp=2 on a MoE model: attention split over tp, experts run row-wise in
    1-MiB chunks under LoRA on their packed stacks, everything FSDP-sharded over dp."""
    from agilerl.distributed import apply_fsdp2, fsdp_layout

    model0 = _lora(tiny_model("qwen3_moe"))
    data = batches(model0.config.vocab_size)
    model = copy.deepcopy(model0)
    apply_fsdp2(model, FSDPConfig(**FP32, tp=2, routed_expert_chunk_mib=1))
    mesh = fsdp_layout(model).mesh
    assert fsdp_layout(model).moe is not None
    q = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert q.device_mesh.mesh_dim_names == ("dp", "tp")
    _assert_grads_like(model, copy.deepcopy(model0), data[0], mesh)  # cleared by zero_grad
    ref_losses, ref_state = reference_run(model0, data)
    losses, state = _sharded_train(model, data, mesh)
    _assert_trained_like(model0, ref_losses, ref_state, losses, state, atol=LORA_ATOL)


@_case(four_ranks)
def dp2_tp2_meta_model_materialised_from_full_state(ctx):
    mesh = _mesh()
    model0 = tiny_model("qwen3")
    with torch.device("meta"):
        model = tiny_model("qwen3")
    apply_tensor_parallel(model, mesh["tp"])
    _shard_dp(model, mesh["dp"])
    materialize_fsdp2_from_cpu_state(model, model0.state_dict(), "cpu")
    _assert_logits_like(model, model0, batches(model0.config.vocab_size, steps=1)[0])


test_tp2 = two_ranks.pytest_test()
test_dp2_tp2 = four_ranks.pytest_test()
