"""MoE routers, routing replay under checkpointing, and expert parallel (EP).

Single-process tests check each piece against transformers / PEFT directly.
Multi-rank cases (real gloo ranks, tests._dist) compare an EP + FSDP2 model
whose ranks each see their own rows with one unsharded model on all the rows:
logits, the loss, and every gradient (experts, routers, attention, LoRA
including the experts' LoRA), gathering what is sharded.

Composition stands in for apply_fsdp2's future EP support: apply_expert_parallel,
then fully_shard the experts on the expert mesh (gradient divide factor = world
size), then apply_fsdp2 with ep=1 for the rest (already-sharded experts are
skipped as nested FSDP units).

Tolerance: everything is fp32. The runs differ in summation order only (per-row
LoRA ``xW^T + s(xA^T)B^T`` vs PEFT's folded ``x(W + sBA)^T``, per-expert matmuls
vs transformers' grouped_mm, batch 2 vs 4 in BLAS, FSDP's reduce-scatter), each
~1e-7 relative. Measured worst absolute differences: 2.4e-7 (gradients),
1.8e-7 (logits), 4.8e-7 (a loss of ~4.1). atol 2e-6 / rtol 1e-5 leaves an ~8x
margin and still catches a misrouted token or a mis-sliced expert (>= 1e-4).
"""

from __future__ import annotations

import copy
import functools
import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from agilerl.distributed import FSDPConfig, apply_fsdp2, find_transformer_blocks, fsdp_layout
from agilerl.distributed._moe import (
    EP_AXIS,
    EXPERT_SHARD_AXIS,
    ROUTER_FORWARDS,
    ExpertShard,
    apply_expert_parallel,
    build_expert_mesh,
    check_expert_parallel,
    checkpoint_moe_block,
    expert_chunk_rows,
    expert_parameter_names,
    expert_slice,
    find_moe_layers,
    fully_shard_experts,
    gather_expert_tensor,
    install_router_forwards,
    moe_layout,
)
from tests._dist import DistCases

ATOL, RTOL = 2e-6, 1e-5
SEQ = 12
HIDDEN = 32
NUM_EXPERTS = 8
EXPERT_INTERMEDIATE = 16
_CKPT = "_checkpoint_wrapped_module."

_COMMON = dict(
    vocab_size=64,
    hidden_size=HIDDEN,
    num_attention_heads=4,
    num_experts_per_tok=2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_MLA = dict(
    kv_lora_rank=16,
    q_lora_rank=None,
    qk_rope_head_dim=4,
    qk_nope_head_dim=4,
    v_head_dim=8,
    num_key_value_heads=4,
    intermediate_size=48,
)
FAMILIES = {
    "qwen3_moe": dict(
        num_experts=NUM_EXPERTS,
        moe_intermediate_size=EXPERT_INTERMEDIATE,
        norm_topk_prob=True,
        num_key_value_heads=2,
        head_dim=8,
    ),
    "olmoe": dict(num_experts=NUM_EXPERTS, intermediate_size=EXPERT_INTERMEDIATE, num_key_value_heads=2),
    "mixtral": dict(
        num_local_experts=NUM_EXPERTS, intermediate_size=EXPERT_INTERMEDIATE, num_key_value_heads=2, head_dim=8
    ),
    # MLA attention, a dense first layer and a shared expert beside the routed ones.
    "deepseek_v2": dict(
        n_routed_experts=NUM_EXPERTS,
        moe_intermediate_size=EXPERT_INTERMEDIATE,
        n_shared_experts=1,
        first_k_dense_replace=1,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        **_MLA,
    ),
}


def tiny_config(family: str, **fields):
    from transformers import AutoConfig

    config = AutoConfig.for_model(family, **{**_COMMON, **FAMILIES.get(family, {}), **fields})
    config._attn_implementation = "eager"
    return config


def tiny_moe(family: str, *, lora: bool = False, num_layers: int = 2):
    """A tiny random fp32 MoE causal LM (eager attention), optionally with all-linear LoRA.

    LoRA factors are both random (``init_lora_weights=False``) so that every
    LoRA gradient is non-zero and the comparison is not vacuous.
    """
    from transformers import AutoModelForCausalLM

    dense_first = 1 if family == "deepseek_v2" else 0
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, num_hidden_layers=num_layers + dense_first))
    if lora:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
        model = get_peft_model(model, config)
    return model


