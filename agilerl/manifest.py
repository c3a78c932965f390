"""Training manifests: the YAML `python -m agilerl.train` (and `agilerl-plan --output`) read and write.

Every field is described once here; errors name the field path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agilerl.distributed import FSDPConfig
from agilerl.typing import AttnImplementation
from agilerl.utils.algo_utils import VLLMConfig, four_bit_problem, weight_offload_problem

__all__ = [
    "Manifest",
    "AlgorithmSection",
    "TrainingSection",
    "EnvironmentSection",
    "LoraSection",
    "load_manifest",
    "ManifestError",
    "ALGORITHM_FIELDS",
    "OFFLINE_ALGORITHMS",
]


class ManifestError(ValueError):
    """A manifest that cannot be read or validated; the message names the fields."""


class _Section(BaseModel):
    # No knob of a manifest means anything at inf or nan (a learning rate, a temperature, a dropout).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


#: The objective fields each algorithm takes (null: the algorithm's own default); the others are
#: refused for it. The classes' signatures say the defaults (a test holds the two together).
ALGORITHM_FIELDS: dict[str, tuple[str, ...]] = {
    "GRPO": ("beta", "clip_coef"),
    "CISPO": ("beta", "clip_coef_high"),
    "GSPO": ("beta", "clip_coef", "clip_coef_high"),
    "LLMREINFORCE": ("beta",),
    "LLMPPO": ("beta", "clip_coef", "vf_coef", "clip_coef_value", "gamma", "gae_lambda"),
    "SFT": (),
    "DPO": ("beta", "nll_alpha"),
}
#: Algorithms trained from a dataset (the environment's prompts with their answers), without a
#: rollout: the rollout's fields are refused for them.
OFFLINE_ALGORITHMS = ("SFT", "DPO")
_ROLLOUT_FIELDS = (
    "group_size",
    "update_epochs",
    "temperature",
    "max_output_tokens",
    "vllm",
    "gather_weights_for_rollout",
    "offload_weights_during_rollout",
)


class AlgorithmSection(_Section):
    name: Annotated[
        Literal["GRPO", "CISPO", "GSPO", "LLMREINFORCE", "LLMPPO", "SFT", "DPO"],
        Field(
            description="LLM algorithm to train: the RL objectives on a rollout (GRPO, CISPO, GSPO, LLMREINFORCE, "
            "LLMPPO), or SFT and DPO on the environment's prompts with their answers (each with its "
            "own defaults)."
        ),
    ] = "GRPO"
    model_name: Annotated[
        str,
        Field(
            description="Local model directory, hub id, or a built-in tiny model such as "
            "'tiny:qwen2?hidden_size=64&num_layers=2' (built locally, no download)."
        ),
    ]
    fsdp: Annotated[
        bool | Literal["auto"] | FSDPConfig,
        Field(
            description="false: no sharding (data parallel under torchrun); true: FSDPConfig defaults; a mapping "
            "of FSDPConfig fields; 'auto': the planner chooses."
        ),
    ] = False
    group_size: Annotated[
        int | None, Field(ge=1, description="Completions per prompt; null: the algorithm's default (8, LLMPPO 1).")
    ] = None
    beta: Annotated[
        float | None,
        Field(
            ge=0.0,
            description="KL penalty weight against the reference policy (DPO: its implicit reward's scale); "
            "null: the algorithm's default (GRPO and LLMREINFORCE 0.04, CISPO and GSPO 0, "
            "LLMPPO 0.05, DPO 0.1).",
        ),
    ] = None
    lr: Annotated[
        float | None,
        Field(
            gt=0.0,
            description="AdamW learning rate of the actor; null: the algorithm's default (1e-5, SFT 5e-5, DPO 5e-6).",
        ),
    ] = None
    clip_coef: Annotated[
        float | None,
        Field(
            gt=0.0,
            description="Ratio clip below (and above, for GRPO); null: the algorithm's default (GRPO 0.2, "
            "GSPO 3e-4; CISPO and LLMREINFORCE take none).",
        ),
    ] = None
    clip_coef_high: Annotated[
        float | None,
        Field(
            gt=0.0,
            description="CISPO: the importance weight's cap is 1 + this (default 4.0); GSPO: the sequence "
            "ratio's upper clip (default 4e-4). Other algorithms take none.",
        ),
    ] = None
    vf_coef: Annotated[float | None, Field(gt=0.0, description="LLMPPO: the value loss's weight (default 0.1).")] = None
    clip_coef_value: Annotated[
        float | None, Field(gt=0.0, description="LLMPPO: the value clip range (default 0.2).")
    ] = None
    gamma: Annotated[float | None, Field(ge=0.0, le=1.0, description="LLMPPO: the discount (default 1.0).")] = None
    gae_lambda: Annotated[float | None, Field(ge=0.0, le=1.0, description="LLMPPO: GAE's lambda (default 0.95).")] = (
        None
    )
    nll_alpha: Annotated[
        float | None, Field(ge=0.0, description="DPO: weight of the chosen completions' NLL (RPO; default 0).")
    ] = None
    max_grad_norm: Annotated[float, Field(gt=0.0, description="Global gradient-norm clip.")] = 1.0
    update_epochs: Annotated[
        int | None,
        Field(ge=1, description="Optimizer passes over each batch; null: the algorithm's default (1, LLMPPO 4)."),
    ] = None
    temperature: Annotated[float, Field(gt=0.0, description="Sampling temperature (log-probs use the same).")] = 1.0
    max_output_tokens: Annotated[int, Field(ge=1, description="Most tokens generated per completion.")] = 256
    max_model_len: Annotated[int | None, Field(ge=1, description="Longest prompt + completion.")] = None
    micro_batch_size_per_gpu: Annotated[
        int | None, Field(ge=1, description="Sequences per forward/backward on each GPU; None: a rank's whole share.")
    ] = None
    logprob_chunk_size: Annotated[
        int | None | Literal["auto"],
        Field(
            description="Token rows per log-prob chunk (bounds the logits workspace); null: unchunked; 'auto': "
            "the largest chunk whose logits workspace the memory estimate fits, under any sharding (1024 "
            "rows when the estimate cannot be made)."
        ),
    ] = "auto"
    gradient_checkpointing: Annotated[
        bool | Literal["auto"],
        Field(
            description="Recompute block activations in backward; 'auto': off where the memory estimate fits every "
            "block's activations, under any sharding (on when the estimate cannot be made)."
        ),
    ] = "auto"
    use_separate_reference_adapter: Annotated[
        bool, Field(description="Keep a frozen 'reference' LoRA adapter instead of disabling adapters.")
    ] = False
    load_in_4bit: Annotated[
        bool, Field(description="QLoRA: 4-bit NF4 base weights (with fsdp too; not with cpu_offload).")
    ] = False
    dtype: Annotated[
        Literal["bfloat16", "float16", "float32"], Field(description="Dtype the base weights are loaded in.")
    ] = "bfloat16"
    attn_implementation: Annotated[
        AttnImplementation | None,
        Field(
            description="Attention kernel (eager holds the batch x heads x length^2 scores, SDPA and "
            "flash_attention_2 do not); null: transformers' choice for the model, SDPA where it has it."
        ),
    ] = None
    vllm: Annotated[VLLMConfig | None, Field(description="Colocated vLLM engine settings; omit for HF generate.")] = (
        None
    )
    gather_weights_for_rollout: Annotated[
        bool | Literal["auto"],
        Field(
            description="Materialise the rollout's weights once for a whole Hugging Face generate instead of once "
            "per token: under FSDP2 every unit gathered, unsharded a merged copy of each adapted "
            "linear; 'auto': where the memory estimate says it fits."
        ),
    ] = "auto"
    share_prompt_prefix: Annotated[
        bool,
        Field(
            description="Run each group's prompt once rather than once per completion (learn, the no-grad "
            "passes, generate's prefill) where the model allows."
        ),
    ] = True
    offload_weights_during_rollout: Annotated[
        bool,
        Field(
            description="Park the trainer's weights (base and adapters) in host memory while the vLLM engine generates "
            "(needs vllm)."
        ),
    ] = False

    @field_validator("logprob_chunk_size")
    @classmethod
    def _chunk(cls, value: Any) -> Any:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be >= 1, null (unchunked) or 'auto'")
        return value

    @field_validator("fsdp", mode="before")
    @classmethod
    def _fsdp_mapping(cls, value: Any) -> Any:
        if not isinstance(value, (bool, dict, FSDPConfig)) and value != "auto":
            raise ValueError(f"must be true, false, 'auto' or a mapping of FSDPConfig fields, got {value!r}")
        if isinstance(value, dict):
            try:
                return FSDPConfig.model_validate(value)
            except ValidationError as err:
                raise ValueError(
                    "; ".join(
                        (f"{'.'.join(str(p) for p in e['loc'])}: " if e["loc"] else "")
                        + e["msg"].removeprefix("Value error, ")
                        for e in err.errors()
                    )
                ) from None
        return value

    @model_validator(mode="after")
    def _fields_of_the_algorithm(self) -> AlgorithmSection:
        takes = ALGORITHM_FIELDS[self.name]
        for field in sorted({f for fields in ALGORITHM_FIELDS.values() for f in fields}):
            if getattr(self, field) is not None and field not in takes:
                raise ValueError(f"{field}: {self.name} takes " + (", ".join(takes) or "none of the objective fields"))
        if self.name in OFFLINE_ALGORITHMS:
            given = [f for f in _ROLLOUT_FIELDS if getattr(self, f) != type(self).model_fields[f].default]
            if given:
                raise ValueError(f"{given[0]}: {self.name} learns from the environment's answers, it has no rollout")
        if self.name == "DPO" and self.beta is not None and self.beta <= 0:
            raise ValueError("beta: DPO's beta scales its implicit reward and must be > 0")
        if self.name == "SFT" and self.use_separate_reference_adapter:
            raise ValueError("use_separate_reference_adapter: SFT has no reference policy")
        if self.name == "LLMREINFORCE" and self.update_epochs not in (None, 1):
            raise ValueError(f"update_epochs: LLMREINFORCE is on-policy, so 1 (got {self.update_epochs})")
        if not self.offline:
            for field, value in (
                ("max_model_len", self.max_model_len),
                ("vllm.max_model_len", self.vllm.max_model_len if self.vllm is not None else None),
            ):
                if value is not None and value <= self.max_output_tokens:
                    raise ValueError(
                        f"{field}={value} leaves no room for a prompt: it bounds prompt + completion, so it "
                        f"must be more than max_output_tokens={self.max_output_tokens}"
                    )
        return self

    @field_validator("group_size")
    @classmethod
    def _group(cls, value: int | None, info) -> int | None:
        name = info.data.get("name", "GRPO")
        if value is not None and value < 2 and name not in ("LLMPPO", *OFFLINE_ALGORITHMS):
            raise ValueError(f"{name}'s advantages are relative within a group of at least 2 (got {value})")
        return value

    @property
    def offline(self) -> bool:
        return self.name in OFFLINE_ALGORITHMS

    @property
    def sequences_per_prompt(self) -> int:
        """Completions trained per prompt: the group (GRPO 8, LLMPPO 1 by default), SFT 1, DPO 2."""
        if self.offline:
            return 2 if self.name == "DPO" else 1
        return self.group_size if self.group_size is not None else (1 if self.name == "LLMPPO" else 8)

    def algorithm_kwargs(self) -> dict[str, Any]:
        """The objective fields and the fields with an algorithm's default that were given (the
        algorithm's own defaults otherwise)."""
        fields = (*ALGORITHM_FIELDS[self.name], "lr", *(() if self.offline else ("group_size", "update_epochs")))
        return {k: getattr(self, k) for k in fields if getattr(self, k) is not None}

    @model_validator(mode="after")
    def _offload_needs_vllm(self) -> AlgorithmSection:
        if self.offload_weights_during_rollout and self.vllm is None:
            raise ValueError("offload_weights_during_rollout: true needs algorithm.vllm settings (a colocated engine)")
        fsdp = self.fsdp_config()
        if problem := weight_offload_problem(getattr(fsdp, "cpu_offload", None), self.offload_weights_during_rollout):
            raise ValueError(problem)
        layout = fsdp if isinstance(fsdp, FSDPConfig) else None  # "auto" is planned with the rule
        if problem := four_bit_problem(
            self.load_in_4bit, cpu_offload=layout and layout.cpu_offload, tp=layout.tp if layout else 1
        ):
            raise ValueError(problem)
        return self

    def fsdp_config(self) -> FSDPConfig | str | None:
        if self.fsdp is False:
            return None
        if self.fsdp is True:
            return FSDPConfig()
        return self.fsdp

    @property
    def tp(self) -> int:
        """The tensor-parallel degree a given FSDPConfig asks for (1 unsharded or under "auto",
        which plans no tensor parallelism): its ranks share their rows, so the rollout batch splits
        over the data-parallel ranks, trainer ranks / tp."""
        fsdp = self.fsdp_config()
        return fsdp.tp if isinstance(fsdp, FSDPConfig) else 1


