"""Write a Plan out: a readable table, JSON, a manifest for `agilerl.train`, a Python snippet."""

from __future__ import annotations

from typing import Any

from agilerl.distributed import FSDPConfig

from .choose import Plan
from .hardware import GIB, Cluster, memory_unit, memory_words
from .memory import Estimate, engine_completions, engine_rank_count, node_ranks, ranks_per_node
from .names import COMPONENTS, PHASES
from .workload import ALGORITHM_CLASSES, OFFLINE_SEQUENCES

__all__ = ["manifest_dict", "manifest_yaml", "plan_json", "python_snippet", "table", "estimate_table"]


def _fsdp_fields(fsdp: FSDPConfig | None) -> dict[str, Any] | bool:
    if fsdp is None:
        return False
    return fsdp.model_dump(mode="json", exclude_defaults=True) or True


def trainer_model_name(model: str) -> str:
    """What the trainer loads for the planned ``model``: a ``config.json`` given as a file is
    planned on its own, and trained from the model directory that holds it."""
    from pathlib import Path

    try:
        path = Path(model).expanduser()
        if path.name == "config.json" and path.is_file():
            return str(path.parent)
    except (OSError, RuntimeError):  # not a usable path: a hub id or a catalog name
        pass
    return model


def manifest_dict(plan: Plan) -> dict[str, Any]:
    """A manifest (agilerl.manifest.Manifest) that trains exactly the planned run: the rollout's
    fields only for the algorithms with a rollout, beta and the reference's only where there is
    one, ``lora: null`` for full fine-tuning."""
    w = plan.workload
    offline = w.algorithm in OFFLINE_SEQUENCES
    algorithm: dict[str, Any] = {
        "name": ALGORITHM_CLASSES[w.algorithm],
        "model_name": trainer_model_name(plan.model),
        "fsdp": _fsdp_fields(plan.fsdp),
    }
    if not offline:
        algorithm.update(group_size=w.group_size, update_epochs=w.update_epochs)
        if w.temperature != 1.0:  # the trainer's default otherwise
            algorithm["temperature"] = w.temperature
    if w.algorithm != "sft":
        algorithm["beta"] = w.beta
    if not offline:
        algorithm["max_output_tokens"] = w.completion_tokens
    algorithm.update(
        {
            "max_model_len": w.sequence_tokens,
            "micro_batch_size_per_gpu": w.micro_batch_size_per_gpu,
            "logprob_chunk_size": w.logprob_chunk_size,
            "gradient_checkpointing": w.gradient_checkpointing,
        }
    )
    if w.algorithm != "sft":
        algorithm["use_separate_reference_adapter"] = w.use_separate_reference_adapter
    algorithm.update(load_in_4bit=w.load_in_4bit, dtype=w.weights_dtype, attn_implementation=w.attn_implementation)
    if not w.share_prompt_prefix:
        algorithm["share_prompt_prefix"] = False
    if w.generation == "hf" and w.gather_weights_for_rollout is not None:
        algorithm["gather_weights_for_rollout"] = bool(w.gather_weights_for_rollout)
    if w.generation == "vllm":
        algorithm["vllm"] = w.vllm_settings()  # a colocated engine on every trainer rank
        if w.offload_weights_during_rollout:
            algorithm["offload_weights_during_rollout"] = True
    targets = w.lora_targets if isinstance(w.lora_targets, str) else list(w.lora_targets)
    return {
        "algorithm": algorithm,
        "training": {
            "rollout_batch_size": w.prompts_per_step,
            "training_gpus_per_agent": plan.cluster.num_gpus,
            "rollout_engines_per_agent": engine_ranks(plan),
        },
        "lora": None
        if w.full_finetune
        else {"r": w.lora_rank, "alpha": w.lora_alpha, "dropout": w.lora_dropout, "target_modules": targets},
    }


