"""GRPO: group relative policy optimisation with LoRA, on one device, data parallel or FSDP2.

One step, and where its memory goes (the phase names the planner uses):

1. ``get_action(prompts)`` (phase ``rollout``): every rank receives the same
   prompts; each is repeated ``group_size`` times and rank r generates the
   r-th contiguous slice of the ``batch_size * group_size`` completions, with
   Hugging Face generate (KV cache; ``synced_gpus`` where its forwards communicate, so ranks that
   finish early keep joining the collectives) or a colocated vLLM engine.
2. ``learn((ids, action_masks, rewards))``: rewards are gathered so each group's
   advantage ``(r - mean) / (std + eps)`` is computed over the whole group, then
   phase ``reference`` computes reference log-probs (adapters disabled, or the
   frozen ``reference`` adapter) and, for ``update_epochs > 1``, the old policy's
   log-probs, without gradients, one micro-batch at a time.
3. For each epoch, phase ``learn`` runs forward + backward per micro-batch of
   ``micro_batch_size_per_gpu`` sequences (gradients accumulate; under FSDP2
   with ``defer_grad_sync`` only the last micro-batch reduce-scatters), and
   phase ``step`` clips the global gradient norm and steps the optimizer. All
   ranks step together; data-parallel ranks average gradients first.

Log-probs come from the final hidden states through the lm_head in chunks of
``logprob_chunk_size`` token rows, each recomputed in backward, so the logits
workspace scales with the chunk, not with batch x length x vocabulary.

Defaults follow public GRPO practice: 8 completions per prompt, KL weight
0.04 against the reference (k3 estimator), clip 0.2, one update epoch,
gradient-norm clip 1.0, sampling at temperature 1.0 (no top-k / top-p), LoRA
r=16, alpha=32 on all linear layers.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from agilerl.distributed import (
    aggregate_metrics_dict,
    dtype_name,
    gather_tensor,
    is_main_process,
)
from agilerl.utils.algo_utils import VLLMConfig, weight_offload_problem
from agilerl.utils.generation import neutral_generation_config
from agilerl.utils.logprobs import (
    causal_lm,
    position_ids_from_mask,
    shared_attention_mask,
)

from .core.adapters import ACTOR, REFERENCE, use_adapter
from .core.base import DEFAULT_LORA, LLMAlgorithm, check_counts, check_hyperparameters, normalise_fsdp_config

__all__ = ["GRPO", "grpo_loss", "group_advantages", "k3_kl"]

logger = logging.getLogger(__name__)


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """``(r - mean) / (std + eps)`` within each group of ``group_size`` consecutive rewards.

    ``std`` is the sample standard deviation, as in public GRPO implementations.
    """
    grouped = rewards.float().view(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True)
    return ((grouped - mean) / (std + eps)).view(-1)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per token, the k3 estimator of KL(policy || reference): ``exp(ref - logp) - (ref - logp) - 1``
    (non-negative, unbiased, low variance; Schulman's approximation)."""
    diff = ref_logp - logp
    return torch.exp(diff) - diff - 1.0


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_coef: float,
    beta: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO objective on token log-probs ``[n, T]`` with a completion ``mask``.

    Per token: ``-min(ratio * A, clip(ratio, 1 - c, 1 + c) * A) + beta * k3`` with
    ``ratio = exp(logp - old_logp)`` and the k3 KL estimator
    ``exp(ref - logp) - (ref - logp) - 1``; the masked mean over each sequence's
    completion tokens, then the mean over sequences.
    """
    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype).unsqueeze(1)
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_coef, 1.0 + clip_coef) * adv
    per_token = -torch.min(unclipped, clipped)
    kl = torch.zeros_like(logp)
    if beta != 0.0 and ref_logp is not None:
        kl = k3_kl(logp, ref_logp)
        per_token = per_token + beta * kl
    tokens = mask.sum(dim=1).clamp(min=1.0)
    loss = ((per_token * mask).sum(dim=1) / tokens).mean()
    with torch.no_grad():
        is_clipped = ((ratio < 1.0 - clip_coef) & (adv < 0)) | ((ratio > 1.0 + clip_coef) & (adv > 0))
        total = mask.sum().clamp(min=1.0)
        stats = {
            "kl": (kl * mask).sum() / total,
            "clip_fraction": (is_clipped.to(mask.dtype) * mask).sum() / total,
        }
    return loss, stats


class GRPO(LLMAlgorithm):
    """Group Relative Policy Optimisation of a LoRA actor.

    ``batch_size`` is the number of prompts per step across all ranks; each
    yields ``group_size`` completions. ``batch_size * group_size`` must divide
    into (data-parallel ranks x ``micro_batch_size_per_gpu``) equal parts.
    ``micro_batch_size_per_gpu=None`` puts a rank's whole share in one
    micro-batch. ``fsdp_config``: None trains unsharded (data parallel under
    torchrun), an ``FSDPConfig`` (or a dict of its fields, or True) shards with
    FSDP2, ``"auto"`` asks the planner. ``gradient_checkpointing="auto"`` and
    ``logprob_chunk_size="auto"`` are resolved from the memory estimate under
    whatever sharding is in use (one device, data parallel, an FSDPConfig or the
    planner's): checkpointing off when every block's activations fit, the
    largest log-prob chunk whose logits workspace fits. If the estimate cannot
    be made (a model it cannot read), checkpointing stays on and chunks are
    1024 rows, and the reason is logged.

    ``gather_weights_for_rollout`` materialises the rollout's weights once per
    Hugging Face generate instead of once per generated token: under FSDP2 every
    unit is gathered once (and the actor's LoRA folded into the gathered copies, or
    into merged copies for adapted weights kept replicated;
    the no-grad reference passes then hold every unit gathered too, and generate
    needs no ``synced_gpus`` unless tensor or expert parallelism communicates),
    on one device or data parallel each adapted linear runs on a merged copy
    ``W + s B A`` (one matmul per token instead of three). Both cost memory (the
    unsharded weights, or a copy of the adapted ones) for the length of the call,
    and the weights after are bit for bit those before: the merged copies are
    dropped, never unmerged. ``"auto"`` (the default) turns it on where the memory
    estimate says the copies fit beside generation's KV cache, off otherwise, and
    logs the choice; it is off with a vLLM engine, where generate does not run.

    ``share_prompt_prefix`` (default True) runs each group's prompt once rather than once
    per completion: in the no-grad passes, in learn (gradients included) and in generate's
    prefill (:mod:`agilerl.utils.shared_prefix`, which also says where it falls back to the
    one-pass forward). Log-probs and gradients equal the one-pass forward's up to float
    summation order.
    """

    algo_name = "GRPO"

    def __init__(
        self,
        model_name: str | None = None,
        *,
        actor_network: nn.Module | None = None,
        pad_token_id: int | None = None,
        pad_token: str | None = None,
        lora_config=DEFAULT_LORA,
        batch_size: int = 8,
        group_size: int = 8,
        beta: float = 0.04,
        lr: float = 1e-5,
        clip_coef: float = 0.2,
        max_grad_norm: float = 1.0,
        update_epochs: int = 1,
        temperature: float = 1.0,
        max_output_tokens: int = 256,
        max_model_len: int | None = None,
        micro_batch_size_per_gpu: int | None = None,
        logprob_chunk_size: int | None | str = "auto",
        gradient_checkpointing: bool | str = "auto",
        use_separate_reference_adapter: bool = False,
        load_in_4bit: bool = False,
        vllm_config: VLLMConfig | None = None,
        rollout_engine=None,
        offload_weights_during_rollout: bool = False,
        gather_weights_for_rollout: bool | str = "auto",
        share_prompt_prefix: bool = True,
        fsdp_config=None,
        device: str | None = None,
        dtype: str = "bfloat16",
        attn_implementation: str | None = None,
        seed: int = 42,
        index: int = 0,
        tokenizer=None,
    ) -> None:
        check_counts(
            group_size=group_size,
            batch_size=batch_size,
            update_epochs=update_epochs,
            max_output_tokens=max_output_tokens,
        )
        if group_size < self.min_group_size:
            raise ValueError(
                f"group_size must be at least {self.min_group_size}"
                + (" (advantages are relative within a group)" if self.min_group_size > 1 else "")
                + f", got {group_size}"
            )
        check_hyperparameters(beta=beta, clip_coef=clip_coef)
        for name, value in (
            ("max_model_len", max_model_len),
            ("vllm_config.max_model_len", vllm_config.max_model_len if vllm_config is not None else None),
        ):
            if value is not None and value <= max_output_tokens:
                raise ValueError(
                    f"{name}={value} leaves no room for a prompt: it bounds prompt + completion, so it must "
                    f"be more than max_output_tokens={max_output_tokens}"
                )
        if gather_weights_for_rollout not in (True, False, "auto"):
            raise ValueError(
                f"gather_weights_for_rollout must be True, False or 'auto', got {gather_weights_for_rollout!r}"
            )
        if offload_weights_during_rollout and vllm_config is None:
            raise ValueError(
                "offload_weights_during_rollout=True needs a colocated vLLM engine (vllm_config): it parks the "
                "trainer's weights in host memory while the engine generates, and Hugging Face generate "
                "runs on those weights"
            )
        self.batch_size = batch_size
        self.group_size = group_size
        self.beta = beta
        self.clip_coef = clip_coef
        self.update_epochs = update_epochs
        self.max_output_tokens = max_output_tokens
        self.generation_kwargs: dict[str, Any] = {}
        self.engine = rollout_engine  # None until a colocated vLLM engine starts (below), if any
        # before the base class asks the memory estimate (workload_fields) for the fields it leaves open
        self.offload_weights_during_rollout = offload_weights_during_rollout
        given = getattr(normalise_fsdp_config(fsdp_config), "cpu_offload", None)  # before any weight loads
        if problem := weight_offload_problem(given, offload_weights_during_rollout):
            raise ValueError(problem)
        super().__init__(
            model_name=model_name,
            actor_network=actor_network,
            pad_token_id=pad_token_id,
            pad_token=pad_token,
            lora_config=lora_config,
            fsdp_config=fsdp_config,
            vllm_config=vllm_config,
            lr=lr,
            max_grad_norm=max_grad_norm,
            micro_batch_size_per_gpu=micro_batch_size_per_gpu,
            logprob_chunk_size=logprob_chunk_size,
            gradient_checkpointing=gradient_checkpointing,
            temperature=temperature,
            max_model_len=max_model_len,
            share_prompt_prefix=share_prompt_prefix,
            use_separate_reference_adapter=use_separate_reference_adapter,
            load_in_4bit=load_in_4bit,
            device=device,
            dtype=dtype,
            attn_implementation=attn_implementation,
            seed=seed,
            index=index,
            tokenizer=tokenizer,
            gather_weights_for_rollout=gather_weights_for_rollout,
            rollout_engine=rollout_engine,
        )
        self.eos_token_id = self._eos_token_id()
        self._weight_offload = None
        if offload_weights_during_rollout:
            if problem := weight_offload_problem(self.sharded and self.fsdp_config.cpu_offload, True):
                raise ValueError(problem)  # an FSDPConfig the estimate chose ("auto"); a given one is refused above
            from .core.offload import WeightOffload

            self._weight_offload = WeightOffload(self.model)
        if (rollout_engine is not None or vllm_config is not None) and (problem := _engine_sync_problem(self)):
            raise ValueError(problem)
        if rollout_engine is not None:
            # an engine of the caller's (agilerl.utils.remote_engine.RemoteEngine: engines on ranks of their own)
            if self.sharded and self.fsdp_config.tp > 1:
                raise ValueError(
                    "rollout_engine with tp > 1: the ranks of a tensor-parallel group would each send "
                    "the engine their shared prompts; use tp=1"
                )
        elif vllm_config is not None:
            from agilerl.utils.engine import shared_vllm_engine

            # One engine per rank, shared by the population's agents on it: each agent syncs its own
            # weights into it before every rollout.
            self.engine = shared_vllm_engine(
                self.model_source,
                vllm_config,
                dtype=dtype_name(self.dtype, "dtype"),  # the canonical name of an alias ("bf16")
                seed=seed + self.rank,
                max_model_len=max_model_len,
            )

    #: The fewest completions per prompt the objective accepts (group-relative advantages need two).
    min_group_size = 2
    generates = True
    algorithm_hyperparameters: tuple[str, ...] = (
        "group_size",
        "beta",
        "clip_coef",
        "update_epochs",
        "temperature",
        "max_output_tokens",
    )

    @property
    def needs_reference(self) -> bool:
        return self.beta != 0.0

    def workload_fields(self) -> tuple[dict[str, Any], str | None]:
        completion = self.max_output_tokens
        prompt = max(1, (self.max_model_len or 2 * completion) - completion)
        vllm = self.vllm_config
        fields: dict[str, Any] = dict(
            prompts_per_step=self.batch_size,
            group_size=self.group_size,
            prompt_tokens=prompt,
            completion_tokens=completion,
            beta=self.beta,
            update_epochs=self.update_epochs,
            temperature=self.temperature,
            # an engine of its own (rollout_engine): nothing generates on the trainer's GPUs
            generation="none" if self.engine is not None and vllm is None else ("vllm" if vllm is not None else "hf"),
            gather_weights_for_rollout=None
            if "gather_weights_for_rollout" in self.auto_knobs
            else self.gather_weights_for_rollout,
        )
        if vllm is not None:  # the trainer's engine settings as they are (VLLMConfig's defaults included)
            if not vllm.sleep_mode or vllm.tensor_parallel_size > 1:
                raise ValueError(
                    "the memory estimate plans a colocated vLLM engine on one GPU that sleeps while the "
                    f"trainer learns; vllm_config has sleep_mode={vllm.sleep_mode}, tensor_parallel_size="
                    f"{vllm.tensor_parallel_size}: give the settings 'auto' would choose explicitly"
                )
            fields.update(
                vllm_gpu_memory_utilization=vllm.gpu_memory_utilization,
                vllm_max_num_seqs=vllm.max_num_seqs,
                vllm_sleep_level=vllm.sleep_level,
                vllm_enforce_eager=vllm.enforce_eager,
                vllm_max_model_len=vllm.max_model_len,
                vllm_max_num_batched_tokens=vllm.max_num_batched_tokens,
                vllm_kv_cache_memory_bytes=vllm.kv_cache_memory_bytes,
                offload_weights_during_rollout=self.offload_weights_during_rollout,
            )
        note = None if self.max_model_len else f"assumed prompts of {prompt} tokens"
        return fields, note

    # -- rollout -------------------------------------------------------------------------

    def local_slice(self, num_prompts: int, group_size: int | None = None) -> slice:
        """This rank's slice of the ``num_prompts * group_size`` completions (``group_size``:
        the agent's unless given)."""
        group_size = self.group_size if group_size is None else group_size
        total = num_prompts * group_size
        if total % self.data_parallel_ranks:
            what = f"{num_prompts} prompts" + (f" x group_size {group_size}" if group_size > 1 else "")
            raise ValueError(
                f"{what} do not split over {self.data_parallel_ranks} data-parallel ranks: give a multiple "
                f"of {self.data_parallel_ranks // math.gcd(self.data_parallel_ranks, group_size)} prompts"
            )
        per_rank = total // self.data_parallel_ranks
        start = self.data_parallel_rank * per_rank
        return slice(start, start + per_rank)

    def _engine_seed(self) -> int:
        """The first of this rollout's per-prompt sampling seeds (the engine adds the prompt's index):
        distinct across steps and data-parallel ranks, so no two completions share a seed."""
        return ((self.seed * 1_000_003 + self.steps) * 4_096 + self.data_parallel_rank) * 65_536 % 2**62

    @torch.no_grad()
    def get_action(
        self, prompts: Sequence[str] | dict[str, torch.Tensor], training: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Generate ``group_size`` completions per prompt; return this rank's share.

        Returns ``(ids, action_masks)``, both ``[n_local, prompt_len + completion_len]``:
        ``ids`` holds the left-padded prompt followed by the completion (padded
        after its end-of-sequence token), and ``action_masks`` is 1 exactly on
        completion tokens (the end-of-sequence token included).

        ``training=True`` takes exactly ``batch_size`` prompts (what memory is planned for
        and what learn splits into micro-batches); ``training=False`` (evaluation, as in
        upstream AgileRL) takes any number (a multiple of the data-parallel ranks) and generates one
        completion per prompt.
        """
        input_ids, attention_mask = self._fit_prompts(*self._encode(prompts))
        num_prompts = input_ids.shape[0]
        if training and num_prompts != self.batch_size:
            raise ValueError(
                f"get_action got {num_prompts} prompts; a training step takes batch_size={self.batch_size} "
                "(prompts per step across all ranks, what memory is planned for): give that many, or "
                "training=False to evaluate any number with one completion each"
            )
        group_size = self.group_size if training else 1
        index = torch.arange(num_prompts, device=input_ids.device).repeat_interleave(group_size)
        index = index[self.local_slice(num_prompts, group_size)]
        ids, mask = input_ids[index], attention_mask[index]
        self._sync_tensor_parallel_rng()
        with self._phase("rollout"):
            if self.engine is not None:
                completions, lengths = self._generate_with_engine(ids, mask)
            else:
                completions = self._generate_hf(ids, mask)
                lengths = None
        completion_mask = self._completion_mask(completions, lengths)
        completions = completions.masked_fill(completion_mask == 0, self.pad_token_id)
        full = torch.cat([ids, completions], dim=1)
        action_masks = torch.cat([torch.zeros_like(ids), completion_mask], dim=1)
        return full, action_masks

    def _fit_prompts(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded prompts cut to what ``max_model_len`` (or a vLLM engine's own, if shorter)
        leaves beside ``max_output_tokens`` (the length memory is planned for, and the engine
        takes): a longer prompt keeps its last tokens, those the completion follows, and the cut
        is logged."""
        engine = self.vllm_config.max_model_len if self.vllm_config is not None else None
        lengths = [n for n in (self.max_model_len, engine) if n is not None]  # a vLLM engine's own cap too
        if not lengths or ids.shape[1] <= (room := min(lengths) - self.max_output_tokens):
            return ids, mask
        longer = int((mask.sum(dim=1) > room).sum())
        if longer and is_main_process():
            logger.warning(
                "[agilerl] %d prompt(s) of up to %d tokens cut to their last %d: max_model_len=%d leaves that "
                "beside max_output_tokens=%d",
                longer,
                int(mask.sum(dim=1).max()),
                room,
                min(lengths),
                self.max_output_tokens,
            )
        return ids[:, -room:], mask[:, -room:]

    def _completion_mask(self, completions: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """1 up to and including each row's first end-of-sequence token, else the whole row
        (or its first ``lengths`` tokens, for engines that return ragged completions)."""
        eos = torch.tensor(sorted(self.eos_token_ids()), device=completions.device, dtype=completions.dtype)
        is_eos = torch.isin(completions, eos)
        width = completions.shape[1]
        first = torch.where(
            is_eos.any(dim=1), is_eos.float().argmax(dim=1), torch.full_like(is_eos[:, 0], width, dtype=torch.long)
        )
        length = torch.clamp(first + 1, max=width)
        if lengths is not None:
            length = torch.minimum(length, lengths.to(length.device))
        positions = torch.arange(width, device=completions.device).unsqueeze(0)
        return (positions < length.unsqueeze(1)).to(completions.dtype)

    @contextlib.contextmanager
    def _gathered_for_reference(self):
        """With ``gather_weights_for_rollout`` under FSDP2: the no-grad passes hold every unit
        unsharded too (each gathered at its first forward, all resharded at the end), which the
        estimate of gathering once for generate has already let fit; nothing is merged (they run
        the reference or the old policy). Otherwise nothing."""
        if not (self.sharded and self.gather_weights_for_rollout and self.engine is None):
            yield
            return
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        before = [_reshards_after_forward(m, self.fsdp_config.reshard_after_forward) for m in units]
        for m in units:
            m.set_reshard_after_forward(False, recurse=False)
        try:
            yield
        finally:
            for m, value in zip(units, before):
                m.reshard()
                m.set_reshard_after_forward(value, recurse=False)

    @contextlib.contextmanager
    def _gathered_for_rollout(self):
        """With ``gather_weights_for_rollout`` under FSDP2: no unit reshards after its forward for the
        duration, so each is gathered once, at its first forward; all reshard at the end, and each
        unit's own setting comes back. Unsharded: the merged copies of :meth:`_merged_copies_for_rollout`.
        Otherwise nothing."""
        if not self.gather_weights_for_rollout:
            try:
                yield
            finally:
                if self.sharded and self.fsdp_config.reshard_after_forward:
                    # the root keeps its parameters gathered after a forward for the backward that
                    # follows (apply_fsdp2); none follows generate: leave the model sharded
                    from torch.distributed.fsdp import FSDPModule

                    if isinstance(self.model, FSDPModule):
                        self.model.reshard()
            return
        if not self.sharded:
            with self._merged_copies_for_rollout():
                yield
            return
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        before = [_reshards_after_forward(m, self.fsdp_config.reshard_after_forward) for m in units]
        for m in units:  # left gathered by a no-grad forward under reshard_after_forward=False
            m.reshard()
        # Found before anything is gathered (a gathered unit holds plain tensors): the sharded
        # adapted weights, folded into their gathered copies, and the replicated ones (below the
        # persistence threshold), which generate on merged copies as unsharded.
        mergeable = _mergeable_lora_layers(self.model) if self.fsdp_config.tp == 1 else []
        replicated = _mergeable_lora_layers(self.model, sharded=False) if self.fsdp_config.tp == 1 else []
        for m in units:
            m.set_reshard_after_forward(False, recurse=False)
        merged = []
        try:
            if mergeable or replicated:
                # Gather every unit now (so every adapter reads as a plain tensor too) and fold the
                # actor's LoRA into the gathered base weights: one matmul per linear per token instead
                # of three. Only FSDP's unsharded copies change, and the reshard below drops them, so
                # the sharded weights stay bit for bit as they were.
                for m in units:
                    m.unshard()
                with torch.no_grad():
                    for layer in mergeable:
                        weight = layer.get_base_layer().weight
                        weight.add_(layer.get_delta_weight(ACTOR).to(weight.dtype))
                        layer.merged_adapters.append(ACTOR)
                        merged.append(layer)
            with self._merged_copies_for_rollout(replicated):
                yield
        finally:
            for layer in merged:
                layer.merged_adapters.remove(ACTOR)
            for m, value in zip(units, before):
                m.reshard()
                m.set_reshard_after_forward(value, recurse=False)

    @contextlib.contextmanager
    def _merged_copies_for_rollout(self, layers: list[nn.Module] | None = None):
        """Each of ``layers`` (default: every mergeable actor LoRA linear of an unsharded model) has
        its base weight swapped for a new tensor ``W + s B A`` for the duration, and PEFT runs the
        base layer alone. The original parameter object is put back untouched at the end (not
        unmerged: subtracting would not be exact)."""
        if layers is None:
            layers = _mergeable_lora_layers(self.model, sharded=False)
        swapped = []
        try:
            with torch.no_grad():
                for layer in layers:
                    base = layer.get_base_layer()
                    original = base.weight
                    merged = original + layer.get_delta_weight(ACTOR).to(original.dtype)
                    base._parameters["weight"] = nn.Parameter(merged, requires_grad=False)
                    layer.merged_adapters.append(ACTOR)
                    swapped.append((layer, base, original))
            yield
        finally:
            for layer, base, original in swapped:
                base._parameters["weight"] = original
                layer.merged_adapters.remove(ACTOR)

    def _generate_hf(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        was_training = self.model.training
        self.model.eval()
        try:
            kwargs = dict(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=self.max_output_tokens,
                do_sample=True,
                temperature=self.temperature,
                top_k=0,
                top_p=1.0,
                pad_token_id=self.pad_token_id,
                eos_token_id=self.eos_token_id,
                use_cache=True,
                synced_gpus=self._generate_needs_sync(),
            )
            kwargs.update(self.generation_kwargs)
            with use_adapter(self.model, ACTOR), self._gathered_for_rollout(), neutral_generation_config(self.model):
                prefilled = self._shared_prefill(ids, mask)
                if prefilled is not None:
                    from agilerl.utils.prefix_cache import cache_argument

                    kwargs[cache_argument(causal_lm(self.model))] = prefilled
                out = self.model.generate(**kwargs)
        finally:
            self.model.train(was_training)
        completions = out[:, ids.shape[1] :]
        if completions.shape[1] == 0:
            completions = torch.full((ids.shape[0], 1), self.pad_token_id, device=ids.device, dtype=ids.dtype)
        return completions

    def _generate_needs_sync(self) -> bool:
        """Whether generate's forwards run collectives, so that a rank that has finished must keep
        joining the others' steps (``synced_gpus``): under FSDP2 every unit gathers in every forward,
        unless they are gathered once for the call; tensor and expert parallelism communicate in
        every forward whatever the gathering."""
        if not (self.sharded and self.world_size > 1):
            return False
        config = self.fsdp_config
        return not self.gather_weights_for_rollout or config.tp > 1 or config.ep > 1

    @torch.no_grad()
    def _shared_prefill(self, ids: torch.Tensor, mask: torch.Tensor):
        """With ``share_prompt_prefix``: the KV cache of every prompt but its last token, made once
        per distinct prompt and copied to its group's rows (generate then runs the last prompt token
        of every row and samples from there). None where the rows share no prompt or the model
        does not take the shared-prefix forward."""
        from transformers.cache_utils import DynamicCache

        split = ids.shape[1] - 1
        groups = self._prefix_groups(ids, mask, split)
        if groups is None:
            return None
        from agilerl.utils.prefix_cache import cache_argument

        rows, dtype, lm = groups.rows, self._activation_dtype(), causal_lm(self.model)
        cache = DynamicCache()
        self.model(
            input_ids=ids[rows, :split],
            attention_mask=shared_attention_mask(lm.config, mask[rows, :split], dtype),
            position_ids=position_ids_from_mask(mask[rows, :split]),
            use_cache=True,
            logits_to_keep=1,  # generate's prefill, as generate runs it (its logits are not read)
            **{cache_argument(lm): cache},
        )
        cache.batch_select_indices(groups.inverse)
        return cache

    def _generate_with_engine(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
        offload = self._weight_offload
        # With the trainer's weights offloaded, the engine wakes in two steps: its weights first, to
        # take the new ones while the trainer's are still on the device, then its KV cache in the
        # memory the trainer's weights leave.
        self.engine.wake_up(tags=["weights"]) if offload is not None else self.engine.wake_up()
        self.sync_engine_weights()
        try:
            if offload is not None:
                offload.offload()
                self.engine.wake_up(tags=["kv_cache"])
            outputs = self.engine.generate(
                prompts,
                max_tokens=self.max_output_tokens,
                temperature=self.temperature,
                seed=self._engine_seed(),
                stop_token_ids=sorted(self.eos_token_ids()),
                min_tokens=int(self.generation_kwargs.get("min_new_tokens", 0)),
            )
        finally:
            self.engine.sleep(self.vllm_config.sleep_level if self.vllm_config else 1)
            if offload is not None:
                offload.restore()
        width = max(1, max(len(o) for o in outputs))
        out = torch.full((len(outputs), width), self.pad_token_id, dtype=ids.dtype)
        for i, o in enumerate(outputs):
            out[i, : len(o)] = torch.tensor(o, dtype=ids.dtype)
        lengths = torch.tensor([len(o) for o in outputs])
        return out.to(ids.device), lengths

    @torch.no_grad()
    def sync_engine_weights(self) -> None:
        """Send the actor's merged weights (base + scaled LoRA) to the rollout engine (phase ``sync``)."""

        checkpoint = getattr(self.engine, "weight_names", "model") == "checkpoint"
        with self._phase("sync"):
            if self.sharded:  # the sync gathers one module at a time: nothing else may stay gathered
                self._reshard_units(self.model)
            self.engine.load_weights(
                _merged_weights(self.model, causal_lm(self.model), self.dtype, checkpoint_names=checkpoint)
            )

    # -- learning ------------------------------------------------------------------------
    def _attention_mask(self, ids: torch.Tensor, action_masks: torch.Tensor) -> torch.Tensor:
        """The mask the rollout generated under: the completion tokens, and each left-padded
        prompt from its first token that is not padding. A prompt token equal to the pad id
        after that (the end-of-sequence token closing a chat turn, where the tokenizer pads
        with it) is attended, as the tokenizer's mask had it when the completion was sampled."""
        prompt_region = action_masks.cumsum(dim=1) == 0
        started = ((ids != self.pad_token_id) & prompt_region).cumsum(dim=1) > 0
        return (action_masks.bool() | (prompt_region & started)).long()

    def learn(self, experiences: Sequence[torch.Tensor]) -> dict[str, float]:
        """One GRPO update on ``(ids, action_masks, rewards)`` from :meth:`get_action`.

        ``rewards`` holds this rank's completions' rewards, in order. Returns
        metrics reduced across ranks: ``loss``, ``kl``, ``clip_fraction``,
        ``grad_norm``, ``mean_reward``, ``reward_std`` and ``completion_length``.
        """
        ids, action_masks, rewards = experiences[0], experiences[1], experiences[2]
        ids = ids.to(self.device)
        action_masks = action_masks.to(self.device)
        rewards = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1)
        n = ids.shape[0]
        if rewards.numel() != n:
            raise ValueError(f"got {rewards.numel()} rewards for {n} completions")
        attention = self._attention_mask(ids, action_masks)
        loss_mask = action_masks[:, 1:]
        first = self._first_scored(loss_mask)  # prompt positions skip the head

        all_rewards = gather_tensor(rewards.cpu())
        tp = self.fsdp_config.tp if self.sharded else 1
        if tp > 1:  # every rank of a tensor-parallel group holds the same rows: keep one copy
            all_rewards = all_rewards.view(self.world_size, n)[::tp].reshape(-1)
        if all_rewards.numel() % self.group_size:
            raise ValueError(f"{all_rewards.numel()} completions in total are not whole groups of {self.group_size}")
        advantages = self.advantages(all_rewards)
        start = self.data_parallel_rank * n
        advantages = advantages[start : start + n].to(self.device)

        with self._phase("reference"), self._gathered_for_reference():
            ref_logp = None
            if self.beta != 0.0:
                ref_adapter = REFERENCE if self.use_separate_reference_adapter else None
                ref_logp = self._no_grad_logprobs(ids, attention, ref_adapter, first)
            old_logp = self._no_grad_logprobs(ids, attention, ACTOR, first) if self.update_epochs > 1 else None

        sums = {"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0}
        norms = []
        count = n // self.micro_batch_size_per_gpu
        if self.step_token_mean:  # a rank's average tokens per micro-batch, over the whole step
            per_micro_batch = max(1.0, self._dp_sum(float(loss_mask.sum())) / self.data_parallel_ranks / count)
        for _ in range(self.update_epochs):
            for s in self._learn_micro_batches(n):
                with use_adapter(self.model, ACTOR):
                    logp = self.token_logprobs(ids[s], attention[s], first)
                old = old_logp[s] if old_logp is not None else logp.detach()
                ref = ref_logp[s] if ref_logp is not None else None
                loss, stats = self.policy_loss(logp, old, ref, advantages[s], loss_mask[s])
                # a token mean over the micro-batch, reweighted to one over the step's tokens on
                # every rank: the gradient is then the same for any micro-batch size
                weight = float(loss_mask[s].sum()) / per_micro_batch / count if self.step_token_mean else 1 / count
                (loss * weight).backward()
                sums["loss"] += loss.item() * weight
                sums["kl"] += stats["kl"].item() * weight
                sums["clip_fraction"] += stats["clip_fraction"].item() * weight
            with self._phase("step"):
                norms.append(float(self._optimizer_step()))
        self.steps += 1
        mean_reward = float(rewards.mean())
        self.scores.append(mean_reward)
        metrics = {
            "loss": sums["loss"] / self.update_epochs,
            "kl": sums["kl"] / self.update_epochs,
            "clip_fraction": sums["clip_fraction"] / self.update_epochs,
            "grad_norm": sum(norms) / len(norms),
            "mean_reward": mean_reward,
            "reward_std": float(all_rewards.std()),
            "completion_length": float(action_masks.sum(dim=1).float().mean()),
        }
        return aggregate_metrics_dict(metrics, maximized=("grad_norm",))

    # -- what the algorithms built on GRPO's loop replace -----------------------------------
    #: Whether :meth:`policy_loss` is a mean over its micro-batch's tokens that stands for a mean
    #: over every completion token of the step (CISPO's normalisation); False: a mean over
    #: sequences, as GRPO's, which micro-batches of equal rows average exactly.
    step_token_mean: bool = False

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """Per-completion advantages from every completion's reward, in group order: GRPO's
        group-normalised ``(r - mean) / (std + eps)``."""
        return group_advantages(rewards, self.group_size)

    def policy_loss(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        ref_logp: torch.Tensor | None,
        advantages: torch.Tensor,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One micro-batch's loss and its ``kl`` and ``clip_fraction`` statistics (:func:`grpo_loss`).
        ``old_logp`` is ``logp.detach()`` with one update epoch (the policy that sampled)."""
        return grpo_loss(logp, old_logp, ref_logp, advantages, mask, clip_coef=self.clip_coef, beta=self.beta)


def _reshards_after_forward(unit: nn.Module, default: bool) -> bool:
    """Whether an FSDP2 unit reshards after forward (FSDP2 has a setter, no getter: read its state)."""
    try:
        group = unit._get_fsdp_state()._fsdp_param_group
    except AttributeError:  # pragma: no cover - another torch layout
        return default
    return default if group is None else group.post_forward_mesh_info is not None


def _mergeable_lora_layers(model: nn.Module, sharded: bool = True) -> list[nn.Module]:
    """The actor's LoRA linears whose delta can be folded into a copy of the base weight.

    ``sharded``: the base weight must be one FSDP2 shards (a DTensor), so that folding into the
    gathered copy changes nothing that survives the reshard. Unsharded: a plain tensor (the copy
    is made by the caller). Left unmerged either way: a replicated base weight under FSDP2 (below
    the persistence threshold), a 4-bit one (QLoRA), DoRA, a LoRA bias, LoRA on packed experts,
    and layers whose adapters are merged already."""
    from peft.tuners.lora.layer import Linear as LoraLinear
    from torch.distributed.tensor import DTensor

    from .core.adapters import tuner_layers

    layers = []
    for layer in tuner_layers(model):
        if type(layer) is not LoraLinear or ACTOR not in layer.lora_A or layer.merged_adapters:
            continue
        base = layer.get_base_layer()
        weight = getattr(base, "weight", None)
        if (
            weight is None
            or isinstance(weight, DTensor) is not sharded
            or getattr(base, "quant_state", None) is not None
            or layer.use_dora.get(ACTOR, False)
            or getattr(layer, "lora_bias", {}).get(ACTOR, False)
        ):
            continue
        layers.append(layer)
    return layers


def _engine_sync_problem(agent) -> str | None:
    """Why the actor's LoRA cannot be merged into the weights a rollout engine is sent
    (:func:`_merged_weights` adds ``W + s B A`` to each adapted linear's weight), or None: DoRA
    rescales the merged weight by its magnitude vector, an adapted embedding keeps its factors
    in ``lora_embedding_A``/``_B``, and LoRA on packed expert parameters (``all-linear`` on most
    MoE models) wraps the parameter, not a linear; the engine would generate from another policy
    than the one trained."""
    if agent.lora_config is None:
        return None
    from peft.tuners.lora.layer import Embedding, ParamWrapper

    from .core.adapters import tuner_layers

    layers = tuner_layers(agent.model)
    kinds = []
    if getattr(agent.lora_config, "use_dora", False):
        kinds.append("DoRA (use_dora=True)")
    if any(isinstance(layer, Embedding) for layer in layers):
        kinds.append("LoRA on the embeddings")
    wrapped = [
        f"{name.replace('.base_layer', '').rsplit('.', 1)[-1]}.{module.parameter_name}"  # experts.gate_up_proj
        for name, module in agent.model.named_modules()
        if isinstance(module, ParamWrapper)
    ]
    if wrapped:
        kinds.append(f"LoRA on MoE parameters, not linear layers ({', '.join(sorted(set(wrapped)))})")
    if not kinds:
        return None
    return (
        f"{' and '.join(kinds)} cannot be merged into the weights a rollout engine generates from yet: "
        "adapt the linear layers only (on a MoE model, e.g. target_modules=['q_proj', 'k_proj', 'v_proj', "
        "'o_proj']), or generate with Hugging Face (no vllm_config)"
    )


def _merged_weights(
    model: nn.Module, lm: nn.Module, dtype: torch.dtype | None = None, *, checkpoint_names: bool = False
):
    """Base weights with the actor's LoRA delta merged, under Hugging Face names: the model's own,
    or with ``checkpoint_names`` the checkpoint's (:func:`_checkpoint_format`).

    A generator that gathers one module's parameters at a time (and, for a
    LoRA layer, its adapter), so a sharded actor never holds more than one
    module unsharded. Every rank must consume it in the same order. A 4-bit
    (QLoRA) base weight is dequantised first: the engine runs the compute dtype.
    """
    from agilerl.distributed import gather_params

    from .core.adapters import tuner_layers

    lora_of = {
        id(layer.get_base_layer()): layer for layer in tuner_layers(model) if ACTOR in getattr(layer, "lora_A", {})
    }
    seen: set[int] = set()
    as_saved = _checkpoint_format(lm) if checkpoint_names else None
    for name, module in lm.named_modules():
        if getattr(module, "base_layer", None) is not None or ".lora_" in f".{name}.":
            continue
        own = [(pname, p) for pname, p in module.named_parameters(recurse=False) if id(p) not in seen]
        if not own:
            continue
        seen.update(id(p) for _, p in own)
        layer = lora_of.get(id(module))
        extra = [layer.lora_A[ACTOR].weight, layer.lora_B[ACTOR].weight] if layer is not None else []
        named: dict[str, torch.Tensor] = {}
        with gather_params(model, [p for _, p in own] + extra):
            for pname, _ in own:
                value = getattr(module, pname)
                if pname == "weight" and getattr(module, "quant_state", None) is not None:
                    # QLoRA: the engine gets the dequantised weight (its own bf16 copy; merging the
                    # adapter into 4-bit would re-quantise it every step and drift from the policy).
                    import bitsandbytes as bnb

                    value = bnb.functional.dequantize_4bit(value.data, module.quant_state)
                if pname == "weight" and layer is not None:
                    value = value + layer.get_delta_weight(ACTOR).to(value.dtype)
                full_name = f"{name}.{pname}" if name else pname
                # in the compute dtype the engine runs (full fine-tuning's fp32 shards: half the bytes sent)
                value = value.detach().to(dtype, copy=True) if dtype is not None else value.detach().clone()
                named[full_name.replace(".base_layer", "").replace("_checkpoint_wrapped_module.", "")] = value
            yield from (as_saved(named) if as_saved is not None else named).items()


def _checkpoint_format(lm: nn.Module):
    """A function from one module's ``{name: tensor}`` to the names and layout its checkpoint
    has on disk, or None where they are the model's own. Transformers 5 loads some layouts
    converted (a MoE layer's experts packed into ``experts.gate_up_proj`` and
    ``experts.down_proj``, from ``experts.<i>.gate_proj.weight`` and the like) and reverts the
    conversion when it saves; vLLM reads the checkpoint's layout, so the sync sends that: the
    packed tensors under vLLM's names would be loaded as another layout, silently."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, revert_weight_conversion
    except ImportError:  # transformers 4: every model keeps its checkpoint's layout
        return None
    conversions = getattr(lm, "_weight_conversions", None)
    if conversions is None:  # built from its config (the meta-device path): the model type's own
        conversions = [c for c in get_model_conversion_mapping(lm, add_legacy=False) if not isinstance(c, PrefixChange)]
    if not conversions:
        return None
    return lambda named: revert_weight_conversion(lm, named)
