"""Random weights from a config without weights, drawn on the device they live on.

On an accelerator the trainer builds such a model on the meta device and draws
its weights in place (``_random_on_device``) instead of drawing them on the host
and copying. These tests run that path on CPU, where ``build_actor`` itself draws
with ``from_config``, and hold it to the same model: the same tensors in the
same order, ties and buffers, transformers' distributions and the adapters every
loading path shares.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from agilerl.algorithms.core.loading import _random_on_device, build_actor, place_empty
from agilerl.utils.tiny import TINY_ARCHITECTURES, tiny_config


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")


def _config(tied: bool):
    return tiny_config(
        "qwen2",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        tie_word_embeddings=tied,
        initializer_range=0.05,
    )


@pytest.fixture
def config_dir(tmp_path):
    def write(tied: bool):
        config = _config(tied)
        config.save_pretrained(tmp_path)
        return config, str(tmp_path)

    return write


@pytest.mark.parametrize("tied", [True, False])
def test_the_model_drawn_in_place_is_the_one_from_config_draws(config_dir, tied):
    config, source = config_dir(tied)
    host = build_actor(
        source=source,
        actor_network=None,
        lora_config=_lora(),
        use_reference_adapter=True,
        fsdp_config=None,
        gradient_checkpointing=False,
        device="cpu",
        dtype=torch.bfloat16,
        attn_implementation="eager",
        load_in_4bit=False,
        seed=3,
    )[0]
    drawn = _random_on_device(config, torch.bfloat16, {"attn_implementation": "eager"}, "cpu", _lora(), True, 3)

    want = {n: (p.shape, p.dtype, p.requires_grad) for n, p in host.named_parameters()}
    got = {n: (p.shape, p.dtype, p.requires_grad) for n, p in drawn.named_parameters()}
    assert got.keys() == want.keys()
    assert all(got[n][:2] == want[n][:2] for n in want)
    adapters = {n for n in want if ".lora_" in n}
    assert adapters and all(
        torch.equal(dict(drawn.named_parameters())[n], dict(host.named_parameters())[n]) for n in adapters
    )  # one seeded draw on every loading path
    base = drawn.get_base_model()
    assert (base.lm_head.weight is base.model.embed_tokens.weight) == tied
    assert all(torch.equal(a, b) for a, b in zip(drawn.buffers(), host.buffers(), strict=True))  # rotary frequencies
    assert all(
        float(m.weight.min()) == float(m.weight.max()) == 1.0
        for name, m in base.named_modules()
        if name.endswith("norm")
    )
    q = base.model.layers[0].self_attn.q_proj.base_layer
    assert not q.bias.any()
    # transformers' draw: normal, std initializer_range (64 x 64 samples: within 10%)
    assert abs(float(q.weight.float().std()) - 0.05) < 0.005
    assert abs(float(q.weight.float().mean())) < 0.005


class _Allocations(TorchDispatchMode):
    """The shapes of the tensors made on CPU, in order."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.empty_like, torch.ops.aten.empty, torch.ops.aten.empty_strided):
            self.shapes.append(tuple(out.shape))
        return out


def test_tensors_are_placed_in_the_order_to_moves_them_and_ties_stay_tied():
    from transformers import AutoModelForCausalLM

    config = _config(tied=True)
    twin = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    moved: dict[int, tuple[int, ...]] = {}  # what torch's .to() moves, in its order (a tied weight once)
    twin._apply(lambda t: moved.setdefault(id(t), tuple(t.shape)) and t)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with _Allocations() as made:
        place_empty(model, "cpu")
    assert made.shapes == list(moved.values())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(p.device.type == "cpu" for p in [*model.parameters(), *model.buffers()])

    with torch.device("meta"):
        untied = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    untied.to_empty(device="cpu")
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight  # why place_empty exists


def test_a_module_with_its_own_tensors_and_children_is_placed_children_first_as_to_does():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(3))
            self.inner = torch.nn.Linear(5, 7)
            self.register_buffer("table", torch.zeros(11))

    twin = torch.nn.Sequential(Block(), torch.nn.Linear(2, 13))
    moved: dict[int, tuple[int, ...]] = {}
    twin._apply(lambda t: moved.setdefault(id(t), tuple(t.shape)) and t)
    with torch.device("meta"):
        model = torch.nn.Sequential(Block(), torch.nn.Linear(2, 13))
    with _Allocations() as made:
        place_empty(model, "cpu")
    assert made.shapes == list(moved.values()) == [(7, 5), (7,), (3,), (11,), (13, 2), (13,)]


@pytest.mark.parametrize("arch", sorted(TINY_ARCHITECTURES))
def test_every_tiny_architecture_draws_in_place_what_from_config_draws(arch):
    """Per architecture: the same tensors, the same buffers (rotary frequencies, embedding scales), and
    every tensor from_config sets to a constant (norms, biases) set to it; the rest only in distribution."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, hidden_size=64, intermediate_size=128, num_layers=2)
    host = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    drawn = _random_on_device(config, torch.bfloat16, {}, "cpu", None, False, 0)
    want, got = dict(host.named_parameters()), dict(drawn.named_parameters())
    assert got.keys() == want.keys()
    assert all(got[n].shape == want[n].shape and got[n].dtype == want[n].dtype for n in want)
    assert all(torch.equal(a, b) for a, b in zip(drawn.buffers(), host.buffers(), strict=True))
    constant = [n for n, p in want.items() if p.numel() > 1 and bool((p == p.flatten()[0]).all())]
    assert constant and all(torch.equal(got[n], want[n]) for n in constant)