def token_ids(rows: int, seed: int = 1234) -> torch.Tensor:
    return torch.randint(3, 64, (rows, SEQ), generator=torch.Generator().manual_seed(seed))


def _loss(model, ids):
    return model(input_ids=ids, labels=ids, use_cache=False)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n.replace(_CKPT, ""): p.grad for n, p in model.named_parameters() if p.grad is not None}


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def _routing_counts(layout) -> list[tuple[int, int]]:
    return [(r._agilerl_router_stats.selections, r._agilerl_router_stats.replays) for r in layout.routers]


# -- single process -------------------------------------------------------------------------

ROUTER_CASES = {
    "qwen3_moe": ("qwen3_moe", {}),
    "olmoe": ("olmoe", {}),
    "mixtral": ("mixtral", {}),
    "qwen2_moe": (
        "qwen2_moe",
        dict(
            num_experts=NUM_EXPERTS,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            num_key_value_heads=2,
            norm_topk_prob=True,
        ),
    ),
    "deepseek_v2_greedy": ("deepseek_v2", dict(first_k_dense_replace=0)),
    "deepseek_v2_group_limited": (
        "deepseek_v2",
        dict(first_k_dense_replace=0, n_group=4, topk_group=2, topk_method="group_limited_greedy"),
    ),
    "deepseek_v3": (
        "deepseek_v3",
        dict(
            n_routed_experts=NUM_EXPERTS,
            moe_intermediate_size=16,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=0,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            **_MLA,
        ),
    ),
}


@pytest.mark.parametrize("case", list(ROUTER_CASES))
def test_router_forwards_match_transformers(case):
    """Same experts, weights and gradients as transformers' own router forward."""
    from transformers import AutoModelForCausalLM

    family, fields = ROUTER_CASES[case]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, num_hidden_layers=1, **fields))
    router = model.model.layers[0].mlp.gate
    with torch.no_grad():
        router.weight.normal_()
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.normal_(std=0.1)
    qualname = f"{type(router).__module__}.{type(router).__qualname__}"
    patched = copy.deepcopy(router)
    patched.forward = functools.partial(ROUTER_FORWARDS[qualname], patched, indices=None)
    hidden = torch.randn(2, 5, HIDDEN, requires_grad=True)
    hidden2 = hidden.detach().clone().requires_grad_(True)
    expected, actual = router(hidden), patched(hidden2)
    torch.testing.assert_close(actual[2], expected[2], rtol=0, atol=0)  # the same experts
    torch.testing.assert_close(actual[1], expected[1], rtol=0, atol=1e-7)
    assert actual[1].dtype == expected[1].dtype
    probe = torch.randn_like(expected[1])
    (expected[1] * probe).sum().backward()
    (actual[1] * probe).sum().backward()
    torch.testing.assert_close(hidden2.grad, hidden.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(patched.weight.grad, router.weight.grad, rtol=1e-6, atol=1e-7)


def test_inplace_renorm_breaks_selective_checkpointing_but_router_forwards_do_not():
    """transformers renormalises top-k weights in place; a cached top-k output then fails."""
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    def policy(ctx, op, *args, **kwargs):
        if op is torch.ops.aten.topk.default:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    model = tiny_moe("mixtral", num_layers=1)
    block = model.model.layers[0].mlp
    hidden = torch.randn(2, 6, HIDDEN)
    expected = block(hidden)
    expected.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad()
    with pytest.raises(RuntimeError, match="mutated"):
        checkpoint(block, hidden, use_reentrant=False, context_fn=context_fn).sum().backward()
    block.zero_grad()
    install_router_forwards(model)
    out = checkpoint(block, hidden, use_reentrant=False, context_fn=context_fn)
    _close(out, expected, "output")
    out.square().sum().backward()
    for name, p in block.named_parameters():
        _close(p.grad, grads[name], name)


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "mixtral"])
def test_local_experts_match_transformers_and_peft(family):
    """ep=1 (no mesh): per-row LoRA, token blocks and chunks change nothing but rounding."""
    model = tiny_moe(family, lora=True)
    ids = token_ids(4)
    reference = copy.deepcopy(model)
    expected = _loss(reference, ids)
    expected.loss.backward()
    for blocks, chunk_mib in ((1, None), (3, 1 / 1024)):
        sharded = copy.deepcopy(model)
        layout = apply_expert_parallel(sharded, None, ep_token_blocks=blocks, routed_expert_chunk_mib=chunk_mib)
        out = _loss(sharded, ids)
        out.loss.backward()
        _close(out.logits, expected.logits, "logits")
        grads, ref = _grads(sharded), _grads(reference)
        assert set(grads) == set(ref)
        assert any(".experts." in n and "lora_" in n for n in grads)
        for name, g in ref.items():
            _close(grads[name], g, name)
        assert moe_layout(sharded) is layout
        assert all(s.num_token_blocks == blocks for s in layout.stats())
        with torch.no_grad():  # the no-grad path writes chunks into one buffer instead
            _close(sharded(input_ids=ids, use_cache=False).logits, expected.logits, "no-grad logits")
        if chunk_mib is not None:
            assert all(s.num_expert_chunks > s.num_token_blocks for s in layout.stats())


