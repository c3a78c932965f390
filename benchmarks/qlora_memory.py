"""QLoRA's estimate against real probes of the trainer (bitsandbytes NF4 on CPU, bf16 base).

    python -m benchmarks.qlora_memory

Probes the tiny Qwen2 of benchmarks/accuracy.py with QLoRA (load_in_4bit) on one
device and under FSDP2 on 2 and 4 gloo ranks (reshard on/off, checkpointing
on/off), and the same run with LoRA for comparison, and prints the measured
peak of the busiest rank per phase against the estimate (CPU coefficients).
What the estimate counts for QLoRA: each block linear's weight packed in NF4
(one byte per two values, sharded by FSDP2 like any tensor, gathered as bytes),
its quantisation constants whole on every rank, the rest in bf16.
"""

from __future__ import annotations

from agilerl.distributed import FSDPConfig
from planner.calibration import coefficients_for
from planner.hardware import CPU_DEVICE, Cluster
from planner.memory import estimate
from planner.models import load_model_spec
from planner.probe import ProbeRequest, run_probe
from planner.workload import Workload

MODEL = "tiny:qwen2?hidden_size=128&intermediate_size=512&num_layers=4&num_heads=4&num_kv_heads=2&vocab_size=4096"
#: (ranks, sharded, gradient checkpointing, reshard after forward, QLoRA)
RUNS = [
    (1, False, True, True, True),
    (1, False, False, True, True),
    (1, False, True, True, False),
    (2, True, True, True, True),
    (2, True, False, True, True),
    (2, True, True, False, True),
    (4, True, True, True, True),
    (2, True, True, True, False),
]
PHASES = ("reference", "learn", "step")


def main() -> None:
    spec = load_model_spec(MODEL)
    print(
        f"{'ranks':>5} {'fsdp':>5} {'gc':>5} {'reshard':>7} {'base':>5} {'phase':<10}"
        f"{'measured KiB':>13}{'estimate KiB':>13}{'error':>8}"
    )
    errors = []
    for world, sharded, gc, reshard, qlora in RUNS:
        cluster = Cluster(gpu=CPU_DEVICE, num_gpus=world)
        workload = Workload(
            padded_batches=False,
            share_prompt_prefix=False,
            prompts_per_step=world,
            group_size=2,
            prompt_tokens=128,
            completion_tokens=128,
            micro_batch_size_per_gpu=2,
            logprob_chunk_size=256,
            gradient_checkpointing=gc,
            lora_rank=8,
            lora_alpha=16,
            lora_dropout=0.0,
            weights_dtype="bfloat16",
            load_in_4bit=qlora,
            generation="none",
        )
        fsdp = (
            FSDPConfig(param_dtype="bfloat16", reshard_after_forward=reshard, param_persistence_threshold=0)
            if sharded
            else None
        )
        m = run_probe(ProbeRequest(model=MODEL, workload=workload, fsdp=fsdp, nproc=world, timed_steps=1))
        if not m.ok:
            print(f"probe failed: {m.failure[-1500:]}")
            continue
        est = estimate(spec, workload, cluster, fsdp, coefficients=coefficients_for(cluster.gpu))
        for phase in PHASES:
            measured = max(r.phases[phase]["total"] for r in m.ranks)
            estimated = est.phases[phase].total
            error = (estimated - measured) / measured * 100
            if qlora:
                errors.append(abs(error))
            print(
                f"{world:>5} {str(sharded):>5} {str(gc):>5} {str(reshard):>7} {'nf4' if qlora else 'bf16':>5} "
                f"{phase:<10}{measured / 1024:>13,.0f}{estimated / 1024:>13,.0f}{error:>+7.1f}%",
                flush=True,
            )
    if errors:
        print(
            f"QLoRA phases: mean |error| {sum(errors) / len(errors):.2f}%, worst {max(errors):.2f}% "
            f"({len(errors)} phase peaks)"
        )


if __name__ == "__main__":
    main()
