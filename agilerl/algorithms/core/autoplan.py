"""The trainer describes its own run to the planner: fsdp_config="auto", the other "auto"
knobs, and the expert chunk.

Imported only when an algorithm meets an "auto" to resolve: fsdp_config="auto", one of
gradient_checkpointing, logprob_chunk_size and gather_weights_for_rollout left at its "auto"
default, or an FSDPConfig with routed_expert_chunk_mib=None on a MoE model or with
optim_cpu_offload=None. Give those knobs values and the planner is not on the trainer's import
path.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from agilerl.distributed import dtype_name, is_main_process

logger = logging.getLogger(__name__)

__all__ = [
    "plan_for_agent",
    "pick_auto_knobs",
    "visible_cluster",
    "least_visible_cluster",
    "config_is_moe",
    "pick_expert_chunk",
    "pick_optim_offload",
    "in_trainer_terms",
    "node_memory_bytes",
]


def _meminfo_bytes(key: str, proc: Path = Path("/proc")) -> int | None:
    """``key``'s figure in ``/proc/meminfo`` (``MemTotal``, ``MemAvailable``), in bytes; None where
    it cannot be read."""
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _host_available_bytes() -> int:
    available = _meminfo_bytes("MemAvailable")
    return 16 * 2**30 if available is None else available


def node_memory_bytes(proc: Path = Path("/proc"), cgroup_fs: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The memory this node's processes may use: its RAM (``MemTotal``), or where lower the limit
    of the memory cgroup this process runs in or any above it (a Slurm job's, a container's:
    cgroup v2's ``memory.max``, v1's ``memory.limit_in_bytes``). None where ``/proc/meminfo``
    cannot be read. The whole node's, as ``agilerl-plan --host-memory`` takes it: what the OS, the
    page cache and other processes hold is the margin's to cover."""
    total = _meminfo_bytes("MemTotal", proc)
    return None if total is None else min([total, *_cgroup_limits(proc, cgroup_fs)])