def test_disabled_adapters_are_honoured():
    """GRPO's reference pass disables the adapters: the experts must then use W alone."""
    model = tiny_moe("qwen3_moe", lora=True)
    ids = token_ids(2)
    with torch.no_grad():
        with model.disable_adapter():
            base = model(input_ids=ids, use_cache=False).logits
        adapted = model(input_ids=ids, use_cache=False).logits
        apply_expert_parallel(model, None)
        with model.disable_adapter():
            _close(model(input_ids=ids, use_cache=False).logits, base, "adapters disabled")
        _close(model(input_ids=ids, use_cache=False).logits, adapted, "adapters enabled")


@pytest.mark.parametrize("replay", [True, False])
def test_checkpointed_blocks_route_once_per_forward(replay):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = tiny_moe("qwen3_moe", lora=True)
    ids = token_ids(4)
    reference = copy.deepcopy(model)
    _loss(reference, ids).loss.backward()
    layout = apply_expert_parallel(model, None, routed_expert_chunk_mib=1 / 1024)
    container, blocks = find_transformer_blocks(model)
    for i, block in enumerate(blocks):
        container[i] = checkpoint_moe_block(block) if replay else checkpoint_wrapper(block)
    _loss(model, ids).loss.backward()
    for name, g in _grads(reference).items():
        _close(_grads(model)[name], g, name)
    # With replay the top-k runs in the forward only and the recompute reuses it.
    assert _routing_counts(layout) == ([(1, 1)] * 2 if replay else [(2, 0)] * 2)


def test_expert_slices_match_peft_per_expert_deltas():
    """Slicing A by rows and B by interleaved columns keeps PEFT's own per-expert delta."""
    from agilerl.distributed._moe import _slice_experts

    model = tiny_moe("mixtral", lora=True, num_layers=1)
    experts = find_moe_layers(model)[0].experts
    wrappers = [experts, experts.base_layer]  # down_proj, then gate_up_proj
    full_delta = {w.parameter_name: w.get_delta_weight("default").detach() for w in wrappers}
    full_ab = {
        w.parameter_name: (w.lora_A["default"].weight.detach().clone(), w.lora_B["default"].weight.detach().clone())
        for w in wrappers
    }
    _slice_experts(experts, 2, 4)
    for w in wrappers:
        name = w.parameter_name
        assert w.num_experts == 4
        _close(w.get_delta_weight("default").detach(), full_delta[name][2:6], name)
        a, b = full_ab[name]
        a_local = expert_slice(a, shard=ExpertShard("dim0", NUM_EXPERTS), first=2, num_local=4)
        b_local = expert_slice(b, shard=ExpertShard("lora_b", NUM_EXPERTS), first=2, num_local=4)
        _close(a_local, w.lora_A["default"].weight.detach(), f"{name} A")
        _close(b_local, w.lora_B["default"].weight.detach(), f"{name} B")


def test_discovery_skips_dense_layers_and_shared_experts():
    model = tiny_moe("deepseek_v2", lora=True)
    layers = find_moe_layers(model)
    assert [layer.name.split(".")[-2] for layer in layers] == ["1", "2"]  # layer 0 is dense
    assert all(type(layer.router).__name__ == "DeepseekV2TopkRouter" for layer in layers)
    names = expert_parameter_names(model)
    assert names and all(".mlp.experts." in n for n in names)
    assert not any("shared_experts" in n for n in names)


