"""Tiny random causal LMs and a character tokenizer, built locally (no downloads).

Used by tests, the CPU demo, the probe and benchmarks. Architectures are real
Hugging Face classes with small dimensions, so sharding, LoRA and generation
exercise the same code paths as full-size models.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

__all__ = ["TINY_ARCHITECTURES", "tiny_config", "tiny_model", "char_tokenizer", "save_tiny_model"]

#: Architecture name -> transformers config class name.
TINY_ARCHITECTURES = {
    "qwen2": "Qwen2Config",
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "gemma2": "Gemma2Config",
    "gemma3": "Gemma3TextConfig",
    "qwen3": "Qwen3Config",
    "qwen3_moe": "Qwen3MoeConfig",
    "mixtral": "MixtralConfig",
    "olmoe": "OlmoeConfig",
    "gemma3n": "Gemma3nTextConfig",
    "smollm3": "SmolLM3Config",
    "olmo2": "Olmo2Config",
    "gpt_oss": "GptOssConfig",
    "gemma4": "Gemma4TextConfig",
}

#: Tiny mixture-of-experts defaults: 4 packed experts, 2 per token.
_MOE_DEFAULTS = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2),
}


def tiny_config(
    arch: str = "qwen2",
    *,
    vocab_size: int = 64,
    hidden_size: int = 32,
    intermediate_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool | None = None,
    **overrides: Any,
):
    """A small config of a real architecture (random weights once built)."""
    import transformers

    if arch not in TINY_ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {sorted(TINY_ARCHITECTURES)}")
    sizes = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
    )
    for key, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"tiny:{arch}: {key}={value!r} must be a positive integer")
    if num_heads % num_kv_heads or hidden_size % num_heads:
        raise ValueError(
            f"tiny:{arch}: num_kv_heads={num_kv_heads} (num_key_value_heads) must divide "
            f"num_heads={num_heads}, and num_heads must divide hidden_size={hidden_size}"
        )
    cls = getattr(transformers, TINY_ARCHITECTURES[arch])
    known = set(cls().to_dict()) | set(getattr(cls, "attribute_map", {}))
    unknown = sorted(set(overrides) - known)
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], [*sizes, *known], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"tiny:{arch}: unknown config key {unknown[0]!r}{hint}; keys are tiny_config's "
            f"({', '.join(sizes)}, seed) or {cls.__name__} fields"
        )
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if tie_word_embeddings is not None:
        kwargs["tie_word_embeddings"] = tie_word_embeddings
    if arch in ("gemma2", "gemma3"):
        kwargs["sliding_window"] = max_position_embeddings
    gemma_types = _gemma_layer_types(num_layers, shared="num_kv_shared_layers" in overrides)
    if arch == "gemma4":  # PLE, global layers twice as wide as the sliding ones; K/V sharing if given
        head_dim = hidden_size // num_heads
        kwargs.update(
            vocab_size_per_layer_input=vocab_size,
            hidden_size_per_layer_input=8,
            num_kv_shared_layers=0,
            sliding_window=max_position_embeddings,
            layer_types=gemma_types,
            per_layer_config={
                f"{i:02d}": {"head_dim": 2 * head_dim} for i, t in enumerate(gemma_types) if t == "full_attention"
            },
        )
    if arch == "smollm3":  # every second layer without rotary embeddings (NoPE), as every fourth in SmolLM3-3B
        kwargs["no_rope_layer_interval"] = 2
    if arch == "gpt_oss":  # attention sinks, biased transposed experts, alternating sliding/full layers
        kwargs.update(
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * (num_layers // 2)
            + ["sliding_attention"] * (num_layers % 2),
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    kwargs.update(_MOE_DEFAULTS.get(arch, {}))
    if arch == "gemma3n":  # per-layer embeddings (PLE), AltUp and Laurel at tiny sizes; K/V sharing if given
        kwargs.update(
            vocab_size_per_layer_input=vocab_size,
            hidden_size_per_layer_input=8,
            laurel_rank=4,
            num_kv_shared_layers=0,
            activation_sparsity_pattern=[0.0] * num_layers,
            sliding_window=max_position_embeddings,
            layer_types=gemma_types,
        )
    kwargs.update(overrides)
    from huggingface_hub.errors import StrictDataclassError

    try:
        config = cls(**kwargs)
    except (TypeError, ValueError, StrictDataclassError) as err:  # the last: a field of the wrong type
        raise ValueError(f"tiny:{arch}: {cls.__name__} refuses these values: {' '.join(str(err).split())}") from None
    from .sources import check_config

    check_config(config.to_dict(), f"tiny:{arch}")
    # Eager attention keeps CPU numerics identical across processes and versions.
    config._attn_implementation = "eager"
    return config


def _gemma_layer_types(num_layers: int, *, shared: bool) -> list[str]:
    """Gemma-3n's and Gemma 4's tiny attention pattern: sliding layers, then a full one. With K/V
    sharing (``num_kv_shared_layers`` given) every third layer is full, as the real models
    interleave them, so each attention type has a layer before the readers to store its K and V
    (``num_kv_shared_layers=0`` gives the same pattern without sharing)."""
    if not shared:
        return ["sliding_attention"] * (num_layers - 1) + ["full_attention"]
    return ["full_attention" if i % 3 == 2 else "sliding_attention" for i in range(num_layers)]


def tiny_model(arch: str = "qwen2", *, seed: int = 0, dtype=None, **config_kwargs: Any):
    """A randomly initialised tiny causal LM (deterministic for a given seed)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, **config_kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    if dtype is not None:
        model = model.to(dtype)
    return model


#: Characters of the tiny tokenizer's vocabulary after the special tokens.
CHARS = string.digits + "+-*=?:. " + string.ascii_lowercase


def char_tokenizer():
    """A character-level fast tokenizer: ``<pad>``=0, ``<s>``=1, ``</s>``=2, ``<unk>``=3, then CHARS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in CHARS:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        padding_side="left",
    )
    return fast


def save_tiny_model(path: str | Path, arch: str = "qwen2", *, seed: int = 0, **config_kwargs: Any) -> Path:
    """Write a tiny model and the char tokenizer to ``path`` (a from_pretrained directory)."""
    path = Path(path)
    tokenizer = char_tokenizer()
    config_kwargs.setdefault("vocab_size", len(tokenizer))
    model = tiny_model(arch, seed=seed, **config_kwargs)
    # save_pretrained writes nothing off global rank 0 under torch.distributed; the main rank of a
    # population member's own ranks (agilerl.distributed.use_rank_group) writes this model too.
    model.should_save_on_this_rank = lambda is_main_process: is_main_process
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