class TrainingSection(_Section):
    rollout_batch_size: Annotated[
        int,
        Field(
            ge=1,
            description="Prompts per step across the agent's GPUs; a multiple of its data-parallel ranks "
            "(training_gpus_per_agent, over algorithm.fsdp.tp under tensor parallelism).",
        ),
    ] = 8
    training_gpus_per_agent: Annotated[
        int | None,
        Field(
            ge=1,
            description="Trainer ranks per population member (data parallel, or FSDP2's shards); null: the "
            "launched ranks shared out, world / population_size - rollout_engines_per_agent.",
        ),
    ] = None
    rollout_engines_per_agent: Annotated[
        int,
        Field(
            ge=0,
            description="Rollout engines per member on ranks of their own, one GPU each, fed weights and "
            "prompts by the member's trainer ranks; they run Hugging Face generate (algorithm.vllm "
            "beside them is refused: a vLLM engine there is not supported yet). 0: the trainer ranks "
            "generate (with algorithm.vllm, a colocated engine on each).",
        ),
    ] = 0
    max_steps: Annotated[int, Field(ge=1, description="Training steps per population member.")] = 100
    population_size: Annotated[int, Field(ge=1, description="Independent agents trained side by side.")] = 1
    seed: Annotated[
        int,
        Field(
            ge=-(2**63),
            lt=2**63,
            description="Seed of the environment and the agents (a 64-bit integer; member i takes seed + i).",
        ),
    ] = 0
    log_every: Annotated[int, Field(ge=1, description="Steps between metric lines.")] = 10
    checkpoint_dir: Annotated[
        str | None,
        Field(
            description="Where each agent's checkpoints go: agent<i>/attributes.pt at the end, agent<i>/step-<n>/ "
            "every checkpoint_interval steps. A rerun resumes from the newest complete one."
        ),
    ] = None
    checkpoint_interval: Annotated[
        int | None, Field(ge=1, description="Steps between checkpoints (needs checkpoint_dir); null: only at the end.")
    ] = None
    keep_checkpoints: Annotated[
        int, Field(ge=1, description="Periodic checkpoints kept per agent (the newest ones).")
    ] = 2

    @model_validator(mode="after")
    def _check(self) -> TrainingSection:
        if self.checkpoint_dir is not None and not self.checkpoint_dir.strip():
            raise ValueError("checkpoint_dir is empty: give a folder, or leave it out to keep no checkpoints")
        if self.checkpoint_interval is not None and not self.checkpoint_dir:
            raise ValueError("checkpoint_interval needs checkpoint_dir: where the checkpoints go")
        return self

    def layout(self, world: int, *, tp: int = 1) -> RankLayout:
        """How ``world`` launched ranks split into population members' trainer and engine ranks,
        or a ValueError saying what launch the manifest needs. ``tp``: the algorithm's
        tensor-parallel degree (:attr:`AlgorithmSection.tp`): a member's trainer ranks are whole
        tensor-parallel groups, and its rollout batch splits over the groups."""
        members, engines = self.population_size, self.rollout_engines_per_agent
        trainers = self.training_gpus_per_agent
        if trainers is None:
            if not engines and world < members:
                trainers = world  # fewer ranks than members (one process): they share them, in turn
            elif world % members or world // members <= engines:
                raise ValueError(
                    f"{world} launched rank(s) do not split into {members} population member(s) of trainer ranks"
                    + (f" and {engines} engine rank(s) each" if engines else "")
                    + f": {self._launches_near(world, tp)}, or set training.training_gpus_per_agent"
                )
            else:
                trainers = world // members - engines
        shared = trainers == world and not engines  # every member on every rank, in turn
        if not shared and world != members * (trainers + engines):
            raise ValueError(
                f"training asks for {members} member(s) x ({trainers} trainer + {engines} engine rank(s)) = "
                f"{members * (trainers + engines)} ranks, but {world} were launched: run `agilerl-train "
                f"--nproc-per-node={members * (trainers + engines)} ...` or change the manifest"
            )
        if problem := self.batch_problem(trainers, tp):
            if self.training_gpus_per_agent is not None:  # the launch is given: the manifest changes
                raise ValueError(f"{problem}: change training.training_gpus_per_agent or rollout_batch_size")
            fix = "algorithm.fsdp.tp" if trainers % tp else "rollout_batch_size"
            raise ValueError(f"{problem}: {self._launches_near(world, tp)}, or change {fix}")
        return RankLayout(members=members, trainers=trainers, engines=engines, shared=shared)

    def batch_problem(self, trainers: int, tp: int = 1, *, ranks: str | None = None) -> str | None:
        """Why ``trainers`` trainer ranks per member (``ranks``: how to name them) under ``tp``
        cannot take the rollout batch, or None: they are whole tensor-parallel groups, and each
        group (a data-parallel rank) takes an even share of the prompts."""
        ranks = ranks or f"the {trainers} trainer rank(s) per member"
        if trainers % tp:
            return f"algorithm.fsdp.tp={tp} must divide {ranks}"
        if self.rollout_batch_size % (data_parallel := trainers // tp):
            groups = f"the {data_parallel} data-parallel rank(s) of {ranks} under tp={tp}" if tp > 1 else ranks
            return f"rollout_batch_size ({self.rollout_batch_size}) must be a multiple of {groups}"
        return None

    def _launches_near(self, world: int, tp: int = 1) -> str:
        """The rank counts nearest ``world`` that this manifest splits into, its trainer ranks per
        member left to the launch: each member's trainers, whole tensor-parallel groups of ``tp``,
        split the rollout batch evenly between the groups beside its engine ranks, or (without
        engines) fewer ranks than members, shared."""
        members, engines, batch = self.population_size, self.rollout_engines_per_agent, self.rollout_batch_size
        trainers = [t * tp for t in range(1, batch + 1) if batch % t == 0]
        sizes = sorted(
            {members * (t + engines) for t in trainers}
            | ({t for t in trainers if t < members} if not engines else set())
        )
        below = [n for n in sizes if n < world][-1:]
        above = [n for n in sizes if n > world][:1]
        return f"launch {' or '.join(map(str, below + above))} ranks in all (nodes x --nproc-per-node)"


@dataclass(frozen=True)
class RankLayout:
    """Launched ranks by role: member m's trainers are ranks ``m * (trainers + engines)`` onwards,
    its engines the ``engines`` ranks after them; ``shared``: one group of every rank, on which
    the members train in turn."""

    members: int
    trainers: int
    engines: int
    shared: bool = False

    def of(self, rank: int) -> tuple[int, bool, list[int], list[int]]:
        """(member, is an engine rank, the member's trainer ranks, its engine ranks) of ``rank``."""
        if self.shared:
            return 0, False, list(range(self.trainers)), []
        span = self.trainers + self.engines
        member, local = divmod(rank, span)
        first = member * span
        return (
            member,
            local >= self.trainers,
            list(range(first, first + self.trainers)),
            list(range(first + self.trainers, first + span)),
        )


class EnvironmentSection(_Section):
    name: Annotated[Literal["arithmetic"], Field(description="Built-in environment.")] = "arithmetic"
    operators: Annotated[str, Field(min_length=1, description="Operators the arithmetic prompts use (+, -, *).")] = "+"

    @field_validator("operators")
    @classmethod
    def _ops(cls, value: str) -> str:
        bad = set(value) - set("+-*")
        if bad:
            raise ValueError(f"unsupported operators {sorted(bad)}; allowed: + - *")
        return value


class LoraSection(_Section):
    r: Annotated[int, Field(ge=1, description="LoRA rank.")] = 16
    alpha: Annotated[int, Field(ge=1, description="LoRA alpha (scale = alpha / r).")] = 32
    dropout: Annotated[
        float,
        Field(
            ge=0.0,
            lt=1.0,
            description="LoRA dropout of the learn forward (its masks cost memory; not with LoRA on MoE experts).",
        ),
    ] = 0.0
    target_modules: Annotated[str | list[str], Field(description="'all-linear' or module names to adapt.")] = (
        "all-linear"
    )

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, value: str | list[str]) -> str | list[str]:
        names = [value] if isinstance(value, str) else value
        if not names or not all(name.strip() for name in names):
            raise ValueError(f"must be 'all-linear' or at least one module name, none empty; got {value!r}")
        return value

    def to_peft(self):
        from peft import LoraConfig

        return LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=self.target_modules,
            task_type="CAUSAL_LM",
        )


