"""QLoRA on one device with real bitsandbytes (CPU): NF4 base weights, LoRA on the 4-bit linears.

QLoRA is LoRA on the dequantised base: the reference is a plain bf16 model whose
every linear weight is ``bitsandbytes.functional.dequantize_4bit`` of the
agent's packed weight, built independently from the config, with the same
adapters, trained by the same GRPO update. Tolerance: both compute in bf16 from
the same bf16 weights; CPU bitsandbytes dequantises and multiplies, so the two
differ only where bf16 rounding of the matmul order differs (measured: losses
within 1e-3 relative, adapters within 1e-3 after two AdamW steps at lr 1e-2).
"""

from __future__ import annotations

import contextlib
import logging
import math

import bitsandbytes as bnb  # the [qlora] extra, part of [dev]: these tests run, never skip
import pytest
import torch

from tests.agilerl.algorithms._common import (
    TINY,
    loop_loss,
    lora_state,
    make_agent,
    synthetic_experiences,
)
from tests.agilerl.algorithms._qlora import QLORA, four_bit_layers, pair

pytestmark = pytest.mark.qlora


def test_base_weights_are_nf4_and_differ_from_the_full_precision_ones():
    from transformers import AutoModelForCausalLM

    agent = make_agent(**QLORA)
    layers = four_bit_layers(agent.model)
    assert len(layers) == 2 * 7  # q, k, v, o, gate, up, down in each of 2 blocks
    original = AutoModelForCausalLM.from_pretrained(agent.model_source, dtype=torch.bfloat16).state_dict()
    for name, layer in layers.items():
        w = layer.weight
        assert w.dtype == torch.uint8 and w.quant_state.quant_type == "nf4"
        assert w.numel() * 2 == layer.in_features * layer.out_features  # two 4-bit values per byte
        full = original[f"{name.replace('.base_layer', '')}.weight"]
        dequantised = bnb.functional.dequantize_4bit(w.data, w.quant_state)
        error = (dequantised.float() - full.float()).abs().max().item()
        assert 1e-4 < error < 0.5 * full.float().abs().max().item(), (name, error)  # quantised, not garbage
    # The adapters train in fp32 beside the 4-bit base; nothing of the base is trainable.
    trainable = [n for n, p in agent.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    assert all(p.dtype == torch.float32 for n, p in agent.model.named_parameters() if ".lora_" in n)


def test_learn_steps_match_lora_on_the_dequantised_base_and_a_python_loop():
    qlora, twin = pair()
    start = lora_state(qlora)
    experiences = [synthetic_experiences(qlora, seed=s)[:3] for s in (1, 2)]
    ids, masks, rewards = experiences[0]
    # Step 1's loss written out in plain Python from the twin's log-probs (old = current; the
    # reference is the base, adapters disabled).
    attention = qlora._attention_mask(ids, masks)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)

    def logprobs(model, adapters: bool):
        with torch.no_grad(), contextlib.nullcontext() if adapters else model.disable_adapter():
            logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits
        return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    actor, ref = logprobs(twin.model, True), logprobs(twin.model, False)
    adv = []
    r = rewards.tolist()
    for g0 in range(0, len(r), qlora.group_size):
        group = r[g0 : g0 + qlora.group_size]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (len(group) - 1))
        adv += [(x - mean) / (std + 1e-4) for x in group]
    expected = loop_loss(actor.tolist(), actor.tolist(), ref.tolist(), adv, masks[:, 1:].tolist(), 0.2, 0.1)

    first, twin_first = qlora.learn(experiences[0]), twin.learn(experiences[0])
    assert first["kl"] > 0.05  # the actor differs from the base: the KL term is in play
    assert math.isclose(twin_first["loss"], expected, rel_tol=1e-4), (twin_first["loss"], expected)
    # bitsandbytes' 4-bit matmul rounds differently from a bf16 nn.Linear on the same weights.
    assert math.isclose(first["loss"], twin_first["loss"], rel_tol=1e-2), (first["loss"], twin_first["loss"])
    assert math.isclose(first["grad_norm"], twin_first["grad_norm"], rel_tol=1e-2)
    second, twin_second = qlora.learn(experiences[1]), twin.learn(experiences[1])
    assert math.isclose(second["loss"], twin_second["loss"], rel_tol=5e-2), (second, twin_second)
    # Adam's first steps are about lr x sign(gradient): where a gradient is near zero the rounding
    # above can flip its sign and move that element by 2 lr, so the measure is the mean, not the max.
    after, twin_after = lora_state(qlora), lora_state(twin)
    for k in after:
        moved = (after[k] - start[k]).abs().mean().item()
        apart = (after[k] - twin_after[k]).abs().mean().item()
        assert moved > 5e-3 and apart < 0.1 * moved, (k, moved, apart)


