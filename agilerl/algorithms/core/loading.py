"""Build the actor: base causal LM + LoRA adapters, sharded or not.

Under FSDP2 with a model on disk, every rank builds the model on the meta
device, adds the adapters, shards, and then fills only its own slices from a
lazily read checkpoint: host memory per rank stays near one tensor, and device
memory never holds a full replica. QLoRA too: the linears are 4-bit modules
on the meta device with the packed NF4 shape, sharded like any tensor; each
full-precision weight is read and quantised one at a time, every rank keeps its
slice of the packed bytes, and the module keeps the whole quantisation state. Without FSDP
(one device, or data parallel) each rank loads the whole model, as data parallelism requires.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from agilerl.distributed import (
    FSDPConfig,
    apply_activation_checkpointing,
    apply_fsdp2,
    barrier,
    is_main_process,
    materialize_fsdp2_from_cpu_state,
)
from agilerl.utils.sources import TINY_PREFIX, check_trainable, four_bit_linears, kv_sharing_roles, parse_tiny

from .adapters import ACTOR, REFERENCE, copy_adapter_, mark_trainable, tuner_layers

__all__ = [
    "default_lora_config",
    "resolve_lora_config",
    "DEFAULT_LORA",
    "resolve_model_source",
    "attention_problem",
    "check_model_length",
    "build_actor",
    "load_tokenizer",
    "TINY_PREFIX",
]

#: The algorithms' ``lora_config`` default: :func:`default_lora_config`. ``None`` fine-tunes every parameter.
DEFAULT_LORA = "default"

logger = logging.getLogger(__name__)


def default_lora_config():
    """r=16, alpha=32 on every linear layer (the lm_head excluded), no dropout: PEFT refuses
    dropout where LoRA adapts packed expert parameters (every MoE model under all-linear), and
    the no-grad passes (the sampling policy, the reference, the old policy) run without it."""
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")


def resolve_lora_config(value):
    """An algorithm's ``lora_config``: a PEFT ``LoraConfig`` as given, :data:`DEFAULT_LORA` (the
    default) -> :func:`default_lora_config`, None -> None (full fine-tuning)."""
    if value is None:
        return None
    if isinstance(value, str):
        if value != DEFAULT_LORA:
            raise ValueError(
                f"lora_config must be a peft LoraConfig, {DEFAULT_LORA!r} (r=16, alpha=32 on every "
                f"linear) or None (full fine-tuning), got {value!r}"
            )
        return default_lora_config()
    from peft import LoraConfig

    if not isinstance(value, LoraConfig):
        hint = " (build one with peft.LoraConfig(**fields))" if isinstance(value, dict) else ""
        raise ValueError(
            f"lora_config must be a peft LoraConfig{hint}, {DEFAULT_LORA!r} (r=16, alpha=32 on every "
            f"linear) or None (full fine-tuning), got a {type(value).__name__}"
        )
    init = getattr(value, "init_lora_weights", True)
    if init not in _ADAPTER_INITS:
        raise ValueError(
            f"lora_config.init_lora_weights={init!r} is not supported: the trainer draws the adapters "
            "itself on every loading path (sharded ones from the meta device too), with PEFT's True "
            "(the default: B = 0), 'gaussian' or False; inits computed from the base weights or from "
            "data (PiSSA, OLoRA, LoftQ, EVA, CorDA, ...) are not"
        )
    return value


#: ``init_lora_weights`` values :func:`_reinit_adapters` draws (PEFT's, from a seed alone).
_ADAPTER_INITS = (True, False, "gaussian")


def _cache_dir() -> Path:
    return Path(os.environ.get("AGILERL_CACHE", Path.home() / ".cache" / "agilerl"))


def resolve_model_source(model_name: str) -> str:
    """A local directory, a hub id (loaded by transformers), or a built-in tiny model.

    ``tiny:<arch>[?config overrides]`` builds a tiny random model with the
    character tokenizer, writes it once to the cache directory (rank 0, the
    others wait) and returns that directory. Nothing is downloaded. The agent
    calls it after ``fsdp_config="auto"`` has planned the name, and
    ``agilerl.train`` only for engine ranks: a tiny model's tokenizer and plan
    need nothing written (:func:`load_tokenizer`, the planner's tiny configs).
    """
    if not model_name.startswith(TINY_PREFIX):
        return model_name
    from agilerl.utils.tiny import save_tiny_model

    arch, kwargs = parse_tiny(model_name)
    vocab = kwargs.get("vocab_size")
    if isinstance(vocab, int) and not isinstance(vocab, bool):
        from agilerl.utils.tiny import char_tokenizer

        tokens = len(char_tokenizer())
        if vocab < tokens:  # its token ids would index past the embedding table
            raise ValueError(
                f"{model_name}: vocab_size={vocab} is smaller than the built-in character tokenizer's "
                f"{tokens} tokens; give vocab_size >= {tokens} or leave it out"
            )
    seed = int(kwargs.pop("seed", 0))
    digest = hashlib.sha1(f"{arch}|{sorted(kwargs.items())}|{seed}".encode()).hexdigest()[:12]
    target = _cache_dir() / "tiny" / f"{arch}-{digest}"
    if is_main_process() and not (target / "config.json").exists():
        import fcntl

        target.parent.mkdir(parents=True, exist_ok=True)
        # Another writer may be at it too (the main rank of every population member's group, another
        # launch): one at a time, and the model appears whole or not at all.
        with open(target.parent / f".{target.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (target / "config.json").exists():
                _quiet_transformers()
                tmp = target.with_name(target.name + f".tmp{os.getpid()}")
                save_tiny_model(tmp, arch, seed=seed, **kwargs)
                tmp.rename(target)
    barrier()
    return str(target)


def _quiet_transformers() -> None:
    # Loading bars from transformers would interleave across ranks and drown the trainer's log.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


#: ``tokenizer_class`` values that mean "the tokenizer.json as saved", not a model's own tokenizer class.
_GENERIC_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def _saved_tokenizer_class(source: str) -> str | None:
    """``tokenizer_class`` of a local directory's (or cached hub repo's) tokenizer_config.json, if any."""
    import json

    from transformers.utils import cached_file

    try:
        path = cached_file(
            source, "tokenizer_config.json", local_files_only=True, _raise_exceptions_for_missing_entries=False
        )
    except OSError:
        return None
    if path is None:
        return None
    try:
        return json.loads(Path(path).read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return None


#: Files any saved tokenizer leaves in a model directory (transformers' fast and slow tokenizers).
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def load_tokenizer(source: str):
    """The source's tokenizer, left-padded for generation.

    A tokenizer saved from a ``tokenizers`` object (``tokenizer_class`` TokenizersBackend or
    PreTrainedTokenizerFast) is loaded exactly as its tokenizer.json says. ``AutoTokenizer``
    would pick the model type's class instead (``Qwen2Tokenizer`` for a qwen2 directory), which
    in transformers 5 rebuilds the pre-tokenizer and normaliser from that class's defaults, so a
    custom vocabulary encodes wrongly or to nothing. A built-in tiny model's (``tiny:...``) is the
    character tokenizer, built here: nothing is written for it.
    """
    if source.startswith(TINY_PREFIX):
        from agilerl.utils.tiny import char_tokenizer

        return char_tokenizer()
    from transformers import AutoTokenizer

    folder = Path(source).expanduser()
    if folder.is_dir() and not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(
            f"{source}: the model directory has no tokenizer ({', '.join(_TOKENIZER_FILES[:3])}, ...): save the "
            "model's tokenizer there (tokenizer.save_pretrained), or give the algorithm a tokenizer"
        )
    if _saved_tokenizer_class(source) in _GENERIC_TOKENIZER_CLASSES:
        try:
            from transformers import TokenizersBackend as Generic
        except ImportError:  # transformers 4
            from transformers import PreTrainedTokenizerFast as Generic
        tokenizer = Generic.from_pretrained(source)
    else:
        tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.padding_side = "left"
    return tokenizer


def _add_adapters(model: nn.Module, lora_config, use_reference: bool) -> nn.Module:
    import copy

    from peft import get_peft_model

    from agilerl.utils.peft_compat import quiet_peft

    # PEFT expands "all-linear" into the module names it found, in the config object: a copy keeps
    # the caller's config as written (it may build the next agent, of another model).
    lora_config = copy.deepcopy(lora_config)
    with quiet_peft():
        peft_model = get_peft_model(model, lora_config, adapter_name=ACTOR)
        if use_reference:
            peft_model.add_adapter(REFERENCE, lora_config)
    return peft_model


def _reinit_adapters(peft_model: nn.Module, use_reference: bool, seed: int) -> None:
    """Initialise every adapter with PEFT's own init for the config's ``init_lora_weights``, from
    one seed, in a fixed order.

    Construction draws differently on the meta device and on a real one, so
    every loading path re-initialises here: the actor adapters, layer by layer,
    then a reference adapter equal to the actor (the initial policy).
    """
    init = peft_model.peft_config[ACTOR].init_lora_weights
    torch.manual_seed(seed)
    layers = tuner_layers(peft_model)
    for layer in layers:
        if init is not False:
            layer.reset_lora_parameters(ACTOR, init)
            continue
        # PEFT's False: both factors drawn as a fresh layer's (not the identity)
        for factors in (layer.lora_A, layer.lora_B):
            if ACTOR in factors:
                factors[ACTOR].reset_parameters()
        for factors in (layer.lora_embedding_A, layer.lora_embedding_B):
            if ACTOR in factors:
                nn.init.normal_(factors[ACTOR])
    if use_reference:
        copy_adapter_(peft_model, ACTOR, REFERENCE)


def _init_adapters_on_cpu(peft_model: nn.Module, use_reference: bool, seed: int) -> dict[str, torch.Tensor]:
    """Initialise meta LoRA weights on CPU; return them by key and put them back on meta."""
    layers = tuner_layers(peft_model)
    for layer in layers:
        for attr in layer.adapter_layer_names:  # ModuleDicts / ParameterDicts of every adapter
            getattr(layer, attr).to_empty(device="cpu")
    _reinit_adapters(peft_model, use_reference, seed)
    state = {
        name.replace("_checkpoint_wrapped_module.", ""): p.detach().clone()
        for name, p in peft_model.named_parameters()
        if ".lora_" in name
    }
    for layer in layers:
        for attr in layer.adapter_layer_names:
            getattr(layer, attr).to(device="meta")
    return state


def attention_problem(attn_implementation: str | None) -> str | None:
    """Why the ``attn_implementation`` kernel cannot run here, or None: a FlashAttention kernel
    needs its package and a CUDA GPU, which transformers checks only once the weights load."""
    if attn_implementation is None or not attn_implementation.startswith("flash_attention_"):
        return None
    import transformers.utils as hf

    version = attn_implementation.removeprefix("flash_attention_")
    available = getattr(hf, f"is_flash_attn_{version}_available", None)
    if available is None or available():
        return None
    return (
        f"attn_implementation={attn_implementation!r} needs the flash-attn package (version {version}) and a "
        "CUDA GPU, which this machine does not have: install it, or use 'sdpa' (the default)"
    )


def check_model_length(source: str | None, actor_network: nn.Module | None, max_model_len: int | None) -> None:
    """Raise ValueError when ``max_model_len`` is longer than the model's positions (its config's
    ``max_position_embeddings``, stretched by its rope scaling's factor:
    :func:`agilerl.utils.sources.model_positions`), before any weight loads: the planner and vLLM
    refuse it too."""
    if max_model_len is None:
        return
    if actor_network is not None:
        config = actor_network.config
    else:
        from transformers import AutoConfig

        _quiet_transformers()
        config = AutoConfig.from_pretrained(source)
    from agilerl.utils.sources import described_positions

    known = described_positions(config.to_dict())
    if known is not None and max_model_len > known[0]:
        raise ValueError(
            f"max_model_len={max_model_len} is longer than the model's {known[0]} positions ({known[1]}): lower it"
        )


def check_adapter_targets(source: str | None, actor_network: nn.Module | None, lora_config, name: str) -> None:
    """Raise ValueError (LoraTargetError) when ``lora_config`` targets a module the model does not
    have: read off ``actor_network``, or off the model built from ``source``'s config on the meta
    device, so that it is said before the memory estimate is asked and before any weight loads."""
    from agilerl.utils.sources import check_lora_targets

    if lora_config is None:
        return
    model = actor_network
    if model is None:
        from transformers import AutoConfig, AutoModelForCausalLM

        _quiet_transformers()
        config = AutoConfig.from_pretrained(source)
        check_trainable(config.to_dict(), name)  # a multimodal checkpoint: its own line first
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    check_lora_targets(model, lora_config.target_modules, name)
    if lora_config.lora_dropout and actor_network is None:  # PEFT's refusal, said before any weight loads
        import copy

        from peft import get_peft_model

        from agilerl.utils.peft_compat import quiet_peft

        try:
            with torch.device("meta"), quiet_peft():
                get_peft_model(model, copy.deepcopy(lora_config))
        except ValueError as err:
            if "lora_dropout" not in str(err):
                raise
            raise ValueError(
                f"{name}: LoRA dropout {lora_config.lora_dropout:g}: these targets adapt the model's expert "
                "parameters, whose inputs PEFT cannot drop out: give lora dropout 0, or targets without the experts"
            ) from None


def build_actor(
    *,
    source: str | None,
    actor_network: nn.Module | None,
    lora_config,
    use_reference_adapter: bool,
    fsdp_config: FSDPConfig | None,
    gradient_checkpointing: bool,
    device: str,
    dtype: torch.dtype,
    attn_implementation: str | None,
    load_in_4bit: bool,
    seed: int,
    trainable: bool = True,
) -> tuple[nn.Module, list[nn.Parameter]]:
    """The actor (sharded when ``fsdp_config``) and its trainable parameters.

    With a ``lora_config`` the model is PEFT-wrapped and only the actor adapter trains. With
    ``lora_config=None`` (full fine-tuning) every parameter trains, and under FSDP2 the shards
    are fp32 masters (``dtype`` is then the compute dtype, FSDPConfig.param_dtype's job).
    ``trainable=False`` builds the frozen reference copy of full fine-tuning: no adapters,
    weights in ``dtype``, nothing trains.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    _quiet_transformers()
    attn = {"attn_implementation": attn_implementation} if attn_implementation else {}
    full = lora_config is None or not trainable
    if full and load_in_4bit:
        raise ValueError("load_in_4bit (QLoRA) needs LoRA adapters: 4-bit weights do not train")

    config = None if actor_network is not None else AutoConfig.from_pretrained(source)
    if config is not None:
        # A multimodal checkpoint (perhaps downloaded just now, so not checked before): one clear line.
        check_trainable(config.to_dict(), str(source))
    if fsdp_config is not None and config is not None:
        # Full fine-tuning keeps fp32 shards (the masters AdamW steps); FSDP2 computes in param_dtype.
        stored = torch.float32 if full and trainable else dtype
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=stored, **attn)
            if load_in_4bit:
                _bnb_config(dtype)  # bitsandbytes installed, or a clear error
                _four_bit_on_meta(model, dtype)
            peft_model = model if full else _add_adapters(model, lora_config, use_reference_adapter)
        lora_state = {} if full else _init_adapters_on_cpu(peft_model, use_reference_adapter, seed)
        _mark_trainable(peft_model, lora=not full, trainable=trainable)
        _skip_unread_kv_stores(peft_model)
        apply_fsdp2(peft_model, fsdp_config, gradient_checkpointing=gradient_checkpointing)
        from agilerl.utils.checkpoint_io import (
            ChainedState,
            ConvertedCheckpoint,
            LazyCheckpoint,
            PeftKeyView,
        )

        directory = _local_dir(source)
        std = getattr(config, "initializer_range", 0.02)
        four_bit = _four_bit_modules(peft_model) if load_in_4bit else {}
        if has_weights(directory):
            keys = [k.replace("_checkpoint_wrapped_module.", "") for k in peft_model.state_dict()]
            base: Any = PeftKeyView(ConvertedCheckpoint(LazyCheckpoint(directory), config.model_type), keys)
            if four_bit:
                from agilerl.utils.checkpoint_io import QuantisedView

                base = QuantisedView(base, four_bit, dtype=dtype, device=device)
            materialize_fsdp2_from_cpu_state(peft_model, ChainedState(base, lora_state), device)
        else:
            # A config without weights: random base weights, drawn per local shard (a 4-bit weight is
            # drawn whole, the same on every rank, and quantised: its quantisation state spans it).
            state: Any = lora_state
            if four_bit:
                from agilerl.utils.checkpoint_io import QuantisedView

                state = ChainedState(
                    QuantisedView(
                        {}, four_bit, dtype=dtype, device=device, fallback=lambda key, m: _random_weight(key, m, std)
                    ),
                    lora_state,
                )
            materialize_fsdp2_from_cpu_state(peft_model, state, device, strict=False)
            _randomise_base(peft_model, std)
        if load_in_4bit:
            _keep_nf4_layout(peft_model)
            _say_full_precision_experts(peft_model, dtype)
        return peft_model, _trainable(peft_model)

    if actor_network is not None:
        model = actor_network
        if full and fsdp_config is not None:
            model.to(torch.float32 if trainable else dtype)  # fp32 shards to train, the compute dtype to refer to
    else:
        kwargs: dict[str, Any] = {"dtype": dtype, **attn}
        if load_in_4bit:
            kwargs["quantization_config"] = _bnb_config(dtype, config)
            kwargs["device_map"] = {"": device}
        if has_weights(_local_dir(source)):
            model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
        elif load_in_4bit:
            model = _random_four_bit_model(config, dtype, attn, device)
        elif torch.device(device).type != "cpu":
            model = None  # random weights drawn on the device, adapters included
        else:
            model = AutoModelForCausalLM.from_config(
                config, **{k: v for k, v in kwargs.items() if k in ("dtype", "attn_implementation")}
            )
    if model is None:
        peft_model = _random_on_device(
            config, dtype, attn, device, None if full else lora_config, use_reference_adapter, seed
        )
    elif full:
        peft_model = model
    else:
        peft_model = _add_adapters(model, lora_config, use_reference_adapter)
        with torch.no_grad():
            _reinit_adapters(peft_model, use_reference_adapter, seed)
    _mark_trainable(peft_model, lora=not full, trainable=trainable)
    _skip_unread_kv_stores(peft_model)
    if fsdp_config is not None:
        apply_fsdp2(peft_model, fsdp_config, gradient_checkpointing=gradient_checkpointing)
    else:
        if gradient_checkpointing:
            apply_activation_checkpointing(peft_model, FSDPConfig())
        if not load_in_4bit:
            peft_model.to(device)
    if load_in_4bit:
        _keep_nf4_layout(peft_model)
        _say_full_precision_experts(peft_model, dtype)
    # After sharding: fully_shard replaces parameters with DTensor parameters.
    return peft_model, _trainable(peft_model)


