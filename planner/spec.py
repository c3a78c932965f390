"""ModelSpec: what a model is made of, read off a meta-device model.

Building a spec imports torch, transformers and peft and instantiates the model
on the meta device (no memory, ~0.6 s for a 70B). Using one does not: a spec is
plain data, cached on disk keyed by the config and the transformers and peft
versions, and shipped precomputed for catalog models, so a warm plan never
imports torch.

LoRA coverage is what PEFT adapts. Where every module a target spec reaches is a
plain linear (``nn.Linear`` or transformers' ``Conv1D``) and no other module holds a
matrix PEFT could wrap, it is read off PEFT's documented rule without importing PEFT
(whose import is about half of a cold build): ``"all-linear"`` is every linear but the
output embedding, and a list names modules by their name or its dotted suffix. Anything
else (packed MoE experts, routers, embeddings, a regex) applies PEFT itself to the meta
model, at rank 1. tests/planner/test_spec_lora.py checks the two agree on a model of
every catalog family. Each adapted module is recorded with its A and B shapes at
rank 1, ``(a_rows, a_cols, b_rows, b_cols)``; at rank r, A is
``(r * a_rows, a_cols)`` and B ``(b_rows, r * b_cols)``. For a linear
``in -> out`` that is ``(1, in, out, 1)``; for PEFT's LoRA on packed MoE
experts (a ParamWrapper) the rank dimension also spans the experts.
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
    "UnsupportedArchitecture",
    "DEFAULT_LORA_TARGETS",
]

SPEC_SCHEMA_VERSION = 10  # 3: hidden_streams, per_layer_input_width (Gemma-3n); 4: attention logit soft-capping;
# 5: expert_layout_problem (gpt-oss), text_model_of (multimodal checkpoints); 6: the NF4 weights of QLoRA;
# 7: K/V sharing across layers (Gemma-3n, Gemma 4), rotary_widths; 8: rotary widths read off the forward (gpt-oss);
# 9: rope_position_factor (linear and dynamic rope scaling stretch the positions); 10: every rope type
# but YaRN and Llama 3 stretches them, by a factor below 1 too (as vLLM)
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
    logit_softcapping: float | None = None  # tanh soft cap of the attention scores (Gemma 2)
    # K/V sharing across layers (Gemma-3n's and Gemma 4's num_kv_shared_layers): "reuse" reads the
    # K and V the last earlier layer of its attention type made (it has no K/V projections and no
    # cache entry of its own); "store" is that layer, whose K and V outlive its forward for them.
    # None otherwise, a store included when no layer reads it (agilerl.utils.sources.kv_sharing_roles).
    kv_sharing: str | None = None

    @property
    def has_own_kv(self) -> bool:
        """The layer makes (and caches) K and V of its own: every layer but a K/V reader."""
        return self.kv_sharing != "reuse"


class MlpSpec(_Frozen):
    kind: str  # "dense" or "moe"
    intermediate_size: int  # dense MLP width, or one routed expert's width for MoE
    num_experts: int = 0
    experts_per_token: int = 0
    shared_intermediate_size: int = 0


LoraShape = tuple[str, int, int, int, int]  # (module[:parameter], a_rows, a_cols, b_rows, b_cols) at rank 1


class BlockSpec(_Frozen):
    kind: str  # block_type, else the class name (FSDPConfig.checkpoint_skip_layer_types)
    tensors: tuple[tuple[str, tuple[int, ...]], ...]
    linears: tuple[tuple[str, int, int], ...]  # (module path, in_features, out_features)
    # The weights QLoRA stores in NF4 (agilerl.utils.sources.four_bit_linears), by tensor name.
    four_bit: tuple[str, ...] = ()
    attention: AttentionSpec
    mlp: MlpSpec
    lora: dict[str, tuple[LoraShape, ...]]  # target spec -> the adapters it adds

    @property
    def has_attention_sinks(self) -> bool:
        """The attention has learned sinks (``self_attn.sinks``, gpt-oss): a logit per head that
        joins every row's softmax."""
        return any(name.endswith("attn.sinks") for name, _ in self.tensors)

    @property
    def has_expert_biases(self) -> bool:
        """The packed experts have gate_up biases (``experts.gate_up_proj_bias``, gpt-oss)."""
        return any(name.endswith("experts.gate_up_proj_bias") for name, _ in self.tensors)

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
    #: How far the rope scaling stretches the positions (agilerl.utils.sources.rope_position_factor).
    rope_position_factor: float = 1.0
    tie_word_embeddings: bool
    embed_shape: tuple[int, ...]
    lm_head_shape: tuple[int, ...] | None  # None when tied to the embeddings
    root_tensors: tuple[tuple[str, tuple[int, ...]], ...]  # outside blocks, embeddings and lm_head (norms, PLE...)
    root_four_bit: tuple[str, ...] = ()  # the root tensors QLoRA stores in NF4 (Gemma-3n's AltUp projections)
    block_types: dict[str, BlockSpec]
    layers: tuple[str, ...]  # block type key of each layer, in order
    total_params: int
    final_logit_softcapping: float | None = None
    lora_outside_blocks: dict[str, tuple[LoraShape, ...]] = {}
    # Gemma-3n: AltUp carries ``hidden_streams`` copies of the hidden state through every
    # block, and the per-layer inputs (num_layers x hidden_size_per_layer_input per token)
    # live from the embeddings to the last block.
    hidden_streams: int = 1
    per_layer_input_width: int = 0
    # Why agilerl.distributed's row-wise experts (expert parallel, routed_expert_chunk_mib)
    # cannot run this model's packed experts (gpt-oss: transposed, with biases); None when
    # they can or the model has none. Such a model trains with Hugging Face's expert loop.
    expert_layout_problem: str | None = None
    # The class of the multimodal checkpoint this is the text model of (its vision / audio
    # encoders are not counted: the trainer fine-tunes the exported text model).
    text_model_of: str | None = None
    # The width of the cos (and of the sin) of each rotary table the forward computes: one per
    # inv_freq buffer of the rotary module, 2 x its length. Gemma 3, Gemma-3n and Gemma 4 compute
    # one per attention type (Gemma 4's global one twice as wide); None when not read.
    rotary_widths: tuple[int, ...] | None = None
    # transformers runs the layers reading shared K and V on the kept positions only when a
    # forward asks for the last logits alone, as generate's prefill does (Gemma 4:
    # ``_maybe_slice_kv_shared_inputs``); Gemma-3n runs them over every position.
    prefill_skips_readers: bool = False

    # -- derived ------------------------------------------------------------------------
    def block(self, index: int) -> BlockSpec:
        return self.block_types[self.layers[index]]

    @property
    def blocks(self) -> list[BlockSpec]:
        return [self.block_types[k] for k in self.layers]

    @property
    def positions(self) -> int:
        """The positions the model takes: ``max_position_embeddings``, stretched by a linear or
        dynamic rope scaling."""
        from agilerl.utils.sources import stretched_positions

        return stretched_positions(self.max_position_embeddings, self.rope_position_factor)

    def positions_words(self) -> str:
        """Where :attr:`positions` comes from, for a message."""
        from agilerl.utils.sources import positions_words

        return positions_words(self.max_position_embeddings, self.rope_position_factor)

    @property
    def block_kinds(self) -> list[str]:
        return sorted({b.kind for b in self.block_types.values()})

    @property
    def is_moe(self) -> bool:
        return any(b.mlp.kind == "moe" for b in self.block_types.values())

    def lora_shapes(self, targets: str | tuple[str, ...]) -> list[LoraShape]:
        """Every adapter the target spec adds, across the whole model (shapes at rank 1)."""
        key = self.target_key(targets)
        out = list(self.lora_outside_blocks.get(key, ()))
        for block in self.blocks:
            out.extend(block.lora[key])
        return out

    def lora_params(self, targets: str | tuple[str, ...], rank: int) -> int:
        return rank * sum(ar * ac + br * bc for _, ar, ac, br, bc in self.lora_shapes(targets))

    def has_lora_targets(self, targets: str | tuple[str, ...]) -> bool:
        key = self.target_key(targets)
        return all(key in b.lora for b in self.block_types.values())

    @staticmethod
    def target_key(targets: str | tuple[str, ...] | list[str]) -> str:
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