def test_checkpoint_holds_only_the_adapters_and_reloads(tmp_path):
    agent = make_agent(**QLORA)
    agent.learn(synthetic_experiences(agent, seed=1)[:3])
    file = agent.save_checkpoint(tmp_path / "ckpt")
    payload = torch.load(file, weights_only=False)
    keys = list(payload["adapters"]["actor"])
    assert keys and all(".lora_" in k for k in keys)  # the base is never saved
    assert file.stat().st_size < 200_000
    resumed = make_agent(**QLORA, seed=7)
    resumed.load_checkpoint(tmp_path / "ckpt")
    for k, v in lora_state(agent).items():
        assert torch.equal(lora_state(resumed)[k], v), k
    nxt = synthetic_experiences(agent, seed=2)[:3]
    assert math.isclose(agent.learn(nxt)["loss"], resumed.learn(nxt)["loss"], rel_tol=1e-6, abs_tol=1e-9)


def test_qlora_generates():
    agent = make_agent(**QLORA)
    ids, masks = agent.get_action(["1+2=", "3+4="])
    assert ids.shape[0] == 2 * agent.group_size and masks[:, -agent.max_output_tokens :].sum() > 0


def test_a_config_without_weights_is_quantised_random_not_left_in_full_precision(tmp_path):
    from transformers import AutoConfig

    from agilerl.algorithms.core.loading import resolve_model_source

    config = AutoConfig.from_pretrained(resolve_model_source(TINY))
    config.tie_word_embeddings = True  # as Qwen2.5 up to 3B: the output embedding is the input one
    config.save_pretrained(tmp_path)
    agent = make_agent(**QLORA, model_name=str(tmp_path))
    layers = four_bit_layers(agent.model)
    assert len(layers) == 2 * 7
    assert all(layer.weight.dtype == torch.uint8 and layer.weight.quant_state is not None for layer in layers.values())
    base = agent.model.get_base_model()
    assert base.lm_head.weight is base.model.embed_tokens.weight  # one matrix, not a copy each
    metrics = agent.learn(synthetic_experiences(agent, seed=1)[:3])
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0


def test_a_rollout_engine_gets_the_dequantised_base_with_the_adapter_merged():
    """QLoRA with a colocated engine (the protocol's fake engine here, not a real vLLM): the engine
    holds its own copy in the compute dtype, each weight dequantised and the actor's LoRA delta added."""
    from tests.agilerl.algorithms.test_grpo_single import FakeEngine

    agent, _ = pair()
    engine = FakeEngine(agent)
    agent.engine = engine
    agent.get_action(["1+1=", "2+2="])
    assert engine.calls[:2] == ["wake_up", "load_weights"]
    layers = four_bit_layers(agent.model)
    assert len(layers) == 14
    for name, base in layers.items():
        key = f"{name.replace('.base_layer', '')}.weight"
        lora = agent.model.get_submodule(f"base_model.model.{name.removesuffix('.base_layer')}")
        expected = bnb.functional.dequantize_4bit(base.weight.data, base.weight.quant_state)
        expected = expected + lora.get_delta_weight("actor").to(expected.dtype)
        sent = engine.weights[key]
        assert sent.dtype == torch.bfloat16 and sent.shape == (base.out_features, base.in_features)
        assert torch.equal(sent, expected), key
        assert not torch.equal(sent, bnb.functional.dequantize_4bit(base.weight.data, base.weight.quant_state))


def test_a_moe_says_its_packed_experts_stay_in_the_compute_dtype(caplog):
    # transformers packs each layer's routed experts into two 3-D tensors (gate_up_proj, down_proj),
    # which bitsandbytes does not quantise: 2 layers x 2 tensors here.
    agent = make_agent(
        **QLORA, model_name="tiny:qwen3_moe?hidden_size=32&intermediate_size=64&num_layers=2&num_heads=2&num_kv_heads=1"
    )
    warned = [
        r.getMessage()
        for r in caplog.records
        if r.name == "agilerl.algorithms.core.loading" and r.levelno == logging.WARNING
    ]
    assert len(warned) == 1
    assert "QLoRA: the 4 packed routed-expert tensors" in warned[0] and "stay in bfloat16" in warned[0]
    assert agent.model is not None
    caplog.clear()
    make_agent(**QLORA)  # a dense model says nothing
    assert "packed routed-expert" not in caplog.text


def test_the_nf4_bytes_survive_an_eval_forward_where_bitsandbytes_would_repack_them(monkeypatch):
    # bitsandbytes repacks a Linear4bit's weight in place at its first no-grad eval forward on CPUs
    # with AVX512-BF16 (a layout the dequantise, the merge and FSDP2's shards do not read). Pretend
    # every CPU has it, so the test means the same on any machine.
    import bitsandbytes.nn.modules as bnb_modules

    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: True)
    agent = make_agent(**QLORA)
    layers = four_bit_layers(agent.model)
    before = {name: (layer.weight.data.clone(), layer.weight.shape) for name, layer in layers.items()}
    ids, masks, _, _ = synthetic_experiences(agent, seed=3)
    agent.model.eval()
    with torch.no_grad():
        agent.model(input_ids=ids, attention_mask=agent._attention_mask(ids, masks))
    for name, layer in layers.items():
        data, shape = before[name]
        assert not getattr(layer.weight.quant_state, "packing_format_for_cpu", False), name
        assert layer.weight.shape == shape and torch.equal(layer.weight.data, data), name


