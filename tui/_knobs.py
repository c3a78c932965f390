"""The explorer's knobs, headless: what each one is, its help, and how its text parses.

No textual here: the screens render :func:`knob_table`; :mod:`tui._request` turns the raw
values back into a plan request. Knob keys are ``"<group>.<field>"`` with group ``cluster``,
``plan``, ``workload`` or ``fsdp``. A knob's help text is its model field's ``description``.
"""

from __future__ import annotations

import functools
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from agilerl.distributed import DTYPE_NAMES, FSDPConfig
from planner.hardware import GIB, GPU, GPUS, MARGIN_FRACTION, Cluster, gpu_by_name
from planner.request import MARGIN_HELP, SHARDING_HELP
from planner.workload import ALGORITHM_DEFAULTS, Workload, parse_lora_targets

__all__ = ["AUTO", "GIB", "Knob", "KnobErrors", "algorithm_values", "initial_values", "knob_table", "parse"]

AUTO = "auto"
NONE = "none"
Kind = Literal["int", "float", "text", "choice", "flag"]

#: Workload fields in the order the panel shows them: the everyday ones first.
WORKLOAD_FIELDS = (
    "algorithm",
    "full_finetune",
    "prompts_per_step",
    "group_size",
    "prompt_tokens",
    "completion_tokens",
    "micro_batch_size_per_gpu",
    "gradient_checkpointing",
    "logprob_chunk_size",
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "lora_targets",
    "load_in_4bit",
    "generation",
    "vllm_gpu_memory_utilization",
    "vllm_sleep_level",
    "vllm_max_num_seqs",
    "vllm_max_model_len",
    "vllm_max_num_batched_tokens",
    "vllm_kv_cache_memory_bytes",
    "vllm_enforce_eager",
    "offload_weights_during_rollout",
    "gather_weights_for_rollout",
    "weights_dtype",
    "attn_implementation",
    "beta",
    "update_epochs",
    "temperature",
    "use_separate_reference_adapter",
    "logprob_rows",
    "padded_batches",
    "share_prompt_prefix",
    "autocast_forward",
)


@dataclass(frozen=True)
class Knob:
    """One control of the panel."""

    key: str
    label: str
    help: str
    kind: Kind
    choices: tuple[str, ...] = ()
    values: tuple[Any, ...] = ()  # what each choice means, when not the choice's text
    auto: bool = False  # "auto" (or an empty field) leaves the value to the planner
    # "none" is a value of its own (FSDPConfig fields whose None means something)
    nullable: bool = False
    # what an empty field shows, where "auto" would mislead (the host memory: not judged)
    placeholder: str | None = None

    @property
    def group(self) -> str:
        return self.key.split(".", 1)[0]

    @property
    def field(self) -> str:
        return self.key.split(".", 1)[1]


class KnobErrors(ValueError):
    """Invalid knobs: ``errors`` maps a knob key ("" for the whole request) to its message."""

    def __init__(self, errors: Mapping[str, str]):
        self.errors = dict(errors)
        super().__init__("; ".join(f"{k or 'input'}: {v}" for k, v in self.errors.items()))


def _members(annotation: Any) -> tuple[list[Any], bool]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = list(typing.get_args(annotation))
    else:
        args = [annotation]
    members = [a for a in args if a is not type(None)]
    return members, len(members) < len(args)


def _knob(group: str, model: type[BaseModel], field: str, *, label: str | None = None) -> Knob:
    info = model.model_fields[field]
    members, optional = _members(info.annotation)
    only = members[0] if len(members) == 1 else None
    key, text = f"{group}.{field}", label or field
    help_text = info.description or ""
    overridable = group == "fsdp"  # every FSDPConfig field is "auto" or an override
    auto = overridable or optional
    nullable = overridable and optional

    def choice(values: tuple[Any, ...]) -> Knob:
        lead, tail = ((AUTO,), (AUTO,)) if auto else ((), ())
        if nullable:
            values += (None,)
        return Knob(
            key,
            text,
            help_text,
            "choice",
            lead + tuple(_text(v) or NONE for v in values),
            tail + values,
            auto,
            nullable,
        )

    if typing.get_origin(only) is Literal:
        return choice(typing.get_args(only))
    if only is bool:
        return choice((True, False)) if auto else Knob(key, text, help_text, "flag")
    if only is str and field.endswith("_dtype"):
        return choice(tuple(dict.fromkeys(DTYPE_NAMES.values())))
    kind: Kind = "int" if only is int else "float" if only is float else "text"
    return Knob(key, text, help_text, kind, (), (), auto, nullable)