def test_chunk_rows_and_validation():
    assert expert_chunk_rows(chunk_mib=None, row_bytes=128) is None
    assert expert_chunk_rows(chunk_mib=1, row_bytes=128) == 8192
    assert expert_chunk_rows(chunk_mib=1 / 1024, row_bytes=128) == 8
    assert expert_chunk_rows(chunk_mib=1 / 2**20, row_bytes=128) == 1  # never below one row
    check_expert_parallel(world_size=8, ep=4, num_experts=128)
    with pytest.raises(ValueError, match=r"ep=3 must divide the 8 ranks \(allowed: 1, 2, 4, 8\)"):
        check_expert_parallel(world_size=8, ep=3)
    with pytest.raises(ValueError, match=r"ep=8 must divide the 60 experts per layer \(allowed: 1, 2, 4\)"):
        check_expert_parallel(world_size=8, ep=8, num_experts=60)


# -- multi-rank -----------------------------------------------------------------------------

two = DistCases(__name__, nproc=2)
four = DistCases(__name__, nproc=4)

FP32 = dict(param_dtype="float32", reduce_dtype="float32", param_persistence_threshold=0)


def shard_with_ep(model, *, ep, token_blocks=1, chunk_mib=None, checkpointing=False):
    """What apply_fsdp2 is to do for FSDPConfig(ep=...): EP, experts on their mesh, the rest."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = build_expert_mesh(ep=ep)
    layout = apply_expert_parallel(
        model, mesh[EP_AXIS], ep_token_blocks=token_blocks, routed_expert_chunk_mib=chunk_mib
    )
    if checkpointing:
        container, blocks = find_transformer_blocks(model)
        for i, block in enumerate(blocks):
            container[i] = checkpoint_moe_block(block)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    fully_shard_experts(
        model, expert_mesh=mesh[EXPERT_SHARD_AXIS], mp_policy=fp32, gradient_divide_factor=dist.get_world_size()
    )
    apply_fsdp2(model, FSDPConfig(**FP32), gradient_checkpointing=checkpointing)
    return mesh, layout


def full_grads(model, mesh, layout) -> dict[str, torch.Tensor]:
    """Every gradient in full: FSDP shards gathered, then EP slices (same order on all ranks)."""
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        shard = layout.expert_shard(name)
        if shard is not None and layout.ep > 1:
            g = gather_expert_tensor(g, shard=shard, group=mesh[EP_AXIS].get_group())
        grads[name.replace(_CKPT, "")] = g
    return grads


def ep_parity(family, *, ep, lora, rows_per_rank=2, shard=shard_with_ep, **shard_kwargs):
    """One step: the EP+FSDP2 model on this rank's rows vs the unsharded one on all rows.

    ``shard(model, ep=..., **shard_kwargs)`` shards in place and returns the
    (expert_shard, ep) mesh and the MoE layout.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_moe(family, lora=lora)
    ids = token_ids(world * rows_per_rank)
    reference = copy.deepcopy(model)
    expected = _loss(reference, ids)
    expected.loss.backward()

    sharded = copy.deepcopy(model)
    mesh, layout = shard(sharded, ep=ep, **shard_kwargs)
    mine = slice(rank * rows_per_rank, (rank + 1) * rows_per_rank)
    out = _loss(sharded, ids[mine])
    out.loss.backward()

    _close(out.logits, expected.logits[mine], "logits")
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)
    _close(loss / world, expected.loss.detach(), "loss")
    grads, ref = full_grads(sharded, mesh, layout), _grads(reference)
    assert set(grads) == set(ref), set(grads) ^ set(ref)
    for kind in (".experts.", ".gate.", ".self_attn."):
        assert any(kind in n for n in grads), f"no {kind} gradient compared"
    assert not lora or any(".experts." in n and "lora_" in n for n in grads)
    for name, g in ref.items():
        _close(grads[name], g, name)
    return sharded, mesh, layout


def _assert_experts_on_expert_mesh(model, mesh):
    for layer in find_moe_layers(model):
        for p in layer.experts.parameters():
            assert isinstance(p, DTensor) and p.device_mesh == mesh[EXPERT_SHARD_AXIS]
            assert p.placements == (Shard(0),)


