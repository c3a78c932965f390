"""Rollouts: Hugging Face generate's KV cache and prefill, or a colocated vLLM engine."""

from __future__ import annotations

from ._activations import largest_forward_temps
from ._context import Context
from ._units import Layout

VLLM_NOTE = "vLLM terms are not yet validated by a measurement"


def kv_cache_bytes(ctx: Context, tokens: int) -> int:
    """K and V of every layer: 2 x n x length x kv_dim / tp x p, a sliding-window layer's
    length capped at its window."""
    n, tp, p = ctx.completions_per_rank, ctx.tp, ctx.compute_bytes
    out = 0
    for i in range(ctx.spec.num_layers):
        att = ctx.spec.block(i).attention
        length = min(tokens, att.sliding_window) if att.sliding_window else tokens
        out += 2 * n * length * att.kv_dim // tp * p
    return out


def hf_rollout_moments(ctx: Context, layout: Layout) -> tuple[dict[str, int], dict[str, int]]:
    """The two moments Hugging Face generate peaks at: the prefill of the prompts (its
    largest block's temporaries beside the prompt's cache and gen_hidden hidden states;
    logits of the last position only), and the last decode steps (the whole cache, grown
    by concatenation, so one layer's worth extra, and sampling's three logits copies)."""
    n, prompt, V = ctx.completions_per_rank, ctx.workload.prompt_tokens, ctx.vocab_size
    prefill = largest_forward_temps(ctx, layout, n, prompt)
    residual = int(ctx.coefficients.gen_hidden * n * prompt * ctx.carried_hidden * ctx.compute_bytes)
    full_kv = kv_cache_bytes(ctx, ctx.sequence_tokens)
    return (
        {"kv_cache": kv_cache_bytes(ctx, prompt), "activations": prefill + residual, "logits": n * V * 4},
        {"kv_cache": int(full_kv * (1 + 1 / max(1, ctx.spec.num_layers))), "logits": n * V * 4 * 3},
    )


def vllm_awake_bytes(ctx: Context) -> int:
    """A colocated vLLM engine awake: vllm_gpu_memory_utilization of the GPU."""
    workload = ctx.workload
    return int(workload.vllm_gpu_memory_utilization * ctx.cluster.gpu.memory_bytes) if workload.generation == "vllm" else 0


def vllm_asleep_bytes(ctx: Context) -> int:
    """A sleeping vLLM engine's residue on a GPU (vllm_sleep_residual_bytes)."""
    return ctx.coefficients.vllm_sleep_residual_bytes if ctx.workload.generation == "vllm" and ctx.on_gpu else 0


def host_vllm_weight_bytes(ctx: Context) -> int:
    """At sleep level 1 vLLM offloads its copy of the weights to the host."""
    workload = ctx.workload
    if workload.generation == "vllm" and workload.vllm_sleep_level == 1:
        return ctx.spec.total_params * ctx.weight_bytes
    return 0
