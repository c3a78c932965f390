"""Manifests: every shipped one validates, bad ones say what is wrong, the demo runs (short)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import yaml

import agilerl
from agilerl.distributed import FSDPConfig
from agilerl.manifest import ManifestError, load_manifest
from agilerl.train import main

SHIPPED = sorted((Path(agilerl.__file__).parent / "examples").glob("*.yaml"))
GOOD = {"algorithm": {"model_name": "tiny:qwen2"}}


@pytest.fixture(autouse=True)
def _single_device(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


def test_there_are_shipped_manifests():
    assert SHIPPED


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_manifest_validates_and_round_trips(path):
    manifest = load_manifest(path)
    again = load_manifest(yaml.safe_load(manifest.to_yaml()))
    assert again == manifest


@pytest.mark.parametrize(
    "data,match",
    [
        ({}, "algorithm: Field required"),
        ({"algorithm": {}}, "algorithm.model_name: Field required"),
        ({**GOOD, "trainer": {}}, "trainer: Extra inputs are not permitted"),
        ({"algorithm": {"model_name": "m", "name": "PPO"}}, "algorithm.name"),
        ({"algorithm": {"model_name": "m", "group_size": 1}}, "algorithm.group_size"),
        ({"algorithm": {"model_name": "m", "fsdp": {"reshard_after_forwad": True}}}, "reshard_after_forwad"),
        (
            {"algorithm": {"model_name": "m", "fsdp": {"cpu_offload": True, "optim_cpu_offload": True}}},
            "cpu_offload=True and optim_cpu_offload=True",
        ),
        ({**GOOD, "training": {"rollout_batch_size": 6, "training_gpus_per_agent": 4}}, "multiple of training_gpus"),
        (
            {"algorithm": {"name": "SFT", "model_name": "m"}, "training": {"rollout_engines_per_agent": 1}},
            "SFT has no rollout",
        ),
        (
            {
                **GOOD,
                "training": {"rollout_engines_per_agent": 1},
                "algorithm": {"model_name": "m", "vllm": {}, "offload_weights_during_rollout": True},
            },
            "share no memory",
        ),
        ({"algorithm": {"model_name": "m", "micro_batch_size_per_gpu": 3}}, "does not divide"),
        ({**GOOD, "environment": {"operators": "/"}}, "unsupported operators"),
        ({**GOOD, "lora": {"r": 0}}, "lora.r"),
        ({"algorithm": {"model_name": "m", "offload_weights_during_rollout": True}}, "needs algorithm.vllm"),
    ],
)
def test_bad_manifests_name_the_field(data, match):
    with pytest.raises(ManifestError, match=match):
        load_manifest(data)


def test_weight_offload_with_an_engine_is_accepted():
    manifest = load_manifest({"algorithm": {"model_name": "m", "vllm": {}, "offload_weights_during_rollout": True}})
    assert manifest.algorithm.offload_weights_during_rollout


def test_fsdp_forms():
    assert load_manifest(GOOD).algorithm.fsdp_config() is None
    assert load_manifest({"algorithm": {"model_name": "m", "fsdp": True}}).algorithm.fsdp_config() == FSDPConfig()
    got = load_manifest({"algorithm": {"model_name": "m", "fsdp": {"reshard_after_forward": False}}})
    assert got.algorithm.fsdp_config() == FSDPConfig(reshard_after_forward=False)
    assert load_manifest({"algorithm": {"model_name": "m", "fsdp": "auto"}}).algorithm.fsdp_config() == "auto"


def test_unreadable_files(tmp_path, capsys):
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ManifestError, match="no such manifest"):
        load_manifest(missing)
    bad = tmp_path / "bad.yaml"
    bad.write_text("algorithm: [unclosed")
    with pytest.raises(ManifestError, match="not valid YAML"):
        load_manifest(bad)
    assert main([str(missing)]) == 2
    assert "no such manifest" in capsys.readouterr().err


def test_the_launched_ranks_split_into_members_trainers_and_engines():
    from agilerl.manifest import TrainingSection

    # the seed's manifest: 4 trainer GPUs and 2 engines per member
    seed = TrainingSection(rollout_batch_size=8, training_gpus_per_agent=4, rollout_engines_per_agent=2)
    layout = seed.layout(6)
    assert (layout.members, layout.trainers, layout.engines, layout.shared) == (1, 4, 2, False)
    assert layout.of(5) == (0, True, [0, 1, 2, 3], [4, 5]) and layout.of(1) == (0, False, [0, 1, 2, 3], [4, 5])
    with pytest.raises(ValueError, match=r"1 member\(s\) x \(4 trainer \+ 2 engine rank\(s\)\) = 6 ranks, but 4"):
        seed.layout(4)
    # the launched world by default, shared out between the members
    pop = TrainingSection(rollout_batch_size=4, population_size=2)
    assert pop.layout(4).trainers == 2 and pop.layout(4).of(3) == (1, False, [2, 3], [])
    assert TrainingSection().layout(2).trainers == 2
    with pytest.raises(ValueError, match="do not split into 2 population member"):
        pop.layout(3)
    # a member given every rank shares them with the others (they train in turn)
    shared = TrainingSection(rollout_batch_size=4, population_size=2, training_gpus_per_agent=2).layout(2)
    assert shared.shared and shared.of(1) == (0, False, [0, 1], [])
    with pytest.raises(ValueError, match="multiple of the 3 trainer"):
        TrainingSection(rollout_batch_size=4).layout(3)


def test_world_size_must_match_the_manifest(tmp_path, capsys, monkeypatch):
    data = {"algorithm": {"model_name": "tiny:qwen2"}, "training": {"training_gpus_per_agent": 2}}
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(data))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main([str(path)]) == 2
    assert "nproc_per_node=2" in capsys.readouterr().err


def test_short_demo_run(tmp_path, capsys):
    """The shipped CPU demo, a few steps, end to end through the CLI (with a checkpoint)."""
    data = yaml.safe_load(SHIPPED[0].read_text())
    data["training"]["checkpoint_dir"] = str(tmp_path / "ckpt")
    data["training"]["log_every"] = 1
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main([str(path), "--device", "cpu", "--max-steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "step    3" in out and "mean reward over the first" in out  # the library's log, shown on stdout
    assert not logging.getLogger("agilerl").handlers  # and only while the command runs
    assert (tmp_path / "ckpt" / "agent0" / "attributes.pt").exists()
    rewards = [float(line.split("reward ")[1].split()[0]) for line in out.splitlines() if " step " in line]
    assert len(rewards) == 3 and all(math.isfinite(r) for r in rewards)