def is_per_layer_embedding(name: str) -> bool:
    """A per-layer embedding table (Gemma-3n's ``embed_tokens_per_layer``)."""
    return "embed_tokens_per_layer" in name.split(".")


def _shape(p) -> tuple[int, ...]:
    return tuple(int(d) for d in p.shape)


def _attention(block, config, roles: dict) -> AttentionSpec:
    import torch.nn as nn

    attn = getattr(block, "self_attn", None) or getattr(block, "attention", None)
    heads = int(getattr(config, "num_attention_heads", 1))
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    # The layer's own head width first: Gemma 4's global layers are twice as wide as its sliding
    # ones, and its config refuses a model-wide head_dim (per_layer_config).
    head_dim = getattr(attn, "head_dim", None)
    if not isinstance(head_dim, int):
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    head_dim = int(head_dim)
    q_dim = heads * head_dim
    kv_dim = kv_heads * head_dim
    if getattr(config, "kv_lora_rank", None):
        # MLA as Hugging Face runs it: the cache holds every head's decompressed key
        # (nope + rope) and value, so 2 x kv_dim is their summed width.
        qk = int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)
        head_dim = qk
        kv_dim = heads * (qk + int(config.v_head_dim)) // 2
    if attn is not None:
        q = getattr(attn, "q_proj", None) or getattr(attn, "q_b_proj", None)
        if isinstance(q, nn.Linear):
            q_dim = q.out_features
        k = getattr(attn, "k_proj", None)
        if isinstance(k, nn.Linear):
            kv_dim = k.out_features
    # The window a layer attends over: its attention module's own attribute (transformers 5),
    # else config.layer_types, else a model-wide config.sliding_window (Mistral v0.1, Phi-3).
    window = getattr(config, "sliding_window", None)
    if attn is not None and hasattr(attn, "sliding_window"):
        sliding = attn.sliding_window
    elif getattr(config, "layer_types", None) is not None:
        layer_type = getattr(attn, "layer_type", None)
        sliding = window if layer_type == "sliding_attention" else None
    else:
        sliding = window if getattr(config, "use_sliding_window", True) else None
    sliding = int(sliding) if sliding else None
    softcap = getattr(config, "attn_logit_softcapping", None)
    return AttentionSpec(
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        q_dim=q_dim,
        kv_dim=kv_dim,
        sliding_window=sliding,
        logit_softcapping=float(softcap) if softcap else None,
        kv_sharing=roles.get(attn),  # agilerl.utils.sources.kv_sharing_roles
    )