def _register_family_cases(family: str) -> None:
    def full_ep2(ctx):
        model, mesh, _ = ep_parity(family, ep=2, lora=False)
        _assert_experts_on_expert_mesh(model, mesh)
        base = find_moe_layers(model)[0].base_experts
        assert base.num_experts == base.gate_up_proj.shape[0] == NUM_EXPERTS // 2

    def lora_ep2_blocks2_chunked(ctx):
        # Chunks of 3 routed rows (a row's widest activation: gate_up's 2 x 16 fp32 values, 128
        # bytes), so chunks cross expert boundaries. How many rows each block gets is the router's
        # (random weights, and LoRA on the router whose random init is PEFT's), so the count is
        # checked against the rows received: each block runs ceil(its rows / 3) chunks, at least one.
        _, _, layout = ep_parity(family, ep=2, lora=True, token_blocks=2, chunk_mib=3 * 128 / 2**20)
        for s in layout.stats():
            least = -(-s.num_rows_received // 3)
            assert s.num_token_blocks == 2 and s.num_rows_received > 6, s  # more rows than one chunk a block
            assert least <= s.num_expert_chunks <= least + 1, s
        # the second block's dispatch ran while the first block's experts computed
        assert all(s.max_blocks_in_flight == 2 for s in layout.stats())

    for fn in (full_ep2, lora_ep2_blocks2_chunked):
        fn.__name__ = f"{family}_{fn.__name__}"
        two.case(fn)


for _family in ("qwen3_moe", "olmoe", "mixtral"):
    _register_family_cases(_family)


@two.case
def mixtral_lora_ep2_blocks1(ctx):
    _, _, layout = ep_parity("mixtral", ep=2, lora=True)
    assert all(s.max_blocks_in_flight == 1 for s in layout.stats())  # one block: nothing to overlap


@two.case
def olmoe_full_ep2_blocks2_chunked(ctx):
    ep_parity("olmoe", ep=2, lora=False, token_blocks=2, chunk_mib=1 / 2048)


@two.case
def a_dispatch_that_arrives_late_is_read_only_once_it_has(ctx):
    # A slow link: every all-to-all started in the background fills its output with NaN and
    # writes the real rows only when waited for. Reading a block's rows before its dispatch is
    # done would feed NaN to the experts; parity (logits, loss, every gradient) says it never does.
    from unittest import mock

    real = dist.all_to_all_single
    late = []

    class _Late:
        def __init__(self, out, staged, work):
            self.out, self.staged, self.work = out, staged, work

        def wait(self):
            self.work.wait()
            with torch.no_grad():  # as the collective writes it: outside autograd
                self.out.copy_(self.staged)
            return True

    def slow(output, input, *args, async_op=False, **kwargs):
        if not async_op:
            return real(output, input, *args, **kwargs)
        staged = torch.empty_like(output)
        output.fill_(float("nan"))
        late.append(1)
        return _Late(output, staged, real(staged, input, *args, async_op=True, **kwargs))

    with mock.patch.object(dist, "all_to_all_single", slow):
        _, _, layout = ep_parity("qwen3_moe", ep=2, lora=True, token_blocks=3, chunk_mib=1 / 1024)
    assert late and all(s.max_blocks_in_flight == 2 for s in layout.stats())


@two.case
def deepseek_v2_shared_experts_and_dense_first_layer(ctx):
    _, _, layout = ep_parity("deepseek_v2", ep=2, lora=True, token_blocks=2)
    assert len(layout.layers) == 2  # the dense first layer is no MoE layer


@two.case
def empty_token_blocks(ctx):
    # 32 blocks for 24 tokens per rank: some blocks are empty, yet every rank
    # runs every block's all-to-alls.
    _, _, layout = ep_parity("qwen3_moe", ep=2, lora=True, token_blocks=32)
    assert all(s.num_token_blocks == 32 for s in layout.stats())
    assert all(s.max_blocks_in_flight == 2 for s in layout.stats())  # never more than the next block


@two.case
def qwen3_moe_lora_checkpointing_routes_once(ctx):
    _, _, layout = ep_parity("qwen3_moe", ep=2, lora=True, token_blocks=2, chunk_mib=1 / 1024, checkpointing=True)
    assert _routing_counts(layout) == [(1, 1)] * 2


@two.case
def mixtral_full_checkpointing_routes_once(ctx):
    _, _, layout = ep_parity("mixtral", ep=2, lora=False, checkpointing=True)
    assert _routing_counts(layout) == [(1, 1)] * 2


@two.case
def experts_zero_rows_on_one_rank(ctx):
    """All rows go to rank 0's experts: rank 1 computes nothing yet joins every collective."""
    rank = dist.get_rank()
    model = tiny_moe("qwen3_moe", lora=True, num_layers=1)
    reference = copy.deepcopy(find_moe_layers(model)[0].experts)
    layout = apply_expert_parallel(model, build_expert_mesh(ep=2)[EP_AXIS], routed_expert_chunk_mib=1 / 4096)
    experts = layout.layers[0].experts
    prefix = {id(m): n for n, m in model.named_modules()}[id(experts)]
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(2, 10, HIDDEN, generator=g)  # both ranks' tokens
    indices = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(20)]).view(2, 10, 2)
    weights = torch.rand(2, 10, 2, generator=g)
    probe = torch.randn(2, 10, HIDDEN, generator=g)

    x_ref = hidden.view(20, HIDDEN).clone().requires_grad_(True)
    y_ref = reference(x_ref, indices.view(20, 2), weights.view(20, 2))
    (y_ref * probe.view(20, HIDDEN)).sum().backward()
    x = hidden[rank].clone().requires_grad_(True)
    (experts(x, indices[rank], weights[rank]) * probe[rank]).sum().backward()

    assert (layout.stats()[0].num_rows_received == 0) == (rank == 1)
    _close(x.grad, x_ref.grad.view(2, 10, HIDDEN)[rank], "hidden grad")
    ref_params = dict(reference.named_parameters())
    for name, p in experts.named_parameters():
        if not p.requires_grad:
            continue
        assert p.grad is not None, f"{name}: every local weight must be in the graph"
        shard = layout.expert_shard(f"{prefix}.{name}")
        expected = expert_slice(ref_params[name].grad, shard=shard, first=rank * 4, num_local=4)
        _close(p.grad, expected, name)