class Manifest(_Section):
    algorithm: AlgorithmSection
    training: TrainingSection = TrainingSection()
    environment: EnvironmentSection = EnvironmentSection()
    lora: Annotated[
        LoraSection | None,
        Field(
            description="LoRA adapters to train; null fine-tunes every parameter (full "
            "fine-tuning: fp32 master weights, gradients and AdamW moments)."
        ),
    ] = LoraSection()

    @model_validator(mode="after")
    def _check(self) -> Manifest:
        if self.training.rollout_engines_per_agent and self.algorithm.offline:
            raise ValueError(f"training.rollout_engines_per_agent: {self.algorithm.name} has no rollout (0)")
        if self.training.rollout_engines_per_agent and self.algorithm.offload_weights_during_rollout:
            raise ValueError(
                "algorithm.offload_weights_during_rollout: engines on ranks of their own "
                "(training.rollout_engines_per_agent) share no memory with the trainer"
            )
        if self.training.rollout_engines_per_agent and self.algorithm.vllm is not None:
            raise ValueError(
                "algorithm.vllm with training.rollout_engines_per_agent: engines on ranks of their own "
                "run Hugging Face generate; a vLLM engine there is not supported yet (drop algorithm.vllm, "
                "or set rollout_engines_per_agent: 0 for a colocated engine on each trainer rank)"
            )
        fsdp = self.algorithm.fsdp_config()
        if self.training.rollout_engines_per_agent and fsdp not in (None, "auto") and fsdp.tp > 1:
            raise ValueError(
                "algorithm.fsdp.tp > 1 with training.rollout_engines_per_agent: the ranks of a "
                "tensor-parallel group would send the engines their shared prompts each; use tp: 1"
            )
        if self.lora is None and self.algorithm.load_in_4bit:
            raise ValueError(
                "lora: null (full fine-tuning) with algorithm.load_in_4bit: 4-bit weights do not train; "
                "QLoRA needs a lora section"
            )
        if self.lora is None and self.algorithm.use_separate_reference_adapter:
            raise ValueError(
                "lora: null (full fine-tuning) with algorithm.use_separate_reference_adapter: there is "
                "no adapter, the reference is a frozen copy of the model"
            )
        total = self.training.rollout_batch_size * self.algorithm.sequences_per_prompt
        micro = self.algorithm.micro_batch_size_per_gpu
        gpus = self.training.training_gpus_per_agent
        tp = self.algorithm.tp  # a tensor-parallel group shares its rows
        if gpus is not None and (
            problem := self.training.batch_problem(gpus, tp, ranks=f"training_gpus_per_agent ({gpus})")
        ):
            raise ValueError(problem)
        per_rank = total // max(1, gpus // tp) if gpus else total
        if (
            micro is not None and per_rank % micro
        ):  # without the GPUs (the launch decides), a rank's share divides the total
            where = "in all"
            if gpus:
                dp = max(1, gpus // tp)
                ranks = f"{dp} data-parallel rank{'s' if dp != 1 else ''} of {gpus} GPUs" if tp > 1 else f"{gpus} GPUs"
                where = f"over {ranks} gives {per_rank} per rank"
            raise ValueError(
                f"rollout_batch_size x group_size = {total} completions {where}, which "
                f"algorithm.micro_batch_size_per_gpu={micro} does not divide"
            )
        if micro is not None and self.algorithm.name == "DPO" and micro % 2:
            raise ValueError(
                f"algorithm.micro_batch_size_per_gpu={micro}: DPO runs a pair's chosen and rejected "
                "sequences in one micro-batch, so it counts sequences and must be even"
            )
        return self

    def to_yaml(self) -> str:
        data = self.model_dump(mode="json", exclude_none=True)
        if self.lora is None:
            data["lora"] = None  # full fine-tuning: written out, or a re-read would train the default LoRA
        return yaml.safe_dump(data, sort_keys=False)

    def layout(self, world: int) -> RankLayout:
        """:meth:`TrainingSection.layout` under the algorithm's tensor-parallel degree."""
        return self.training.layout(world, tp=self.algorithm.tp)


def _format_errors(err: ValidationError) -> str:
    """Every field error on one line: ``algorithm.lr: Input should be greater than 0; ...``.

    A union field (``fsdp``: bool, 'auto' or a mapping) reports one error per
    member; only the member the value was meant as is kept.
    """
    parts: dict[str, str] = {}
    for e in err.errors():
        loc = [str(p) for p in e["loc"] if not _is_union_member(p)]
        where = ".".join(loc) or "(top level)"
        msg = " ".join(e["msg"].removeprefix("Value error, ").split())
        parts.setdefault(where, msg)
    return "; ".join(f"{where}: {msg}" for where, msg in parts.items())


def _is_union_member(part: object) -> bool:
    # pydantic names union members in the location: 'bool', "literal['auto']", 'function-before[...]'
    text = str(part)
    return text in ("bool", "str", "int", "float") or text.startswith(
        ("literal[", "function-", "FSDPConfig", "VLLMConfig")
    )


def load_manifest(source: str | Path | dict) -> Manifest:
    """Read and validate a manifest (a path or a mapping); raise ManifestError naming the fields."""
    name = "manifest"
    if isinstance(source, dict):
        data = source
    else:
        path = Path(source)
        name = str(path)
        try:
            if not path.exists():
                raise ManifestError(f"{path}: no such manifest")
            if path.is_dir():
                raise ManifestError(f"{path}: is a directory; give the manifest's YAML file")
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            raise ManifestError(f"{path}: not valid YAML: {err}") from None
        except UnicodeDecodeError as err:
            raise ManifestError(f"{path}: not UTF-8 text (byte {err.start}: {err.reason})") from None
        except RecursionError:  # thousands of nested brackets: no manifest is that deep
            raise ManifestError(f"{path}: nested too deeply to be a manifest") from None
        except OSError as err:  # unreadable: permissions, a name too long, a special file
            raise ManifestError(f"{path}: cannot read the manifest: {err.strerror or err}") from None
    if not isinstance(data, dict):
        raise ManifestError(f"{name}: a manifest is a mapping with algorithm, training, environment and lora sections")
    try:
        return Manifest.model_validate(data)
    except ValidationError as err:
        raise ManifestError(f"{name} is not a valid manifest: {_format_errors(err)}") from None
