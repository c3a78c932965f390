"""Population helpers."""

from __future__ import annotations

from typing import Any

__all__ = ["create_population", "INIT_HP_KEYS"]

#: INIT_HP keys (upper case, as in AgileRL) -> the algorithms' keyword arguments (each takes its own).
INIT_HP_KEYS = {
    "BATCH_SIZE": "batch_size",
    "GROUP_SIZE": "group_size",
    "BETA": "beta",
    "LR": "lr",
    "CLIP_COEF": "clip_coef",
    "CLIP_COEF_HIGH": "clip_coef_high",
    "CLIP_COEF_VALUE": "clip_coef_value",
    "VF_COEF": "vf_coef",
    "GAMMA": "gamma",
    "GAE_LAMBDA": "gae_lambda",
    "NLL_ALPHA": "nll_alpha",
    "MAX_GRAD_NORM": "max_grad_norm",
    "UPDATE_EPOCHS": "update_epochs",
    "TEMPERATURE": "temperature",
    "MAX_OUTPUT_TOKENS": "max_output_tokens",
    "MAX_MODEL_LEN": "max_model_len",
    "MICRO_BATCH_SIZE_PER_GPU": "micro_batch_size_per_gpu",
    "LOGPROB_CHUNK_SIZE": "logprob_chunk_size",
    "GRADIENT_CHECKPOINTING": "gradient_checkpointing",
    "USE_SEPARATE_REFERENCE_ADAPTER": "use_separate_reference_adapter",
    "FSDP": "fsdp_config",
    "SEED": "seed",
}


def create_population(
    algo: str,
    INIT_HP: dict[str, Any],
    population_size: int = 1,
    *,
    algo_kwargs: dict[str, Any] | None = None,
    device: str | None = None,
    **kwargs: Any,
) -> list:
    """Build ``population_size`` agents of ``algo`` from ``INIT_HP``.

    ``INIT_HP["FSDP"]`` may be True (FSDPConfig defaults), a dict of FSDPConfig
    fields, "auto" (the planner decides), or absent/False (no sharding).
    ``algo_kwargs`` (model_name, pad_token_id, pad_token, ...) pass through.
    Unknown INIT_HP keys are an error listing the known ones.
    """
    from agilerl.algorithms import CISPO, DPO, GRPO, GSPO, LLMPPO, LLMREINFORCE, SFT

    algos = {a.algo_name: a for a in (GRPO, CISPO, GSPO, LLMREINFORCE, LLMPPO, SFT, DPO)}
    if algo not in algos:
        raise ValueError(f"unknown LLM algorithm {algo!r}; available: {sorted(algos)}")
    params: dict[str, Any] = {}
    for key, value in INIT_HP.items():
        if key == "ALGO":
            continue
        if key not in INIT_HP_KEYS:
            raise KeyError(f"unknown INIT_HP key {key!r}; known keys: {sorted(INIT_HP_KEYS)}")
        params[INIT_HP_KEYS[key]] = value
    if INIT_HP.get("ALGO", algo) != algo:
        raise ValueError(f"INIT_HP['ALGO']={INIT_HP['ALGO']!r} disagrees with algo={algo!r}")
    params.update(algo_kwargs or {})
    params.update(kwargs)
    if device is not None:
        params["device"] = device
    return algos[algo].population(population_size, **params)
