"""Shared machinery of the LLM algorithms: launch checks, the actor, phases, checkpoints.

Memory behaviour is deliberate and named by phase (DESIGN.md): ``rollout``
(generation), ``reference`` (no-grad reference / old log-prob passes),
``learn`` (forward + backward of one micro-batch), ``step`` (clip and
optimizer step), ``save``. A ``phase_observer`` (the probe's memory tracker)
is entered around each.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from agilerl.distributed import (
    FSDPConfig,
    build_optimizer,
    full_optimizer_state_dict,
    full_tensors,
    get_rank,
    get_world_size,
    init_distributed,
    is_distributed,
    is_main_process,
    load_full_optimizer_state_dict,
    resolve_device,
    set_full_model_state_dict,
)
from agilerl.utils.algo_utils import VLLMConfig

from .adapters import ACTOR, REFERENCE, adapter_state_dict, copy_adapter_

__all__ = ["LLMAlgorithm", "normalise_fsdp_config"]

CHECKPOINT_FILE = "attributes.pt"


def normalise_fsdp_config(value: Any) -> FSDPConfig | str | None:
    """``None``/``False`` -> None; ``True`` -> defaults; a dict -> its fields; "auto" kept."""
    if value is None or value is False:
        return None
    if value is True:
        return FSDPConfig()
    if isinstance(value, FSDPConfig):
        return value
    if isinstance(value, dict):
        return FSDPConfig.model_validate(value)
    if isinstance(value, str) and value == "auto":
        return "auto"
    raise TypeError(f"fsdp_config must be an FSDPConfig, a dict of its fields, True, 'auto' or None; got {value!r}")


class LLMAlgorithm:
    """Base of GRPO (and later the other LLM algorithms)."""

    algo_name = "LLM"

    def __init__(
        self,
        *,
        model_name: str | None,
        actor_network: nn.Module | None,
        pad_token_id: int | None,
        pad_token: str | None,
        lora_config,
        fsdp_config,
        vllm_config: VLLMConfig | None,
        gradient_checkpointing: bool,
        use_separate_reference_adapter: bool,
        load_in_4bit: bool,
        device: str | None,
        dtype: str,
        attn_implementation: str | None,
        seed: int,
        index: int,
        tokenizer=None,
    ) -> None:
        if (model_name is None) == (actor_network is None):
            raise ValueError("pass exactly one of model_name (a local path or hub id) and actor_network")
        if pad_token_id is None or pad_token is None:
            raise ValueError(
                "pad_token_id and pad_token are required (for example tokenizer.pad_token_id and "
                "tokenizer.pad_token; set tokenizer.pad_token = tokenizer.eos_token if it has none)"
            )
        self.fsdp_config = normalise_fsdp_config(fsdp_config)
        self.distributed = init_distributed()
        if isinstance(self.fsdp_config, FSDPConfig) and not is_distributed():
            raise RuntimeError(
                "fsdp_config shards the actor across ranks and needs a torch.distributed process group. "
                "Launch with torchrun (for example `torchrun --nproc_per_node=2 train.py`), or pass "
                "fsdp_config=None to train on one device."
            )
        if isinstance(self.fsdp_config, FSDPConfig):
            if self.fsdp_config.cpu_offload and vllm_config is None:
                raise ValueError(
                    "FSDPConfig(cpu_offload=True) needs a colocated vLLM engine (vllm_config): Hugging Face "
                    "generate assumes weights stay on the compute device. Use optim_cpu_offload=True to "
                    "offload only the optimizer."
                )
            if load_in_4bit and self.fsdp_config.cpu_offload:
                raise ValueError(
                    "QLoRA (load_in_4bit=True) with FSDPConfig(cpu_offload=True) is not supported: the 4-bit "
                    "quantisation state stays on the device. Use optim_cpu_offload=True to offload the optimizer."
                )
        if vllm_config is not None:
            from agilerl.utils.engine import require_vllm

            require_vllm()

        self.model_name = model_name
        self.pad_token_id = int(pad_token_id)
        self.pad_token = pad_token
        self.lora_config = lora_config
        self.vllm_config = vllm_config
        self.gradient_checkpointing = gradient_checkpointing
        self.use_separate_reference_adapter = use_separate_reference_adapter
        self.load_in_4bit = load_in_4bit
        self.dtype = getattr(torch, dtype)
        self.attn_implementation = attn_implementation
        self.seed = seed
        self.index = index
        self.rank = get_rank()
        self.world_size = get_world_size()
        self.device = resolve_device(device)
        self.tokenizer = tokenizer
        from .loading import resolve_model_source

        # Collective (rank 0 may write a built-in model while the others wait): every rank, now.
        self.model_source = resolve_model_source(model_name) if model_name else None
        self.phase_observer: Callable[[str], ContextManager] | None = None
        self.steps = 0
        self.scores: list[float] = []
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    # -- properties ----------------------------------------------------------------
    @property
    def sharded(self) -> bool:
        return isinstance(self.fsdp_config, FSDPConfig)

    @property
    def data_parallel_ranks(self) -> int:
        tp = self.fsdp_config.tp if self.sharded else 1
        return max(1, self.world_size // tp)

    @property
    def data_parallel_rank(self) -> int:
        tp = self.fsdp_config.tp if self.sharded else 1
        return self.rank // tp

    # -- actor -----------------------------------------------------------------------
    def _build(self, actor_network: nn.Module | None) -> None:
        from .loading import build_actor, load_tokenizer

        source = self.model_source
        if source is not None and self.model_name is not None and not self.model_name.startswith("tiny:"):
            from agilerl.utils.sources import check_model_source

            # A missing path, a bad config or an unreachable hub: one clear error now, not the hub client's retries.
            check_model_source(source, allow_download=True)
        if self.tokenizer is None and source is not None:
            try:
                self.tokenizer = load_tokenizer(source)
            except (OSError, ValueError, TypeError):
                self.tokenizer = None  # a config without a tokenizer: prompts must come tokenized
        torch.manual_seed(self.seed)
        self.model, self.trainable_params = build_actor(
            source=source,
            actor_network=actor_network,
            lora_config=self.lora_config,
            use_reference_adapter=self.use_separate_reference_adapter,
            fsdp_config=self.fsdp_config if self.sharded else None,
            gradient_checkpointing=self.gradient_checkpointing,
            device=self.device,
            dtype=self.dtype,
            attn_implementation=self.attn_implementation,
            load_in_4bit=self.load_in_4bit,
            seed=self.seed,
        )
        if self.sharded:
            from agilerl.distributed import register_forward_method

            # generate() bypasses the root's forward; this routes it through FSDP's root hooks.
            register_forward_method(self.model, "generate")
        self.optimizer = build_optimizer(
            self.trainable_params, fsdp_config=self.fsdp_config if self.sharded else None, lr=self.lr
        )
        # Every rank built the same adapters from one seed; from here on, sampling must differ
        # between data-parallel ranks (two ranks may hold copies of the same prompt) and match
        # within a tensor-parallel group.
        torch.manual_seed(self.seed + 1_000_003 * self.data_parallel_rank)

    def _phase(self, name: str) -> ContextManager:
        return self.phase_observer(name) if self.phase_observer is not None else contextlib.nullcontext()

    def update_reference(self) -> None:
        """Make the reference policy the current actor (separate reference adapter only)."""
        if not self.use_separate_reference_adapter:
            raise ValueError("update_reference needs use_separate_reference_adapter=True")
        copy_adapter_(self.model, ACTOR, REFERENCE)

    # -- checkpoints -------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        return {"algo": self.algo_name, "steps": self.steps, "scores": list(self.scores), "index": self.index}

    def save_checkpoint(self, path: str | Path, *, extra: dict[str, Any] | None = None) -> Path:
        """Write ``path/attributes.pt``: gathered adapter weights, optimizer state, attributes,
        every rank's RNG states, and ``extra`` (the caller's own state, e.g. a data position).

        The same layout on one device and under FSDP2 (every rank must call this
        under FSDP2; rank 0 writes). The file is written atomically (temporary
        file, fsync, rename): a kill mid-save leaves the previous checkpoint whole.
        """
        from agilerl.utils.checkpoint_io import atomic_save

        path = Path(path)
        rng = _gather(_rng_state())
        with self._phase("save"):
            keep = is_main_process()
            adapters = [ACTOR] + ([REFERENCE] if self.use_separate_reference_adapter else [])
            # Only the adapters are saved: gather them one tensor at a time, never the base.
            weights = {name: full_tensors(self.model, adapter_state_dict(self.model, name), keep=keep)
                       for name in adapters}
            optim = full_optimizer_state_dict(self.model, self.optimizer, keep=keep)
        if keep:
            path.mkdir(parents=True, exist_ok=True)
            payload = {**self.checkpoint_state(), "adapters": weights, "optimizer": optim, "rng": rng,
                       "world_size": self.world_size, "extra": dict(extra or {})}
            atomic_save(payload, path / CHECKPOINT_FILE)
        if is_distributed():
            torch.distributed.barrier()
        return path / CHECKPOINT_FILE

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Load a checkpoint written by :meth:`save_checkpoint` (on any number of ranks); return its ``extra``.

        Each rank takes back its own RNG states when the checkpoint was written
        on as many ranks (so sampling continues as if never stopped); otherwise
        they keep their current ones.
        """
        path = Path(path)
        file = path / CHECKPOINT_FILE if path.is_dir() else path
        if not file.exists():
            raise FileNotFoundError(f"no checkpoint at {file}")
        payload = torch.load(file, map_location="cpu", weights_only=False)
        if payload.get("algo") != self.algo_name:
            raise ValueError(f"{file} is a {payload.get('algo')} checkpoint, not {self.algo_name}")
        for name, weights in payload["adapters"].items():
            if name == REFERENCE and not self.use_separate_reference_adapter:
                continue
            set_full_model_state_dict(self.model, weights, strict=False)
        load_full_optimizer_state_dict(self.model, self.optimizer, payload["optimizer"])
        self.steps = payload.get("steps", 0)
        self.scores = list(payload.get("scores", []))
        rng = payload.get("rng")
        if rng and len(rng) == self.world_size:
            _set_rng_state(rng[self.rank])
        return dict(payload.get("extra", {}))


def _rng_state() -> dict[str, Any]:
    """This rank's random states: Python's, torch's CPU generator and, where present, the current CUDA one."""
    import random

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import random

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _gather(obj: Any) -> list[Any]:
    """``obj`` from every rank, in rank order (a list of one without a process group)."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out
