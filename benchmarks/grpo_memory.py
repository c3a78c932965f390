"""GRPO learn step: time and peak tensor bytes per rank, measured with the probe (CPU, gloo).

    python -m benchmarks.grpo_memory

A small Qwen2-architecture model (random weights), at 1 and 2 ranks, data
parallel vs FSDP2, chunked vs unchunked log-probs. Peak bytes are torch's
memory tracker (live tensor bytes per rank) over the learn phase (forward +
backward of one micro-batch) and over the whole step.
"""

from __future__ import annotations

from agilerl.distributed import FSDPConfig
from planner.probe import ProbeRequest, run_probe
from planner.workload import Workload

# A vocabulary large enough that logits matter, as in real LLMs (relative to hidden size).
MODEL = "tiny:qwen2?hidden_size=128&intermediate_size=512&num_layers=4&num_heads=4&vocab_size=8192"
WORKLOAD = Workload(
    padded_batches=False,
    share_prompt_prefix=False,
    prompts_per_step=4,
    group_size=4,
    prompt_tokens=64,
    completion_tokens=64,
    micro_batch_size_per_gpu=4,
    gradient_checkpointing=True,
    lora_rank=16,
    lora_alpha=32,
    lora_dropout=0.0,
    weights_dtype="float32",
    attn_implementation="sdpa",
)


def main() -> None:
    rows = []
    for ranks in (1, 2):
        for sharded in (False, True):
            for chunk in (None, 128):
                fsdp = FSDPConfig(param_dtype="float32", param_persistence_threshold=0) if sharded else None
                workload = WORKLOAD.model_copy(update={"logprob_chunk_size": chunk})
                m = run_probe(ProbeRequest(model=MODEL, workload=workload, fsdp=fsdp, nproc=ranks, timed_steps=5))
                if not m.ok:
                    print(f"FAILED ranks={ranks} sharded={sharded} chunk={chunk}: {m.failure[:300]}")
                    continue
                rows.append(
                    (
                        ranks,
                        "FSDP2" if sharded else ("DP" if ranks > 1 else "single"),
                        chunk or "none",
                        m.phase_total("learn"),
                        m.phase_total("learn", key="logits"),
                        m.peak_bytes,
                        m.step_seconds_median,
                        m.step_seconds_spread,
                        m.tokens_per_second,
                    )
                )
    print(f"model {MODEL}\nworkload {WORKLOAD.model_dump(exclude_defaults=True)}")
    print(
        f"{'ranks':>5} {'mode':>7} {'chunk':>6} {'learn peak MiB':>15} {'logits MiB':>11} {'step peak MiB':>14}"
        f" {'step s':>8} {'spread s':>9} {'tokens/s':>9}"
    )
    for r in rows:
        print(
            f"{r[0]:>5} {r[1]:>7} {r[2]:>6} {r[3] / 2**20:>15.2f} {r[4] / 2**20:>11.2f} {r[5] / 2**20:>14.2f}"
            f" {r[6]:>8.3f} {r[7]:>9.3f} {r[8]:>9.0f}"
        )


if __name__ == "__main__":
    main()
