"""Torch-native distributed helpers for LLM training.

AgileRL is single-device by default; multi-GPU LLM training initialises
torch.distributed from the launcher's environment (torchrun, or an
orchestration layer setting the same variables), and these helpers no-op on a
single device.

``FSDPConfig`` and the layout rules of ``_plan`` (``ParallelDims``, the tensor-
parallel block plan, expert chunks, FSDP unit order) are imported eagerly and
import no torch; everything else is loaded on first access, so the planner can
import them cheaply.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agilerl.utils.lazy import lazy_names

from ._config import DTYPE_NAMES, FSDPConfig, dtype_name
from ._plan import (
    BLOCK_PLAN,
    COLWISE,
    EP_AXIS,
    EXPERT_SHARD_AXIS,
    HEAD_NORMS,
    ROWWISE,
    FSDPUnit,
    ParallelDims,
    combination_problem,
    expert_chunk_rows,
    expert_parallel_problem,
    expert_row_bytes,
    fsdp_units,
    tp_dim,
    tp_split_problem,
)

_LAZY = {
    # process group and collectives
    "init_distributed": "_runtime",
    "is_distributed": "_runtime",
    "get_rank": "_runtime",
    "get_local_rank": "_runtime",
    "get_world_size": "_runtime",
    "is_main_process": "_runtime",
    "barrier": "_runtime",
    "broadcast_object_list": "_runtime",
    "gather_tensor": "_runtime",
    "gather_objects": "_runtime",
    "allreduce_minmax_int": "_runtime",
    "aggregate_metrics_across_gpus": "_runtime",
    "aggregate_metrics_dict": "_runtime",
    "sync_grads": "_runtime",
    "all_reduce_grads": "_runtime",
    "resolve_device": "_runtime",
    "require_process_group": "_runtime",
    "use_rank_group": "_runtime",
    "group_of_ranks": "_runtime",
    "rank_group": "_runtime",
    "RankGroup": "_runtime",
    "device_mesh": "_runtime",
    # dense views of sharded parameters
    "materialize_dtensors": "_tensors",
    "gather_params": "_tensors",
    "full_shape_views": "_tensors",
    # sharding
    "apply_fsdp2": "_fsdp",
    "apply_activation_checkpointing": "_fsdp",
    "find_transformer_blocks": "_blocks",
    "block_kind": "_blocks",
    "fsdp_layout": "_fsdp",
    "expert_parallel": "_fsdp",
    "FSDPLayout": "_fsdp",
    "set_gradient_sync": "_fsdp",
    "register_forward_method": "_fsdp",
    # tensor parallelism
    "apply_tensor_parallel": "_tp",
    "build_dp_tp_mesh": "_tp",
    "tp_mesh_layout": "_tp",
    "check_tp_divides": "_tp",
    "parallel_ranks": "_tp",
    "ParallelRanks": "_tp",
    "tp_layout": "_tp",
    "TPLayout": "_tp",
    "sync_tp_rng": "_tp",
    # state dicts
    "materialize_fsdp2_from_cpu_state": "_state",
    "set_full_model_state_dict": "_state",
    "full_model_state_dict": "_state",
    "full_tensors": "_state",
    "reinit_non_persistent_buffers": "_state",
    "full_optimizer_state_dict": "_state",
    "load_full_optimizer_state_dict": "_state",
    # mixture of experts
    "model_experts_problem": "_moe",
    "moe_layout": "_moe",
    "build_expert_mesh": "_moe",
    # optimizers and clipping
    "build_optimizer": "_optim",
    "CPUOffloadAdamW": "_optim",
    "MasterWeightAdamW": "_optim",
    "clip_grad_norm_": "_optim",
    "resolve_optim_cpu_offload": "_optim",
}

__all__ = [
    "FSDPConfig",
    "DTYPE_NAMES",
    "dtype_name",
    # how a model is laid out over ranks (torch-free; the planner counts from the same rules)
    "ParallelDims",
    "combination_problem",
    "BLOCK_PLAN",
    "HEAD_NORMS",
    "COLWISE",
    "ROWWISE",
    "tp_dim",
    "tp_split_problem",
    "EP_AXIS",
    "EXPERT_SHARD_AXIS",
    "expert_parallel_problem",
    "expert_row_bytes",
    "expert_chunk_rows",
    "FSDPUnit",
    "fsdp_units",
    *_LAZY,
]


__getattr__, __dir__ = lazy_names(__name__, _LAZY, __all__)


if TYPE_CHECKING:  # pragma: no cover
    from ._blocks import block_kind, find_transformer_blocks  # noqa: F401
    from ._fsdp import (  # noqa: F401
        FSDPLayout,
        apply_activation_checkpointing,
        apply_fsdp2,
        fsdp_layout,
        set_gradient_sync,
    )
    from ._optim import (  # noqa: F401
        CPUOffloadAdamW,
        MasterWeightAdamW,
        build_optimizer,
        clip_grad_norm_,
        resolve_optim_cpu_offload,
    )
    from ._runtime import *  # noqa: F401,F403
    from ._state import (  # noqa: F401
        full_model_state_dict,
        full_optimizer_state_dict,
        load_full_optimizer_state_dict,
        materialize_fsdp2_from_cpu_state,
        reinit_non_persistent_buffers,
        set_full_model_state_dict,
    )
    from ._tensors import full_shape_views, gather_params, materialize_dtensors  # noqa: F401
