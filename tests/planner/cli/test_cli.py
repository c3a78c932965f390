"""agilerl-plan MODEL: outputs, the manifest it writes, bad input, and the no-torch fast path."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from agilerl.manifest import load_manifest
from planner.cli import main


def run(args, capsys):
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_table_for_a_catalog_model(capsys):
    code, out, _ = run(["Qwen/Qwen2.5-7B", "--gpus", "8", "--gpu", "H100-80GB"], capsys)
    assert code == 0
    assert "FITS" in out and "why:" in out and "FSDPConfig" in out
    for phase in ("load", "rollout", "reference", "learn", "step"):
        assert phase in out


def test_json_has_the_shared_names_and_a_valid_manifest(capsys):
    code, out, _ = run(["llama-3.1-70b", "--gpus", "8", "--format", "json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["fits"] and data["fsdp_config"] is not None
    assert data["peak_bytes"] == max(p["total"] for p in data["phases"].values())
    assert {d["field"] for d in data["decisions"]} >= {"sharding", "micro_batch_size_per_gpu", "reshard_after_forward"}
    manifest = load_manifest(data["manifest"])
    assert manifest.training.training_gpus_per_agent == 8
    assert manifest.algorithm.fsdp_config().model_dump(mode="json") == data["fsdp_config"]


def test_yaml_and_output_file_are_loadable_manifests(tmp_path, capsys):
    path = tmp_path / "plan.yaml"
    code, out, _ = run(
        [
            "Qwen/Qwen2.5-72B",
            "--gpus",
            "16",
            "--gpus-per-node",
            "8",
            "--format",
            "yaml",
            "--output",
            str(path),
            "--completion-tokens",
            "512",
        ],
        capsys,
    )
    assert code == 0
    assert path.read_text() == out
    assert out.startswith("# agilerl-plan: Qwen/Qwen2.5-72B on 16 x H100-80GB")
    # two nodes of 8: the launch line says so
    assert "# run: agilerl-train --nproc-per-node=8 --nnodes=2 --rdzv-endpoint=<first node>:29500 <this file>" in out
    manifest = load_manifest(yaml.safe_load(out))
    assert manifest.algorithm.max_output_tokens == 512 and manifest.training.training_gpus_per_agent == 16
    assert load_manifest(path) == manifest


def test_python_snippet(capsys):
    code, out, _ = run(["qwen2.5-7b", "--gpus", "1", "--format", "python"], capsys)
    assert code == 0 and "GRPO(" in out and "fsdp_config = None" in out
    compile(out.replace("tokenizer.", "tok_"), "<snippet>", "exec")


def test_nothing_fits_says_what_would(capsys):
    code, out, _ = run(["meta-llama/Llama-3.1-70B", "--gpus", "1", "--gpu", "L4"], capsys)
    assert code == 3
    assert "DOES NOT FIT" in out and "what would fit:" in out
    assert "use " in out and "GPUs" in out


def test_not_a_config(tmp_path, capsys):
    not_config = tmp_path / "other.json"
    not_config.write_text("{}")
    code, _, err = run([str(not_config)], capsys)
    assert code == 2 and "no model_type" in err


def test_a_config_json_plans_and_is_cached(tmp_path, capsys):
    from agilerl.utils.tiny import tiny_config

    config = tiny_config("llama", hidden_size=64, num_layers=2).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, out, _ = run([str(tmp_path), "--gpus", "1", "--format", "json"], capsys)
    assert code == 0 and json.loads(out)["model"] == str(tmp_path)
    # Second run: the cached spec, without importing torch.
    code = (
        "import sys; from planner.cli import main; rc = main([sys.argv[1], '--format', 'json']); "
        "print('torch' in sys.modules); raise SystemExit(rc)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_fixed_fields_are_respected(capsys):
    code, out, _ = run(
        [
            "llama-3.1-70b",
            "--gpus",
            "8",
            "--format",
            "json",
            "--reshard-after-forward",
            "true",
            "--wrap-every-n-blocks",
            "1",
            "--micro-batch-size-per-gpu",
            "2",
        ],
        capsys,
    )
    data = json.loads(out)
    assert data["fsdp_config"]["reshard_after_forward"] is True
    assert data["fsdp_config"]["wrap_every_n_blocks"] == 1
    assert data["workload"]["micro_batch_size_per_gpu"] == 2


def test_a_raised_default_prompts_per_step_is_said_not_silent(capsys):
    code, out, _ = run(["qwen2.5-7b", "--gpus", "16", "--format", "json"], capsys)
    assert code in (0, 3)
    decisions = {d["field"]: d for d in json.loads(out)["decisions"]}
    assert decisions["prompts_per_step"]["value"] == 16
    assert "raised to a multiple of the 16 GPUs" in decisions["prompts_per_step"]["reason"]
    code, out, _ = run(["qwen2.5-7b", "--gpus", "16", "--prompts-per-step", "32", "--format", "json"], capsys)
    assert "prompts_per_step" not in {d["field"] for d in json.loads(out)["decisions"]}


def test_every_algorithm_and_full_finetuning_plan_to_a_manifest_the_trainer_reads(capsys):
    import inspect

    import agilerl.algorithms
    from planner.workload import ALGORITHM_CLASSES

    for algorithm, cls in ALGORITHM_CLASSES.items():
        for full in ([], ["--full-finetune"]):
            code, out, err = run(
                ["Qwen/Qwen2.5-1.5B", "--gpus", "4", "--algorithm", algorithm, *full, "--format", "json"], capsys
            )
            assert code == 0, (algorithm, full, err)
            data = json.loads(out)
            manifest = load_manifest(data["manifest"])
            assert manifest.algorithm.name == cls
            assert (manifest.lora is None) == bool(full)
            # a manifest written out and read back keeps full fine-tuning (lora: null)
            assert (load_manifest(yaml.safe_load(manifest.to_yaml())).lora is None) == bool(full)
            phases = set(data["phases"])
            assert ("rollout" in phases) == (algorithm not in ("sft", "dpo")), (algorithm, phases)
            assert ("reference" in phases) == (algorithm not in ("sft", "cispo", "gspo")), (algorithm, phases)
            components = {c for p in data["phases"].values() for c in p["components"]}
            assert ("reference_weights" in components) == (bool(full) and "reference" in phases)
            assert ("lora" in components) == (not full)
            # every field the manifest's algorithm section sets is an argument of the class it names
            section = {k for k, v in data["manifest"]["algorithm"].items()} - {"name", "model_name", "fsdp", "vllm"}
            params = set(inspect.signature(getattr(agilerl.algorithms, cls)).parameters)
            params |= set(inspect.signature(agilerl.algorithms.GRPO).parameters) if cls not in ("SFT", "DPO") else set()
            assert section <= params | {"dtype"}, (cls, section - params)
    code, out, _ = run(
        ["Qwen/Qwen2.5-1.5B", "--gpus", "4", "--algorithm", "dpo", "--full-finetune", "false", "--format", "json"],
        capsys,
    )
    assert code == 0 and load_manifest(json.loads(out)["manifest"]).lora is not None
    # 8 pairs over 16 GPUs would split pairs: one line, exit 2
    code, out, err = run(["Qwen/Qwen2.5-1.5B", "--gpus", "16", "--algorithm", "dpo", "--prompts-per-step", "8"], capsys)
    assert code == 2 and "8 preference pairs do not split over 16 ranks" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_reader_that_goes_away_gets_no_traceback():
    """``agilerl-plan ... | head -1``: the pipe closes before the plan is printed."""
    code = "import sys; from planner.cli import main; raise SystemExit(main(['Qwen/Qwen2.5-7B', '--gpus', '8']))"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the reader is gone before the planner has written anything
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and err == "", err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_an_output_that_cannot_be_written_is_one_line_and_exit_2():
    """``agilerl-plan ... > /dev/full``: every write fails with ENOSPC."""
    code = "import sys; from planner.cli import main; raise SystemExit(main(['Qwen/Qwen2.5-7B', '--format', 'json']))"
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-c", code], stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == "agilerl-plan: error: cannot write the output (standard output): No space left on device\n"


def _tiny_config_dir(path):
    from agilerl.utils.tiny import tiny_config

    path.mkdir()
    (path / "config.json").write_text(json.dumps(tiny_config("llama", hidden_size=64, num_layers=2).to_dict()))
    return path


def test_a_config_shared_by_two_checkpoints_plans_each_under_its_own_name(tmp_path, capsys, monkeypatch):
    """A fine-tune shares its base's config.json: the cached spec must not name the other one."""
    monkeypatch.setenv("AGILERL_CACHE", str(tmp_path / "cache"))
    for name in ("base", "finetune"):
        model = _tiny_config_dir(tmp_path / name)
        code, out, _ = run([str(model), "--format", "yaml"], capsys)
        assert code == 0
        assert yaml.safe_load(out)["algorithm"]["model_name"] == str(model)
        assert out.startswith(f"# agilerl-plan: {model} on")


