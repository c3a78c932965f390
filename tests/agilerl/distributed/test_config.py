"""FSDPConfig: fields, defaults, descriptions, validation and serialisation."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from pydantic import ValidationError

from agilerl.distributed import FSDPConfig

# Defaults and descriptions as the API reference documents them.
SEED_DEFAULTS = {
    "reshard_after_forward": True,
    "cpu_offload": False,
    "optim_cpu_offload": None,
    "defer_grad_sync": True,
    "param_dtype": "bfloat16",
    "reduce_dtype": "float32",
    "prefetch_units": 1,
    "backward_prefetch_units": 1,
    "checkpoint_skip_layer_types": (),
    "checkpoint_every_n_blocks": 1,
    "wrap_every_n_blocks": 1,
    "param_persistence_threshold": 100000,
    "ep": 1,
    "ep_token_blocks": 1,
    "routed_expert_chunk_mib": None,
    "tp": 1,
    "shard_group_size": None,
}


def test_fields_and_defaults_match_the_reference():
    assert list(FSDPConfig.model_fields) == list(SEED_DEFAULTS)
    assert FSDPConfig().model_dump() == SEED_DEFAULTS


def test_descriptions_are_the_reference_text():
    d = FSDPConfig.field_descriptions()
    assert d["reshard_after_forward"] == (
        "Free gathered parameters after each module's forward. False keeps them gathered: faster, more VRAM."
    )
    assert d["optim_cpu_offload"].startswith("Keep Adam state on CPU and step it there with the default AdamW kernel.")
    assert d["param_persistence_threshold"] == (
        "Parameters with fewer elements than this stay unsharded. 0 shards every parameter."
    )
    assert all(d.values()), "every field has a description"


@pytest.mark.parametrize(
    "value,stored",
    [(torch.bfloat16, "bfloat16"), ("torch.float16", "float16"), ("bf16", "bfloat16"), (torch.float32, "float32")],
)
def test_dtype_fields_accept_dtype_or_name(value, stored):
    assert FSDPConfig(param_dtype=value, reduce_dtype=value).param_dtype == stored


def test_dtype_error_names_field_and_allowed_values():
    with pytest.raises(ValidationError, match=r"reduce_dtype='int8'.*\['bfloat16', 'float16', 'float32'\]"):
        FSDPConfig(reduce_dtype="int8")


@pytest.mark.parametrize(
    "field",
    [
        "prefetch_units",
        "backward_prefetch_units",
        "checkpoint_every_n_blocks",
        "wrap_every_n_blocks",
        "ep",
        "ep_token_blocks",
        "tp",
        "shard_group_size",
        "routed_expert_chunk_mib",
    ],
)
def test_ge_one_constraints(field):
    with pytest.raises(ValidationError, match=field):
        FSDPConfig(**{field: 0})
    assert getattr(FSDPConfig(**{field: 2}), field) == 2


def test_persistence_threshold_allows_zero_not_negative():
    assert FSDPConfig(param_persistence_threshold=0).param_persistence_threshold == 0
    with pytest.raises(ValidationError, match="param_persistence_threshold"):
        FSDPConfig(param_persistence_threshold=-1)


def test_both_offloads_is_an_error_naming_both():
    with pytest.raises(ValidationError, match="cpu_offload=True and optim_cpu_offload=True"):
        FSDPConfig(cpu_offload=True, optim_cpu_offload=True)
    config = FSDPConfig(cpu_offload=True)
    with pytest.raises(ValidationError, match="optim_cpu_offload"):
        config.optim_cpu_offload = True  # assignment is validated too


def test_unknown_field_is_rejected():
    with pytest.raises(ValidationError, match="reshard_after_fwd"):
        FSDPConfig(reshard_after_fwd=True)


def _custom() -> FSDPConfig:
    return FSDPConfig(
        reshard_after_forward=False,
        optim_cpu_offload=True,
        param_dtype=torch.float16,
        checkpoint_skip_layer_types=["moe", "linear_attention"],
        wrap_every_n_blocks=2,
        routed_expert_chunk_mib=128,
        shard_group_size=8,
        param_persistence_threshold=0,
    )


def test_round_trips_dict_json_yaml():
    config = _custom()
    assert FSDPConfig.model_validate(config.model_dump()) == config
    assert FSDPConfig.model_validate(config.to_dict()) == config
    assert FSDPConfig.model_validate_json(config.model_dump_json()) == config
    assert FSDPConfig.model_validate(json.loads(json.dumps(config.to_dict()))) == config
    assert FSDPConfig.from_yaml(config.to_yaml()) == config
    assert yaml.safe_load(config.to_yaml())["checkpoint_skip_layer_types"] == ["moe", "linear_attention"]


def test_from_yaml_rejects_non_mapping():
    with pytest.raises(ValueError, match="mapping"):
        FSDPConfig.from_yaml("- 1\n- 2\n")