def _cgroup_limits(proc: Path, cgroup_fs: Path) -> list[int]:
    """The memory limits of this process's cgroup and of every cgroup above it, v2 and v1 (none
    where ``/proc/self/cgroup`` cannot be read). A cgroup namespace (a container's) shows its
    own cgroup as the root of the mount: the root's limit file is read too."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except (OSError, ValueError):
        return []
    limits = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2: one unified hierarchy
            mount, name = cgroup_fs, "memory.max"
        elif "memory" in controllers.split(","):
            mount, name = cgroup_fs / "memory", "memory.limit_in_bytes"
        else:
            continue
        if ".." in Path(path).parts:  # not a cgroup of this mount's tree
            continue
        folder = mount / path.strip("/")
        for where in (folder, *folder.parents):
            if where.is_relative_to(mount):
                limits += _limit_in(where / name)
    return limits


def _limit_in(file: Path) -> list[int]:
    """A cgroup memory limit file's bytes; none where it is missing, unreadable, says "max" (no
    limit) or anything but a positive count of bytes."""
    try:
        text = file.read_text().strip()
    except (OSError, ValueError):  # a file that is not text is no limit either
        return []
    return [int(text)] if text.isascii() and text.isdecimal() and int(text) > 0 else []


def visible_cluster(world_size: int, *, judge_host: bool = False):
    """The cluster this process can see: world size, GPUs per node, this device's memory and,
    with ``judge_host`` on a GPU, the node's host memory (:func:`node_memory_bytes`), which a
    plan then judges: where the planner chooses what the host holds (fsdp_config="auto", Adam's
    place). The other "auto" knobs move nothing to or from the host and are chosen for the GPU
    alone. On a CPU the device is the host: its memory is the device's, not judged a second time."""
    from planner.hardware import CPU_DEVICE, GPU, Cluster, gpu_for_device

    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        name = props.name
        match = gpu_for_device(name)
        gpu = GPU(
            name=name,
            memory_bytes=int(props.total_memory),
            cuda_context_bytes=match.cuda_context_bytes if match else GPU.model_fields["cuda_context_bytes"].default,
            source="visible device",
        )
        host = node_memory_bytes() if judge_host else None
    else:
        gpu = CPU_DEVICE.model_copy(update={"memory_bytes": _host_available_bytes() // max(1, per_node)})
        host = None
    return Cluster(
        gpu=gpu, num_gpus=world_size, gpus_per_node=min(per_node, world_size), host_memory_per_node_bytes=host
    )


def least_visible_cluster(world_size: int, *, judge_host: bool = False):
    """:func:`visible_cluster` as the least of what every rank sees: the device with the least
    memory (a GPU of another kind or size on one node, a CPU rank's share of what is free) and
    the least host memory of any node (nodes of one job differ in RAM and in their cgroups'
    limits), so that a plan made on rank 0 fits every rank. A collective: every rank calls it.
    Where ranks differ, rank 0 logs the range it planned within."""
    from agilerl.distributed import gather_objects

    try:
        mine: Any = visible_cluster(world_size, judge_host=judge_host)
    except Exception as err:  # every rank must learn of it: the others would wait in the gather
        mine = f"{type(err).__name__}: {err}"
    seen = gather_objects([mine])
    failed = [(rank, what) for rank, what in enumerate(seen) if isinstance(what, str)]
    if failed:
        rank, what = failed[0]
        raise RuntimeError(f"rank {rank} could not read its device's memory: {what}")
    gpu = min((c.gpu for c in seen), key=lambda g: g.memory_bytes)
    hosts = sorted(c.host_memory_per_node_bytes for c in seen if c.host_memory_per_node_bytes is not None)
    least = mine.model_copy(update={"gpu": gpu, "host_memory_per_node_bytes": hosts[0] if hosts else None})
    gpus = sorted(c.gpu.memory_bytes for c in seen)
    # a spread under 1% is one figure read at different moments (a CPU rank's share of free memory)
    gpus_differ, hosts_differ = (bool(f) and f[-1] - f[0] > 0.01 * f[-1] for f in (gpus, hosts))
    if is_main_process() and (gpus_differ or hosts_differ):
        device = f"{gpus[0] / 2**30:.2f}-{gpus[-1] / 2**30:.2f} GiB a device" if gpus_differ else None
        host = f"{hosts[0] / 2**30:.2f}-{hosts[-1] / 2**30:.2f} GiB of host a node" if hosts_differ else None
        logger.info(
            "[agilerl] the ranks see different memory (%s): planning for the least",
            ", ".join(x for x in (device, host) if x),
        )
    return least


def _spec_for(agent, actor_network: nn.Module | None):
    from planner.models import load_model_spec
    from planner.spec import build_spec

    targets = _lora_targets(agent)
    if actor_network is not None:
        return build_spec(actor_network.config.to_dict(), name=type(actor_network).__name__, lora_targets=(targets,))
    return load_model_spec(agent.model_source, lora_targets=targets)


def _lora_targets(agent) -> str | tuple[str, ...]:
    lora = agent.lora_config
    if lora is None:
        return "all-linear"
    tm = lora.target_modules
    return tm if isinstance(tm, str) else tuple(sorted(tm))


def _planned_attention(attn_implementation: str | None) -> str:
    """The planner's attention kernel for the trainer's ``attn_implementation``: None is
    transformers' default, SDPA; any FlashAttention is planned as flash_attention_2 (neither
    keeps the scores); another fused kernel (flex, a hub kernel) as SDPA."""
    if attn_implementation == "eager":
        return "eager"
    if attn_implementation is not None and attn_implementation.startswith("flash_attention"):
        return "flash_attention_2"
    return "sdpa"


def _workload_for(agent, micro: int | None):
    """The planner's description of this trainer's run, and the prompt length it assumed."""
    from planner.workload import ALGORITHM_CLASSES, Workload

    algorithm = next(k for k, name in ALGORITHM_CLASSES.items() if name == agent.algo_name)
    lora = agent.lora_config
    rank, alpha = (int(lora.r), int(lora.lora_alpha)) if lora is not None else (16, 32)
    dtype = dtype_name(agent.dtype, "dtype")
    fields, prompt = agent.workload_fields()
    chunk = agent.logprob_chunk_size
    if "logprob_chunk_size" in agent.auto_knobs:
        chunk = None  # the planner's None: it chooses
    elif chunk is None:  # the trainer's None: unchunked, a chunk of every row of the step
        rows = fields["prompts_per_step"] * fields["group_size"]
        chunk = rows * (fields["prompt_tokens"] + fields["completion_tokens"])
    return Workload(
        algorithm=algorithm,
        full_finetune=agent.full_finetune,
        micro_batch_size_per_gpu=micro,
        logprob_chunk_size=chunk,
        gradient_checkpointing=None if "gradient_checkpointing" in agent.auto_knobs else agent.gradient_checkpointing,
        lora_rank=rank,
        lora_alpha=alpha,
        lora_dropout=float(lora.lora_dropout) if lora is not None else 0.0,
        lora_targets=_lora_targets(agent),
        use_separate_reference_adapter=agent.use_separate_reference_adapter,
        weights_dtype=dtype,
        load_in_4bit=agent.load_in_4bit,
        share_prompt_prefix=agent.share_prompt_prefix,
        attn_implementation=_planned_attention(agent.attn_implementation),
        **fields,
    ), prompt


def plan_for_agent(
    agent, actor_network: nn.Module | None, micro: int | None, cluster, sharding: str = "auto"
) -> dict[str, Any]:
    """The planner's run for ``agent`` on ``cluster`` (:func:`least_visible_cluster`, judging the
    host; ``sharding``: "auto", or "none" where no launcher started ranks to shard over), as the
    fields the agent takes."""
    from planner import emit
    from planner.calibration import coefficients_for, coefficients_source
    from planner.choose import plan

    spec = _spec_for(agent, actor_network)
    workload, prompt = _workload_for(agent, micro)
    result = plan(
        spec,
        workload,
        cluster,
        coefficients=coefficients_for(cluster.gpu),
        coefficients_source=coefficients_source(cluster.gpu),
        sharding=sharding,
        engine_ranks=False,  # the agent's rollout engine, if any, is the caller's: its own GPU and size
    )
    over = result.over()  # what the plan is over: its GPUs', a node's host
    summary = "[agilerl] fsdp_config='auto' planned:\n" + emit.table(result)
    if prompt is not None:
        summary += f"\n{prompt} (set max_model_len to plan for your real length)"
    return {
        "fsdp": result.fsdp.model_dump(mode="json") if result.fsdp else None,
        "micro_batch_size_per_gpu": result.workload.micro_batch_size_per_gpu,
        "logprob_chunk_size": result.workload.logprob_chunk_size,
        "gradient_checkpointing": bool(result.workload.gradient_checkpointing),
        "gather_weights_for_rollout": bool(result.workload.gather_weights_for_rollout),
        "fits": result.fits,
        "peak_gib": result.estimate.peak_bytes / 2**30,
        "capacity_gib": cluster.gpu.memory_bytes / 2**30,
        # where it fits the GPUs and not the node's host: that host, in words
        "host_over": over[0].words() if [limit.what for limit in over] == ["host"] else None,
        "suggestions": [in_trainer_terms(line, workload) for line in result.suggestions],
        "summary": summary,
        "algorithm": result.workload.algorithm,  # what the planner was told this run is
        "full_finetune": result.workload.full_finetune,
    }


def in_trainer_terms(suggestion: str, workload) -> str:
    """A "what would fit" line of the planner's, in the algorithm's own arguments: the planner's
    prompts_per_step is batch_size, its lengths max_output_tokens and max_model_len (prompt +
    completion), its generation, engine fraction and KV cache vllm_config's (Hugging Face generate:
    none), full_finetune=False a
    lora_config, its lora_rank the lora_config's r."""
    import re

    line = re.sub(r"\bprompts_per_step=", "batch_size=", suggestion)
    line = re.sub(r"\(completion_tokens=(\d+)\)", r"(max_output_tokens=\1)", line)
    line = re.sub(
        r"\(prompt_tokens=(\d+)\)", lambda m: f"(max_model_len={int(m[1]) + workload.completion_tokens})", line
    )
    line = line.replace("(full_finetune=False)", "(a lora_config)")
    line = line.replace("(generation='vllm')", "(vllm_config=VLLMConfig())")
    if "instead of a colocated vLLM engine (generation='hf'" in line:  # the engine's settings go with it
        offloaded = "offload_weights_during_rollout" in line
        instead = "no vllm_config" + (", offload_weights_during_rollout=False" if offloaded else "")
        line = re.sub(r"\(generation='hf'(, without [^)]*)?\)", f"({instead})", line)
    line = re.sub(r"\(lora_rank=(\d+)\)", r"(lora_config r=\1)", line)
    line = re.sub(r" \(--host-memory \d+\)", "", line)  # the planner's flag: the trainer reads its node's
    line = line.replace("vllm_kv_cache_memory_bytes", "vllm_config.kv_cache_memory_bytes")
    return line.replace("vllm_gpu_memory_utilization", "vllm_config.gpu_memory_utilization")


def pick_auto_knobs(agent, actor_network: nn.Module | None, micro: int, cluster) -> dict[str, Any]:
    """gradient_checkpointing / logprob_chunk_size / gather_weights_for_rollout "auto" under the
    sharding the user chose (one device, data parallel or an explicit FSDPConfig) on ``cluster``
    (:func:`least_visible_cluster`, the GPU alone): the planner's choice of those alone, every
    other field as given."""
    from planner.calibration import coefficients_for, coefficients_source
    from planner.choose import plan

    spec = _spec_for(agent, actor_network)
    workload, _ = _workload_for(agent, micro)
    fsdp = agent.fsdp_config
    result = plan(
        spec,
        workload,
        cluster,
        coefficients=coefficients_for(cluster.gpu),
        coefficients_source=coefficients_source(cluster.gpu),
        suggest=False,
        engine_ranks=False,
        sharding="none" if fsdp is None else "fsdp",
        fixed=None if fsdp is None else fsdp.model_dump(),
    )
    est = result.estimate

    def size(n: int) -> str:
        return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"

    chosen = []
    if "gradient_checkpointing" in agent.auto_knobs:
        chosen.append(f"gradient_checkpointing={bool(result.workload.gradient_checkpointing)}")
    if "logprob_chunk_size" in agent.auto_knobs:
        chosen.append(f"logprob_chunk_size={result.workload.logprob_chunk_size}")
    if "gather_weights_for_rollout" in agent.auto_knobs:
        chosen.append(f"gather_weights_for_rollout={bool(result.workload.gather_weights_for_rollout)}")
    where = (
        "one device"
        if agent.world_size == 1
        else ("data parallel" if fsdp is None else "the given FSDPConfig") + f" on {agent.world_size} ranks"
    )
    summary = (
        f"[agilerl] 'auto' resolved by the memory estimate ({where}): {', '.join(chosen)} "
        f"(peak {size(est.peak_bytes)} of {size(cluster.gpu.memory_bytes)} per device"
        f"{'' if result.fits else ', does not fit'})"
    )
    return {
        "logprob_chunk_size": result.workload.logprob_chunk_size,
        "gradient_checkpointing": bool(result.workload.gradient_checkpointing),
        "gather_weights_for_rollout": bool(result.workload.gather_weights_for_rollout),
        "summary": summary,
    }


def config_is_moe(config: Any) -> bool:
    """Whether a transformers config describes routed experts (cheap: no model is built)."""
    keys = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    return any(int(getattr(config, k, 0) or 0) > 1 for k in keys)


def _as_resolved(agent, micro: int):
    """The agent's run as a Workload with its checkpointing and log-prob chunk as resolved (no
    "auto" left: what the FSDPConfig fields still open are decided beside)."""
    workload, _ = _workload_for(agent, micro)
    return workload.model_copy(
        update={
            "logprob_chunk_size": agent.logprob_chunk_size,
            "gradient_checkpointing": bool(agent.gradient_checkpointing),
        }
    )


def pick_expert_chunk(agent, actor_network: nn.Module | None, micro: int, cluster) -> dict[str, Any]:
    """FSDPConfig.routed_expert_chunk_mib=None on a MoE model: the largest of 64/128/256/512
    MiB the memory estimate fits on ``cluster`` (:func:`least_visible_cluster`, the GPU alone)
    with the user's other fields, else the smallest."""
    from planner.calibration import coefficients_for
    from planner.memory import EXPERT_CHUNKS_MIB, MARGIN_FRACTION, resolve_expert_chunk

    spec = _spec_for(agent, actor_network)
    if spec.expert_layout_problem:  # gpt-oss: Hugging Face's expert loop, no chunk to pick
        return {
            "routed_expert_chunk_mib": None,
            "summary": "[agilerl] routed_expert_chunk_mib stays unset: this model's experts run in "
            "Hugging Face's own expert loop (their layout has no chunked experts)",
        }
    workload = _as_resolved(agent, micro)
    chosen, peaks = resolve_expert_chunk(
        spec, workload, cluster, agent.fsdp_config, coefficients=coefficients_for(cluster.gpu)
    )
    gib = 2**30
    fits = peaks[chosen] <= cluster.gpu.memory_bytes * (1 - MARGIN_FRACTION)
    why = (
        f"the largest of {'/'.join(map(str, EXPERT_CHUNKS_MIB))} MiB the memory estimate fits "
        f"(peak {peaks[chosen] / gib:.2f} GiB of {cluster.gpu.memory_bytes / gib:.2f} GiB per GPU)"
        if fits
        else f"none fits the estimate ({peaks[chosen] / gib:.2f} GiB at the smallest, of "
        f"{cluster.gpu.memory_bytes / gib:.2f} GiB): the smallest chunk"
    )
    return {"routed_expert_chunk_mib": chosen, "summary": f"[agilerl] routed_expert_chunk_mib={chosen}: {why}"}


def pick_optim_offload(agent, actor_network: nn.Module | None, micro: int, cluster) -> dict[str, Any]:
    """FSDPConfig.optim_cpu_offload=None under FSDP2: as documented, Adam on the GPU where the
    memory estimate fits it there (with the user's other fields and the knobs as resolved), else
    on the CPU. On a GPU, whose node's host memory ``cluster`` knows (:func:`least_visible_cluster`), the CPU
    only where the host holds it: where neither does, the GPU, with a warning (its out-of-memory
    error is said; the host's out-of-memory killer ends processes silently). Under
    cpu_offload=True Adam already steps on the host beside the offloaded shards (the two fields
    are exclusive): False, without asking the estimate."""
    from planner.calibration import coefficients_for
    from planner.choose import host_judge
    from planner.memory import MARGIN_FRACTION, estimate

    if agent.fsdp_config.cpu_offload:
        return {
            "optim_cpu_offload": False,
            "summary": "[agilerl] optim_cpu_offload=False: cpu_offload=True keeps the parameter, gradient "
            "and Adam shards on the host already",
        }
    spec = _spec_for(agent, actor_network)
    workload = _as_resolved(agent, micro)
    coefficients = coefficients_for(cluster.gpu)
    on_gpu = agent.fsdp_config.model_copy(update={"optim_cpu_offload": False})
    gpu_est = estimate(spec, workload, cluster, on_gpu, coefficients=coefficients)
    peak = gpu_est.peak_bytes
    budget = cluster.gpu.memory_bytes * (1 - MARGIN_FRACTION)
    gib = 2**30
    offload = peak > budget
    where = "on the CPU: with Adam on the GPU" if offload else "on the GPU:"
    device = f"the memory estimate's peak is {peak / gib:.2f} GiB of the {budget / gib:.2f} GiB per device it may take"
    judge = host_judge(spec, workload, cluster, coefficients=coefficients, engine_ranks=False) if offload else None
    if judge is not None:
        on_host = agent.fsdp_config.model_copy(update={"optim_cpu_offload": True})
        host = judge(estimate(spec, workload, cluster, on_host, coefficients=coefficients))
        if host.over:  # neither holds it: the GPU's out-of-memory error says so; the host's killer does not
            without = judge(gpu_est)  # the host with Adam on the GPU: over already, Adam is not what fills it
            already = f" (over with Adam on the GPU too: {without.words()})" if without.over else ""
            return {
                "optim_cpu_offload": False,
                "warning": True,
                "summary": f"[agilerl] optim_cpu_offload=False: the memory estimate fits Adam nowhere: on the GPU "
                f"{device}; on the host it needs {host.words()}{already}. Adam stays on the GPU, where "
                "running out of memory is an error that says so (the host's out-of-memory killer ends the "
                "processes without a word); give the run more GPUs, or nodes with more memory",
            }
    return {
        "optim_cpu_offload": offload,
        "summary": f"[agilerl] optim_cpu_offload={offload}: Adam steps {where} {device}",
    }
