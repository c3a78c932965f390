"""What a fine-tuning run does, in the terms memory depends on. Pure data: no torch."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from agilerl.typing import AttnImplementation
from agilerl.utils.algo_utils import batched_tokens_problem

__all__ = [
    "Workload",
    "ALGORITHM_CLASSES",
    "ALGORITHM_DEFAULTS",
    "OFFLINE_SEQUENCES",
    "VLLM_DEFAULT_UTILIZATION",
    "VLLM_DEFAULT_MAX_NUM_SEQS",
    "resolved",
    "parse_lora_targets",
]

T = TypeVar("T")


def resolved(value: T | None, name: str) -> T:
    """A workload field left to the planner (None) once it has been resolved: the estimate
    resolves micro-batch and engine settings first (planner.memory.resolve_workload), the plan
    its own choices. ValueError names the field should an unresolved one reach here."""
    if value is None:
        raise ValueError(f"{name} is unresolved here: the planner sets it before it is read")
    return value


#: agilerl.utils.algo_utils.VLLMConfig's defaults, read where the planner is not asked to choose.
VLLM_DEFAULT_UTILIZATION = 0.3
VLLM_DEFAULT_MAX_NUM_SEQS = 256


#: Workload.algorithm -> the trainer class (agilerl.algorithms) and the manifest's algorithm.name.
ALGORITHM_CLASSES = {
    "grpo": "GRPO",
    "cispo": "CISPO",
    "gspo": "GSPO",
    "reinforce": "LLMREINFORCE",
    "ppo": "LLMPPO",
    "sft": "SFT",
    "dpo": "DPO",
}
#: The offline objectives (no rollout) and the sequences each example has: SFT's completion, DPO's
#: chosen and rejected ones.
OFFLINE_SEQUENCES = {"sft": 1, "dpo": 2}
#: Each algorithm's own defaults where they differ from GRPO's (the trainer classes' signatures).
ALGORITHM_DEFAULTS: dict[str, dict[str, Any]] = {
    "cispo": {"beta": 0.0},
    "gspo": {"beta": 0.0},
    "ppo": {"beta": 0.05, "group_size": 1, "update_epochs": 4},
    "sft": {"beta": 0.0, "group_size": 1, "generation": "none"},
    "dpo": {"beta": 0.1, "group_size": 2, "generation": "none"},
}


def parse_lora_targets(text: str) -> str | tuple[str, ...]:
    """LoRA targets as a user types them (``--lora-targets``, the explorer's knob): ``all-linear``,
    or comma-separated module names; ValueError says what is wrong."""
    text = text.strip()
    if text == "all-linear":
        return text
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    if "all-linear" in names:
        raise ValueError(f"all-linear stands alone: give it or module names, not both (got {text!r})")
    if not names:
        raise ValueError(f"give all-linear or comma-separated module names (got {text!r})")
    return names


class Workload(BaseModel):
    """One training step's shape (algorithm, global batch, lengths, LoRA, generation)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # inf and nan plan nothing

    algorithm: Annotated[
        Literal["grpo", "cispo", "gspo", "reinforce", "ppo", "sft", "dpo"],
        Field(
            description="The objective. grpo, cispo, gspo and reinforce run GRPO's passes (rollout, reference "
            "when beta > 0, an old log-prob pass when update_epochs > 1, learn; cispo and gspo default "
            "to beta 0, reinforce to one epoch); ppo adds a value head, its sampling pass every step "
            "and 4 epochs; sft learns completions (no rollout, no reference); dpo a chosen and a "
            "rejected completion per prompt against a reference pass (no rollout)."
        ),
    ] = "grpo"
    full_finetune: Annotated[
        bool,
        Field(
            description="Train every parameter (lora_config=None) with fp32 master weights, gradients and AdamW "
            "moments, and a frozen reference copy in the weights dtype where the objective has a "
            "reference; False: LoRA adapters on a frozen base."
        ),
    ] = False
    prompts_per_step: Annotated[
        int,
        Field(
            ge=1,
            description="Prompts (preference pairs for dpo, examples for sft) per optimizer step across "
            "all GPUs (the trainer's batch_size).",
        ),
    ] = 8
    group_size: Annotated[
        int,
        Field(
            ge=1,
            description="Completions per prompt: generated (at least 2 for the group-relative "
            "objectives; ppo 1 by default), 1 for sft, 2 for dpo (chosen, rejected).",
        ),
    ] = 8
    prompt_tokens: Annotated[int, Field(ge=1, description="Prompt length in tokens (the longest, as padded).")] = 256
    completion_tokens: Annotated[int, Field(ge=1, description="Completion length in tokens (max_output_tokens).")] = 256
    micro_batch_size_per_gpu: Annotated[
        int | None, Field(ge=1, description="Sequences per forward/backward on each GPU; None: the planner chooses.")
    ] = None
    logprob_chunk_size: Annotated[
        int | None, Field(ge=1, description="Token rows per log-prob chunk; None: the planner chooses.")
    ] = None
    gradient_checkpointing: Annotated[
        bool | None, Field(description="Recompute block activations in backward; None: the planner chooses.")
    ] = None
    lora_rank: Annotated[int, Field(ge=1, description="LoRA rank r.")] = 16
    lora_alpha: Annotated[int, Field(ge=1, description="LoRA alpha.")] = 32
    lora_dropout: Annotated[
        float,
        Field(
            ge=0.0,
            lt=1.0,
            description="LoRA dropout (the trainer's default: 0): above 0, each adapted linear's learn "
            "forward keeps its dropped input and a one-byte mask per element (PEFT refuses it where LoRA "
            "adapts MoE expert parameters).",
        ),
    ] = 0.0
    lora_targets: Annotated[
        str | tuple[str, ...], Field(description="'all-linear' or the module names LoRA adapts.")
    ] = "all-linear"
    use_separate_reference_adapter: Annotated[
        bool, Field(description="A frozen 'reference' adapter (fp32) instead of disabling adapters.")
    ] = False
    beta: Annotated[
        float,
        Field(
            ge=0.0,
            description="KL weight; 0 skips the reference pass (dpo: the implicit reward's scale, "
            "its reference pass always runs).",
        ),
    ] = 0.04
    update_epochs: Annotated[
        int, Field(ge=1, description="Optimizer passes per batch (>1 adds an old log-prob pass).")
    ] = 1
    temperature: Annotated[
        float,
        Field(
            gt=0.0,
            allow_inf_nan=False,
            description="Sampling temperature of the rollout (the trainer's default: 1; the log-probs use it "
            "too): other than 1, Hugging Face generate keeps one more fp32 copy of the last position's "
            "logits while it samples (the offline objectives sample nothing: 1).",
        ),
    ] = 1.0
    weights_dtype: Annotated[
        Literal["bfloat16", "float16", "float32"],
        Field(
            description="Dtype the base weights are loaded in (frozen with LoRA; with full_finetune the model "
            "computes in it and the optimizer keeps fp32 masters, or FSDP2 keeps fp32 shards)."
        ),
    ] = "bfloat16"
    load_in_4bit: Annotated[
        bool,
        Field(
            description="QLoRA: NF4 base weights (planned sharded by FSDP2 or not; a colocated vLLM "
            "engine holds its own copy in the weights dtype)."
        ),
    ] = False
    generation: Annotated[
        Literal["hf", "vllm", "none"],
        Field(
            description="Rollouts with Hugging Face generate (KV cache), a colocated vLLM engine, or none on "
            "the trainer GPUs (an objective with a rollout then generates on engine ranks of their own, one "
            "GPU per node, which a plan judges too)."
        ),
    ] = "hf"
    vllm_gpu_memory_utilization: Annotated[
        float | None,
        Field(
            gt=0,
            le=1,
            description="Fraction of GPU memory a colocated vLLM engine takes; None: the planner "
            "picks the largest that fits (an estimate alone reads VLLMConfig's 0.3).",
        ),
    ] = None
    vllm_sleep_level: Annotated[Literal[1, 2], Field(description="vLLM sleep level between rollouts.")] = 1
    vllm_max_num_seqs: Annotated[
        int | None,
        Field(
            ge=1,
            description="Most sequences the vLLM engine schedules at once; None: the planner picks a rank's "
            "completions per rollout, at most 256 (an estimate alone reads VLLMConfig's 256).",
        ),
    ] = None
    vllm_max_model_len: Annotated[
        int | None,
        Field(ge=1, description="Longest sequence the vLLM engine accepts; None: prompt + completion tokens."),
    ] = None
    vllm_max_num_batched_tokens: Annotated[
        int | None,
        Field(
            ge=1,
            description="Tokens the vLLM engine schedules per step; None: the trainer's rule "
            "(agilerl.utils.algo_utils.vllm_batched_tokens).",
        ),
    ] = None
    vllm_kv_cache_memory_bytes: Annotated[
        int | None,
        Field(
            ge=1,
            description="The vLLM engine's KV cache in bytes (VLLMConfig.kv_cache_memory_bytes; on CPU, "
            "VLLM_CPU_KVCACHE_SPACE); None: vllm_gpu_memory_utilization sizes it.",
        ),
    ] = None
    vllm_enforce_eager: Annotated[
        bool, Field(description="vLLM without CUDA graphs (their pool comes out of its KV cache, not on top).")
    ] = False
    offload_weights_during_rollout: Annotated[
        bool,
        Field(
            description="Park the trainer's weights (base and adapters) in host memory while the colocated vLLM engine "
            "generates (needs generation='vllm')."
        ),
    ] = False
    gather_weights_for_rollout: Annotated[
        bool | None,
        Field(
            description="Materialise the rollout's weights once for a whole Hugging Face generate instead of once per "
            "token: under FSDP2 every unit gathered (and LoRA folded in), unsharded a merged copy of "
            "each adapted linear; None: the planner chooses."
        ),
    ] = None
    logprob_rows: Annotated[
        Literal["completion", "all"],
        Field(
            description="Token rows the log-prob head runs over: the completion's, from its earliest token on "
            "(this trainer), or every position (trainers that score the prompt too, such as "
            "upstream AgileRL's)."
        ),
    ] = "completion"
    attn_implementation: Annotated[
        AttnImplementation,
        Field(description="Attention kernel; eager materialises the batch x heads x length^2 scores."),
    ] = "sdpa"
    padded_batches: Annotated[
        bool,
        Field(
            description="Rows of a micro-batch differ in length (real rollouts: prompts left-padded, completions "
            "ending early), so its forward holds an attention mask of micro-batch x length^2; False: "
            "every row has the same length (synthetic batches, as the accuracy benchmarks probe)."
        ),
    ] = True
    share_prompt_prefix: Annotated[
        bool,
        Field(
            description="The rows of a group share their prompt (real rollouts) and the trainer runs it once per "
            "group where the model allows (agilerl.utils.shared_prefix): in learn, the no-grad passes "
            "and generate's prefill; False: rows that share nothing (the probes' random batches) or "
            "a trainer that runs every row whole."
        ),
    ] = True
    autocast_forward: Annotated[
        bool,
        Field(
            description="The trainer runs its forwards under torch.autocast to the compute dtype: PEFT's fp32 "
            "adapters on a bf16 base then save a bf16 copy of each adapted linear's input rather than an fp32 "
            "one (no effect with full fine-tuning or adapters in the compute dtype). Not this project's "
            "trainer (it casts to the adapters' dtype); upstream AgileRL's GRPO without an Accelerator does."
        ),
    ] = False

    @field_validator("lora_targets")
    @classmethod
    def _targets(cls, value: str | tuple[str, ...]) -> str | tuple[str, ...]:
        names = (value,) if isinstance(value, str) else value
        if not names or not all(n.strip() for n in names):
            raise ValueError("name at least one module for LoRA to adapt, or 'all-linear'")
        return value

    @model_validator(mode="before")
    @classmethod
    def _algorithm_defaults(cls, data: Any) -> Any:
        # Fields not given take the algorithm's own default (CISPO's and GSPO's papers use no KL
        # term, so no reference pass; SFT and DPO have no rollout; ...).
        if isinstance(data, dict) and data.get("algorithm") in ALGORITHM_DEFAULTS:
            defaults = ALGORITHM_DEFAULTS[data["algorithm"]]
            data = {**data, **{k: v for k, v in defaults.items() if data.get(k) is None}}
        return data

    @model_validator(mode="after")
    def _check(self) -> Workload:
        algorithm = self.algorithm
        if algorithm in OFFLINE_SEQUENCES:
            wanted = OFFLINE_SEQUENCES[algorithm]
            if self.group_size != wanted:
                raise ValueError(
                    f"group_size={self.group_size}: {algorithm} has {wanted} sequence(s) per example"
                    + (" (chosen, rejected)" if algorithm == "dpo" else "")
                )
            if self.generation != "none":
                raise ValueError(
                    f"generation={self.generation!r}: {algorithm} learns from a dataset, it has no "
                    "rollout (generation='none')"
                )
            if self.update_epochs != 1:
                raise ValueError(f"update_epochs={self.update_epochs}: {algorithm} takes one pass per batch")
            if self.temperature != 1.0:
                raise ValueError(
                    f"temperature={self.temperature:g}: {algorithm} learns from a dataset, it samples nothing "
                    "(temperature 1)"
                )
        elif algorithm != "ppo" and self.group_size < 2:
            raise ValueError(
                f"group_size={self.group_size}: {algorithm}'s advantages are relative within a group "
                "of at least 2 completions"
            )
        if algorithm == "dpo" and self.beta <= 0:
            raise ValueError(f"beta={self.beta}: dpo's beta scales its implicit reward and must be > 0")
        if algorithm == "sft" and self.beta != 0:
            raise ValueError(f"beta={self.beta}: sft has no reference policy (beta 0)")
        if algorithm == "sft" and self.use_separate_reference_adapter:
            raise ValueError("use_separate_reference_adapter=True: sft has no reference policy to keep an adapter for")
        if self.full_finetune and self.load_in_4bit:
            raise ValueError(
                "full_finetune=True with load_in_4bit=True: QLoRA trains LoRA adapters on a frozen "
                "4-bit base; 4-bit weights do not train"
            )
        if self.full_finetune and self.use_separate_reference_adapter:
            raise ValueError(
                "full_finetune=True with use_separate_reference_adapter=True: there is no adapter; the "
                "reference is a frozen copy of the model"
            )
        if algorithm == "reinforce" and self.update_epochs != 1:
            raise ValueError(f"update_epochs={self.update_epochs}: reinforce is on-policy (one update epoch)")
        if self.offload_weights_during_rollout and self.generation != "vllm":
            raise ValueError(
                "offload_weights_during_rollout=True needs generation='vllm' (a colocated engine): "
                "Hugging Face generate runs on the trainer's weights"
            )
        if problem := batched_tokens_problem(self.vllm_max_num_batched_tokens, self.vllm_max_num_seqs, "vllm_"):
            raise ValueError(problem)
        if self.vllm_max_model_len is not None and self.vllm_max_model_len < self.sequence_tokens:
            raise ValueError(
                f"vllm_max_model_len={self.vllm_max_model_len} is shorter than prompt_tokens + "
                f"completion_tokens = {self.sequence_tokens}: the engine would refuse the prompts"
            )
        return self

    def other_trainer_fields(self) -> list[str]:
        """The fields set to describe another trainer than this project's (upstream AgileRL's), as
        ``name=value``: a probe or a tuner trial runs this project's, so it cannot measure them."""
        ours = {"logprob_rows": "completion", "autocast_forward": False}
        return [f"{name}={getattr(self, name)!r}" for name, value in ours.items() if getattr(self, name) != value]

    def vllm_settings(self) -> dict[str, Any]:
        """The colocated engine's settings as agilerl.utils.algo_utils.VLLMConfig fields (what the
        manifest's ``algorithm.vllm`` holds and the probe starts): VLLMConfig's defaults for the
        fraction and max_num_seqs when neither was given nor chosen; the optional sizes only when set."""
        settings: dict[str, Any] = {
            "gpu_memory_utilization": self.vllm_gpu_memory_utilization or VLLM_DEFAULT_UTILIZATION,
            "max_num_seqs": self.vllm_max_num_seqs or VLLM_DEFAULT_MAX_NUM_SEQS,
            "sleep_level": self.vllm_sleep_level,
            "enforce_eager": self.vllm_enforce_eager,
        }
        for key in ("max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes"):
            value = getattr(self, f"vllm_{key}")
            if value is not None:
                settings[key] = value
        return settings

    @property
    def has_reference(self) -> bool:
        """A no-grad pass of the reference policy: DPO's always, the RL objectives' when beta > 0."""
        return self.algorithm == "dpo" or (self.algorithm != "sft" and self.beta > 0)

    @property
    def has_old_policy_pass(self) -> bool:
        """A no-grad pass of the sampling policy: PPO's (its log-probs and values) always, the
        others' with more than one update epoch."""
        return self.algorithm == "ppo" or self.update_epochs > 1

    def micro_batch_fits_examples(self, micro: int) -> bool:
        """Whether a micro-batch of ``micro`` sequences holds whole examples: DPO runs a pair's
        chosen and rejected sequences in one micro-batch, so an even number."""
        return micro % 2 == 0 if self.algorithm == "dpo" else True

    @property
    def vllm_model_len(self) -> int:
        """The vLLM engine's max_model_len: as given, else prompt + completion."""
        return self.vllm_max_model_len or self.sequence_tokens

    @property
    def sequence_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def completions_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    def completions_per_rank(self, data_parallel_ranks: int) -> int:
        """A data-parallel rank's sequences per step. The RL objectives split the step's
        completions; sft and dpo split its examples, so a rank trains on whole pairs
        (agilerl.algorithms.LLMAlgorithm.local_examples)."""
        total = self.completions_per_step
        if self.algorithm in OFFLINE_SEQUENCES and self.prompts_per_step % data_parallel_ranks:
            kind = "preference pairs" if self.algorithm == "dpo" else "examples"
            raise ValueError(
                f"prompts_per_step = {self.prompts_per_step} {kind} do not split over "
                f"{data_parallel_ranks} ranks: {self.algorithm} trains each rank on whole {kind}"
            )
        if total % data_parallel_ranks:
            raise ValueError(
                f"prompts_per_step x group_size = {total} completions do not split over {data_parallel_ranks} ranks"
            )
        return total // data_parallel_ranks
