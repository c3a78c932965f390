"""Shared machinery of the LLM algorithms: launch checks, the actor (LoRA or every
parameter), the reference policy, the log-prob forward, the optimizer step, checkpoints.

Memory behaviour is deliberate and named by phase (docs/accuracy.md): ``rollout``
(generation), ``reference`` (no-grad reference / old log-prob passes),
``learn`` (forward + backward of one micro-batch), ``step`` (clip and
optimizer step), ``save``. A ``phase_observer`` (the probe's memory tracker)
is entered around each.

A subclass sets its own attributes (``batch_size``, ``group_size`` and whatever its
objective needs) and then calls ``LLMAlgorithm.__init__``, which validates, resolves the
"auto" knobs from the memory estimate and builds the actor, its optimizer and, for full
fine-tuning with a reference policy, the frozen reference copy.

**Full fine-tuning** (``lora_config=None``) trains every parameter with fp32 master
weights: under FSDP2 the sharded parameters themselves are fp32, gathered and computed
in ``FSDPConfig.param_dtype`` and reduce-scattered into fp32 gradient shards; on one
device and data parallel the model computes in ``dtype`` and
:class:`~agilerl.distributed.MasterWeightAdamW` keeps an fp32 master, an fp32 gradient
accumulator and the fp32 moments beside each weight (Megatron-LM's mixed precision). The
reference policy, which LoRA gets by disabling its adapters, is then a frozen copy of the
initial model in ``dtype``, sharded like the actor.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import numbers
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from agilerl.distributed import (
    DTYPE_NAMES,
    FSDPConfig,
    barrier,
    build_optimizer,
    clip_grad_norm_,
    dtype_name,
    full_optimizer_state_dict,
    full_tensors,
    get_rank,
    get_world_size,
    init_distributed,
    is_distributed,
    is_main_process,
    load_full_optimizer_state_dict,
    materialize_dtensors,
    resolve_device,
    set_full_model_state_dict,
    sync_grads,
)
from agilerl.utils.algo_utils import VLLMConfig, four_bit_problem
from agilerl.utils.logprobs import (
    causal_lm,
    chunked_token_logprobs,
    final_norm,
    full_causal,
    last_position_only,
    linear_token_logprobs,
    logit_multiplier,
    output_head,
    position_ids_from_mask,
    shared_attention_mask,
)
from agilerl.utils.shared_prefix import shared_prefix_problem

from .adapters import ACTOR, REFERENCE, adapter_state_dict, copy_adapter_, use_adapter
from .loading import DEFAULT_LORA, attention_problem, resolve_lora_config

__all__ = ["LLMAlgorithm", "normalise_fsdp_config", "on_rank0", "check_hyperparameters", "DEFAULT_LORA"]

logger = logging.getLogger(__name__)

CHECKPOINT_FILE = "attributes.pt"


#: The range of every numeric hyperparameter of the algorithms, each also finite: (lowest, whether
#: the lowest is allowed, highest or None). The manifest's fields keep the same bounds (a test
#: holds the two together).
HYPERPARAMETER_RANGES: dict[str, tuple[float, bool, float | None]] = {
    "lr": (0.0, False, None),
    "value_lr": (0.0, False, None),
    "max_grad_norm": (0.0, False, None),
    "temperature": (0.0, False, None),
    "beta": (0.0, True, None),
    "clip_coef": (0.0, False, None),
    "clip_coef_high": (0.0, False, None),
    "vf_coef": (0.0, False, None),
    "clip_coef_value": (0.0, False, None),
    "nll_alpha": (0.0, True, None),
    "gamma": (0.0, True, 1.0),
    "gae_lambda": (0.0, True, 1.0),
}


def check_hyperparameters(**values: Any) -> None:
    """Raise ValueError naming the first of ``values`` (hyperparameters by name) that is not a
    finite number in its range (HYPERPARAMETER_RANGES)."""
    for name, value in values.items():
        low, low_allowed, high = HYPERPARAMETER_RANGES[name]
        if high is not None:
            wanted = f"in [{low:g}, {high:g}]"
        else:
            wanted = f"a finite number {'>=' if low_allowed else '>'} {low:g}"
        number = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if (
            not number
            or not math.isfinite(value)
            or value < low
            or (value == low and not low_allowed)
            or (high is not None and value > high)
        ):
            raise ValueError(f"{name} must be {wanted}, got {value!r}")


def _is_count(value: Any) -> bool:
    """Whether ``value`` is an int >= 1 (a bool is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_counts(**values: Any) -> None:
    """Raise ValueError naming the first of ``values`` that is not an int >= 1."""
    for name, value in values.items():
        if not _is_count(value):
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _check_knobs(logprob_chunk_size: Any, gradient_checkpointing: Any, seed: Any) -> None:
    """Raise ValueError naming the first of an algorithm's knobs of the wrong type or value."""
    if logprob_chunk_size is not None and logprob_chunk_size != "auto" and not _is_count(logprob_chunk_size):
        raise ValueError(
            f"logprob_chunk_size must be an int >= 1, None (unchunked) or 'auto', got {logprob_chunk_size!r}"
        )
    if not (isinstance(gradient_checkpointing, bool) or gradient_checkpointing == "auto"):
        raise ValueError(f"gradient_checkpointing must be True, False or 'auto', got {gradient_checkpointing!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int, got {seed!r}")


def resolve_dtype(value: Any) -> torch.dtype:
    """The base weights' dtype from an algorithm's ``dtype``: a name FSDPConfig's dtype fields
    take ("bfloat16", "bf16", "float32", "fp32", ...) or a torch.dtype."""
    try:
        return getattr(torch, dtype_name(value, "dtype"))
    except ValueError:  # said with the aliases, for an argument that takes them all
        raise ValueError(
            f"dtype must be a torch.dtype or one of {sorted(set(DTYPE_NAMES.values()))} (or an alias: "
            f"{sorted(k for k in DTYPE_NAMES if k not in DTYPE_NAMES.values())}), got {value!r}"
        ) from None


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


def on_rank0(fn, *args) -> dict[str, Any]:
    """``fn(*args)`` on rank 0, its dict result broadcast to every rank; an exception becomes
    ``{"error": "Type: message"}`` on every rank, so no rank waits on a failed rank 0."""
    from agilerl.distributed import broadcast_object_list

    payload = [None]
    if is_main_process():
        try:
            payload = [fn(*args)]
        except Exception as err:  # every rank must learn about the failure, not only rank 0
            payload = [{"error": f"{type(err).__name__}: {err}"}]
    broadcast_object_list(payload, src=0)
    return payload[0]


@contextlib.contextmanager
def _forward_without_grad(module: nn.Module):
    """Run ``module``'s forward with grad disabled, FSDP2's hooks around it included, while the
    context is open: FSDP2 then registers no backward hooks for its unit (its pre-forward hook
    comes after ours, its post-forward hook before)."""
    modes: list[bool] = []

    def enter(_module, _args):
        modes.append(torch.is_grad_enabled())
        torch.set_grad_enabled(False)

    def leave(_module, _args, _output):
        if modes:  # (always called: also when the forward raised before ``enter`` ran)
            torch.set_grad_enabled(modes.pop())

    before = module.register_forward_pre_hook(enter, prepend=True)
    after = module.register_forward_hook(leave, always_call=True)
    mode = torch.is_grad_enabled()
    try:
        yield
    finally:
        before.remove()
        after.remove()
        torch.set_grad_enabled(mode)


def _peft_actor_problem(actor_network: nn.Module | None) -> str | None:
    """Why a PEFT model cannot be the actor as given, or None: the agent adds its own adapters."""
    if actor_network is None or not type(actor_network).__module__.startswith("peft."):
        return None
    return (
        f"actor_network is a PEFT {type(actor_network).__name__}: the agent adds its own adapters, "
        "so yours would not be the starting policy. Pass actor_network.merge_and_unload() to "
        "start from it (its adapters folded into the base), or actor_network.unload() (the base "
        "without them) with lora_config=actor_network.peft_config['default'] to train adapters of "
        "that shape anew"
    )


def _four_bit_source_problem(full_finetune: bool, actor_network: nn.Module | None) -> str | None:
    """Why ``load_in_4bit`` cannot build this actor, or None: 4-bit weights do not train, and a
    given network is used as it is (only a model loaded from model_name is quantised)."""
    if full_finetune:
        return (
            "load_in_4bit (QLoRA) trains LoRA adapters on a frozen 4-bit base: give a lora_config, "
            "or load_in_4bit=False to fine-tune every parameter"
        )
    if actor_network is not None:
        return (
            "load_in_4bit quantises the model it loads from model_name; an actor_network is used as "
            "given: pass one already in 4-bit, with load_in_4bit=False, or a model_name"
        )
    return None


class LLMAlgorithm:
    """Base of the LLM algorithms (GRPO and those on its loop, LLMPPO, SFT, DPO)."""

    algo_name = "LLM"
    #: Hyperparameters saved in a checkpoint beside the shared ones: the algorithm's, and those a
    #: variant of it adds (CISPO's clip_coef_high beside GRPO's).
    algorithm_hyperparameters: tuple[str, ...] = ()
    extra_hyperparameters: tuple[str, ...] = ()
    #: Hugging Face generate runs on the actor's weights (GRPO and LLMPPO): "auto" may gather them.
    generates = False

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
        lr: float,
        max_grad_norm: float,
        micro_batch_size_per_gpu: int | None,
        logprob_chunk_size: int | None | str,
        gradient_checkpointing: bool | str,
        temperature: float,
        max_model_len: int | None,
        share_prompt_prefix: bool,
        use_separate_reference_adapter: bool,
        load_in_4bit: bool,
        device: str | None,
        dtype: str,
        attn_implementation: str | None,
        seed: int,
        index: int,
        tokenizer=None,
        gather_weights_for_rollout: bool | str = False,
        rollout_engine=None,
    ) -> None:
        if (model_name is None) == (actor_network is None):
            raise ValueError("pass exactly one of model_name (a local path or hub id) and actor_network")
        if pad_token_id is None or pad_token is None:
            raise ValueError(
                "pad_token_id and pad_token are required (for example tokenizer.pad_token_id and "
                "tokenizer.pad_token; set tokenizer.pad_token = tokenizer.eos_token if it has none)"
            )
        _check_knobs(logprob_chunk_size, gradient_checkpointing, seed)
        check_hyperparameters(lr=lr, max_grad_norm=max_grad_norm, temperature=temperature)
        base_dtype = resolve_dtype(dtype)
        lora_config = resolve_lora_config(lora_config)
        self.full_finetune = lora_config is None
        if self.full_finetune and use_separate_reference_adapter:
            raise ValueError(
                "use_separate_reference_adapter needs LoRA adapters; full fine-tuning (lora_config=None) "
                "keeps the reference policy as a frozen copy of the model"
            )
        if load_in_4bit and (problem := _four_bit_source_problem(self.full_finetune, actor_network)):
            raise ValueError(problem)
        if problem := _peft_actor_problem(actor_network):
            raise ValueError(problem)
        self.fsdp_config = normalise_fsdp_config(fsdp_config)
        self.distributed = init_distributed()
        if isinstance(self.fsdp_config, FSDPConfig) and not is_distributed():
            raise RuntimeError(
                "fsdp_config shards the actor across ranks and needs a torch.distributed process group. "
                "Launch with torchrun (for example `torchrun --nproc_per_node=2 train.py`), or pass "
                "fsdp_config=None to train on one device."
            )
        if isinstance(self.fsdp_config, FSDPConfig):
            if self.fsdp_config.cpu_offload and vllm_config is None and rollout_engine is None and self.generates:
                raise ValueError(
                    "FSDPConfig(cpu_offload=True) needs a colocated vLLM engine (vllm_config): Hugging Face "
                    "generate assumes weights stay on the compute device. Use optim_cpu_offload=True to "
                    "offload only the optimizer."
                )
            config = self.fsdp_config
            if problem := four_bit_problem(load_in_4bit, cpu_offload=config.cpu_offload, tp=config.tp):
                raise ValueError(problem)
        if vllm_config is not None:
            from agilerl.utils.engine import require_vllm

            require_vllm()

        self.model_name = model_name
        self.pad_token_id = int(pad_token_id)
        self.pad_token = pad_token
        self.lora_config = lora_config
        self.vllm_config = vllm_config
        self.lr = lr
        self.max_grad_norm = max_grad_norm
        self.temperature = temperature
        self.max_model_len = max_model_len
        # The knobs given as "auto", which the memory estimate sets. With a vLLM engine Hugging
        # Face generate does not run: there is no rollout gather to choose.
        gather_auto = (
            self.generates and gather_weights_for_rollout == "auto" and vllm_config is None and rollout_engine is None
        )
        self.auto_knobs: frozenset[str] = frozenset(
            name
            for name, auto in (
                ("logprob_chunk_size", logprob_chunk_size == "auto"),
                ("gradient_checkpointing", gradient_checkpointing == "auto"),
                ("gather_weights_for_rollout", gather_auto),
            )
            if auto
        )
        # Until the estimate says otherwise "auto" is off: it costs memory, unit-by-unit never does.
        self.gather_weights_for_rollout = gather_weights_for_rollout is True
        self.logprob_chunk_size = 1024 if logprob_chunk_size == "auto" else logprob_chunk_size
        self.gradient_checkpointing = True if gradient_checkpointing == "auto" else gradient_checkpointing
        self.share_prompt_prefix = bool(share_prompt_prefix)
        self._prefix_problems: dict[int, str | None] = {}
        self.use_separate_reference_adapter = use_separate_reference_adapter
        self.load_in_4bit = load_in_4bit
        self.dtype = base_dtype
        if problem := attention_problem(attn_implementation):
            raise ValueError(problem)
        self.attn_implementation = attn_implementation
        self.seed = seed
        self.index = index
        self.rank = get_rank()
        self.world_size = get_world_size()
        self.device = resolve_device(device)
        self.tokenizer = tokenizer
        # A built-in tiny model keeps its name until fsdp_config="auto" has planned it (the planner
        # reads tiny names as configs): a run the plan refuses never builds its weights.
        self.model_source = model_name
        self.phase_observer: Callable[[str], ContextManager] | None = None
        self.steps = 0
        self.scores: list[float] = []
        self.model: nn.Module | None = None
        self.reference_model: nn.Module | None = None
        self._reference_updated = False
        self.optimizer: torch.optim.Optimizer | None = None
        # trainable modules beside the model (a value head), their parameters and optimizer
        self.heads: dict[str, nn.Module] = {}
        self.head_params: list[nn.Parameter] = []
        self.head_optimizer: torch.optim.Optimizer | None = None
        self.plan = None
        if self.fsdp_config == "auto":
            micro_batch_size_per_gpu = self._resolve_auto_fsdp(actor_network, micro_batch_size_per_gpu)
        from .loading import resolve_model_source

        # Collective (rank 0 may write a built-in model while the others wait): every rank, now.
        self.model_source = resolve_model_source(model_name) if model_name else None
        self.micro_batch_size_per_gpu = self._check_batch_shape(micro_batch_size_per_gpu)
        if self.model_source is not None and not model_name.startswith("tiny:"):
            from agilerl.utils.sources import check_model_source

            # A missing path, a bad config or an unreachable hub: one clear error before any
            # check reads the config, not the hub client's retries or its repo-id complaint.
            check_model_source(self.model_source, allow_download=True)
        self._check_before_loading(actor_network, lora_config, model_name)
        if self.plan is None and self.auto_knobs:
            self._resolve_auto_knobs(actor_network)
        if self.sharded:
            self._resolve_open_fsdp_fields(actor_network)
        self._build(actor_network)

    def _check_before_loading(self, actor_network: nn.Module | None, lora_config, model_name: str | None) -> None:
        """What the model's config refuses (LoRA targets it lacks, a max_model_len over its
        positions), said before the memory estimate is asked and any weight loads
        (fsdp_config='auto' asked the planner already, which refuses them with the same lines)."""
        from .loading import check_adapter_targets, check_model_length

        name = model_name or type(actor_network).__name__
        check_adapter_targets(self.model_source, actor_network, lora_config, name)
        check_model_length(self.model_source, actor_network, self.max_model_len)

    # -- what each algorithm says about itself -------------------------------------
    #: Sequences per example of a step's batch (GRPO: its completions per prompt; SFT 1; DPO 2).
    group_size: int = 1

    @property
    def needs_reference(self) -> bool:
        """Whether the objective reads the reference policy's log-probs."""
        return False

    def workload_fields(self) -> tuple[dict[str, Any], str | None]:
        """The planner's Workload fields this algorithm decides (batch, group, lengths, beta,
        epochs, generation) and, where a length had to be assumed, a line saying so. The offline
        objectives see their lengths only in their data: ``max_model_len`` (default 1024) is
        planned as half prompt, half completion."""
        total = self.max_model_len or 1024
        completion = max(1, total // 2)
        fields = dict(
            prompts_per_step=self.batch_size,
            group_size=self.group_size,
            prompt_tokens=max(1, total - completion),
            completion_tokens=completion,
            beta=getattr(self, "beta", 0.0),
            generation="none",
        )
        note = None if self.max_model_len else (f"assumed sequences of {total} tokens, half prompt and half completion")
        return fields, note

    def local_examples(self, num_examples: int) -> slice:
        """This rank's slice of a step's ``num_examples`` examples (prompts, pairs): each data-parallel
        rank trains on its own share, a tensor-parallel group on the same one."""
        ranks = self.data_parallel_ranks
        if num_examples % ranks:
            raise ValueError(f"{num_examples} examples do not split over {ranks} data-parallel ranks")
        per = num_examples // ranks
        return slice(self.data_parallel_rank * per, (self.data_parallel_rank + 1) * per)

    @property
    def sequences_per_step(self) -> int:
        """Sequences (completions) a step trains on across every rank."""
        return self.batch_size * self.group_size

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

    # -- the "auto" knobs, from the memory estimate -----------------------------------
    def _resolve_auto_fsdp(self, actor_network: nn.Module | None, micro: int | None) -> int | None:
        """Ask the planner (on rank 0), share its choice with every rank, apply and log it. On a
        single device without a launcher nothing can shard: the plan is unsharded, and a run that
        does not fit is refused before any weight loads, as it is under a launcher. On a GPU the
        plan judges the node's host memory too (``autoplan.node_memory_bytes``): a run whose ranks
        the host cannot hold, a full fine-tune's save that rank 0 cannot gather included, is
        refused the same way."""
        from .autoplan import least_visible_cluster, plan_for_agent

        cluster = least_visible_cluster(self.world_size, judge_host=True)
        sharding = "auto" if self.distributed else "none"
        result = on_rank0(plan_for_agent, self, actor_network, micro, cluster, sharding)
        if "error" in result:  # what the planner refuses (a LoRA target, a batch): one line, as input errors are
            raise ValueError(f"fsdp_config='auto': the planner failed: {result['error']}")
        if not self.distributed:
            logger.info(
                "[agilerl] fsdp_config='auto' on a single device without a launcher: no sharding needed, "
                "training unsharded"
            )
        self.plan = result
        self.fsdp_config = FSDPConfig.model_validate(result["fsdp"]) if result["fsdp"] is not None else None
        self._take_auto_knobs(result)  # logs the plan's table
        if not result["fits"]:
            instead = "; ".join(result["suggestions"])
            instead = f"; what would fit: {instead}" if instead else ""
            if result["host_over"] is not None:  # the GPUs fit; this node's RAM does not
                raise ValueError(
                    f"fsdp_config='auto': the plan fits the GPUs, but it needs {result['host_over']} "
                    f"(this node's RAM, or its cgroup's limit, less the margin){instead}"
                )
            raise ValueError(
                f"fsdp_config='auto': no configuration fits in {result['capacity_gib']:.1f} GiB per device (the "
                f"most frugal needs {result['peak_gib']:.1f} GiB){instead}"
            )
        return micro if micro is not None else result["micro_batch_size_per_gpu"]

    def _resolve_auto_knobs(self, actor_network: nn.Module | None) -> None:
        """gradient_checkpointing / logprob_chunk_size / gather_weights_for_rollout "auto" without
        fsdp_config="auto" (one device, data parallel, an explicit FSDPConfig): rank 0 asks the memory
        estimate, every rank applies the same. Should the estimate fail, the safe defaults stay
        (checkpointing on, 1024-row chunks, no gather) and the reason is logged."""
        from .autoplan import least_visible_cluster, pick_auto_knobs

        cluster = least_visible_cluster(self.world_size)
        result = on_rank0(pick_auto_knobs, self, actor_network, self.micro_batch_size_per_gpu, cluster)
        if "error" in result:
            if is_main_process():
                logger.warning(
                    "[agilerl] 'auto' kept its defaults (gradient_checkpointing=True, "
                    "logprob_chunk_size=1024, gather_weights_for_rollout=False): "
                    "the memory estimate failed (%s)",
                    result["error"],
                )
            return
        self._take_auto_knobs(result)

    def _take_auto_knobs(self, result: dict[str, Any]) -> None:
        """Apply the estimate's checkpointing, log-prob chunk and rollout gather where they were "auto";
        log the plan."""
        for name in sorted(self.auto_knobs):
            setattr(self, name, result[name])
        if is_main_process():
            logger.info("%s", result["summary"])

    def _resolve_expert_chunk(self, actor_network: nn.Module | None) -> None:
        """routed_expert_chunk_mib=None on a MoE model: as documented, the largest of 64/128/256/512
        MiB the memory estimate fits (rank 0 asks the planner; every rank applies the same)."""
        from .autoplan import config_is_moe, least_visible_cluster, pick_expert_chunk

        if actor_network is not None:
            config = actor_network.config
        else:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(self.model_source)
        if not config_is_moe(config):
            return
        cluster = least_visible_cluster(self.world_size)
        result = on_rank0(pick_expert_chunk, self, actor_network, self.micro_batch_size_per_gpu, cluster)
        if "error" in result:  # the smallest chunk, the most frugal, as the other open fields keep a safe value
            smallest = 64
            if is_main_process():
                logger.warning(
                    "[agilerl] routed_expert_chunk_mib=None took the smallest chunk, %d MiB: the memory estimate "
                    "failed (%s)",
                    smallest,
                    result["error"],
                )
            result = {"routed_expert_chunk_mib": smallest, "summary": None}
        self.fsdp_config = self.fsdp_config.model_copy(
            update={"routed_expert_chunk_mib": result["routed_expert_chunk_mib"]}
        )
        if is_main_process() and result["summary"]:
            logger.info("%s", result["summary"])

    def _resolve_open_fsdp_fields(self, actor_network: nn.Module | None) -> None:
        """The FSDPConfig fields whose None the memory estimate decides: the expert chunk, then
        (with it) where Adam steps."""
        if self.fsdp_config.routed_expert_chunk_mib is None:
            self._resolve_expert_chunk(actor_network)
        if self.fsdp_config.optim_cpu_offload is None:
            self._resolve_optim_offload(actor_network)

    def _resolve_optim_offload(self, actor_network: nn.Module | None) -> None:
        """optim_cpu_offload=None: as documented, Adam on the GPU where the memory estimate fits,
        else on the CPU (rank 0 asks the estimate; every rank applies the same). Should the estimate
        fail, Adam stays on the device and the reason is logged."""
        from .autoplan import least_visible_cluster, pick_optim_offload

        cluster = least_visible_cluster(self.world_size, judge_host=True)
        result = on_rank0(pick_optim_offload, self, actor_network, self.micro_batch_size_per_gpu, cluster)
        if "error" in result:
            if is_main_process():
                logger.warning(
                    "[agilerl] optim_cpu_offload=None kept Adam on the device: the memory estimate failed (%s)",
                    result["error"],
                )
            return
        self.fsdp_config = self.fsdp_config.model_copy(update={"optim_cpu_offload": result["optim_cpu_offload"]})
        if is_main_process():
            logger.log(logging.WARNING if result.get("warning") else logging.INFO, "%s", result["summary"])

    def _check_batch_shape(self, micro: int | None) -> int:
        """A rank's sequences per step, split into micro-batches of whole examples."""
        total, per = self.sequences_per_step, self.group_size
        ranks = self.data_parallel_ranks
        what = f"batch_size x group_size = {self.batch_size} x {per} = {total}" if per > 1 else f"batch_size = {total}"
        if total % ranks:
            raise ValueError(f"{what} sequences do not split evenly over {ranks} data-parallel ranks")
        local = total // ranks
        if micro is None:
            return local
        if micro < 1 or local % micro:
            choices = [m for m in range(1, local + 1) if local % m == 0]
            raise ValueError(
                f"{what} sequences over {ranks} data-parallel ranks gives {local} per rank, which "
                f"micro_batch_size_per_gpu={micro} does not divide; choose one of {choices}"
            )
        return micro

    # -- actor -----------------------------------------------------------------------
    def _build(self, actor_network: nn.Module | None) -> None:
        from .loading import build_actor, load_tokenizer

        source = self.model_source
        if self.tokenizer is None and source is not None:
            try:
                self.tokenizer = load_tokenizer(source)
            except (OSError, ValueError, TypeError):
                self.tokenizer = None  # a config without a tokenizer: prompts must come tokenized
        with_reference = self.full_finetune and self.needs_reference
        # Its own module for the reference copy, before the actor's build shards actor_network in place.
        reference_network = copy.deepcopy(actor_network) if with_reference and actor_network is not None else None
        torch.manual_seed(self.seed)
        self.model, self.trainable_params = build_actor(**self._build_kwargs(actor_network, source))
        if with_reference:
            self.reference_model, _ = build_actor(**self._build_kwargs(reference_network, source), trainable=False)
            self._copy_actor_into_reference()  # exactly the initial policy, random weights included
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

    def _build_kwargs(self, actor_network: nn.Module | None, source: str | None) -> dict[str, Any]:
        return dict(
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

    def _eos_token_id(self) -> int | list[int] | None:
        lm = causal_lm(self.model)
        gen = getattr(lm, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        if eos is None:
            eos = getattr(lm.config, "eos_token_id", None)
        return eos

    def completion_eos_id(self) -> int | None:
        """The end-of-sequence token an offline objective appends to each completion: of the ids
        that end one (:meth:`eos_token_ids`), the tokenizer's own where it is one of them (a chat
        model's turn end: Llama-3.1-Instruct lists <|end_of_text|> first, its tokenizer names
        <|eot_id|>, which its chat turns end with), else the model's first."""
        eos = self._eos_token_id() if not hasattr(self, "eos_token_id") else self.eos_token_id
        ids = list(eos) if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else [])
        own = getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer is not None else None
        return own if own in ids else (ids[0] if ids else None)

    def eos_token_ids(self) -> set[int]:
        """The token ids that end a completion (the tokenizer's EOS, else the model config's)."""
        eos = self._eos_token_id() if not hasattr(self, "eos_token_id") else self.eos_token_id
        return set(eos) if isinstance(eos, (list, tuple)) else ({eos} if eos is not None else set())

    def _encode(self, prompts) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts (strings, or a dict of ``input_ids`` / ``attention_mask``) as left-padded ids and mask."""
        if isinstance(prompts, dict):
            if "input_ids" not in prompts or "attention_mask" not in prompts:
                raise ValueError(
                    "tokenized prompts need both input_ids and attention_mask (left-padded), "
                    f"got keys {sorted(prompts)}"
                )
            return prompts["input_ids"].to(self.device), prompts["attention_mask"].to(self.device)
        if isinstance(prompts, str):
            raise ValueError("prompts must be a list of strings, got one string: wrap it in a list")
        if len(prompts) == 0:
            raise ValueError("prompts is empty: give at least one prompt")
        if self.tokenizer is None:
            raise ValueError("string prompts need a tokenizer: pass tokenizer=... or tokenized prompts")
        enc = self.tokenizer(
            list(prompts), return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False
        )
        return enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)

    def add_head(self, name: str, module: nn.Module, *, lr: float) -> nn.Module:
        """Train ``module`` beside the model (LLMPPO's value head): on this rank's device, fp32,
        replicated, with its own AdamW at ``lr``; saved in checkpoints under ``name``. Every rank
        must build it with the same initial weights."""
        module = module.to(device=self.device, dtype=torch.float32)
        self.heads[name] = module
        self.head_params = [p for m in self.heads.values() for p in m.parameters()]
        self.head_optimizer = torch.optim.AdamW(self.head_params, lr=lr, weight_decay=0.0)
        return module

    def _phase(self, name: str) -> ContextManager:
        return self.phase_observer(name) if self.phase_observer is not None else contextlib.nullcontext()

    def update_reference(self) -> None:
        """Make the reference policy the current actor: the reference adapter (LoRA with
        ``use_separate_reference_adapter=True``) or the frozen copy (full fine-tuning)."""
        if self.reference_model is not None:
            self._copy_actor_into_reference()
            self._reference_updated = True
            return
        if not self.use_separate_reference_adapter:
            raise ValueError(
                "update_reference needs use_separate_reference_adapter=True (LoRA) or, with full "
                "fine-tuning, an objective that keeps a reference"
            )
        copy_adapter_(self.model, ACTOR, REFERENCE)

    @torch.no_grad()
    def _copy_actor_into_reference(self) -> None:
        """The frozen reference copy (full fine-tuning) takes the actor's weights, shard by shard
        (both are sharded alike), cast to its dtype."""
        for (_, ref), (_, actor) in zip(
            self.reference_model.named_parameters(), self.model.named_parameters(), strict=True
        ):
            dst = ref.to_local() if hasattr(ref, "to_local") else ref
            src = actor.to_local() if hasattr(actor, "to_local") else actor
            dst.copy_(src)

    # -- the log-prob forward -------------------------------------------------------------
    def _activation_dtype(self) -> torch.dtype:
        """The dtype attention computes in: FSDP2's param_dtype when it casts, else the model's."""
        if self.sharded and self.fsdp_config.param_dtype is not None:
            return getattr(torch, self.fsdp_config.param_dtype)
        return self.dtype

    def _sync_tensor_parallel_rng(self) -> None:
        """Ranks of one tensor-parallel group must sample the same tokens (and dropout masks)."""
        if self.sharded and self.fsdp_config.tp > 1:
            from agilerl.distributed import fsdp_layout, sync_tp_rng

            sync_tp_rng(fsdp_layout(self.model).mesh["tp"])

    def _micro_batches(self, n: int) -> list[slice]:
        m = self.micro_batch_size_per_gpu
        if n % m:
            raise ValueError(f"{n} sequences on this rank do not split into micro-batches of {m}")
        return [slice(i, i + m) for i in range(0, n, m)]

    def _learn_micro_batches(self, n: int):
        """The slices of a rank's ``n`` sequences, one micro-batch at a time, each inside phase
        ``learn`` (the caller's forward and backward run there) with FSDP2's gradient sync on for the
        last one only under ``defer_grad_sync`` (one reduce-scatter a step), every one otherwise."""
        from agilerl.distributed import set_gradient_sync

        self.model.train()
        self._sync_tensor_parallel_rng()  # identical dropout masks within a TP group
        batches = self._micro_batches(n)
        defer = self.sharded and self.fsdp_config.defer_grad_sync
        for i, s in enumerate(batches):
            with self._phase("learn"):
                if self.sharded:
                    set_gradient_sync(self.model, (i == len(batches) - 1) or not defer)
                yield s

    @staticmethod
    def _first_scored(loss_mask: torch.Tensor) -> int:
        """The first log-prob position any loss term reads (the earliest completion token's)."""
        cols = loss_mask.any(dim=0).nonzero()
        return int(cols[0]) if cols.numel() else 0

    def _policy_model(self, adapter: str | None) -> nn.Module:
        """The model that runs a policy: the actor, or for the reference with full fine-tuning, its
        frozen copy (LoRA runs the reference on the actor with adapters disabled or swapped)."""
        if adapter != ACTOR and self.reference_model is not None:
            return self.reference_model
        return self.model

    @torch.no_grad()
    def _no_grad_logprobs(self, ids, attention, adapter: str | None, first: int = 0) -> torch.Tensor:
        """Log-probs of a rank's whole batch without gradients, a micro-batch at a time, under the
        actor (``ACTOR``) or the reference (``REFERENCE``: its adapter; None: adapters disabled)."""
        model = self._policy_model(adapter)
        was_training = model.training
        model.eval()
        try:
            with use_adapter(model, adapter):
                return torch.cat(
                    [
                        self.token_logprobs(ids[s], attention[s], first, model=model)
                        for s in self._micro_batches(ids.shape[0])
                    ]
                )
        finally:
            model.train(was_training)
            if model is self.reference_model and self.sharded:
                # It never runs backward, where FSDP2 reshards units kept gathered after a forward
                # (reshard_after_forward=False): release them here, or they stay through learn.
                self._reshard_units(model)

    @staticmethod
    def _reshard_units(model: nn.Module) -> None:
        """Reshard every FSDP2 unit of ``model`` a forward left gathered (FSDP2 itself does so
        only in post-backward): the root after any forward, every unit with
        reshard_after_forward=False."""
        from torch.distributed.fsdp import FSDPModule

        for unit in model.modules():
            if isinstance(unit, FSDPModule):
                unit.reshard()

    def token_logprobs(
        self,
        ids: torch.Tensor,
        attention_mask: torch.Tensor,
        first: int = 0,
        *,
        model: nn.Module | None = None,
        hidden: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """log p(ids[:, t+1] | ids[:, :t+1]) for every position, ``[n, T - 1]`` fp32 (chunked).

        ``first``: positions before it skip the head and read 0 (the prompt's, which no loss
        term uses): the head's matmuls and softmax run over the completion rows only.
        ``model``: the actor (default) or the frozen reference copy. ``hidden``: if given,
        receives ``"h"``, the final hidden states from position ``hidden["offset"]`` on (a value
        head reads them).
        """
        model = self.model if model is None else model
        groups = self._prefix_groups(ids, attention_mask, first, model)
        if groups is not None:
            return self._shared_prefix_logprobs(ids, attention_mask, first, groups, model, hidden)
        captured: dict[str, torch.Tensor] = {}
        handle = final_norm(model).register_forward_hook(lambda m, i, o: captured.__setitem__("h", o))
        head_without_grad, head_context = self._model_head_forward(model)
        try:
            # The model's own head runs on the last position only (last_position_only); the
            # log-probs below come from the captured final hidden states, chunked.
            with head_context:
                out = model(
                    input_ids=ids,
                    # a padded batch: one additive mask shared by every layer, not a float copy per layer
                    attention_mask=shared_attention_mask(
                        causal_lm(model).config, attention_mask, self._activation_dtype()
                    ),
                    position_ids=position_ids_from_mask(attention_mask),
                    use_cache=False,
                    logits_to_keep=last_position_only(ids),
                )
        finally:
            handle.remove()
        if hidden is not None:
            hidden["h"], hidden["offset"] = captured["h"], 0
        # Every position goes through the head (the last with a dummy target, dropped after), so
        # the final hidden states are used as they are rather than copied without their last row.
        targets = torch.nn.functional.pad(ids[:, 1:], (0, 1))
        logp = self._head_logprobs(captured["h"], targets, first, model)[:, :-1]
        if torch.is_grad_enabled() and not head_without_grad:
            # FSDP2 (torch 2.13) segfaults in backward when a unit that ran forward with grad
            # (the lm_head) has no output in the graph; a zero-weighted term keeps its
            # one-position logits in the graph at no cost to the gradient.
            logp = logp + 0.0 * out.logits.sum()
        return logp

    def _model_head_forward(self, model: nn.Module) -> tuple[bool, ContextManager[None]]:
        """(whether the model's own head runs without grad, the context its forwards run in):
        :meth:`_model_head_without_grad`, for both log-prob forwards."""
        if self._model_head_without_grad(model):
            return True, _forward_without_grad(output_head(model))
        return False, contextlib.nullcontext()

    def _model_head_without_grad(self, model: nn.Module) -> bool:
        """Whether ``model``'s own one-position lm_head forward runs without grad: under FSDP2,
        where the head is an FSDP2 unit of its own (untied) that reshards after its forward. The
        chunked head (:meth:`_head_logprobs`) then gathers its own copy of the weight, whose
        backward reduce-scatters the head's gradient; in the graph, the unit would gather the
        head again in backward and reduce-scatter a zero gradient of it, held whole in fp32
        through a step that defers the gradient sync (V x H x 4 bytes when the head trains).

        Kept gathered (reshard_after_forward=False), the chunked head reads the unit's weight,
        and the unit's post-backward, which the model's head keeps in the graph, reduce-scatters
        the gradient as soon as the head's backward is done. A tied head lives in the root unit
        and keeps its zero-weighted term (tried without it: a 2-rank full fine-tune's learn peak
        read 20.49 MiB, within the 20.44-20.49 MiB the probe measures with it, depending on the
        schedule; planner.memory counts what the term costs, the model head's backward)."""
        from torch.distributed.fsdp import FSDPModule

        return self.sharded and self.fsdp_config.reshard_after_forward and isinstance(output_head(model), FSDPModule)

    def _prefix_groups(
        self, ids: torch.Tensor, attention_mask: torch.Tensor, split: int, model: nn.Module | None = None
    ):
        """The distinct ``[:, :split]`` prompts of a batch when the shared-prefix forward applies
        (:func:`agilerl.utils.shared_prefix.shared_prefix_problem`), else None."""
        if not self.share_prompt_prefix:
            return None
        length = ids.shape[1]
        if length not in self._prefix_problems:
            config = causal_lm(self.model if model is None else model).config
            self._prefix_problems[length] = shared_prefix_problem(
                getattr(config, "model_type", None),
                getattr(config, "_attn_implementation", None),
                full_causal=full_causal(config, length),
                tp=self.fsdp_config.tp if self.sharded else 1,
            )
        if self._prefix_problems[length] is not None:
            return None
        from agilerl.utils.prefix_cache import prompt_groups

        groups = prompt_groups(ids, attention_mask, split)
        if self.sharded and self.world_size > 1:
            # FSDP2's units gather in every forward: every rank must run as many as the others, so
            # the two-pass forward runs only where every rank's rows share prompts.
            from agilerl.distributed import allreduce_minmax_int

            if allreduce_minmax_int(int(groups is not None))[0] == 0:
                return None
        return groups

    def _shared_prefix_logprobs(
        self,
        ids: torch.Tensor,
        attention_mask: torch.Tensor,
        first: int,
        groups,
        model: nn.Module,
        hidden: dict[str, torch.Tensor] | None,
    ) -> torch.Tensor:
        """:meth:`token_logprobs` by the two-pass forward: the distinct prompts' columns
        ``[0, first)`` once, then every row's ``[first, T)`` over its prompt's recorded keys and
        values. Positions before ``first`` read 0, as in the one-pass forward."""
        from agilerl.utils.prefix_cache import (
            PrefixedCache,
            RecordingCache,
            cache_argument,
            suffix_attention_mask,
        )

        lm = causal_lm(model)
        config, kv = lm.config, cache_argument(lm)
        dtype = self._activation_dtype()
        positions = position_ids_from_mask(attention_mask)
        rows = groups.rows
        recorded = RecordingCache(config.num_hidden_layers)
        captured: dict[str, torch.Tensor] = {}
        handle = final_norm(model).register_forward_hook(lambda m, i, o: captured.__setitem__("h", o))
        head_without_grad, head_context = self._model_head_forward(model)
        try:
            with head_context:
                prefix = model(
                    input_ids=ids[rows, :first],
                    attention_mask=shared_attention_mask(config, attention_mask[rows, :first], dtype),
                    position_ids=positions[rows, :first],
                    use_cache=True,
                    logits_to_keep=last_position_only(ids[:, :first]),
                    **{kv: recorded},
                )
                prefix_hidden = captured["h"]
                suffix = model(
                    input_ids=ids[:, first:],
                    attention_mask=suffix_attention_mask(attention_mask, first, dtype),
                    position_ids=positions[:, first:],
                    use_cache=True,
                    logits_to_keep=last_position_only(ids[:, first:]),
                    **{kv: PrefixedCache(recorded, groups.inverse, first)},
                )
        finally:
            handle.remove()
        if hidden is not None:
            hidden["h"], hidden["offset"] = captured["h"], first
        targets = torch.nn.functional.pad(ids[:, first + 1 :], (0, 1))
        logp = torch.nn.functional.pad(self._head_logprobs(captured["h"], targets, 0, model)[:, :-1], (first, 0))
        if torch.is_grad_enabled():
            # The prefix pass's last block feeds the loss through its keys and values only, so its
            # output (from whose hook FSDP2 gathers the block again in backward) is kept in the graph
            # by a zero-weighted term; as in the one-pass forward, so is the model's own head's when
            # it ran with grad.
            kept = prefix_hidden.sum() if head_without_grad else prefix.logits.sum() + suffix.logits.sum()
            logp = logp + 0.0 * kept
        return logp

    def _head_logprobs(
        self, hidden: torch.Tensor, targets: torch.Tensor, first: int = 0, model: nn.Module | None = None
    ) -> torch.Tensor:
        model = self.model if model is None else model
        head = output_head(model)
        config = causal_lm(model).config
        softcap = getattr(config, "final_logit_softcapping", None)
        # a model that scales its logits (Granite, Cohere): the scale folds into the temperature
        temperature = self.temperature / logit_multiplier(config)
        weight = getattr(head, "weight", None)
        if isinstance(head, nn.Linear) and weight is not None:
            # Cast before gathering: a sharded fp32 head (full fine-tuning) gathers in the compute dtype,
            # and a shard on the host (FSDP2's cpu_offload) gathers on the hidden states' device.
            device, dtype = hidden.device, hidden.dtype
            bias = head.bias.to(device=device, dtype=dtype) if head.bias is not None else None
            with materialize_dtensors(weight.to(device=device, dtype=dtype), bias) as (w, b):
                return linear_token_logprobs(
                    hidden,
                    targets,
                    w,
                    b,
                    chunk_size=self.logprob_chunk_size,
                    temperature=temperature,
                    softcap=softcap,
                    first=first,
                )
        return chunked_token_logprobs(
            hidden, targets, head, chunk_size=self.logprob_chunk_size, temperature=temperature, softcap=softcap
        )

    def _dp_sum(self, local: float) -> float:
        """A per-rank value summed over the data-parallel ranks (the ranks of a tensor-parallel group
        hold the same rows and count once); the value itself on one device."""
        from agilerl.distributed import gather_tensor

        values = gather_tensor(torch.tensor(float(local), dtype=torch.float64))
        tp = self.fsdp_config.tp if self.sharded else 1
        return float(values.reshape(-1)[::tp].sum())

    # -- the optimizer step -------------------------------------------------------------------
    def _gradient_tensors(self) -> list[torch.Tensor]:
        """The tensors whose ``.grad`` carry the step's gradients: the trainable parameters, or
        the fp32 masters that accumulate them (full fine-tuning of a bf16 model, unsharded)."""
        grads = getattr(self.optimizer, "grad_tensors", None)
        return grads() if callable(grads) else list(self.trainable_params)

    def _optimizer_step(self) -> torch.Tensor:
        """Average (data parallel), clip the global norm and step; a non-finite norm skips the step.

        The heads beside the model (LLMPPO's value head: small, fp32, replicated on every rank and
        outside FSDP2's units) are averaged over every rank explicitly, clipped with the model's
        gradients under one global norm and stepped by their own AdamW."""
        tensors = self._gradient_tensors()
        if not self.sharded and self.distributed and self.world_size > 1:
            sync_grads(tensors)
        if self.head_params and self.distributed and self.world_size > 1:
            from agilerl.distributed import all_reduce_grads

            all_reduce_grads(self.head_params)
        norm = clip_grad_norm_(tensors + self.head_params, self.max_grad_norm, model=self.model)
        if math.isfinite(float(norm)):
            self.optimizer.step()
            if self.head_optimizer is not None:
                self.head_optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.head_optimizer is not None:
            self.head_optimizer.zero_grad(set_to_none=True)
        return norm

    # -- populations -------------------------------------------------------------------------
    @classmethod
    def population(cls, size: int, **kwargs: Any) -> list[LLMAlgorithm]:
        """``size`` independent agents (index 0..size-1, seeds offset by index)."""
        if size < 1:
            raise ValueError(f"population size must be >= 1, got {size}")
        seed = kwargs.pop("seed", 42)
        return [cls(index=i, seed=seed + i, **kwargs) for i in range(size)]

    # -- checkpoints -------------------------------------------------------------------
    #: Hyperparameters every algorithm saves.
    shared_hyperparameters: tuple[str, ...] = (
        "batch_size",
        "lr",
        "max_grad_norm",
        "micro_batch_size_per_gpu",
        "logprob_chunk_size",
    )

    def checkpoint_state(self) -> dict[str, Any]:
        return {
            "algo": self.algo_name,
            "steps": self.steps,
            "scores": list(self.scores),
            "index": self.index,
            "full_finetune": self.full_finetune,
            "hyperparameters": {
                k: getattr(self, k)
                for k in (*self.shared_hyperparameters, *self.algorithm_hyperparameters, *self.extra_hyperparameters)
            },
        }

    def _saved_hyperparameters(self, saved: dict[str, Any], file: Path) -> dict[str, Any]:
        """The checkpoint's hyperparameters that differ from this agent's and a load takes (see
        :meth:`load_checkpoint`), each logged with those it keeps; checked before anything loads."""
        taken = {k: v for k, v in saved.items() if hasattr(self, k) and getattr(self, k) != v}
        kept = {k: taken.pop(k) for k in self.shape_hyperparameters if k in taken}
        if taken.get("beta", 0) != 0 and self.full_finetune and self.reference_model is None:
            raise CheckpointMismatch(
                f"{file} was trained with beta={taken['beta']}, which reads a reference policy; this agent "
                "(beta=0, every parameter trained) keeps no reference copy: build it with that beta to load it"
            )
        if is_main_process():
            for name, value in taken.items():
                logger.info("[agilerl] %s=%r from the checkpoint (this agent had %r)", name, value, getattr(self, name))
            for name, value in kept.items():
                logger.info(
                    "[agilerl] %s=%r kept: it fixes the batch's shape (the checkpoint's was %r)",
                    name,
                    getattr(self, name),
                    value,
                )
        return taken

    def _trained_weights(self) -> dict[str, dict[str, torch.Tensor]]:
        """What a checkpoint stores of the model, by name: the LoRA adapters (never the frozen
        base), or with full fine-tuning every parameter (and the reference copy once updated)."""
        if self.full_finetune:
            weights = {"model": dict(self.model.named_parameters())}
            if self._reference_updated:
                weights["reference"] = dict(self.reference_model.named_parameters())
            return {
                k: {n.replace("_checkpoint_wrapped_module.", ""): p for n, p in v.items()} for k, v in weights.items()
            }
        adapters = [ACTOR] + ([REFERENCE] if self.use_separate_reference_adapter else [])
        return {name: adapter_state_dict(self.model, name) for name in adapters}

    def save_checkpoint(self, path: str | Path, *, extra: dict[str, Any] | None = None) -> Path:
        """Write ``path/attributes.pt``: gathered trained weights (the adapters, or every parameter
        with full fine-tuning), optimizer state, attributes, every rank's RNG states, and ``extra``
        (the caller's own state, e.g. a data position).

        The same layout on one device and on several ranks. **Every rank must call this**
        whenever the run has more than one (data parallel or FSDP2): each sends its RNG
        states and shards, and rank 0 writes; called on rank 0 alone it waits for the others
        until the process group's timeout. The file is written atomically (temporary
        file, fsync, rename): a kill mid-save leaves the previous checkpoint whole.
        """
        from agilerl.utils.checkpoint_io import atomic_save

        path = Path(path)
        rng = _gather(_rng_state())
        with self._phase("save"):
            keep = is_main_process()
            # Gathered one tensor at a time, never the whole model at once.
            weights = {
                name: full_tensors(
                    self.model if name != "reference" or not self.full_finetune else self.reference_model,
                    tensors,
                    keep=keep,
                )
                for name, tensors in self._trained_weights().items()
            }
            optim = full_optimizer_state_dict(self.model, self.optimizer, keep=keep)
        if keep:
            path.mkdir(parents=True, exist_ok=True)
            key = "weights" if self.full_finetune else "adapters"
            payload = {
                **self.checkpoint_state(),
                key: weights,
                "optimizer": optim,
                "rng": rng,
                "world_size": self.world_size,
                "extra": dict(extra or {}),
            }
            if self.heads:
                payload["heads"] = {
                    name: {k: v.detach().cpu().clone() for k, v in m.state_dict().items()}
                    for name, m in self.heads.items()
                }
                payload["head_optimizer"] = self.head_optimizer.state_dict()
            atomic_save(payload, path / CHECKPOINT_FILE)
        barrier()
        return path / CHECKPOINT_FILE

    #: Saved hyperparameters a load leaves as this agent was built with: they fix the batch's
    #: shape and what memory was planned for (a checkpoint may come from another number of ranks).
    shape_hyperparameters: tuple[str, ...] = (
        "batch_size",
        "micro_batch_size_per_gpu",
        "logprob_chunk_size",
        "group_size",
        "max_output_tokens",
    )

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Load a checkpoint written by :meth:`save_checkpoint` (on any number of ranks); return its ``extra``.

        The objective's hyperparameters (lr, beta, clip_coef, temperature, ...) take the
        checkpoint's values, as the optimizer state already does for its learning rate (a
        population member resumes as it was mutated); those in :attr:`shape_hyperparameters`
        keep this agent's. Each differing value is logged.

        Each rank takes back its own RNG states (Python's, NumPy's, torch's) when the checkpoint
        was written on as many ranks (so sampling continues as if never stopped); otherwise
        they keep their current ones.
        """
        path = Path(path)
        file = path / CHECKPOINT_FILE if path.is_dir() else path
        if not file.exists():
            raise FileNotFoundError(f"no checkpoint at {file}")
        # memory-mapped: each rank reads the tensors it takes, not the whole file into host memory
        payload = torch.load(file, map_location="cpu", weights_only=False, mmap=True)
        if payload.get("algo") != self.algo_name:
            raise CheckpointMismatch(f"{file} is a {payload.get('algo')} checkpoint, not {self.algo_name}")
        if bool(payload.get("full_finetune", False)) != self.full_finetune:
            saved = "full fine-tuning" if payload.get("full_finetune") else "LoRA"
            raise CheckpointMismatch(
                f"{file} is a {saved} checkpoint; this agent trains "
                f"{'every parameter' if self.full_finetune else 'LoRA adapters'}"
            )
        if not self.full_finetune:  # the same adapted modules and ranks, or nothing is loaded
            mine = adapter_state_dict(self.model, ACTOR)
            saved = payload["adapters"].get(ACTOR, {})
            if set(saved) != set(mine):
                missing, extra = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
                raise CheckpointMismatch(
                    f"{file} holds adapters of other modules: missing {missing[:3]}, unexpected {extra[:3]}"
                )
            if other := _other_shape(mine, saved, _checkpoint_shape(self.model)):
                raise CheckpointMismatch(f"{file} holds adapters of another rank: {other}")
        restored = self._saved_hyperparameters(payload.get("hyperparameters", {}), file)
        if self.full_finetune:
            weights = payload["weights"]
            mine = {n.replace("_checkpoint_wrapped_module.", ""): p for n, p in self.model.named_parameters()}
            if set(weights["model"]) != set(mine):
                missing, extra = sorted(set(mine) - set(weights["model"])), sorted(set(weights["model"]) - set(mine))
                raise CheckpointMismatch(
                    f"{file} holds another model's weights: missing {missing[:5]}, unexpected {extra[:5]}"
                )
            if other := _other_shape(mine, weights["model"], _checkpoint_shape(self.model)):
                raise CheckpointMismatch(f"{file} holds another model's weights: {other}")
            set_full_model_state_dict(self.model, weights["model"], strict=False)
            if "reference" in weights and self.reference_model is not None:
                set_full_model_state_dict(self.reference_model, weights["reference"], strict=False)
                self._reference_updated = True
        else:
            for name, weights in payload["adapters"].items():
                if name == REFERENCE and not self.use_separate_reference_adapter:
                    continue
                set_full_model_state_dict(self.model, weights, strict=False)
        load_full_optimizer_state_dict(
            self.model,
            self.optimizer,
            payload["optimizer"],
            master_weights=payload["weights"]["model"] if self.full_finetune else None,
        )
        for name, module in self.heads.items():
            module.load_state_dict(payload["heads"][name])
        if self.heads:
            self.head_optimizer.load_state_dict(payload["head_optimizer"])
        self.steps = payload.get("steps", 0)
        self.scores = list(payload.get("scores", []))
        for name, value in restored.items():
            setattr(self, name, value)
        for group in self.optimizer.param_groups if "lr" in restored else ():
            group["lr"] = self.lr
        rng = payload.get("rng")
        if rng and len(rng) == self.world_size:
            _set_rng_state(rng[self.rank])
        return dict(payload.get("extra", {}))


def _checkpoint_shape(model: nn.Module):
    """The shape a checkpoint holds of one of ``model``'s parameters: a DTensor's whole shape,
    and an expert-parallel slice's times the EP group (a checkpoint holds every expert:
    packed weights and LoRA A along dim 0, LoRA B along its columns)."""
    from agilerl.distributed import expert_parallel

    moe, _ = expert_parallel(model)

    def shape(name: str, tensor: torch.Tensor) -> tuple[int, ...]:
        dims = list(tensor.shape)
        shard = moe.expert_shard(name) if moe is not None else None
        if shard is not None:
            dims[1 if shard.kind == "lora_b" else 0] *= moe.ep
        return tuple(dims)

    return shape


def _other_shape(mine: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], shape) -> str | None:
    """The first tensor whose saved shape is not the one ``shape(name, tensor)`` says this model's
    checkpoint holds, said as ``name is [..] there, [..] here``; None when every shape agrees."""
    for name, tensor in mine.items():
        theirs, ours = tuple(saved[name].shape), shape(name, tensor)
        if theirs != ours:
            return f"{name} is {list(theirs)} there, {list(ours)} here"
    return None


class CheckpointMismatch(ValueError):
    """A whole checkpoint of another run: another algorithm, LoRA against full fine-tuning, other
    adapted modules or another model (not a damaged file)."""


def _rng_state() -> dict[str, Any]:
    """This rank's random states: Python's, NumPy's global one, torch's CPU generator and, where
    present, the current CUDA one."""
    import random

    import numpy as np

    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import random

    random.setstate(state["python"])
    if "numpy" in state:  # checkpoints written before NumPy's state was kept lack it
        import numpy as np

        np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _gather(obj: Any) -> list[Any]:
    """``obj`` from every rank (of the agent's rank group), in rank order (a list of one without a
    process group)."""
    from agilerl.distributed import gather_objects

    return gather_objects([obj])
