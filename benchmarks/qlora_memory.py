"""QLoRA's estimate against real probes of the trainer (bitsandbytes NF4 on CPU, bf16 base).

    python -m benchmarks.qlora_memory

Probes the tiny Qwen2 of benchmarks/accuracy.py with QLoRA (load_in_4bit) on one
device and under FSDP2 on 2 and 4 gloo ranks (reshard on/off, checkpointing
on/off), and the same run with LoRA for comparison; then a tiny Qwen3-MoE (its
routers and packed experts stay in bf16) and a tiny Gemma-3n (its AltUp and
per-layer projections outside the blocks are NF4 too). Prints the measured peak
of the busiest rank per phase against the estimate (CPU coefficients).
What the estimate counts for QLoRA: each linear transformers' bitsandbytes
loader quantises (agilerl.utils.sources.four_bit_linears, recorded in the spec)
packed in NF4 (one byte per two values, sharded by FSDP2 like any tensor,
gathered as bytes), its quantisation constants whole on every rank, the rest in
bf16.
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
MOE = "tiny:qwen3_moe?hidden_size=128&moe_intermediate_size=256&num_experts=8&num_experts_per_tok=2&num_layers=4"
GEMMA3N = "tiny:gemma3n?hidden_size=128&intermediate_size=256&num_layers=4&num_heads=4&num_kv_heads=2"
#: (model, ranks, sharded, gradient checkpointing, reshard after forward, QLoRA)
RUNS = [
    (MODEL, 1, False, True, True, True),
    (MODEL, 1, False, False, True, True),
    (MODEL, 1, False, True, True, False),
    (MODEL, 2, True, True, True, True),
    (MODEL, 2, True, False, True, True),
    (MODEL, 2, True, True, False, True),
    (MODEL, 4, True, True, True, True),
    (MODEL, 2, True, True, True, False),
    (MOE, 1, False, True, True, True),
    (MOE, 2, True, True, True, True),
    (GEMMA3N, 1, False, True, True, True),
    (GEMMA3N, 2, True, True, True, True),
]
PHASES = ("reference", "learn", "step")


def main() -> None:
    print(
        f"{'model':<10}{'ranks':>5} {'fsdp':>5} {'gc':>5} {'reshard':>7} {'base':>5} {'phase':<10}"
        f"{'measured KiB':>13}{'estimate KiB':>13}{'error':>8}"
    )
    errors = []
    for model, world, sharded, gc, reshard, qlora in RUNS:
        spec = load_model_spec(model)
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
        m = run_probe(ProbeRequest(model=model, workload=workload, fsdp=fsdp, nproc=world, timed_steps=1))
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
            arch, base = model.removeprefix("tiny:").split("?")[0], "nf4" if qlora else "bf16"
            print(
                f"{arch:<10}{world:>5} {str(sharded):>5} {str(gc):>5} {str(reshard):>7} {base:>5} "
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