def _skip_unread_kv_stores(model: nn.Module) -> None:
    """Stop attention layers storing their K and V for sharing when no layer reads them, and in a
    checkpoint's recompute when layers do.

    Gemma-3n's and Gemma 4's last layer of each attention type stores its K and V in the
    forward's ``shared_kv_states`` for the layers that reuse them (``num_kv_shared_layers``),
    and does so even when none does, for assistant models that read the states the forward
    returns. The trainer never asks for them, and under activation checkpointing each store
    layer's recompute in backward stores its recomputed K and V there, which keeps them and the
    tensors behind them (the K and V projections' inputs, their norms' fp32 copies) alive until
    the whole backward ends: measured on a tiny Gemma 4, 0.4-0.5 MiB per store layer at 256
    tokens, the learn peak's largest uncounted term. Layers that reuse K and V keep the store.
    """
    # Where layers reuse them, a checkpointed store layer's recompute in backward still need not store.
    # The layers reading them ran their backward already (they come later in the forward), and the
    # forward's stores stay as they were; a recomputed store would only be kept, with the graph
    # behind it, until the backward ends (measured on a tiny Gemma-3n sharing its last 2 of 6
    # layers' K and V, 512 tokens: 3.2 MiB of a 22.2 MiB learn peak). torch._C's graph task id is
    # -1 outside autograd's engine, which runs a non-reentrant checkpoint's recompute.
    for module, role in kv_sharing_roles(model).items():
        if role == "store":
            module.register_forward_pre_hook(_store_unless_recomputing)
        else:
            module.store_full_length_kv = False