def test_the_spec_cache_is_only_a_cache(tmp_path, capsys, monkeypatch):
    """A cache folder that cannot be written, or a corrupt entry, costs a rebuild, not the plan."""
    model = _tiny_config_dir(tmp_path / "model")
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("AGILERL_CACHE", str(tmp_path / "a-file"))
    code, out, err = run([str(model), "--format", "json"], capsys)
    assert code == 0 and json.loads(out)["model"] == str(model), err
    monkeypatch.setenv("AGILERL_CACHE", str(tmp_path / "cache"))
    assert run([str(model), "--format", "json"], capsys)[0] == 0
    (entry,) = (tmp_path / "cache" / "specs").glob("*.json")
    entry.write_text("{not json")
    code, out, err = run([str(model), "--format", "json"], capsys)
    assert code == 0 and json.loads(out)["model"] == str(model), err


def test_output_follows_a_symlink_and_writes_into_a_pipe(tmp_path, capsys):
    import os
    import threading

    target = tmp_path / "real" / "plan.yaml"
    target.parent.mkdir()
    target.write_text("old\n")
    link = tmp_path / "link.yaml"
    link.symlink_to(target)
    code, out, _ = run(["Qwen/Qwen2.5-0.5B", "--output", str(link)], capsys)
    assert code == 0 and link.is_symlink()  # the link stays; its target has the manifest
    assert target.read_text().startswith("# agilerl-plan: Qwen/Qwen2.5-0.5B")

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    code, _, _ = run(["Qwen/Qwen2.5-0.5B", "--output", str(fifo)], capsys)
    reader.join(timeout=60)
    assert code == 0 and fifo.is_fifo()  # written into, not renamed over
    assert got and got[0].startswith("# agilerl-plan: Qwen/Qwen2.5-0.5B")


