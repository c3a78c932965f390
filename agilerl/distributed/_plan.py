"""How agilerl.distributed lays a model out over ranks, in plain Python (no torch).

One source for the rules both sides need: the runtime builds its device meshes,
its tensor-parallel splits, its expert chunks and its FSDP units from them, and
the planner (``planner.memory``) counts memory from the same ones, so a rule
changed here changes both.

- :class:`ParallelDims`: the world split into tensor-parallel, expert-parallel
  and FSDP shard groups, validated once, with the shapes of the meshes built
  from it;
- :data:`BLOCK_PLAN`: which linears of a decoder block tensor parallelism
  splits, and along which dimension (:func:`tp_dim`); :func:`tp_split_problem`:
  which head counts and widths it can split;
- :func:`expert_parallel_problem`: which expert-parallel degrees a model takes;
  :func:`expert_chunk_rows`: the rows one routed-expert chunk computes;
- :func:`fsdp_units`: the order in which ``apply_fsdp2`` wraps a model's parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "BLOCK_PLAN",
    "COLWISE",
    "EP_AXIS",
    "EXPERT_SHARD_AXIS",
    "FSDPUnit",
    "HEAD_NORMS",
    "ParallelDims",
    "ROWWISE",
    "combination_problem",
    "expert_chunk_rows",
    "expert_parallel_problem",
    "expert_row_bytes",
    "fsdp_units",
    "tp_dim",
    "tp_split_problem",
]

_MIB = 2**20

#: Axis names of the expert mesh: FSDP shards a rank's local experts over ``expert_shard``,
#: and ``ep`` splits the experts.
EXPERT_SHARD_AXIS = "expert_shard"
EP_AXIS = "ep"


def _allowed(n: int, *also: int) -> str:
    """The divisors of ``n`` that divide every one of ``also`` too, as "1, 2, 4"."""
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0 and all(a % d == 0 for a in also))


def combination_problem(*, tp: int, ep: int, shard_group_size: int | None) -> str | None:
    """Why these degrees cannot combine on any number of ranks, or None: expert parallelism
    takes neither tensor parallelism nor HSDP yet."""
    if ep > 1 and (tp > 1 or shard_group_size is not None):
        return (
            f"ep={ep} with tp > 1 or shard_group_size (HSDP) is not supported yet: use ep=1, "
            "or tp=1 and shard_group_size=None"
        )
    return None


@dataclass(frozen=True)
class ParallelDims:
    """``world`` ranks split into tensor-parallel, expert-parallel and FSDP shard groups.

    Validated when made (ValueError naming the allowed values): ``tp``, ``ep``
    and ``shard_group_size`` must each divide the ranks; with ``tp > 1`` FSDP
    shards over every data-parallel rank (``shard_group_size`` unset or
    ``world // tp``); expert parallelism combines with neither ``tp > 1`` nor
    HSDP. TP groups are consecutive ranks (``rank // tp`` is the data-parallel
    rank), and so are EP groups, so both stay inside a node when they fit in one.
    """

    world: int
    tp: int = 1
    ep: int = 1
    shard_group_size: int | None = None

    def __post_init__(self) -> None:
        world, tp, ep, group = self.world, self.tp, self.ep, self.shard_group_size
        if world < 1:
            raise ValueError(f"world size must be positive, got {world}")
        for name, value in (("tp", tp), ("ep", ep), ("shard_group_size", group)):
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be positive")
        if world % tp:
            raise ValueError(f"tp={tp} must divide the {world} ranks (allowed: {_allowed(world)})")
        if world % ep:
            raise ValueError(f"ep={ep} must divide the {world} ranks (allowed: {_allowed(world)})")
        if problem := combination_problem(tp=tp, ep=ep, shard_group_size=group):
            raise ValueError(problem)
        if group is not None:
            if tp > 1 and group != world // tp:
                raise ValueError(
                    f"tp={tp} with shard_group_size={group} (HSDP) is not supported yet: leave "
                    "shard_group_size unset with tp > 1"
                )
            if world % group:
                raise ValueError(f"shard_group_size={group} must divide the {world} ranks (allowed: {_allowed(world)})")

    @property
    def dp(self) -> int:
        """Data-parallel ranks: batch shards, one per TP group."""
        return self.world // self.tp

    @property
    def shard(self) -> int:
        """Ranks a dense parameter's FSDP shards span."""
        return self.shard_group_size or self.dp

    @property
    def replicate(self) -> int:
        """FSDP replicas (HSDP): shard groups holding the same shards."""
        return self.dp // self.shard

    @property
    def expert_shard(self) -> int:
        """Ranks a local expert's FSDP shards span (``world // ep``)."""
        return self.world // self.ep

    def fsdp_mesh(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """Shape and axis names of the dense mesh: ``(dp, tp)`` under TP, ``(replicate, shard)``
        under HSDP, else ``(shard,)``."""
        if self.tp > 1:
            return (self.dp, self.tp), ("dp", "tp")
        if self.replicate > 1:
            return (self.replicate, self.shard), ("replicate", "shard")
        return (self.world,), ("shard",)

    def expert_mesh(self) -> tuple[tuple[int, int], tuple[str, str]]:
        """Shape and axis names of the expert mesh, ``(world // ep, ep)``: ``ep`` consecutive
        ranks split the experts, and FSDP shards each rank's experts over the other axis."""
        return (self.expert_shard, self.ep), (EXPERT_SHARD_AXIS, EP_AXIS)


# -- tensor parallelism -----------------------------------------------------------------------

#: Linear layers of a dense decoder block, by path, and how tensor parallelism splits each:
#: colwise by output (weight dim 0, and the bias), rowwise by input (weight dim 1).
BLOCK_PLAN: dict[str, str] = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}
#: Norms over ``head_dim`` applied to local heads (Qwen3, Gemma 3), where present.
HEAD_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
#: The split linears' own names, by how they are split.
COLWISE = tuple(p.rsplit(".", 1)[1] for p, kind in BLOCK_PLAN.items() if kind == "colwise")
ROWWISE = tuple(p.rsplit(".", 1)[1] for p, kind in BLOCK_PLAN.items() if kind == "rowwise")


def tp_dim(tensor_name: str) -> int | None:
    """The dimension tensor parallelism splits a block tensor along, or None when it stays
    whole: 0 for a colwise linear's weight and bias, 1 for a rowwise linear's weight."""
    parts = tensor_name.split(".")
    module = parts[-2] if len(parts) >= 2 else ""
    if module in COLWISE:
        return 0
    if module in ROWWISE and parts[-1] == "weight":
        return 1
    return None


def tp_split_problem(
    tp: int, *, num_heads: int, num_kv_heads: int, intermediate_size: int | None = None, sinks: bool = False
) -> str | None:
    """Why ``tp`` ranks cannot split a block, or None: each rank must hold whole heads, whole
    GQA groups and (when a dense MLP is split, ``intermediate_size`` given) whole MLP columns;
    attention sinks (one learnt logit per head, gpt-oss) are not split."""
    if tp == 1:
        return None
    if sinks:
        return f"tp={tp} does not split attention sinks (one learnt logit per head, gpt-oss); use tp=1"
    counts = {"num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads}
    if intermediate_size is not None:
        counts["intermediate_size"] = intermediate_size
    bad = {name: n for name, n in counts.items() if n % tp}
    if not bad:
        return None
    return (
        f"tp={tp} must divide the model's head counts and MLP width so that each rank holds whole "
        f"heads and whole GQA groups; not divisible: {bad} (model has {counts}; allowed: "
        f"{_allowed(min(counts.values()), *counts.values())})"
    )


# -- expert parallelism -------------------------------------------------------------------------


def expert_parallel_problem(world: int, ep: int, expert_counts: tuple[int, ...] = ()) -> str | None:
    """Why ``ep`` cannot split the experts over ``world`` ranks, or None: it must divide the
    ranks and every MoE layer's expert count."""
    if ep < 1 or world % ep:
        return f"ep={ep} must divide the {world} ranks (allowed: {_allowed(world)})"
    odd = sorted({n for n in expert_counts if n % ep})
    if odd:
        return f"ep={ep} must divide the {odd[-1]} experts per layer (allowed: {_allowed(world, *expert_counts)})"
    return None


def expert_row_bytes(*, expert_width: int, hidden_size: int, element_size: int) -> int:
    """Bytes of the widest activation of one routed (token, expert) row: gate_up's output
    (2 x the expert width) or the hidden state, whichever is wider."""
    return max(2 * expert_width, hidden_size) * element_size


def expert_chunk_rows(*, chunk_mib: float | None, row_bytes: int) -> int | None:
    """Rows per chunk so one chunk's widest activation is at most ``chunk_mib`` MiB.

    ``row_bytes`` is the widest activation of one row; None means no chunking.
    At least one row per chunk, so a chunk may exceed a budget below one row.
    """
    if chunk_mib is None:
        return None
    return max(1, int(chunk_mib * _MIB) // row_bytes)


# -- FSDP units ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class FSDPUnit:
    """One ``fully_shard`` call of ``apply_fsdp2``: a part of the model, in forward order."""

    kind: Literal["embed", "per_layer_embed", "blocks", "head"]
    start: int = 0  # blocks: the first block; per_layer_embed: the table
    stop: int = 1  # blocks: one past the last

    @property
    def name(self) -> str:
        if self.kind == "blocks":
            return f"blocks.{self.start}"
        return {"embed": "embed", "per_layer_embed": "embed_tokens_per_layer", "head": "lm_head"}[self.kind]


def fsdp_units(
    num_blocks: int,
    wrap_every_n_blocks: int = 1,
    *,
    separate_embedding: bool = True,
    per_layer_embeddings: int = 0,
    separate_head: bool = True,
) -> tuple[FSDPUnit, ...]:
    """The FSDP units of a model in forward order, the root apart: the input embeddings
    (unless tied to the head), each per-layer embedding table (looked up right after them),
    the blocks ``wrap_every_n_blocks`` at a time, and the untied lm_head. The root holds
    the rest. ``apply_fsdp2`` skips a unit whose parameters are all kept replicated."""
    if wrap_every_n_blocks < 1:
        raise ValueError(f"wrap_every_n_blocks={wrap_every_n_blocks} must be positive")
    units = [FSDPUnit("embed")] if separate_embedding else []
    units += [FSDPUnit("per_layer_embed", i, i + 1) for i in range(per_layer_embeddings)]
    units += [
        FSDPUnit("blocks", s, min(s + wrap_every_n_blocks, num_blocks))
        for s in range(0, num_blocks, wrap_every_n_blocks)
    ]
    if separate_head:
        units.append(FSDPUnit("head"))
    return tuple(units)