def _rotary_widths(model) -> tuple[int, ...]:
    """The cos width of each rotary table the forward computes, one per ``inv_freq`` buffer of
    the rotary modules (``<layer_type>_inv_freq`` where there is one per attention type; the
    ``original_`` copies kept for dynamic scaling are not tables): read off the module's own
    forward over one position on the meta device, as most concatenate the frequencies twice
    (2 x the buffer's length) and gpt-oss does not (its length). A module that cannot run so, or
    returns no (cos, sin) pair (DeepSeek-V2's complex ``freqs_cis``, as wide as the buffer at 8
    bytes an element: 2 x its length x p in bf16), is taken as concatenating."""
    widths = []
    for module in model.modules():
        for leaf, buffer in module.named_buffers(recurse=False):
            if leaf.endswith("inv_freq") and "original" not in leaf:
                widths.append(_cos_width(module, leaf[: -len("_inv_freq")] or None, 2 * int(buffer.numel())))
    return tuple(widths)


def _cos_width(module, layer_type: str | None, default: int) -> int:
    import torch

    x = torch.empty(1, 1, 1, device="meta")
    positions = torch.zeros(1, 1, dtype=torch.long, device="meta")
    try:
        out = module(x, positions, layer_type) if layer_type else module(x, positions)
    except Exception:  # noqa: BLE001 - a module of another signature: the common layout
        return default
    return int(out[0].shape[-1]) if isinstance(out, tuple) and len(out) == 2 else default