def _store_unless_recomputing(module: nn.Module, args) -> None:
    """Store K and V in a forward, not in a checkpoint's recompute (run by autograd's engine)."""
    module.store_full_length_kv = torch._C._current_graph_task_id() == -1


def _mark_trainable(model: nn.Module, *, lora: bool, trainable: bool) -> None:
    """LoRA: only the actor adapter trains. Full fine-tuning: every floating-point parameter (or,
    for the frozen reference copy, none)."""
    if lora:
        mark_trainable(model)
        return
    for p in model.parameters():
        p.requires_grad_(trainable and p.is_floating_point())


def _keep_nf4_layout(model: nn.Module) -> None:
    """Keep every ``Linear4bit`` weight in the NF4 layout it was quantised in. On CPUs with
    AVX512-BF16, bitsandbytes repacks a 4-bit weight in place, at its first no-grad forward in eval
    mode, into a layout only its CPU inference kernel reads: a trainer switches between eval
    (rollout, reference) and train, FSDP2 shards the packed bytes, and the merge, the weight sync
    and checkpoints dequantise them, none of which read the repacked layout (and the repacking fails
    outright on a linear narrower than a quantisation block)."""
    import bitsandbytes as bnb

    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False


def _say_full_precision_experts(model: nn.Module, dtype: torch.dtype) -> None:
    """QLoRA quantises nn.Linear layers only: say so when packed routed experts (3-D parameters,
    most of a MoE model's weights) stay in the compute dtype."""
    from agilerl.distributed import is_main_process

    packed = [p for n, p in model.named_parameters() if p.dim() == 3 and ".lora_" not in n]
    if packed and is_main_process():
        size = sum(p.numel() for p in packed) * torch.empty((), dtype=dtype).element_size() / 2**30
        logger.warning(
            "[agilerl] QLoRA: the %d packed routed-expert tensors (%.2f GiB) stay in %s: bitsandbytes "
            "quantises nn.Linear layers only",
            len(packed),
            size,
            str(dtype).removeprefix("torch."),
        )


