"""Sharded-vs-single-process training comparison used by the multi-rank tests.

The reference is the same model trained unsharded on the *full* batch in one
process (each rank computes it locally; it is deterministic). The sharded run
gives each rank an equal slice of the rows, so the mean of the rank losses is
the full-batch loss and FSDP's gradient average is the full-batch gradient.

Tolerance: everything runs in float32 (param_dtype and reduce_dtype). The two
runs differ only in summation order (per-rank partial sums, then the
reduce-scatter) and in AdamW kernel (fused vs for-loop), each about 1e-7
relative per step; Adam's normalisation can amplify that for elements whose
gradient is near zero, bounded by lr per step. Over 3 steps at lr 1e-3 that
gives the atol of 1e-5 used below, with rtol 1e-4 for losses.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from agilerl.distributed import (
    FSDPConfig,
    apply_activation_checkpointing,
    apply_fsdp2,
    build_optimizer,
    clip_grad_norm_,
    full_model_state_dict,
    set_gradient_sync,
)
from agilerl.utils.tiny import tiny_model

LR = 1e-3
STEPS = 3
ROWS = 4
SEQ = 12
ATOL = 1e-5
LOSS_RTOL = 1e-4


def batches(vocab: int, steps: int = STEPS, rows: int = ROWS, seq: int = SEQ) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(3, vocab, (rows, seq), generator=g) for _ in range(steps)]


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def reference_run(
    model: torch.nn.Module,
    data: list[torch.Tensor],
    *,
    gradient_checkpointing: bool = False,
    config: FSDPConfig | None = None,
    max_norm: float | None = None,
):
    model = copy.deepcopy(model)
    if gradient_checkpointing:
        apply_activation_checkpointing(model, config or FSDPConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    losses = []
    for ids in data:
        opt.zero_grad()
        loss = _loss(model, ids)
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def sharded_run(
    model: torch.nn.Module,
    data: list[torch.Tensor],
    config: FSDPConfig,
    *,
    micro_batches: int = 1,
    gradient_checkpointing: bool = False,
    max_norm: float | None = None,
    mesh=None,
    data_ranks: int | None = None,
    data_rank: int | None = None,
):
    rank, world = dist.get_rank(), dist.get_world_size()
    data_ranks = data_ranks or world
    data_rank = rank if data_rank is None else data_rank
    model = copy.deepcopy(model)
    apply_fsdp2(model, config, mesh=mesh, gradient_checkpointing=gradient_checkpointing)
    opt = build_optimizer(model.parameters(), fsdp_config=config, lr=LR, weight_decay=0.01)
    losses = []
    for ids in data:
        rows = ids.shape[0] // data_ranks
        mine = ids[data_rank * rows : (data_rank + 1) * rows]
        chunks = mine.chunk(micro_batches)
        opt.zero_grad()
        total = 0.0
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            if config.defer_grad_sync:
                set_gradient_sync(model, last)
            loss = _loss(model, chunk) / len(chunks)
            loss.backward()
            total += loss.item()
        if max_norm is not None:
            clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        t = torch.tensor([total])
        dist.all_reduce(t)
        losses.append(t.item() / world)
    return model, opt, losses, full_model_state_dict(model)


def assert_parity(
    arch: str,
    config: FSDPConfig,
    *,
    micro_batches: int = 1,
    gradient_checkpointing: bool = False,
    max_norm: float | None = None,
    **model_kwargs,
) -> torch.nn.Module:
    model = tiny_model(arch, **model_kwargs)
    data = batches(model.config.vocab_size)
    ref_losses, ref_state = reference_run(
        model, data, gradient_checkpointing=gradient_checkpointing, config=config, max_norm=max_norm
    )
    sharded, _, losses, state = sharded_run(
        model,
        data,
        config,
        micro_batches=micro_batches,
        gradient_checkpointing=gradient_checkpointing,
        max_norm=max_norm,
    )
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=LOSS_RTOL, atol=0)
    assert set(state) == set(ref_state), set(state) ^ set(ref_state)
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, atol=ATOL, rtol=0, msg=lambda m, k=key: f"{k}: {m}")
    # The run must have moved the weights, or the comparison proves nothing.
    start = model.state_dict()
    moved = max((state[k].float() - start[k].float()).abs().max().item() for k in start)
    assert moved > 10 * ATOL, f"weights barely moved ({moved}); the comparison would be vacuous"
    return sharded