def engine_ranks(plan: Plan) -> int:
    """Rollout engines on ranks of their own (``rollout_engines_per_agent``): none, unless an
    objective with a rollout was planned with nothing generating on its GPUs (generation='none');
    then as many as there are nodes (planner.memory.engine_rank_count), so every node launches one
    more rank (agilerl.train puts a member's engine ranks after its trainer ranks, so on several
    nodes they fill the last node(s): planner.memory.node_ranks), each running Hugging Face
    generate for the trainers."""
    return engine_rank_count(plan.workload, plan.cluster)


def _ranks_per_node(plan: Plan) -> str:
    """Each node's trainer and engine ranks as the launch places them (planner.memory.node_ranks)."""
    layout = node_ranks(plan.cluster, engine_ranks(plan))
    return "trainers + engine ranks per node: " + ", ".join(f"{t} + {e}" for t, e in layout)


def launch_command(cluster: Cluster, engines: int = 0) -> str:
    """The ``agilerl-train`` line that launches the manifest on ``cluster`` (and ``engines`` engine
    ranks, one per node): on more than one node, the node count and the rendezvous every node's
    launcher names (its host left to the user)."""
    run = f"agilerl-train --nproc-per-node={ranks_per_node(cluster, engines)}"
    if cluster.num_nodes > 1:
        run += f" --nnodes={cluster.num_nodes} --rdzv-endpoint=<first node>:29500"
    return f"{run} <this file>"


def _engine_rank_line(plan: Plan) -> str:
    """The engine rank's estimated peak against its GPU (plans with engine ranks only)."""
    engine = plan.engine_rank
    assert engine is not None
    gpu = plan.cluster.gpu.memory_bytes
    return (
        f"an engine rank's estimated peak: {memory_words(engine.total, gpu)} of {memory_words(gpu, gpu)} "
        f"({'over the limit' if plan.engine_rank_over else 'fits'}), the whole model and Hugging Face generate's "
        f"cache of {engine_completions(plan.workload, plan.cluster)} completions"
    )


def manifest_yaml(plan: Plan) -> str:
    engines = engine_ranks(plan)
    header = [*_verdict(plan), f"# run: {launch_command(plan.cluster, engines)}"]
    if engines:
        header.append(
            f"# rollouts: {engines} engine rank(s) of their own after the {plan.cluster.num_gpus} trainer ranks "
            "(generation 'none' plans none on the trainer GPUs): one more GPU per node"
        )
        if plan.cluster.num_nodes > 1:
            header.append(
                f"# the ranks fill the nodes in rank order, {_ranks_per_node(plan)}"
                + (": node-local shard groups (shard_group_size) then span nodes" if plan.fsdp is not None else "")
            )
    import yaml  # on use: a table or JSON plan reads and writes no YAML

    return "\n".join(header) + "\n" + yaml.safe_dump(manifest_dict(plan), sort_keys=False)


def plan_json(plan: Plan) -> dict[str, Any]:
    est = plan.estimate
    return {
        "model": plan.model,
        "fits": plan.fits,
        "cluster": plan.cluster.model_dump(mode="json"),
        "fsdp_config": plan.fsdp.model_dump(mode="json") if plan.fsdp else None,
        "workload": plan.workload.model_dump(mode="json"),
        "peak_bytes": est.peak_bytes,
        "peak_phase": est.peak_phase,
        "capacity_bytes": est.capacity_bytes,
        "headroom_bytes": est.headroom_bytes,
        "margin_bytes": plan.margin_bytes,
        "host_peak_bytes_per_rank": est.host_peak_bytes,
        "host_peak_bytes_per_node": plan.host_per_node_bytes,
        "host_peak_phase": plan.host_peak_phase,
        "host_limit_bytes_per_node": plan.host_limit_bytes,
        "host_fits": None if plan.host_limit_bytes is None else not plan.host_over,
        # every limit the plan is over: what, its need and limit, the phase where the need peaks
        "over": [limit.as_json() for limit in plan.over()],
        "phases": {
            name: {"components": ph.components, "total": ph.total, "host": ph.host} for name, ph in est.phases.items()
        },
        "engine_rank": None
        if plan.engine_rank is None
        else {
            "count": engine_ranks(plan),
            "completions": engine_completions(plan.workload, plan.cluster),
            "components": plan.engine_rank.components,
            "total": plan.engine_rank.total,
            "host": plan.engine_rank.host,
        },
        "decisions": [d.model_dump(mode="json") for d in plan.decisions],
        "suggestions": list(plan.suggestions),
        "notes": list(est.notes),
        "coefficients": plan.coefficients_source,
        "manifest": manifest_dict(plan),
    }


