"""Manifests: every shipped one validates, bad ones say what is wrong, the demo runs (short)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import yaml

import agilerl
from agilerl.distributed import FSDPConfig
from agilerl.manifest import ALGORITHM_FIELDS, ManifestError, load_manifest
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
        # no knob means anything at inf or nan
        *(
            ({"algorithm": {"model_name": "m", "name": name, field: value}}, f"algorithm.{field}: .*finite")
            for name, field in (
                ("GRPO", "beta"),
                ("GRPO", "lr"),
                ("GRPO", "temperature"),
                ("GRPO", "max_grad_norm"),
                ("GRPO", "clip_coef"),
                ("CISPO", "clip_coef_high"),
                ("LLMPPO", "vf_coef"),
                ("LLMPPO", "clip_coef_value"),
                ("DPO", "nll_alpha"),
            )
            for value in (math.inf, math.nan)
        ),
        ({**GOOD, "lora": {"dropout": math.nan}}, "lora.dropout: .*finite"),
        ({**GOOD, "training": {"seed": 2**64}}, "training.seed"),
        # a prompt must fit beside the completion
        ({"algorithm": {"model_name": "m", "max_model_len": 256}}, "max_model_len=256 leaves no room for a prompt"),
        (
            {"algorithm": {"model_name": "m", "max_output_tokens": 8, "vllm": {"max_model_len": 4}}},
            "vllm.max_model_len=4 leaves no room for a prompt",
        ),
        ({**GOOD, "lora": {"target_modules": []}}, "lora.target_modules"),
        ({**GOOD, "lora": {"target_modules": ""}}, "lora.target_modules"),
        ({**GOOD, "lora": {"target_modules": ["q_proj", ""]}}, "lora.target_modules"),
    ],
)
def test_bad_manifests_name_the_field(data, match):
    with pytest.raises(ManifestError, match=match):
        load_manifest(data)


def test_a_tensor_parallel_group_shares_its_rows_in_the_micro_batch_check():
    """8 prompts x 8 = 64 completions on 2 GPUs in one tp=2 group: one data-parallel rank
    holds all 64, so a micro-batch of 64 divides them (as agilerl.train and the planner count)."""
    data = {
        "algorithm": {"model_name": "m", "micro_batch_size_per_gpu": 64, "fsdp": {"tp": 2}},
        "training": {"rollout_batch_size": 8, "training_gpus_per_agent": 2},
    }
    assert load_manifest(data).algorithm.micro_batch_size_per_gpu == 64
    data["algorithm"]["micro_batch_size_per_gpu"] = 48
    with pytest.raises(ManifestError, match="over 1 data-parallel rank of 2 GPUs gives 64 per rank"):
        load_manifest(data)


def test_the_manifest_bounds_each_hyperparameter_as_the_algorithms_do():
    """One rule: a value the manifest takes, the algorithm takes too, and the other way round
    (check_hyperparameters beside lr in the algorithms' base; the manifest's fields' bounds)."""
    from agilerl.algorithms.core.base import HYPERPARAMETER_RANGES, check_hyperparameters

    takes = {"lr": "GRPO", "max_grad_norm": "GRPO", "temperature": "GRPO"}  # field -> an algorithm taking it
    for name, fields in ALGORITHM_FIELDS.items():
        for field in fields:
            takes.setdefault(field, name)
    in_manifest = [field for field in HYPERPARAMETER_RANGES if field in takes]
    assert set(in_manifest) == set(HYPERPARAMETER_RANGES) - {"value_lr"}  # LLMPPO's value head: API only
    for field in in_manifest:
        for value in (-1.0, -1e-9, 0.0, 1e-9, 0.5, 1.0, 1.5, 1e9, math.inf, -math.inf, math.nan):
            try:
                check_hyperparameters(**{field: value})
                api = True
            except ValueError:
                api = False
            try:
                load_manifest({"algorithm": {"model_name": "m", "name": takes[field], field: value}})
                manifest = True
            except ManifestError:
                manifest = False
            assert api == manifest, f"{field}={value}: the algorithms {'take' if api else 'refuse'} it"


def test_weight_offload_with_an_engine_is_accepted():
    manifest = load_manifest({"algorithm": {"model_name": "m", "vllm": {}, "offload_weights_during_rollout": True}})
    assert manifest.algorithm.offload_weights_during_rollout


def test_fsdp_forms():
    assert load_manifest(GOOD).algorithm.fsdp_config() is None
    assert load_manifest({"algorithm": {"model_name": "m", "fsdp": True}}).algorithm.fsdp_config() == FSDPConfig()
    got = load_manifest({"algorithm": {"model_name": "m", "fsdp": {"reshard_after_forward": False}}})
    assert got.algorithm.fsdp_config() == FSDPConfig(reshard_after_forward=False)
    assert load_manifest({"algorithm": {"model_name": "m", "fsdp": "auto"}}).algorithm.fsdp_config() == "auto"


def test_fsdp_auto_without_a_launcher_is_let_through_to_train_on_one_device():
    """The algorithm trains fsdp: auto unsharded on one device without a launcher (it says so);
    the launch check refused it as if it sharded. A given FSDPConfig still needs torchrun."""
    from agilerl.train import check_launch

    check_launch(load_manifest({"algorithm": {"model_name": "tiny:qwen2", "fsdp": "auto"}}))
    with pytest.raises(ValueError, match="needs a process group"):
        check_launch(load_manifest({"algorithm": {"model_name": "tiny:qwen2", "fsdp": True}}))


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
    with pytest.raises(ManifestError, match=f"{tmp_path}: is a directory"):
        load_manifest(tmp_path)
    latin = tmp_path / "latin1.yaml"
    latin.write_bytes("algorithm:\n  model_name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ManifestError, match=f"{latin}: not UTF-8 text"):
        load_manifest(latin)
    for path, what in ((tmp_path, "is a directory"), (latin, "not UTF-8"), (tmp_path / ("x" * 300), "too long")):
        assert main([str(path)]) == 2
        err = capsys.readouterr().err
        assert what in err and str(path) in err and len(err.splitlines()) == 1 and "Traceback" not in err


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
    with pytest.raises(ValueError, match=r"do not split into 2 population member.*: launch 2 or 4 ranks in all"):
        pop.layout(3)  # two members of one or two trainers each (4 rows split over 1, 2 or 4)
    engines = TrainingSection(rollout_batch_size=6, population_size=2, rollout_engines_per_agent=1)
    with pytest.raises(ValueError, match=r"launch 6 or 8 ranks in all"):
        engines.layout(7)  # members of 2 (or 3) trainers and an engine each: 6 or 8 ranks
    with pytest.raises(ValueError, match=r"launch 2 or 4 ranks in all"):  # 2: four members share them
        TrainingSection(rollout_batch_size=4, population_size=4).layout(3)
    # a member given every rank shares them with the others (they train in turn)
    shared = TrainingSection(rollout_batch_size=4, population_size=2, training_gpus_per_agent=2).layout(2)
    assert shared.shared and shared.of(1) == (0, False, [0, 1], [])
    with pytest.raises(ValueError, match=r"multiple of the 3 trainer rank\(s\) per member: launch 2 or 4 ranks in all"):
        TrainingSection(rollout_batch_size=4).layout(3)
    # under tensor parallelism a member's trainers are whole groups, and the groups split the prompts
    one = TrainingSection(rollout_batch_size=1)
    assert one.layout(2, tp=2).trainers == 2  # one group of 2 takes the one prompt
    with pytest.raises(ValueError, match=r"multiple of the 2 trainer rank\(s\) per member: launch 1 ranks"):
        one.layout(2)
    with pytest.raises(ValueError, match=r"tp=2 must divide the 3 trainer rank\(s\) per member: launch 2 ranks"):
        one.layout(3, tp=2)
    with pytest.raises(
        ValueError, match=r"of the 2 data-parallel rank\(s\) of the 4 .* under tp=2: launch 2 or 6 ranks"
    ):
        TrainingSection(rollout_batch_size=3).layout(4, tp=2)  # groups of 2: 1 or 3 of them split 3 prompts
    assert TrainingSection(rollout_batch_size=3).layout(6, tp=2).trainers == 6
    with pytest.raises(ValueError, match=r"tp=2 must divide the 1 trainer rank\(s\) .*, or change algorithm.fsdp.tp$"):
        one.layout(1, tp=2)  # no batch makes one rank a group of 2
    given = TrainingSection(rollout_batch_size=3, training_gpus_per_agent=2)  # (a manifest refuses it first)
    with pytest.raises(ValueError, match=r"multiple of the 2 .*: change training.training_gpus_per_agent or rollout_b"):
        given.layout(2)


def test_the_manifest_launches_under_its_tensor_parallel_degree():
    """The manifest's layout takes its FSDPConfig's tp: one prompt on a tp=2 group of 2 ranks
    (which the launch check takes), and a given trainer count tp does not divide is refused."""
    from agilerl.manifest import load_manifest

    def manifest(tp: int, prompts: int, gpus: int | None = None):
        training = {"rollout_batch_size": prompts, **({"training_gpus_per_agent": gpus} if gpus else {})}
        return load_manifest({"algorithm": {"model_name": "m", "fsdp": {"tp": tp}}, "training": training})

    assert manifest(2, 1, 2).layout(2).trainers == 2
    assert manifest(2, 2).layout(4).trainers == 4  # two groups of 2, a prompt each
    with pytest.raises(ValueError, match=r"tp=2 must divide the 3 trainer rank\(s\) per member: launch 2 or 4 ranks"):
        manifest(2, 2).layout(3)
    with pytest.raises(ValueError, match=r"algorithm.fsdp.tp=2 must divide training_gpus_per_agent \(3\)"):
        manifest(2, 3, 3)
    with pytest.raises(
        ValueError, match=r"multiple of the 2 data-parallel rank\(s\) of training_gpus_per_agent \(4\) under tp=2"
    ):
        manifest(2, 3, 4)


def test_world_size_must_match_the_manifest(tmp_path, capsys, monkeypatch):
    data = {"algorithm": {"model_name": "tiny:qwen2"}, "training": {"training_gpus_per_agent": 2}}
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(data))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main([str(path)]) == 2
    assert "run `agilerl-train --nproc-per-node=2 ...`" in capsys.readouterr().err


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


@pytest.mark.timeout(300)
def test_the_demo_prints_only_its_own_lines(tmp_path):
    """As a user runs it, in a process of its own: no warning about a kernel package a LoRA run does
    not use (bitsandbytes), nor about PEFT's use of transformers (a FutureWarning), on either stream."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    run = subprocess.run(
        [sys.executable, "-m", "agilerl.train", str(SHIPPED[0]), "--device", "cpu", "--max-steps", "1"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env=env,
    )
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""
    assert "step    1" in run.stdout and "Warning" not in run.stdout and "kernels" not in run.stdout


def _refused_in_one_line(tmp_path, capsys, data: dict) -> str:
    """``python -m agilerl.train`` on ``data`` (a manifest): exit 2 and one line on stderr, returned."""
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main([str(path), "--device", "cpu"]) == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.err and "error:" in lines[0], out.err
    return lines[0]


TINY_RUN = {
    "algorithm": {"model_name": "tiny:qwen2?hidden_size=32&num_layers=2", "group_size": 2, "max_output_tokens": 2},
    "training": {"rollout_batch_size": 2, "max_steps": 1},
}


def test_a_checkpoint_dir_that_is_a_file_is_refused_before_training(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    for folder in (tmp_path / "file", tmp_path / "file" / "under"):
        data = {**TINY_RUN, "training": {**TINY_RUN["training"], "checkpoint_dir": str(folder)}}
        line = _refused_in_one_line(tmp_path, capsys, data)
        assert f"training.checkpoint_dir: {folder}" in line and "not a directory" in line


def test_a_population_that_cannot_fit_is_refused_before_building_it(tmp_path, capsys):
    from agilerl.train import _check_shared_population

    data = {**TINY_RUN, "training": {**TINY_RUN["training"], "population_size": 10**9}}
    assert "training.population_size=1000000000" in _refused_in_one_line(tmp_path, capsys, data)
    # the floor: each member's token embedding, vocab_size x hidden_size weights in the dtype
    config = {"vocab_size": 1000, "hidden_size": 10}
    _check_shared_population(members=50, config=config, dtype="bfloat16", memory_bytes=50 * 20_000)
    with pytest.raises(ValueError, match="50 x 40,000 bytes"):
        _check_shared_population(members=50, config=config, dtype="float32", memory_bytes=50 * 20_000)


def test_a_model_name_of_an_unknown_users_home_is_one_line(tmp_path, capsys):
    data = {**TINY_RUN, "algorithm": {**TINY_RUN["algorithm"], "model_name": "~no_such_user_agilerl/model"}}
    assert "~no_such_user_agilerl/model: no home directory" in _refused_in_one_line(tmp_path, capsys, data)


@pytest.mark.parametrize(
    "change,expect",
    [
        ({"rms_norm_eps": "x"}, "rms_norm_eps"),
        ({"rope_scaling": "yes"}, "rope_parameters"),  # transformers' name for it now
        ({"intermediate_size": [1, 2]}, "intermediate_size"),
        ({"model_type": "no_such_model_type"}, "no_such_model_type"),
    ],
    ids=lambda value: next(iter(value)) if isinstance(value, dict) else "",
)
def test_a_config_transformers_refuses_is_one_line_naming_the_file(tmp_path, capsys, change, expect):
    """check_config passes these; transformers' strict config validation would raise only once
    loading starts."""
    import json

    from tests._configs import TINY_LLAMA

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**TINY_LLAMA, **change}))
    data = {**TINY_RUN, "algorithm": {**TINY_RUN["algorithm"], "model_name": str(model)}}
    line = _refused_in_one_line(tmp_path, capsys, data)
    assert f"{model / 'config.json'}: " in line and expect in line


def test_a_model_directory_without_a_tokenizer_is_refused_as_such(tmp_path, capsys):
    """A config.json with no tokenizer files beside it: transformers blamed a missing sentencepiece
    or tiktoken install; the line names what is missing."""
    from agilerl.utils.tiny import tiny_config

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(tiny_config("qwen2", hidden_size=32, num_layers=2).to_json_string())
    data = {**TINY_RUN, "algorithm": {**TINY_RUN["algorithm"], "model_name": str(folder)}}
    line = _refused_in_one_line(tmp_path, capsys, data)
    assert f"{folder}: the model directory has no tokenizer" in line
