"""One on-disk layout: full state dicts in and out of sharded models, meta materialisation."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor

from agilerl.distributed import (
    FSDPConfig,
    apply_fsdp2,
    barrier,
    full_model_state_dict,
    materialize_fsdp2_from_cpu_state,
    set_full_model_state_dict,
)
from agilerl.utils.tiny import tiny_config, tiny_model
from tests._dist import DistCases

cases = DistCases(__name__, nproc=2)

CONFIG = FSDPConfig(param_dtype="float32", reduce_dtype="float32", param_persistence_threshold=100)
IDS = torch.randint(3, 60, (2, 10), generator=torch.Generator().manual_seed(7))


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS, use_cache=False).logits


@cases.case
def checkpoint_sharded_to_unsharded_and_back(ctx):
    reference = tiny_model("qwen2", seed=3)
    sharded = copy.deepcopy(reference)
    apply_fsdp2(sharded, CONFIG, gradient_checkpointing=True)
    state = full_model_state_dict(sharded, keep=ctx.rank == 0)
    path = ctx.shared_dir / "ckpt.pt"
    if ctx.rank == 0:
        assert not any(isinstance(v, DTensor) for v in state.values())
        assert set(state) == set(reference.state_dict())
        torch.save(state, path)
    else:
        assert state == {}
    barrier()
    loaded = torch.load(path)
    unsharded = tiny_model("qwen2", seed=99)  # different weights until loaded
    unsharded.load_state_dict(loaded, strict=True)
    torch.testing.assert_close(_logits(unsharded), _logits(reference), atol=0, rtol=0)
    # ...and back into a freshly sharded model with different weights.
    resharded = tiny_model("qwen2", seed=42)
    apply_fsdp2(resharded, CONFIG)
    set_full_model_state_dict(resharded, loaded)
    torch.testing.assert_close(_logits(resharded), _logits(reference), atol=1e-6, rtol=1e-6)


def _materialize_case(arch: str):
    def materialize_from_meta(ctx):
        reference = tiny_model(arch, seed=5)
        cpu_state = reference.state_dict()
        with torch.device("meta"):
            from transformers import AutoModelForCausalLM

            meta = AutoModelForCausalLM.from_config(tiny_config(arch), attn_implementation="eager")
        apply_fsdp2(meta, CONFIG)
        assert all(p.is_meta for p in meta.parameters())
        materialize_fsdp2_from_cpu_state(meta, cpu_state, "cpu")
        assert not any(p.is_meta for p in meta.parameters())
        assert any(isinstance(p, DTensor) for p in meta.parameters())
        # Non-persistent buffers (rotary inv_freq, Gemma's embed_scale) were recomputed.
        for (name, buf), (_, ref_buf) in zip(meta.named_buffers(), reference.named_buffers()):
            torch.testing.assert_close(buf, ref_buf, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(_logits(meta), _logits(reference), atol=1e-6, rtol=1e-6)

    materialize_from_meta.__name__ = f"materialize_from_meta_{arch}"
    return materialize_from_meta


for _arch in ("qwen2", "llama", "gemma3", "gemma3n"):
    cases.case(_materialize_case(_arch))


@cases.case
def a_tied_table_kept_replicated_stays_tied_from_meta_and_computes_in_param_dtype(ctx):
    """A tied embedding table under param_persistence_threshold (replicated, as a tiny model's is
    by default) with the default bf16 param_dtype. Materialised from meta, it lost its tie
    (to_empty gave the head a parameter of its own, which no state dict key fills: the load
    refused it), and the head read the table uncast after the embedding's forward (fp32 against
    bf16 hidden states: a dtype error)."""
    from transformers import AutoModelForCausalLM

    reference = tiny_model("qwen2", seed=5, tie_word_embeddings=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("qwen2", tie_word_embeddings=True))
    apply_fsdp2(model, FSDPConfig())
    assert not isinstance(model.get_input_embeddings().weight, DTensor)  # replicated
    materialize_fsdp2_from_cpu_state(model, reference.state_dict(), "cpu")
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    torch.testing.assert_close(model.get_output_embeddings().weight, reference.lm_head.weight, atol=0, rtol=0)
    rows = IDS[ctx.rank : ctx.rank + 1]
    loss = model(input_ids=rows, labels=rows).loss
    loss.backward()
    assert model.get_input_embeddings().weight.grad is not None
    with torch.no_grad():  # the same forward, the whole model cast to bf16 as FSDP2 computes
        expected = copy.deepcopy(reference).to(torch.bfloat16)(input_ids=rows, labels=rows).loss
    torch.testing.assert_close(loss.float(), expected.float(), atol=0, rtol=2e-2)


@cases.case
def meta_materialised_model_with_replicated_params_trains_like_unsharded(ctx):
    # to_empty replaces the replicated (non-FSDP) parameters with new objects;
    # their gradient averaging must survive it.
    from transformers import AutoModelForCausalLM

    from agilerl.distributed import build_optimizer, fsdp_layout
    from tests.agilerl.distributed._parity import ATOL, batches, reference_run

    reference = tiny_model("llama", seed=5)
    data = batches(reference.config.vocab_size)
    ref_losses, ref_state = reference_run(reference, data)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="eager")
    apply_fsdp2(model, CONFIG)
    materialize_fsdp2_from_cpu_state(model, reference.state_dict(), "cpu")
    replicated = fsdp_layout(model).replicated_params
    live = {id(p) for p in model.parameters()}
    assert replicated and all(id(p) in live for p in replicated)
    opt = build_optimizer(model.parameters(), fsdp_config=CONFIG, lr=1e-3)
    for ids in data:
        rows = ids[ctx.rank * 2 : (ctx.rank + 1) * 2]
        model(input_ids=rows, labels=rows).loss.backward()
        opt.step()
        opt.zero_grad()
    state = full_model_state_dict(model)
    for k, v in ref_state.items():
        torch.testing.assert_close(state[k], v, atol=ATOL, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


@cases.case
def set_full_state_dict_errors_are_clear(ctx):
    model = tiny_model("qwen2")
    apply_fsdp2(model, CONFIG)
    state = tiny_model("qwen2").state_dict()
    state.pop("lm_head.weight")
    state["extra.weight"] = torch.zeros(1)
    with pytest.raises(KeyError, match="missing.*lm_head.weight.*unexpected.*extra.weight"):
        set_full_model_state_dict(model, state)
    bad = tiny_model("qwen2").state_dict()
    bad["lm_head.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="lm_head.weight: shape mismatch"):
        set_full_model_state_dict(model, bad)


test_dist = cases.pytest_test()
