"""ModelSpec: what a model is made of, read off a meta-device model.

Building a spec imports torch, transformers and peft and instantiates the model
on the meta device (no memory, ~0.6 s for a 70B). Using one does not: a spec is
plain data, cached on disk keyed by the config and the transformers and peft
versions, and shipped precomputed for catalog models, so a warm plan never
imports torch.

LoRA coverage is read by applying PEFT itself to the meta model (rank 1), not
re-derived by hand: a LoRA on a linear ``in -> out`` has ``r * (in + out)``
parameters (A: ``r x in``, B: ``out x r``), so rank 1 gives every shape.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

__all__ = [
    "AttentionSpec",
    "MlpSpec",
    "BlockSpec",
    "ModelSpec",
    "build_spec",
    "spec_cache_dir",
    "config_digest",
    "SPEC_SCHEMA_VERSION",
    "DEFAULT_LORA_TARGETS",
]

SPEC_SCHEMA_VERSION = 1
#: LoRA target specs precomputed in every spec.
DEFAULT_LORA_TARGETS = ("all-linear",)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class AttentionSpec(_Frozen):
    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_dim: int  # width of the query projection output
    kv_dim: int  # width of each of the key / value caches per token
    sliding_window: int | None = None


class MlpSpec(_Frozen):
    kind: str  # "dense" or "moe"
    intermediate_size: int  # dense MLP width, or one routed expert's width for MoE
    num_experts: int = 0
    experts_per_token: int = 0
    shared_intermediate_size: int = 0


class BlockSpec(_Frozen):
    kind: str  # block_type, else the class name (FSDPConfig.checkpoint_skip_layer_types)
    tensors: tuple[tuple[str, tuple[int, ...]], ...]
    linears: tuple[tuple[str, int, int], ...]  # (module path, in_features, out_features)
    attention: AttentionSpec
    mlp: MlpSpec
    lora: dict[str, tuple[tuple[str, int, int], ...]]  # target spec -> linears it adapts

    @property
    def numel(self) -> int:
        total = 0
        for _, shape in self.tensors:
            n = 1
            for d in shape:
                n *= d
            total += n
        return total


class ModelSpec(_Frozen):
    schema_version: int = SPEC_SCHEMA_VERSION
    name: str
    model_type: str
    architecture: str
    config_digest: str
    transformers_version: str
    peft_version: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    embed_shape: tuple[int, ...]
    lm_head_shape: tuple[int, ...] | None  # None when tied to the embeddings
    root_tensors: tuple[tuple[str, tuple[int, ...]], ...]  # outside blocks, embeddings and lm_head (norms, PLE...)
    block_types: dict[str, BlockSpec]
    layers: tuple[str, ...]  # block type key of each layer, in order
    total_params: int
    final_logit_softcapping: float | None = None
    lora_outside_blocks: dict[str, tuple[tuple[str, int, int], ...]] = {}

    # -- derived ------------------------------------------------------------------------
    def block(self, index: int) -> BlockSpec:
        return self.block_types[self.layers[index]]

    @property
    def blocks(self) -> list[BlockSpec]:
        return [self.block_types[k] for k in self.layers]

    @property
    def block_kinds(self) -> list[str]:
        return sorted({b.kind for b in self.block_types.values()})

    @property
    def is_moe(self) -> bool:
        return any(b.mlp.kind == "moe" for b in self.block_types.values())

    def lora_linears(self, targets: str) -> list[tuple[str, int, int]]:
        """Every linear the target spec adapts, across the whole model."""
        key = self._target_key(targets)
        out = list(self.lora_outside_blocks.get(key, ()))
        for block in self.blocks:
            out.extend(block.lora[key])
        return out

    def lora_params(self, targets: str, rank: int) -> int:
        return rank * sum(i + o for _, i, o in self.lora_linears(targets))

    def has_lora_targets(self, targets: str | tuple[str, ...]) -> bool:
        key = self._target_key(targets)
        return all(key in b.lora for b in self.block_types.values())

    @staticmethod
    def _target_key(targets: str | tuple[str, ...] | list[str]) -> str:
        if isinstance(targets, str):
            return targets
        return ",".join(sorted(targets))


def config_digest(config_dict: dict[str, Any]) -> str:
    drop = {"transformers_version", "_name_or_path", "torch_dtype", "dtype", "architectures_autodetected"}
    clean = {k: v for k, v in sorted(config_dict.items()) if k not in drop}
    return hashlib.sha256(json.dumps(clean, sort_keys=True, default=str).encode()).hexdigest()[:16]


def spec_cache_dir() -> Path:
    root = os.environ.get("AGILERL_CACHE") or os.path.join(Path.home(), ".cache", "agilerl")
    return Path(root) / "specs"


def _shape(p) -> tuple[int, ...]:
    return tuple(int(d) for d in p.shape)


def _attention(block, config) -> AttentionSpec:
    import torch.nn as nn

    attn = getattr(block, "self_attn", None) or getattr(block, "attention", None)
    heads = int(getattr(config, "num_attention_heads", 1))
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    q_dim = heads * head_dim
    kv_dim = kv_heads * head_dim
    if attn is not None:
        q = getattr(attn, "q_proj", None)
        if isinstance(q, nn.Linear):
            q_dim = q.out_features
        k = getattr(attn, "k_proj", None)
        if isinstance(k, nn.Linear):
            kv_dim = k.out_features
        elif hasattr(config, "kv_lora_rank"):  # MLA caches the compressed kv plus the rope key
            kv_dim = int(config.kv_lora_rank) + int(getattr(config, "qk_rope_head_dim", 0))
    sliding = None
    attention_type = getattr(block, "attention_type", None) or getattr(attn, "attention_type", None)
    window = getattr(config, "sliding_window", None)
    if window and attention_type == "sliding_attention":
        sliding = int(window)
    return AttentionSpec(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, q_dim=q_dim, kv_dim=kv_dim,
                         sliding_window=sliding)


def _mlp(block, config) -> MlpSpec:
    mlp = getattr(block, "mlp", None) or getattr(block, "block_sparse_moe", None)
    experts = getattr(mlp, "experts", None) if mlp is not None else None
    if experts is not None:
        num = int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
                  or getattr(config, "n_routed_experts", None) or 0)
        top_k = int(getattr(config, "num_experts_per_tok", None) or getattr(config, "moe_topk", None) or 1)
        width = int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size)
        shared = getattr(mlp, "shared_experts", None) or getattr(mlp, "shared_expert", None)
        shared_width = 0
        if shared is not None:
            up = getattr(shared, "up_proj", None)
            shared_width = int(up.out_features) if up is not None else 0
        return MlpSpec(kind="moe", intermediate_size=width, num_experts=num, experts_per_token=top_k,
                       shared_intermediate_size=shared_width)
    width = int(getattr(config, "intermediate_size", 4 * config.hidden_size))
    up = getattr(mlp, "up_proj", None) if mlp is not None else None
    if up is not None and hasattr(up, "out_features"):
        width = int(up.out_features)
    return MlpSpec(kind="dense", intermediate_size=width)


def build_spec(config, *, name: str, lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS) -> ModelSpec:
    """Build a spec from a transformers config (or config dict) on the meta device."""
    import peft
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from agilerl.distributed import block_kind, find_transformer_blocks

    if isinstance(config, dict):
        data = dict(config)
        model_type = data.pop("model_type")
        config = AutoConfig.for_model(model_type, **data)
    config_dict = config.to_dict()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    _, blocks = find_transformer_blocks(model)
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight

    names = {id(m): n for n, m in model.named_modules()}
    block_prefix = {id(b): names[id(b)] + "." for b in blocks}

    def in_block(param_name: str) -> int | None:
        for i, b in enumerate(blocks):
            if param_name.startswith(block_prefix[id(b)]):
                return i
        return None

    root_tensors = []
    seen = set()
    embed_name = names[id(embed)] + ".weight"
    head_name = names[id(head)] + ".weight" if head is not None else None
    for pname, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if in_block(pname) is not None or pname in (embed_name, head_name):
            continue
        root_tensors.append((pname, _shape(p)))

    lora_by_block: list[dict[str, list[tuple[str, int, int]]]] = [dict() for _ in blocks]
    lora_outside: dict[str, list[tuple[str, int, int]]] = {}
    for targets in lora_targets:
        key = ModelSpec._target_key(targets)
        with torch.device("meta"):
            fresh = AutoModelForCausalLM.from_config(config)
            pm = get_peft_model(fresh, LoraConfig(r=1, lora_alpha=1, target_modules=targets, task_type="CAUSAL_LM"))
        per_block = [[] for _ in blocks]
        outside = []
        for mname, module in pm.get_base_model().named_modules():
            if not hasattr(module, "lora_A") or "default" not in getattr(module, "lora_A", {}):
                continue
            a = module.lora_A["default"].weight
            b = module.lora_B["default"].weight
            entry = (mname, int(a.shape[1]), int(b.shape[0]))
            index = in_block(mname + ".")
            if index is None:
                outside.append(entry)
            else:
                local = mname[len(block_prefix[id(blocks[index])]):]
                per_block[index].append((local, entry[1], entry[2]))
        for i in range(len(blocks)):
            lora_by_block[i][key] = per_block[i]
        lora_outside[key] = outside

    block_types: dict[str, BlockSpec] = {}
    layers = []
    for i, b in enumerate(blocks):
        import torch.nn as nn

        tensors = tuple((n, _shape(p)) for n, p in b.named_parameters())
        linears = tuple((n, int(m.in_features), int(m.out_features)) for n, m in b.named_modules()
                        if isinstance(m, nn.Linear))
        spec = BlockSpec(
            kind=block_kind(b), tensors=tensors, linears=linears, attention=_attention(b, text_config),
            mlp=_mlp(b, text_config), lora={k: tuple(v) for k, v in lora_by_block[i].items()},
        )
        key = hashlib.sha256(spec.model_dump_json().encode()).hexdigest()[:10]
        block_types.setdefault(key, spec)
        layers.append(key)

    total = sum(p.numel() for p in model.parameters())
    return ModelSpec(
        name=name,
        model_type=str(config_dict.get("model_type")),
        architecture=type(model).__name__,
        config_digest=config_digest(config_dict),
        transformers_version=transformers.__version__,
        peft_version=peft.__version__,
        hidden_size=int(text_config.hidden_size),
        vocab_size=int(text_config.vocab_size),
        num_layers=len(blocks),
        max_position_embeddings=int(getattr(text_config, "max_position_embeddings", 0) or 0),
        tie_word_embeddings=bool(tied),
        embed_shape=_shape(embed.weight),
        lm_head_shape=None if tied or head is None else _shape(head.weight),
        root_tensors=tuple(root_tensors),
        block_types=block_types,
        layers=tuple(layers),
        total_params=int(total),
        final_logit_softcapping=getattr(text_config, "final_logit_softcapping", None),
        lora_outside_blocks={k: tuple(v) for k, v in lora_outside.items()},
    )