@two.case
def chunk_count_follows_chunk_mib(ctx):
    """Structure only (no timing or memory): chunks = ceil(rows received / rows per chunk)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = token_ids(2 * world)[rank * 2 : (rank + 1) * 2]
    previous = first_logits = None
    for chunk_mib in (None, 1 / 256, 1 / 1024, 1 / 4096):
        model = tiny_moe("qwen3_moe", lora=True)
        layout = apply_expert_parallel(model, build_expert_mesh(ep=2)[EP_AXIS], routed_expert_chunk_mib=chunk_mib)
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits
        if first_logits is None:
            first_logits = logits
        _close(logits, first_logits, f"no-grad logits, chunk {chunk_mib} MiB")  # same model seed
        # A row's widest activation: gate_up's 2 * 16 fp32 values (wider than hidden 32).
        rows = expert_chunk_rows(chunk_mib=chunk_mib, row_bytes=2 * EXPERT_INTERMEDIATE * 4)
        total = 0
        for s in layout.stats():
            received = s.num_rows_received
            expected = 1 if rows is None else max(1, math.ceil(received / rows))
            assert s.num_expert_chunks == expected, (chunk_mib, s)
            total += s.num_expert_chunks
            count = torch.tensor([received])
            dist.all_reduce(count)  # each (token, expert) pair is computed exactly once
            assert count.item() == world * 2 * SEQ * 2
        assert previous is None or total > previous
        previous = total


@four.case
def ep2_with_fsdp_dp2_on_experts(ctx):
    model, mesh, _ = ep_parity("qwen3_moe", ep=2, lora=True, token_blocks=2, chunk_mib=1 / 1024)
    assert mesh.shape == (2, 2) and mesh.mesh_dim_names == (EXPERT_SHARD_AXIS, EP_AXIS)
    _assert_experts_on_expert_mesh(model, mesh)
    w = find_moe_layers(model)[0].base_experts.gate_up_proj
    assert w.shape[0] == NUM_EXPERTS // 2 and w.to_local().shape[0] == NUM_EXPERTS // 4


@four.case
def ep4_full_mixtral(ctx):
    ep_parity("mixtral", ep=4, lora=False, token_blocks=2)


@four.case
def ep2_checkpointing_olmoe(ctx):
    _, _, layout = ep_parity("olmoe", ep=2, lora=True, checkpointing=True)
    assert _routing_counts(layout) == [(1, 1)] * 2


# tests._dist_worker looks cases up by name in ``cases``; each launch runs only its own.
# -- through apply_fsdp2(FSDPConfig(ep=...)) ---------------------------------------------------
def via_apply_fsdp2(model, *, ep, checkpointing=False, **fields):
    apply_fsdp2(model, FSDPConfig(**{**FP32, **fields}, ep=ep), gradient_checkpointing=checkpointing)
    layout = fsdp_layout(model)
    return layout.expert_mesh, layout.moe


@two.case
def qwen3_lora_ep2_via_apply_fsdp2(ctx):
    model, mesh, _ = ep_parity(
        "qwen3_moe", ep=2, lora=True, shard=via_apply_fsdp2, ep_token_blocks=2, routed_expert_chunk_mib=1
    )
    assert len(fsdp_layout(model).expert_units) == 2
    for layer in find_moe_layers(model):
        assert all(
            isinstance(p, DTensor) and p.device_mesh == mesh[EXPERT_SHARD_AXIS] for p in layer.experts.parameters()
        )


@two.case
def mixtral_full_ep2_checkpointing_via_apply_fsdp2(ctx):
    _, _, layout = ep_parity("mixtral", ep=2, lora=False, shard=via_apply_fsdp2, checkpointing=True)
    assert _routing_counts(layout) == [(1, 1)] * 2


@two.case
def olmoe_lora_ep2_default_threshold_via_apply_fsdp2(ctx):
    model, _, _ = ep_parity("olmoe", ep=2, lora=True, shard=via_apply_fsdp2, param_persistence_threshold=100000)
    layout = fsdp_layout(model)
    assert layout.replicated_params and not any(".experts." in n for n in layout.replicated_names)
    assert all(isinstance(p, DTensor) for layer in find_moe_layers(model) for p in layer.experts.parameters())


@two.case
def ep1_checkpointing_routes_once_via_apply_fsdp2(ctx):
    rank = dist.get_rank()
    model = tiny_moe("qwen3_moe", lora=True)
    ids = token_ids(4)
    ref = copy.deepcopy(model)
    _loss(ref, ids).loss.backward()
    apply_fsdp2(model, FSDPConfig(**FP32), gradient_checkpointing=True)
    _loss(model, ids[rank * 2 : (rank + 1) * 2]).loss.backward()
    assert fsdp_layout(model).moe is None
    expected = _grads(ref)
    for n, p in model.named_parameters():
        if p.grad is not None:
            _close(p.grad.full_tensor(), expected[n.replace(_CKPT, "")], n)
    routers = [layer.router for layer in find_moe_layers(model)]
    assert [(r._agilerl_router_stats.selections, r._agilerl_router_stats.replays) for r in routers] == [(1, 1)] * 2


@two.case
def clipping_under_ep_uses_the_global_norm(ctx):
    from agilerl.distributed import clip_grad_norm_, gather_objects

    reference = tiny_moe("qwen3_moe", lora=True)
    model = copy.deepcopy(reference)
    ids = token_ids(4)
    _loss(reference, ids).loss.backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters() if p.grad is not None])
    via_apply_fsdp2(model, ep=2)
    _loss(model, ids[ctx.rank * 2 : (ctx.rank + 1) * 2]).loss.backward()
    norm = clip_grad_norm_(list(model.parameters()), max_norm=1e9, model=model)
    _close(norm, expected, "total norm")
    assert len(set(gather_objects([round(float(norm), 6)]))) == 1  # every rank agrees


@two.case
def state_dicts_gather_and_slice_over_the_ep_group(ctx):
    from agilerl.distributed import full_model_state_dict, set_full_model_state_dict

    reference = tiny_moe("mixtral", lora=True)
    model = copy.deepcopy(reference)
    via_apply_fsdp2(model, ep=2)
    state = full_model_state_dict(model)
    expected = reference.state_dict()
    assert set(state) == set(expected)
    for k, v in expected.items():
        torch.testing.assert_close(state[k], v, msg=lambda m, k=k: f"{k}: {m}")
    fresh = copy.deepcopy(reference)
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)  # different weights until loaded
    via_apply_fsdp2(fresh, ep=2)
    set_full_model_state_dict(fresh, expected)
    reloaded = full_model_state_dict(fresh)
    for k, v in expected.items():
        torch.testing.assert_close(reloaded[k], v, msg=lambda m, k=k: f"{k}: {m}")


@four.case
def ep2_four_ranks_via_apply_fsdp2(ctx):
    ep_parity("qwen3_moe", ep=2, lora=True, shard=via_apply_fsdp2, ep_token_blocks=2)


cases = SimpleNamespace(cases={**two.cases, **four.cases})
test_two_ranks = two.pytest_test()
test_four_ranks = four.pytest_test()