def test_output_with_the_longest_name_its_folder_allows_is_written(tmp_path, capsys):
    """The temporary file beside it had a longer name than the manifest's own: a 255-byte name
    passed every check, printed the plan, and then failed to write."""
    target = tmp_path / ("x" * 250 + ".yaml")
    code, _, err = run(["Qwen/Qwen2.5-0.5B", "--output", str(target)], capsys)
    assert code == 0, err
    assert target.read_text().startswith("# agilerl-plan: Qwen/Qwen2.5-0.5B")
    assert [p.name for p in tmp_path.iterdir()] == [target.name]  # no temporary file left


def test_a_model_path_with_a_line_break_stays_in_its_comment(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("AGILERL_CACHE", str(tmp_path / "cache"))
    model = _tiny_config_dir(tmp_path / "odd\nname")
    code, out, _ = run([str(model), "--format", "yaml"], capsys)
    assert code == 0
    assert set(yaml.safe_load(out)) == {"algorithm", "training", "lora"}  # nothing injected
    assert load_manifest(yaml.safe_load(out)).algorithm.model_name == str(model)


@pytest.mark.parametrize(
    "content, reason",
    [
        ("[]", "got a list"),
        ('{"allocator_slack_fraction": -5}', "allocator_slack_fraction = -5.0"),
        ('{"vllm_sleep_residual_bytes": NaN}', "vllm_sleep_residual_bytes"),
        ('{"nccl_bytes": 1,\n', "Expecting"),
        (None, "Is a directory"),
    ],
)
def test_a_calibration_that_cannot_be_read_is_one_line_naming_it(tmp_path, monkeypatch, capsys, content, reason):
    """The user's calibration wins over the shipped coefficients: one that is not a JSON object of
    finite, non-negative numbers stops the plan in one line that names the file (it used to end in
    a traceback, or to plan with a negative allocator slack)."""
    monkeypatch.setenv("AGILERL_CACHE", str(tmp_path))
    path = tmp_path / "calibration" / "H100-80GB.json"
    path.parent.mkdir()
    if content is None:
        path.mkdir()
    else:
        path.write_text(content)
    code, out, err = run(["Qwen/Qwen2.5-0.5B"], capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and str(path) in err and reason in err, err


def test_a_config_json_is_trained_from_the_folder_that_holds_it(tmp_path, capsys, monkeypatch):
    """The planner plans a config.json file; the trainer loads model directories: the manifest
    names the folder (it named the file, which the trainer then refused as missing)."""
    from agilerl.utils.sources import check_model_source

    monkeypatch.setenv("AGILERL_CACHE", str(tmp_path / "cache"))
    model = _tiny_config_dir(tmp_path / "model")
    code, _, err = run([str(model / "config.json"), "--output", str(tmp_path / "m.yaml")], capsys)
    assert code == 0, err
    manifest = load_manifest(tmp_path / "m.yaml")
    assert manifest.algorithm.model_name == str(model)
    assert check_model_source(manifest.algorithm.model_name, allow_download=False)["hidden_size"] == 64


def test_version_names_the_installed_package(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"agilerl-plan {version('agilerl-fsdp-planner')}\n"