def _four_bit_on_meta(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """Swap, on the meta device, every linear transformers' bitsandbytes loader quantises
    (:func:`~agilerl.utils.sources.four_bit_linears`) for a ``Linear4bit`` whose weight already has
    the packed NF4 shape ``[in x out / 2, 1]`` in uint8: fully_shard then shards the packed bytes,
    and :class:`~agilerl.utils.checkpoint_io.QuantisedView` fills them. Returns the names swapped."""
    import bitsandbytes as bnb

    wanted = set(four_bit_linears(model))
    swapped = []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if full not in wanted:
                continue
            layer = bnb.nn.Linear4bit(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                compute_dtype=dtype,
                quant_type="nf4",
                quant_storage=torch.uint8,
                device="meta",
            )
            packed = torch.empty(child.in_features * child.out_features // 2, 1, dtype=torch.uint8, device="meta")
            layer.weight = bnb.nn.Params4bit(
                packed,
                requires_grad=False,
                quant_type="nf4",
                quant_storage=torch.uint8,
                bnb_quantized=True,
                module=layer,
            )
            if child.bias is not None:
                layer.bias = nn.Parameter(
                    torch.empty(child.out_features, dtype=dtype, device="meta"), requires_grad=False
                )
            setattr(parent, name, layer)
            swapped.append(full)
    return swapped


def _four_bit_modules(model: nn.Module) -> dict[str, nn.Module]:
    """State-dict key of each 4-bit weight -> its ``Linear4bit`` (checkpoint-wrapper prefixes dropped)."""
    import bitsandbytes as bnb

    return {
        f"{name}.weight".replace("_checkpoint_wrapped_module.", ""): m
        for name, m in model.named_modules()
        if isinstance(m, bnb.nn.Linear4bit)
    }


@torch.no_grad()
def place_empty(model: nn.Module, device: str | torch.device) -> None:
    """Allocate ``model``'s meta parameters and buffers on ``device``, uninitialised, in the order
    ``model.to(device)`` moves them (each module's children first, then its own tensors: the
    caching allocator's segments end up as a loaded model's), keeping tied parameters tied: torch's
    ``to_empty`` gives each module a copy of a tied weight of its own (a second embedding matrix)."""
    placed: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id -> (the meta one, kept alive; its twin)

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        for name, p in module._parameters.items():
            if p is None or p.device.type != "meta":
                continue
            if id(p) not in placed:
                placed[id(p)] = (p, nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad))
            module._parameters[name] = placed[id(p)][1]
        for name, b in module._buffers.items():
            if b is not None and b.device.type == "meta":
                module._buffers[name] = torch.empty_like(b, device=device)

    visit(model)


def _random_on_device(
    config, dtype: torch.dtype, attn: dict[str, Any], device: str, lora_config, use_reference: bool, seed: int
) -> nn.Module:
    """A model from a config without weights (probes on a GPU), its random weights drawn where they
    live: built on the meta device, the adapters added there, placed on ``device`` as ``.to(device)``
    places a loaded model, then initialised by transformers' own ``initialize_weights`` (the same
    distributions as ``from_config``: normal linears and embeddings, unit norms, zero biases, rotary
    frequencies) and the adapters by the one CPU draw every loading path shares. Drawing on the host
    and copying costs what a CPU spends drawing (about 18 s per billion parameters on one core: a 7B
    probe spent minutes before its first step); on the device it costs nothing."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **attn)
        peft_model = model if lora_config is None else _add_adapters(model, lora_config, use_reference)
    lora_state = {} if lora_config is None else _init_adapters_on_cpu(peft_model, use_reference, seed)
    place_empty(peft_model, device)
    model.initialize_weights()  # every base tensor, buffers too (ties kept by place_empty); adapters below
    params = dict(peft_model.named_parameters())
    with torch.no_grad():
        for name, value in lora_state.items():
            params[name].copy_(value)
    return peft_model


def _random_four_bit_model(config, dtype: torch.dtype, attn: dict[str, Any], device: str) -> nn.Module:
    """QLoRA from a config without weights (probes): random weights, the linears quantised to NF4."""
    from transformers import AutoModelForCausalLM

    from agilerl.distributed import reinit_non_persistent_buffers, set_full_model_state_dict
    from agilerl.utils.checkpoint_io import QuantisedView

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **attn)
        _four_bit_on_meta(model, dtype)
    place_empty(model, device)
    reinit_non_persistent_buffers(model)
    std = getattr(config, "initializer_range", 0.02)
    _randomise_base(model, std)
    four_bit = _four_bit_modules(model)
    set_full_model_state_dict(
        model,
        QuantisedView({}, four_bit, dtype=dtype, device=device, fallback=lambda key, m: _random_weight(key, m, std)),
        strict=False,
    )
    import bitsandbytes as bnb

    for layer in four_bit.values():  # unsharded: the weight carries its state, as from_pretrained leaves it
        layer.weight = bnb.nn.Params4bit(
            layer.weight.data,
            requires_grad=False,
            quant_state=layer.quant_state,
            quant_type="nf4",
            quant_storage=torch.uint8,
            bnb_quantized=True,
            module=layer,
        )
    return model


def _random_weight(key: str, module: nn.Module, std: float) -> torch.Tensor:
    """A full random weight for a 4-bit module, the same on every rank (seeded by its key)."""
    import zlib

    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randn(module.out_features, module.in_features, generator=g) * std


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def has_weights(directory: str | Path) -> bool:
    d = Path(directory)
    return (
        any(d.glob("*.safetensors"))
        or any(d.glob("pytorch_model*.bin"))
        or (d / "model.safetensors.index.json").exists()
    )


@torch.no_grad()
def _randomise_base(model: nn.Module, std: float) -> None:
    for name, p in model.named_parameters():
        if ".lora_" not in name and p.is_floating_point():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.normal_(0.0, std)


def _local_dir(source: str) -> str:
    if Path(source).is_dir():
        return source
    if Path(source).is_file():  # a config.json
        return str(Path(source).parent)
    from huggingface_hub import snapshot_download

    # Resolves from the local cache; downloads only where the user allows it.
    return snapshot_download(source, allow_patterns=["*.safetensors", "*.json", "*.bin", "*.model", "*.txt"])


def _bnb_config(dtype: torch.dtype, config=None):
    """The loader's NF4 settings; given the model's ``config``, it also lists every linear that
    :func:`~agilerl.utils.sources.four_bit_linears` keeps in ``dtype`` (read on the meta device), so
    the loader quantises exactly what the meta-device path and the planner count."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "load_in_4bit (QLoRA) needs bitsandbytes: `pip install 'agilerl-fsdp-planner[qlora]'`"
        ) from err
    from transformers import BitsAndBytesConfig

    keep = None
    if config is not None:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        four_bit = set(four_bit_linears(model))
        keep = [name for name, m in model.named_modules() if type(m) is nn.Linear and name not in four_bit]
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_use_double_quant=True,
        llm_int8_skip_modules=keep,
    )