@functools.cache
def knob_table() -> tuple[Knob, ...]:
    """Every knob of the panel, in order, with its model field's description as help."""
    gpu_help = GPU.model_fields["name"].description or ""
    memory_help = GPU.model_fields["memory_bytes"].description or ""
    cluster = (
        _knob("cluster", Cluster, "num_gpus", label="GPUs"),
        _knob("cluster", Cluster, "gpus_per_node", label="GPUs per node"),
        Knob(
            "cluster.gpu",
            "GPU kind",
            f"{gpu_help} Catalog: {', '.join(GPUS)}.",
            "choice",
            tuple(GPUS),
            tuple(GPUS),
        ),
        Knob(
            "cluster.gpu_memory_gib",
            "GPU memory GiB",
            f"{memory_help} Empty: the GPU kind's figure.",
            "float",
            auto=True,
        ),
        Knob(
            "cluster.host_memory_gib",
            "host memory GiB",
            "Host memory (RAM) per node in GiB: the plan then fits only if every node's host holds its ranks' "
            "(offloaded optimizer state, a gathered checkpoint, engine ranks). Empty: reported, not judged.",
            "float",
            auto=True,
            placeholder="not judged",
        ),
        Knob(
            "plan.sharding",
            "sharding",
            SHARDING_HELP,
            "choice",
            ("auto", "fsdp", "none"),
            ("auto", "fsdp", "none"),
        ),
        Knob("plan.margin_fraction", "safety margin", MARGIN_HELP, "float"),
    )
    workload = tuple(_knob("workload", Workload, f) for f in WORKLOAD_FIELDS)
    fsdp = tuple(_knob("fsdp", FSDPConfig, f) for f in FSDPConfig.model_fields)
    return cluster + workload + fsdp


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return ",".join(value)
    return str(value)


def initial_values(
    *,
    num_gpus: int = 1,
    gpus_per_node: int | None = None,
    gpu: str = "H100-80GB",
    gpu_memory_gib: float | None = None,
    host_memory_gib: float | None = None,
) -> dict[str, str | bool]:
    """Each knob's starting value: the cluster given, Workload's defaults, FSDPConfig all on auto.

    ``gpu`` is resolved with :func:`planner.hardware.gpu_by_name` (KeyError with suggestions).
    """
    values: dict[str, str | bool] = {
        "cluster.num_gpus": str(num_gpus),
        "cluster.gpus_per_node": _text(gpus_per_node),
        "cluster.gpu": gpu_by_name(gpu).name,
        "cluster.gpu_memory_gib": _text(gpu_memory_gib),
        "cluster.host_memory_gib": _text(host_memory_gib),
        "plan.sharding": "auto",
        "plan.margin_fraction": _text(MARGIN_FRACTION),
    }
    for knob in knob_table():
        if knob.group not in ("workload", "fsdp"):
            continue
        default = Workload.model_fields[knob.field].default if knob.group == "workload" else None
        if knob.kind == "flag":
            values[knob.key] = bool(default)
        elif default is None:
            values[knob.key] = AUTO if knob.kind == "choice" else ""
        else:
            values[knob.key] = _text(default)
    return values


def algorithm_values(algorithm: str) -> dict[str, str]:
    """The knobs an algorithm has its own defaults for (beta, group_size, update_epochs,
    generation), as texts: the algorithm's where it has one, else Workload's (GRPO's). Choosing
    an algorithm sets them, as ``agilerl-plan --algorithm`` plans it with them."""
    fields = sorted({name for defaults in ALGORITHM_DEFAULTS.values() for name in defaults})
    own = ALGORITHM_DEFAULTS.get(algorithm, {})
    return {f"workload.{name}": _text(own.get(name, Workload.model_fields[name].default)) for name in fields}


def parse(knob: Knob, raw: str | bool) -> Any:
    """The value of a knob's raw text (``AUTO``: the planner chooses); ValueError says why not."""
    if knob.kind == "flag":
        return bool(raw)
    text = str(raw).strip()
    if knob.auto and text.lower() in ("", AUTO):
        return AUTO
    if knob.nullable and knob.kind != "choice" and text.lower() == NONE:
        return None
    if text == "" and knob.kind != "text":
        raise ValueError("required")
    if knob.key == "workload.lora_targets":  # as --lora-targets reads it
        return parse_lora_targets(text)
    match knob.kind:
        case "choice":
            if text not in knob.choices:
                raise ValueError(f"choose from {', '.join(knob.choices)}")
            return knob.values[knob.choices.index(text)]
        case "int":
            try:
                return int(text)
            except ValueError:
                raise ValueError(f"{text!r} is not a whole number") from None
        case "float":
            try:
                return float(text)
            except ValueError:
                raise ValueError(f"{text!r} is not a number") from None
        case _:
            return tuple(t.strip() for t in text.split(",") if t.strip())
