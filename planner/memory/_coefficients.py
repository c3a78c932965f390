"""The kernel-dependent constants of the estimate, fitted on measured probes.

benchmarks/accuracy.py fits them on one half of its configurations and reports the
other; benchmarks/moe_memory.py fits the ``moe_*`` ones the same way.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

MIB = 2**20
GIB = 2**30


class Coefficients(BaseModel):
    """Kernel-dependent constants of the estimate (fitted; see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Bytes of activations autograd saves per token of one block, as multiples of p x width:
    act_hidden: Annotated[float, Field(description="saved per token per block, x hidden_size")] = 8.0
    act_qkv: Annotated[float, Field(description="saved per token per block, x (q + 2 kv) width")] = 2.0
    act_mlp: Annotated[float, Field(description="saved per token per block, x MLP width")] = 4.0
    act_lora: Annotated[float, Field(description="saved per token per adapted linear, x rank")] = 1.0
    act_checkpointed: Annotated[float, Field(description="saved per token per checkpointed block, x hidden_size")] = 1.0
    act_boundary: Annotated[float, Field(description="saved per token outside the blocks, x hidden_size")] = 3.0
    # Peak temporaries of one block's forward without grad, as multiples of p x width per token:
    fwd_hidden: Annotated[float, Field(description="no-grad forward temporaries, x hidden_size")] = 3.0
    fwd_mlp: Annotated[float, Field(description="no-grad forward temporaries, x MLP width")] = 3.0
    gen_hidden: Annotated[float, Field(description="generation prefill: hidden-state copies alive, x hidden_size per prompt token")] = 1.0
    # Attention scores, where a kernel materialises them (eager; SDPA's math fallback on CPU):
    attn_scores_fwd: Annotated[float, Field(description="eager attention: batch x heads x Tq x Tk score copies alive in a forward")] = 2.0
    attn_scores_saved: Annotated[float, Field(description="eager attention: score copies saved per block for backward")] = 1.0
    # Log-prob workspace: fp32 copies of a chunk's logits alive at the peak. Measured on CPU
    # with torch's MemTracker: 4 either way (chunked: the recomputed logits, their exp and two
    # gradients in backward; unchunked: one copy saved in forward, three made in backward).
    logits_copies_grad: Annotated[float, Field(description="fp32 logits copies, chunked with grad")] = 4.0
    logits_copies_unchunked: Annotated[float, Field(description="fp32 logits copies, all rows at once with grad")] = 4.0
    logits_copies_nograd: Annotated[float, Field(description="fp32 logits copies without grad")] = 2.0
    # Mixture-of-experts blocks (planner.memory._moe). Per (token, expert) row:
    moe_rows_saved: Annotated[float, Field(description="chunked / expert-parallel experts: saved per routed row, x hidden_size")] = 2.0
    moe_rows_hf: Annotated[float, Field(description="Hugging Face experts loop: saved per routed row, x hidden_size (besides act_mlp x width)")] = 2.0
    moe_chunk: Annotated[float, Field(description="one expert chunk's recompute in backward, x its counted tensors")] = 1.0
    moe_dispatch: Annotated[float, Field(description="row-wise experts: buffers in the dispatch's backward beyond the four row gradients, x routed rows of a token block x hidden (none on CPU probes)")] = 0.0
    moe_stack_grad: Annotated[float, Field(description="Hugging Face experts with LoRA on the stacks: copies of PEFT's merged down stack made in its backward (its gradient)")] = 1.0
    # FSDP2: buffers beside the backward's gathered window (fraction of the largest edge unit).
    all_gather_overlap: Annotated[float, Field(description="FSDP buffers beside the gathered window, x the largest of the embeddings, head and root units")] = 1.0
    # GPU-only terms.
    nccl_bytes: Annotated[int, Field(description="NCCL communicator buffers per rank (multi-GPU)")] = 256 * MIB
    allocator_slack_fraction: Annotated[float, Field(description="caching-allocator fragmentation, x allocated")] = 0.07
    vllm_sleep_residual_bytes: Annotated[int, Field(description="what a sleeping vLLM engine keeps on the GPU")] = 512 * MIB
    host_process_bytes: Annotated[int, Field(description="host memory of a trainer process before the model")] = 2 * GIB