@pytest.mark.parametrize("arch", ["qwen3_moe", "gemma3n"])
def test_the_nf4_weights_are_those_transformers_own_loader_quantises(arch, tmp_path):
    """Which weights QLoRA stores in NF4: transformers' bitsandbytes loader on a saved model (the
    truth, less Gemma-3n's AltUp coefficients, which its own training code cannot run in 4 bits),
    against the trainer's loader settings, its meta-device FSDP2 path and the planner's spec. A
    MoE's routers keep a bare weight and stay bf16; Gemma-3n's AltUp and per-layer projections
    outside the blocks are plain linears and go 4-bit: a rule by shape (2-D block weights) got
    both wrong."""
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    from agilerl.algorithms.core.loading import _bnb_config, _four_bit_on_meta
    from agilerl.utils.tiny import save_tiny_model
    from planner.spec import build_spec

    def loaded(quantization_config) -> set[str]:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16, device_map={"": "cpu"}, quantization_config=quantization_config
        )
        return {name for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}

    path = save_tiny_model(tmp_path / arch, arch)
    config = AutoConfig.from_pretrained(path)
    stock = loaded(BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"))
    coefficients = {n for n in stock if n.endswith(("altup.prediction_coefs", "altup.correction_coefs"))}
    assert bool(coefficients) == (arch == "gemma3n")
    truth = stock - coefficients
    assert loaded(_bnb_config(torch.bfloat16, config)) == truth  # the trainer's from_pretrained path

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert set(_four_bit_on_meta(meta, torch.bfloat16)) == truth

    spec = build_spec(config, name=arch)
    planned = {n.removesuffix(".weight") for n in spec.root_four_bit}
    for i, block in enumerate(spec.blocks):
        planned |= {f"model.layers.{i}.{n.removesuffix('.weight')}" for n in block.four_bit}
    assert planned == truth

    if arch == "qwen3_moe":  # the router is not a plain linear: not 4-bit, though a 2-D block weight
        assert "model.layers.0.mlp.gate" not in truth
        assert ("mlp.gate.weight", (4, config.hidden_size)) in spec.blocks[0].tensors
    else:  # linears outside the blocks
        assert "model.per_layer_model_projection" in truth


def test_gemma3n_trains_with_qlora(tmp_path):
    """Gemma-3n's AltUp clamps its prediction coefficients in place while training: with those
    quantised, the first learn step stopped on a uint8 weight. From a saved model and from a
    config, one step now runs and moves the adapters."""
    from agilerl.utils.tiny import save_tiny_model

    size = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1)
    saved = save_tiny_model(tmp_path / "gemma3n", "gemma3n", **size)
    tiny = "tiny:gemma3n?" + "&".join(f"{k}={v}" for k, v in size.items())
    for source in (str(saved), tiny):
        agent = make_agent(model_name=source, **QLORA)
        assert four_bit_layers(agent.model) and not any("coefs" in n for n in four_bit_layers(agent.model))
        before = lora_state(agent)
        metrics = agent.learn(synthetic_experiences(agent)[:3])
        assert math.isfinite(metrics["loss"]), source
        after = lora_state(agent)
        assert any(not torch.equal(before[k], after[k]) for k in before), source


def test_the_probe_counts_each_4bit_linears_quantisation_state():
    """Each Linear4bit keeps its quantisation state as plain tensors, neither parameters nor buffers:
    the probe's weights must hold them (they are device memory) beside the packed bytes. Sized here
    by bitsandbytes' own serialisation of each state (its offset, a 0-dim fp32 tensor on the device,
    is written there as a float)."""
    from planner.probe.tracking import PhaseRecorder, param_bytes, resident_tensors

    agent = make_agent(**QLORA)
    tensors = [*agent.model.parameters(), *agent.model.buffers()]
    plain = sum(t.numel() * t.element_size() for t in tensors)
    states = 0
    for layer in four_bit_layers(agent.model).values():
        serialised = layer.weight.quant_state.as_dict(packed=False).values()
        states += sum(v.numel() * v.element_size() for v in serialised if isinstance(v, torch.Tensor)) + 4
    assert states > 0
    assert sum(param_bytes(agent.model).values()) == plain + states

    # A phase counts them once, as weights: not also among the tensors resident when it starts,
    # which it registers as activations.
    recorder = PhaseRecorder(agent.model, agent.optimizer, torch.device("cpu"))
    storages = set()
    for layer in four_bit_layers(agent.model).values():
        state = layer.weight.quant_state
        for t in (state.absmax, state.code, state.offset, state.state2.absmax, state.state2.code):
            storages.add(t.untyped_storage().data_ptr())
    resident = resident_tensors(torch.device("cpu"), known=recorder._known_storages())
    assert not storages & {t.untyped_storage().data_ptr() for t in resident}
    with recorder("idle"):
        pass
    record = recorder.peaks["idle"]
    assert record["weights"] == param_bytes(agent.model)["weights"]
    assert record["total"] == sum(param_bytes(agent.model).values()) + record["activations"]