#: Manifest fields the algorithm's constructor takes under another name (agilerl/train.py passes
#: them so); every other algorithm field keeps its name.
_ARGUMENT_NAMES = {
    "fsdp": "fsdp_config",
    "vllm": "vllm_config",
    "lora": "lora_config",
    "rollout_batch_size": "batch_size",
}
#: The manifest's sections that the trainer builds an object from: the module and class, and the
#: call a mapping becomes (LoRA through the manifest's own mapping onto peft's LoraConfig).
_CONFIG_CLASSES = {
    "fsdp": ("agilerl.distributed", "FSDPConfig", "FSDPConfig({})"),
    "vllm": ("agilerl.utils.algo_utils", "VLLMConfig", "VLLMConfig({})"),
    "lora": ("agilerl.manifest", "LoraSection", "LoraSection({}).to_peft()"),
}
#: What a config section's false or null means to the trainer.
_WITHOUT = {"fsdp": "no sharding needed", "vllm": "Hugging Face generate", "lora": "full fine-tuning"}


def _snippet_arguments(manifest: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The manifest's fields split into the algorithm's constructor arguments, named as
    agilerl.train passes them (the config sections still as the manifest holds them), and the
    rest (how to launch it), named by section."""
    arguments: dict[str, Any] = {}
    launch: dict[str, Any] = {}
    for section, fields in manifest.items():
        if section == "lora":
            arguments["lora"] = fields
        elif section == "algorithm":
            arguments.update((k, v) for k, v in fields.items() if k != "name")
        else:
            for k, v in fields.items():
                if k in _ARGUMENT_NAMES:
                    arguments[k] = v
                else:
                    launch[f"{section}.{k}"] = v
    return arguments, launch


def _config_expression(field: str, value: Any) -> tuple[str, str | None]:
    """The Python a config section's value becomes, and the class it needs imported."""
    module, cls, call = _CONFIG_CLASSES[field]
    if value is None or value is False:
        return f"None  # {_WITHOUT[field]}", None
    fields = {} if value is True else value  # fsdp: true is FSDPConfig's defaults
    return call.format(", ".join(f"{k}={v!r}" for k, v in fields.items())), f"from {module} import {cls}"


def _fit_words(plan: Plan) -> str:
    """Whether the plan fits and, where its trainer GPUs fit but it does not, what does not."""
    if plan.fits:
        return "fits"
    over = {limit.what for limit in plan.over()}
    if "gpu" in over or not over:
        return "DOES NOT FIT"
    named = [words for what, words in (("host", "a node's host"), ("engine_rank", "an engine rank")) if what in over]
    return f"DOES NOT FIT (the GPUs fit; {' and '.join(named)} do{'es' if len(named) == 1 else ''} not)"


def _verdict(plan: Plan) -> list[str]:
    """The comment lines that head a manifest or a snippet: what was planned, and whether it fits
    (with what would, when not). A model path's line breaks are escaped: a comment is one line."""
    est, gpu = plan.estimate, plan.cluster.gpu.memory_bytes
    model = plan.model.replace("\r", "\\r").replace("\n", "\\n")
    lines = [
        f"# agilerl-plan: {model} on {plan.cluster.num_gpus} x {plan.cluster.gpu.name}",
        f"# estimated peak {memory_words(est.peak_bytes, gpu)} per GPU (phase {est.peak_phase}) of "
        f"{memory_words(gpu, gpu)}; {_fit_words(plan)}",
    ]
    if plan.engine_rank is not None:
        lines.append(f"# {_engine_rank_line(plan)}")
    if plan.host_limit_bytes is not None:
        lines.append(f"# {host_line(plan)}")
    if not plan.fits:
        lines.extend(f"# what would fit: {s}" for s in plan.suggestions)
    # what the estimate noted (a multimodal checkpoint's text model: the trainer loads the
    # export, not the checkpoint named here)
    lines.extend(f"# note: {n}" for n in est.notes)
    return lines


def python_snippet(plan: Plan) -> str:
    """Python that builds the agent `python -m agilerl.train` builds from this plan's manifest
    (manifest_dict): every field of it, as the constructor argument the trainer passes."""
    manifest = manifest_dict(plan)
    cls = manifest["algorithm"]["name"]
    arguments, launch = _snippet_arguments(manifest)
    imports = {
        f"from agilerl.algorithms import {cls}",
        "from agilerl.algorithms.core.loading import load_tokenizer",
    }
    configs, calls = [], []
    for field, value in arguments.items():
        name = _ARGUMENT_NAMES.get(field, field)
        if field in _CONFIG_CLASSES:
            expression, needs = _config_expression(field, value)
            imports.update([needs] if needs else [])
            configs.append(f"{name} = {expression}")
            calls.append(f"    {name}={name},")
        elif field != "model_name":
            calls.append(f"    {name}={value!r},")
    launch_fields = ", ".join(f"{k}={v!r}" for k, v in launch.items())
    lines = [
        *_verdict(plan),
        f"# launch: {launch_fields}: each trainer rank runs this (under torchrun)",
        *sorted(imports),
        "",
        f"model_name = {arguments['model_name']!r}",
        "tokenizer = load_tokenizer(model_name)",
        "if tokenizer.pad_token is None:",
        "    tokenizer.pad_token = tokenizer.eos_token",
        *configs,
        f"agent = {cls}(",
        "    model_name=model_name,",
        "    pad_token_id=tokenizer.pad_token_id,",
        "    pad_token=tokenizer.pad_token,",
        "    tokenizer=tokenizer,",
        *calls,
        ")",
    ]
    return "\n".join(lines)


def _bar(value: int, capacity: int, width: int = 30) -> str:
    filled = min(width, round(width * value / capacity)) if capacity else 0
    return "#" * filled + "." * (width - filled) + ("!" if value > capacity else " ")


def estimate_table(est: Estimate, *, capacity: int | None = None, host_line: str | None = None) -> str:
    """The estimate's phases against ``capacity`` (its own by default), their components, and
    ``host_line`` (by default the host per rank and per node of the trainer ranks)."""
    capacity = capacity or est.capacity_bytes
    unit, scale = memory_unit(capacity)
    phases = [p for p in PHASES if p in est.phases]
    present = [c for c in COMPONENTS if any(est.phases[p].components.get(c) for p in phases)]
    lines = [f"{'phase':<10} {unit:>7}  {'of ' + format(capacity / scale, '.1f') + ' ' + unit:<31}  largest components"]
    for name in phases:
        ph = est.phases[name]
        top = sorted(((v, c) for c, v in ph.components.items() if v), reverse=True)[:3]
        parts = ", ".join(f"{c} {v / scale:.2f}" for v, c in top)
        marker = "  <- peak" if name == est.peak_phase else ""
        lines.append(f"{name:<10} {ph.total / scale:>7.2f}  {_bar(ph.total, capacity)}  {parts}{marker}")
    lines.append("")
    lines.append(f"{unit + ' per GPU':<20}" + "".join(f"{p[:9]:>10}" for p in phases))
    for c in present:
        lines.append(f"{c:<20}" + "".join(f"{est.phases[p].components.get(c, 0) / scale:>10.2f}" for p in phases))
    lines.append(f"{'total':<20}" + "".join(f"{est.phases[p].total / scale:>10.2f}" for p in phases))
    lines.append(host_line or _host_sizes(est.host_peak_bytes, est.host_per_node_bytes))
    return "\n".join(lines)


def _host_words(n: float, limit: int | None) -> str:
    """Host bytes in the unit of the host's limit where it is given (MiB under 4 GiB, as a GPU's
    figures), else in GiB."""
    return f"{n / GIB:.2f} GiB" if limit is None else memory_words(n, limit)


def _host_sizes(per_rank: int, per_node: int, limit: int | None = None) -> str:
    rank, node = _host_words(per_rank, limit), _host_words(per_node, limit)
    return f"host per trainer rank {rank} (rank 0's), per node {node}"


def host_line(plan: Plan) -> str:
    """The plan's host memory: per rank, the busiest node (engine ranks of their own included),
    and against the node's host memory where given."""
    limit = plan.cluster.host_memory_per_node_bytes
    line = _host_sizes(plan.estimate.host_peak_bytes, plan.host_per_node_bytes, limit)
    if plan.host_limit_bytes is None:
        return line + " (host memory not given: not judged)"
    assert limit is not None
    verdict = "over the limit" if plan.host_over else "fits"
    unit, scale = memory_unit(limit)
    return line + f" of {limit / scale:.2f} {unit} ({verdict}; the margin leaves {plan.host_limit_bytes / scale:.2f})"


def _node_words(c: Cluster) -> str:
    """How the GPUs sit on nodes, where that is not one whole node: several nodes, or part of one
    (``--gpus-per-node`` above ``--gpus``: the plan's ranks, and its host figure, are those GPUs')."""
    if c.num_nodes > 1:
        return f", {c.per_node} per node"
    if c.gpus_per_node is not None and c.gpus_per_node > c.num_gpus:
        return f", {c.num_gpus} of a node's {c.gpus_per_node}"
    return ""


def table(plan: Plan) -> str:
    est = plan.estimate
    c = plan.cluster
    unit, scale = memory_unit(c.gpu.memory_bytes)
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    lines = [
        f"{plan.model} on {c.num_gpus} x {c.gpu.name} ({c.gpu.memory_bytes / scale:.1f} {unit}{_node_words(c)}): "
        f"{verdict}",
        f"peak {est.peak_bytes / scale:.2f} {unit} per GPU in phase {est.peak_phase}; headroom "
        f"{est.headroom_bytes / scale:.2f} {unit} (safety margin {plan.margin_bytes / scale:.2f} {unit})",
        # what else is over its limit: an engine rank of its own, a node's host
        *(limit.words() for limit in plan.over() if limit.what != "gpu"),
        "",
        estimate_table(est, host_line=host_line(plan)),
        "",
    ]
    if plan.engine_rank is not None:
        engine = plan.engine_rank
        top = sorted(((v, c) for c, v in engine.components.items() if v), reverse=True)[:3]
        lines.append(
            f"engine rank (one more GPU per node): {engine.total / scale:.2f} {unit}  "
            f"{_bar(engine.total, c.gpu.memory_bytes)}  "
            + ", ".join(f"{k} {v / scale:.2f}" for v, k in top)
            + f"; host {_host_words(engine.host_total, c.host_memory_per_node_bytes)} as it loads"
            + (f" ({_ranks_per_node(plan)})" if c.num_nodes > 1 else "")
        )
        lines.append("")
    if plan.fsdp is not None:
        lines.append(
            "FSDPConfig: " + ", ".join(f"{k}={v}" for k, v in plan.fsdp.model_dump(exclude_defaults=True).items())
        )
    else:
        lines.append("FSDPConfig: none (no sharding)")
    w = plan.workload
    lines.append(
        f"micro_batch_size_per_gpu={w.micro_batch_size_per_gpu}, logprob_chunk_size={w.logprob_chunk_size}, "
        f"gradient_checkpointing={w.gradient_checkpointing}"
    )
    lines.append("")
    lines.append("why:")
    for d in plan.decisions:
        lines.append(f"  {d.field} = {d.value}: {d.reason}")
    if plan.suggestions:
        lines.append("")
        lines.append("what would fit:")
        lines.extend(f"  - {s}" for s in plan.suggestions)
    lines.append("")
    lines.append(f"coefficients: {plan.coefficients_source}")
    lines.extend(f"note: {n}" for n in est.notes)
    return "\n".join(lines)
