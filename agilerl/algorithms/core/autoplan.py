"""fsdp_config="auto": the trainer describes its own run to the planner and applies the plan.

Imported only when an algorithm meets fsdp_config="auto" (the planner is not
on the trainer's import path otherwise).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

__all__ = ["plan_for_agent", "visible_cluster"]


def _host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 16 * 2**30


def visible_cluster(world_size: int):
    """The cluster this process can see: world size, GPUs per node, this device's memory."""
    from planner.hardware import CPU_DEVICE, GPU, GPUS, Cluster

    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        name = props.name
        match = next((g for key, g in GPUS.items() if key.split("-")[0].lower() in name.lower()), None)
        gpu = GPU(name=name, memory_bytes=int(props.total_memory),
                  cuda_context_bytes=match.cuda_context_bytes if match else GPU.model_fields["cuda_context_bytes"].default,
                  source="visible device")
    else:
        gpu = CPU_DEVICE.model_copy(update={"memory_bytes": _host_available_bytes() // max(1, per_node)})
    return Cluster(gpu=gpu, num_gpus=world_size, gpus_per_node=min(per_node, world_size))


def plan_for_agent(agent, actor_network: nn.Module | None, micro: int | None) -> dict[str, Any]:
    from planner import emit
    from planner.calibration import coefficients_for
    from planner.choose import plan
    from planner.models import load_model_spec
    from planner.spec import build_spec
    from planner.workload import Workload

    lora = agent.lora_config
    targets = "all-linear"
    rank, alpha = 16, 32
    if lora is not None:
        rank, alpha = int(lora.r), int(lora.lora_alpha)
        tm = lora.target_modules
        targets = tm if isinstance(tm, str) else tuple(sorted(tm))
    if actor_network is not None:
        spec = build_spec(actor_network.config.to_dict(), name=type(actor_network).__name__, lora_targets=(targets,))
    else:
        spec = load_model_spec(agent.model_source, lora_targets=targets)
    completion = agent.max_output_tokens
    prompt = max(1, (agent.max_model_len or 2 * completion) - completion)
    dtype = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[agent.dtype]
    workload = Workload(
        prompts_per_step=agent.batch_size, group_size=agent.group_size, prompt_tokens=prompt,
        completion_tokens=completion, micro_batch_size_per_gpu=micro,
        logprob_chunk_size=None if agent._auto_chunk else agent.logprob_chunk_size,
        gradient_checkpointing=None if agent._auto_gc else agent.gradient_checkpointing,
        lora_rank=rank, lora_alpha=alpha, lora_targets=targets,
        use_separate_reference_adapter=agent.use_separate_reference_adapter, beta=agent.beta,
        update_epochs=agent.update_epochs, weights_dtype=dtype, load_in_4bit=agent.load_in_4bit,
        generation="vllm" if agent.vllm_config is not None else "hf",
        vllm_gpu_memory_utilization=agent.vllm_config.gpu_memory_utilization if agent.vllm_config else 0.3,
    )
    cluster = visible_cluster(agent.world_size)
    result = plan(spec, workload, cluster, coefficients=coefficients_for(cluster.gpu),
                  sharding="none" if agent.load_in_4bit else "auto")
    summary = "[agilerl] fsdp_config='auto' planned:\n" + emit.table(result)
    if not agent.max_model_len:
        summary += f"\nassumed prompts of {prompt} tokens (set max_model_len to plan for your real length)"
    return {
        "fsdp": result.fsdp.model_dump(mode="json") if result.fsdp else None,
        "micro_batch_size_per_gpu": result.workload.micro_batch_size_per_gpu,
        "logprob_chunk_size": result.workload.logprob_chunk_size,
        "gradient_checkpointing": bool(result.workload.gradient_checkpointing),
        "fits": result.fits,
        "summary": summary,
    }
