"""A small FSDP2 training demo on CPU: a tiny Qwen2 trained a few steps, sharded.

    torchrun --nproc_per_node=2 -m agilerl.examples.fsdp_demo [--steps 20]

Prints each step's loss (averaged across ranks), the parameter shard shapes and
the bytes of parameters each rank holds against the unsharded model.
"""

from __future__ import annotations

import argparse

import torch

from agilerl.distributed import (
    FSDPConfig,
    aggregate_metrics_dict,
    apply_fsdp2,
    build_optimizer,
    clip_grad_norm_,
    get_rank,
    get_world_size,
    init_distributed,
    is_main_process,
)
from agilerl.utils.tiny import tiny_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    if not init_distributed(timeout_seconds=120):
        raise SystemExit("launch with torchrun, e.g. `torchrun --nproc_per_node=2 -m agilerl.examples.fsdp_demo`")
    rank, world = get_rank(), get_world_size()
    model = tiny_model("qwen2", hidden_size=64, intermediate_size=128, num_layers=4, vocab_size=64)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    config = FSDPConfig(param_dtype="float32", param_persistence_threshold=1000)
    apply_fsdp2(model, config, gradient_checkpointing=True)
    local_bytes = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in model.parameters()
    )
    optimizer = build_optimizer(model.parameters(), fsdp_config=config, lr=args.lr)
    if is_main_process():
        w = model.model.layers[0].mlp.up_proj.weight
        print(f"{world} ranks; up_proj.weight global {tuple(w.shape)} -> local shard {tuple(w.to_local().shape)}")
        print(f"parameter bytes per rank: {local_bytes:,} of {full_bytes:,} unsharded")

    # A learnable toy sequence task: each row counts upward modulo 60.
    g = torch.Generator().manual_seed(rank)
    for step in range(1, args.steps + 1):
        start = torch.randint(3, 63, (4, 1), generator=g)
        ids = (start + torch.arange(16)) % 60 + 3
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        norm = clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        metrics = aggregate_metrics_dict({"loss": loss.detach(), "grad_norm": norm}, maximized=("grad_norm",))
        if is_main_process() and (step == 1 or step % 5 == 0):
            print(f"step {step:3d}  loss {metrics['loss']:.4f}  grad_norm(max) {metrics['grad_norm']:.3f}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
