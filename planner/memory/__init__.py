"""estimate(spec, workload, cluster, fsdp) -> per-rank, per-phase memory by component.

Pure and fast (no torch; ~1 ms for a 70B once the spec exists). It models what
*this project's* GRPO trainer does (agilerl.algorithms.GRPO on
agilerl.distributed.apply_fsdp2), phase by phase; peak is the largest phase
(docs/accuracy.md). Every number is per rank: rank 0, which holds the
largest shards (FSDP2 gives rank i rows ``[i*ceil(d/S), (i+1)*ceil(d/S))``).

Notation (the :class:`~planner.memory._context.Context` field in brackets): ``S``
ranks share a weight shard (``shard_group_size`` or all) [shard_group], ``D``
data-parallel ranks [data_parallel_ranks], ``n = prompts x group / D`` completions
per rank [completions_per_rank], ``m`` the micro-batch [micro_batch], ``T`` prompt +
completion tokens [sequence_tokens], ``N = m T`` tokens per micro-batch
[micro_batch_tokens], ``c`` the log-prob chunk (token rows), ``V`` the vocabulary
[vocab_size], ``H`` hidden size [hidden_size], ``p`` bytes of the compute dtype (FSDP
``param_dtype``, or the weights' dtype unsharded) [compute_bytes], ``w`` bytes of the
stored weights [weight_bytes].

Every term the trainer's code allocates is counted from shapes: a block's
activations op by op (``_tape``), the log-prob workspace, weights, adapters,
optimizer state. What depends on kernels the trainer does not own (FSDP's buffers,
the experts' dispatch) or on the device (the allocator's slack, a vLLM engine's
residue) carries a coefficient from :class:`Coefficients`, fitted on one half of a
measured set and judged on the other. docs/accuracy.md has the derivations and the
measured errors.

One module per concern: the inputs resolved and validated once (``_context``), how
agilerl.distributed splits the model (``_parallel``), tensors and FSDP units
(``_units``), gathered windows (``_gathered``), weights, adapters, optimizer state and
gradients (``_static``), a block's ops (``_tape``), activations (``_activations``),
routed experts (``_moe``),
the log-prob workspace (``_logits``), generation (``_generation``), GPU-only terms
(``_overheads``), the phases (``_phases``), the entry points (``_estimate``), and a rollout
engine on a rank of its own (``_engine``: not a trainer rank's phase, a GPU of its own).
"""

from ._allocator import CachingAllocator
from ._coefficients import Coefficients
from ._context import DTYPE_BYTES, resolve_workload
from ._engine import (
    engine_completions,
    engine_rank_count,
    engine_rank_estimate,
    node_host_bytes,
    node_host_phase,
    node_ranks,
    ranks_per_node,
)
from ._estimate import (
    EXPERT_CHUNKS_MIB,
    MARGIN_FRACTION,
    estimate,
    resolve_expert_chunk,
    vllm_budget_problem,
    vllm_floor,
)
from ._parallel import (
    check_ep,
    expert_parallel_degrees,
    row_wise_experts,
    tensor_parallel_degrees,
    tp_problem,
)
from ._result import Estimate, PhaseEstimate

__all__ = [
    "CachingAllocator",
    "Coefficients",
    "Estimate",
    "PhaseEstimate",
    "estimate",
    "DTYPE_BYTES",
    "resolve_workload",
    "expert_parallel_degrees",
    "row_wise_experts",
    "tensor_parallel_degrees",
    "check_ep",
    "tp_problem",
    "resolve_expert_chunk",
    "EXPERT_CHUNKS_MIB",
    "MARGIN_FRACTION",
    "vllm_floor",
    "vllm_budget_problem",
    "engine_rank_count",
    "engine_completions",
    "engine_rank_estimate",
    "node_host_bytes",
    "node_host_phase",
    "node_ranks",
    "ranks_per_node",
]
