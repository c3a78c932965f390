"""FSDPConfig: settings for sharding the LLM actor with FSDP2.

This module must not import torch: the planner builds and compares thousands of
configs offline, and ``from agilerl.distributed import FSDPConfig`` is on its
fast path. A ``torch.dtype`` passed for a dtype field is recognised by its type
name and stored as its name.

Constructing an FSDPConfig needs no process group (the planner builds them on a
laptop); *applying* one (``apply_fsdp2``, an algorithm given ``fsdp_config``)
does, and says to launch with torchrun when there is none.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ._plan import ParallelDims, combination_problem

__all__ = ["FSDPConfig", "DTYPE_NAMES", "dtype_name"]

#: Dtype names accepted by ``param_dtype`` and ``reduce_dtype``, with aliases.
DTYPE_NAMES: dict[str, str] = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


def dtype_name(value: Any, field_name: str) -> str:
    """The canonical name ("bfloat16", "float16", "float32") of a torch dtype or a name in
    :data:`DTYPE_NAMES`; ValueError naming ``field_name`` otherwise."""
    if type(value).__name__ == "dtype" and type(value).__module__ == "torch":
        value = str(value)
    if not isinstance(value, str):
        raise ValueError(
            f"{field_name} must be a torch.dtype or one of {sorted(set(DTYPE_NAMES.values()))}, got {value!r}"
        )
    name = value.removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValueError(
            f"{field_name}={value!r} is not supported; allowed: {sorted(set(DTYPE_NAMES.values()))} (or a torch.dtype)"
        )
    return DTYPE_NAMES[name]


class FSDPConfig(BaseModel):
    """Settings for sharding the LLM actor with PyTorch FSDP2 (fully_shard)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    reshard_after_forward: Annotated[
        bool,
        Field(
            description="Free gathered parameters after each module's forward. "
            "False keeps them gathered: faster, more VRAM."
        ),
    ] = True
    cpu_offload: Annotated[
        bool,
        Field(
            description="Offload sharded parameters and gradients to CPU. Needs colocated "
            "vLLM. Mutually exclusive with optim_cpu_offload."
        ),
    ] = False
    optim_cpu_offload: Annotated[
        bool | None,
        Field(
            description="Keep Adam state on CPU and step it there with the default AdamW "
            "kernel. Parameters and gradients stay on GPU. False keeps Adam on GPU and steps "
            "it with fused AdamW. None picks GPU when the memory estimate fits, else CPU."
        ),
    ] = None
    defer_grad_sync: Annotated[
        bool,
        Field(
            description="Reduce-scatter gradients only on the last micro-batch of an "
            "optimizer step. Saves communication; holds unsharded grads in between."
        ),
    ] = True
    param_dtype: Annotated[
        str,
        Field(
            description="Mixed-precision parameter dtype, e.g. 'bfloat16'. A torch.dtype "
            "is accepted and stored by name."
        ),
    ] = "bfloat16"
    reduce_dtype: Annotated[
        str,
        Field(description="Dtype for gradient reduce-scatter and all-reduce."),
    ] = "float32"
    prefetch_units: Annotated[
        int,
        Field(
            ge=1,
            description="Neighbouring FSDP units to all-gather ahead during forward. "
            "1 gathers unit i+1 while unit i runs.",
        ),
    ] = 1
    backward_prefetch_units: Annotated[
        int,
        Field(
            ge=1,
            description="Neighbouring FSDP units to all-gather ahead during backward. "
            "1 gathers unit i-1 while unit i runs backward.",
        ),
    ] = 1
    checkpoint_skip_layer_types: Annotated[
        tuple[str, ...],
        Field(
            description="Transformer block kinds left out of activation checkpointing. A "
            "block's kind is its block_type (hybrid models, e.g. 'linear_attention', "
            "'full_attention', 'moe') or else its class name. Empty checkpoints every "
            "block. Applies when gradient_checkpointing is on."
        ),
    ] = ()
    checkpoint_every_n_blocks: Annotated[
        int,
        Field(
            ge=1,
            description="Checkpoint one in every n blocks not skipped by "
            "checkpoint_skip_layer_types. 1 checkpoints all of them.",
        ),
    ] = 1
    wrap_every_n_blocks: Annotated[
        int,
        Field(
            ge=1,
            description="Consecutive transformer blocks per FSDP unit. Larger values mean fewer, bigger collectives.",
        ),
    ] = 1
    param_persistence_threshold: Annotated[
        int,
        Field(
            ge=0,
            description="Parameters with fewer elements than this stay unsharded. 0 shards every parameter.",
        ),
    ] = 100000
    ep: Annotated[
        int,
        Field(
            ge=1,
            description="Expert-parallel degree: packed MoE experts per layer are split "
            "across this many GPUs. 1 keeps data parallel plus FSDP sharding with no "
            "expert split.",
        ),
    ] = 1
    ep_token_blocks: Annotated[
        int,
        Field(
            ge=1,
            description="Token blocks per routed MoE layer under expert parallel. Each "
            "block runs dispatch, experts, and combine; on GPU the next block's all-to-all "
            "overlaps this block's experts. 1 moves every token in one all-to-all.",
        ),
    ] = 1
    routed_expert_chunk_mib: Annotated[
        int | None,
        Field(
            ge=1,
            description="MiB of the widest activation of one routed-expert row chunk under "
            "expert LoRA, of one fp32 chunk of the expert-parallel combine, and of one "
            "grouped LoRA GEMM output. Bigger chunks launch fewer kernels per MoE layer; on "
            "Super-VL the learn peak grows ~0.37 GiB per GiB of chunk. None picks the "
            "largest of 64/128/256/512 the memory estimate fits.",
        ),
    ] = None
    tp: Annotated[
        int,
        Field(
            ge=1,
            description="Tensor-parallel degree for dense layers. Ranks in one TP group "
            "share a batch shard. 1 gives every rank its own batch.",
        ),
    ] = 1
    shard_group_size: Annotated[
        int | None,
        Field(
            ge=1,
            description="Ranks that shard weights between them; groups replicate (HSDP). "
            "Set to GPUs per node so weight gathers stay inside a node. None shards across "
            "all trainer ranks.",
        ),
    ] = None

    @field_validator("param_dtype", "reduce_dtype", mode="before")
    @classmethod
    def _normalise_dtype(cls, value: Any, info) -> str:
        return dtype_name(value, info.field_name)

    @field_validator("checkpoint_skip_layer_types", mode="before")
    @classmethod
    def _normalise_layer_types(cls, value: Any) -> tuple[str, ...]:
        if isinstance(value, str):
            return (value,)
        if value is None:
            return ()
        if not isinstance(value, (list, tuple, set, frozenset)) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"must be a block kind or a list of block kinds (strings), got {value!r}")
        return tuple(value)

    @model_validator(mode="after")
    def _check_combinations(self) -> FSDPConfig:
        if self.cpu_offload and self.optim_cpu_offload:
            raise ValueError(
                "cpu_offload=True and optim_cpu_offload=True cannot both be set: cpu_offload "
                "already keeps parameters, gradients and Adam state on CPU. Set "
                "optim_cpu_offload=False (or None) with cpu_offload=True, or "
                "cpu_offload=False to offload only the optimizer."
            )
        if problem := combination_problem(tp=self.tp, ep=self.ep, shard_group_size=self.shard_group_size):
            raise ValueError(problem)
        return self

    def dims(self, world_size: int) -> ParallelDims:
        """This layout on ``world_size`` ranks: its data-parallel, shard and expert groups.

        Raises ValueError unless the ranks can take it (``ParallelDims`` names the
        allowed values): the single rule for the planner and for ``apply_fsdp2``'s meshes.
        """
        return ParallelDims(world_size, tp=self.tp, ep=self.ep, shard_group_size=self.shard_group_size)

    def check_world(self, world_size: int) -> None:
        """Raise ValueError unless ``world_size`` ranks can take this layout (see :meth:`dims`)."""
        self.dims(world_size)

    # -- serialisation ---------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON/YAML-safe dict (tuples become lists)."""
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        import yaml  # on use: the planner's command line imports this module and reads no YAML here

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> FSDPConfig:
        import yaml

        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as err:
            raise ValueError(f"FSDPConfig YAML is not valid YAML: {err}") from None
        if not isinstance(data, dict):
            raise ValueError(f"FSDPConfig YAML must be a mapping of fields, got {type(data).__name__}")
        return cls.model_validate(data)

    @classmethod
    def field_descriptions(cls) -> dict[str, str]:
        """Each field's description: the single source for CLI help, manifests and the TUI."""
        return {name: f.description or "" for name, f in cls.model_fields.items()}