def _mlp(block, config) -> MlpSpec:
    mlp = getattr(block, "mlp", None) or getattr(block, "block_sparse_moe", None)
    experts = getattr(mlp, "experts", None) if mlp is not None else None
    if experts is not None:
        num = int(
            getattr(config, "num_experts", None)
            or getattr(config, "num_local_experts", None)
            or getattr(config, "n_routed_experts", None)
            or 0
        )
        top_k = int(getattr(config, "num_experts_per_tok", None) or getattr(config, "moe_topk", None) or 1)
        width = int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size)
        shared = getattr(mlp, "shared_experts", None) or getattr(mlp, "shared_expert", None)
        shared_width = 0
        if shared is not None:
            up = getattr(shared, "up_proj", None)
            shared_width = int(up.out_features) if up is not None else 0
        return MlpSpec(
            kind="moe",
            intermediate_size=width,
            num_experts=num,
            experts_per_token=top_k,
            shared_intermediate_size=shared_width,
        )
    width = getattr(config, "intermediate_size", 4 * config.hidden_size)
    width = int(max(width) if isinstance(width, list) else width)  # per layer (Gemma-3n): read off up_proj
    up = getattr(mlp, "up_proj", None) if mlp is not None else None
    if up is not None and hasattr(up, "out_features"):
        width = int(up.out_features)
    return MlpSpec(kind="dense", intermediate_size=width)


class UnsupportedArchitecture(ValueError):
    """A causal LM whose structure the runtime or the estimate does not model (one line, naming it)."""


#: Attribute names of a block's attention module in Hugging Face models, and the query (or
#: fused query-key-value) projections that make it softmax attention with a KV cache.
ATTENTION_NAMES = ("self_attn", "attention", "attn")
QUERY_PROJECTIONS = ("q_proj", "qkv_proj", "query_key_value", "c_attn", "q_a_proj", "Wqkv")


def _has_softmax_attention(block) -> bool:
    return any(hasattr(getattr(block, a, None), q) for a in ATTENTION_NAMES for q in QUERY_PROJECTIONS)


def _plain_linear_lora(model, targets) -> list[tuple[str, str, tuple[int, int, int, int]]] | None:
    """``(module name, label, rank-1 shapes)`` of what PEFT adapts for ``targets`` when every
    module they reach is a plain linear; None where PEFT itself must say (see the module doc)."""
    import torch.nn as nn
    from transformers.pytorch_utils import Conv1D

    linear = (nn.Linear, Conv1D)
    for module in model.modules():
        if not isinstance(module, (*linear, nn.Embedding)) and any(
            p.dim() >= 2 for p in module.parameters(recurse=False)
        ):
            return None  # a matrix PEFT may wrap as a parameter (packed experts, a router)
    if isinstance(targets, str):
        if targets.lower() != "all-linear":
            return None  # a regex
        head = model.get_output_embeddings()
        chosen = [(n, m) for n, m in model.named_modules() if isinstance(m, linear) and m is not head]
    else:
        chosen = [(n, m) for n, m in model.named_modules() if n and any(n == t or n.endswith("." + t) for t in targets)]
        if not chosen or not all(isinstance(m, linear) for _, m in chosen):
            return None  # nothing matched (PEFT's own error), or a non-linear module
    out = []
    for n, m in chosen:
        fan_in, fan_out = (m.in_features, m.out_features) if isinstance(m, nn.Linear) else m.weight.shape
        out.append((n, n, (1, int(fan_in), int(fan_out), 1)))
    return out


def _peft_lora(model, targets) -> list[tuple[str, str, tuple[int, int, int, int]]]:
    """What PEFT adapts for ``targets``: applies it to ``model`` (on meta, rank 1; modifies it)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from agilerl.utils.peft_compat import quiet_peft
    from agilerl.utils.sources import LoraTargetError

    with torch.device("meta"), quiet_peft():
        try:
            pm = get_peft_model(model, LoraConfig(r=1, lora_alpha=1, target_modules=targets, task_type="CAUSAL_LM"))
        except ValueError as err:
            if "is not supported" not in str(err):
                raise
            # a target PEFT cannot adapt (a packed expert module): the target's fault, not the config's
            kind = str(err).split("Target module ", 1)[-1].split(" is not supported", 1)[0]
            raise LoraTargetError(
                f"LoRA targets {targets if isinstance(targets, str) else ', '.join(targets)} name a module PEFT "
                f"cannot adapt ({kind}): target linear "
                "layers (q_proj, v_proj, ..., or 'all-linear')"
            ) from None
    out = []
    for mname, module in pm.get_base_model().named_modules():
        if not hasattr(module, "lora_A") or "default" not in getattr(module, "lora_A", {}):
            continue
        a = module.lora_A["default"].weight
        b = module.lora_B["default"].weight
        label = mname.replace(".base_layer", "")
        if getattr(module, "parameter_name", None):  # LoRA on a packed parameter (MoE experts)
            label = f"{label}:{module.parameter_name}"
        out.append((mname, label, (int(a.shape[0]), int(a.shape[1]), int(b.shape[0]), int(b.shape[1]))))
    return out


def _outside_blocks(model, in_block, *, skip: tuple) -> list[tuple[str, tuple[int, ...]]]:
    """Each parameter outside the blocks (a shared one once), those named in ``skip`` apart."""
    out, seen = [], set()
    for name, p in model.named_parameters():
        if id(p) not in seen and in_block(name) is None and name not in skip:
            out.append((name, _shape(p)))
        seen.add(id(p))
    return out


def build_spec(
    config,
    *,
    name: str,
    lora_targets: tuple[str | tuple[str, ...], ...] = DEFAULT_LORA_TARGETS,
    text_model_of: str | None = None,
) -> ModelSpec:
    """Build a spec from a transformers config (or config dict) on the meta device.

    ``text_model_of``: the class of the multimodal checkpoint whose text model ``config`` is.
    """
    from importlib.metadata import version

    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    from agilerl.distributed import block_kind, find_transformer_blocks, model_experts_problem
    from agilerl.utils.sources import check_lora_targets, four_bit_linears, kv_sharing_roles, rope_position_factor

    if isinstance(config, dict):
        import copy

        data = copy.deepcopy(config)  # transformers rewrites nested rope dicts in place
        model_type = data.pop("model_type")
        config = AutoConfig.for_model(model_type, **data)
    config_dict = config.to_dict()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        _, blocks = find_transformer_blocks(model)
    except ValueError as err:  # what apply_fsdp2 would refuse too
        raise UnsupportedArchitecture(f"{name}: {err}; only decoder-only transformer LMs are supported") from None
    if not any(_has_softmax_attention(b) for b in blocks):
        raise UnsupportedArchitecture(
            f"{name}: the blocks of {type(model).__name__} ({type(blocks[0]).__name__}) have no attention with "
            "query/key/value projections; "
            "the estimate models attention decoder blocks, so recurrent and state-space models "
            "(RWKV, Mamba) are not supported"
        )
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

    # Read before PEFT adapts the model (the adapters' own linears are not the base's).
    nf4 = {name + ".weight" for name in four_bit_linears(model)}
    embed_name = names[id(embed)] + ".weight"
    head_name = names[id(head)] + ".weight" if head is not None else None
    root_tensors = _outside_blocks(model, in_block, skip=(embed_name, head_name))

    # Everything about the base model is read above this line, so PEFT may adapt this very
    # model (building a 70B on meta costs ~0.6 s); a target spec after that needs a fresh one.
    import torch.nn as nn

    block_types: dict[str, BlockSpec] = {}
    layers = []
    block_tensors = [tuple((n, _shape(p)) for n, p in b.named_parameters()) for b in blocks]
    block_four_bit = [
        tuple(n for n, _ in tensors if block_prefix[id(b)] + n in nf4) for b, tensors in zip(blocks, block_tensors)
    ]
    block_linears = [
        tuple((n, int(m.in_features), int(m.out_features)) for n, m in b.named_modules() if isinstance(m, nn.Linear))
        for b in blocks
    ]
    roles = kv_sharing_roles(model)
    block_attention = [_attention(b, text_config, roles) for b in blocks]
    block_mlp = [_mlp(b, text_config) for b in blocks]
    block_kinds = [block_kind(b) for b in blocks]
    total = sum(p.numel() for p in model.parameters())
    expert_problem = model_experts_problem(model)

    lora_by_block: list[dict[str, list[LoraShape]]] = [dict() for _ in blocks]
    lora_outside: dict[str, list[LoraShape]] = {}
    base = model  # PEFT adapts the model it is given: after it, later target specs build a fresh one
    for targets in lora_targets:
        key = ModelSpec.target_key(targets)
        if base is None:
            with torch.device("meta"):
                base = AutoModelForCausalLM.from_config(config)
        check_lora_targets(base, targets, name)  # PEFT would skip a misspelt name beside a right one
        adapted = _plain_linear_lora(base, targets)
        if adapted is None:
            adapted, base = _peft_lora(base, targets), None
        per_block: list[list[LoraShape]] = [[] for _ in blocks]
        outside: list[LoraShape] = []
        for mname, label, shapes in adapted:
            index = in_block(mname + ".")
            if index is None:
                outside.append((label, *shapes))
            else:
                local = label[len(block_prefix[id(blocks[index])]) :]
                per_block[index].append((local, *shapes))
        for i in range(len(blocks)):
            lora_by_block[i][key] = per_block[i]
        lora_outside[key] = outside

    for i in range(len(blocks)):
        spec = BlockSpec(
            kind=block_kinds[i],
            tensors=block_tensors[i],
            linears=block_linears[i],
            four_bit=block_four_bit[i],
            attention=block_attention[i],
            mlp=block_mlp[i],
            lora={k: tuple(v) for k, v in lora_by_block[i].items()},
        )
        key = hashlib.sha256(spec.model_dump_json().encode()).hexdigest()[:10]
        block_types.setdefault(key, spec)
        layers.append(key)
    return ModelSpec(
        name=name,
        model_type=str(config_dict.get("model_type")),
        architecture=type(model).__name__,
        config_digest=config_digest(config_dict),
        transformers_version=transformers.__version__,
        peft_version=version("peft"),
        hidden_size=int(text_config.hidden_size),
        vocab_size=int(text_config.vocab_size),
        num_layers=len(blocks),
        max_position_embeddings=int(getattr(text_config, "max_position_embeddings", 0) or 0),
        rope_position_factor=rope_position_factor(config_dict),
        tie_word_embeddings=bool(tied),
        embed_shape=_shape(embed.weight),
        lm_head_shape=None if tied or head is None else _shape(head.weight),
        root_tensors=tuple(root_tensors),
        root_four_bit=tuple(n for n, _ in root_tensors if n in nf4),
        block_types=block_types,
        layers=tuple(layers),
        total_params=int(total),
        final_logit_softcapping=getattr(text_config, "final_logit_softcapping", None),
        lora_outside_blocks={k: tuple(v) for k, v in lora_outside.items()},
        hidden_streams=int(getattr(text_config, "altup_num_inputs", 1) or 1),
        per_layer_input_width=len(blocks) * int(getattr(text_config, "hidden_size_per_layer_input", 0) or 0)
        if any(is_per_layer_embedding(n) for n, _ in root_tensors)
        else 0,
        expert_layout_problem=expert_problem,
        text_model_of=text_model_of,
        rotary_widths=_rotary_widths(model),
        prefill_skips_readers=any(hasattr(m, "_maybe_slice_kv_shared_inputs") for m in model.modules()),
    )
