"""planner.emit's Python snippet builds the agent `python -m agilerl.train` builds from the same
plan's manifest: the snippet is run with the algorithm class swapped for one that records its
arguments, and agilerl.train's own _train is run on the manifest up to the population it would
create."""

from __future__ import annotations

import ast
import inspect
import json
import re
from types import SimpleNamespace

import pytest
import yaml

from agilerl.manifest import load_manifest
from planner.cli import main

#: One tokenizer object for both sides: the trainer and the snippet each load "the" tokenizer.
TOKENIZER = SimpleNamespace(pad_token="<pad>", pad_token_id=0, eos_token="</s>")
#: Constructor arguments of the trainer's that are not the plan's: the manifest's training.seed
#: default (0) is a run's choice, which the snippet leaves to its user.
NOT_PLANNED = {"seed"}

PLANS = {
    "qlora, rank 64 on two targets": [
        "Qwen/Qwen2.5-7B",
        "--gpus",
        "8",
        "--lora-rank",
        "64",
        "--lora-alpha",
        "128",
        "--lora-targets",
        "q_proj,v_proj",
        "--load-in-4bit",
        "--update-epochs",
        "2",
        "--weights-dtype",
        "float16",
        "--temperature",
        "0.7",
    ],
    "vllm with a reference adapter": [
        "Qwen/Qwen2.5-7B",
        "--gpus",
        "8",
        "--generation",
        "vllm",
        "--use-separate-reference-adapter",
        "true",
    ],
    "vllm, weights offloaded during rollouts": [
        "Qwen/Qwen2.5-7B",
        "--generation",
        "vllm",
        "--offload-weights-during-rollout",
        "true",
    ],
    "full fine-tuning": ["Qwen/Qwen2.5-7B", "--gpus", "2", "--full-finetune"],
    "eager attention": ["Qwen/Qwen2.5-7B", "--attn-implementation", "eager"],
    "fsdp on 8 gpus": ["llama-3.1-70b", "--gpus", "8"],
    "two nodes": ["Qwen/Qwen2.5-72B", "--gpus", "16", "--gpus-per-node", "8"],
    "dpo": ["Qwen/Qwen2.5-7B", "--gpus", "2", "--algorithm", "dpo"],
    "sft": ["Qwen/Qwen2.5-7B", "--gpus", "2", "--algorithm", "sft"],
    "ppo": ["Qwen/Qwen2.5-7B", "--gpus", "2", "--algorithm", "ppo"],
    "does not fit": ["meta-llama/Llama-3.1-70B", "--gpus", "1", "--gpu", "L4"],
}


class _Built(Exception):
    """Raised where the trainer would build its population: its arguments are recorded."""


def _emit(args: list[str], fmt: str, capsys) -> tuple[int, str]:
    code = main([*args, "--format", fmt])
    return code, capsys.readouterr().out


def _trainer_arguments(manifest, monkeypatch) -> tuple[str, dict]:
    """The class and arguments agilerl.train._train builds its agents with, for ``manifest`` on
    its training_gpus_per_agent ranks (the launch checks, the process group and the tokenizer
    stubbed)."""
    import agilerl.algorithms.core.loading as loading
    import agilerl.distributed as distributed
    import agilerl.train as train
    import agilerl.utils.utils as utils

    monkeypatch.setattr(train, "check_launch", lambda *args, **kwargs: None)
    monkeypatch.setattr(distributed, "init_distributed", lambda *args, **kwargs: None)
    monkeypatch.setattr(distributed, "get_world_size", lambda: manifest.training.training_gpus_per_agent)
    monkeypatch.setattr(distributed, "get_rank", lambda: 0)
    monkeypatch.setattr(loading, "resolve_model_source", lambda name: name)
    monkeypatch.setattr(loading, "load_tokenizer", lambda source: TOKENIZER)
    built = {}

    def create_population(algo, hp, population_size=1, *, algo_kwargs, device=None):
        built.update(cls=algo, kwargs=algo_kwargs)
        raise _Built

    monkeypatch.setattr(utils, "create_population", create_population)
    with pytest.raises(_Built):
        train._train(manifest, device="cpu", max_steps=1)
    return built["cls"], built["kwargs"]


def _snippet_arguments(snippet: str, cls: str, monkeypatch) -> dict:
    """Run ``snippet`` with ``agilerl.algorithms.<cls>`` recording its arguments (the tokenizer
    loader stubbed as for the trainer)."""
    import agilerl.algorithms
    import agilerl.algorithms.core.loading as loading

    monkeypatch.setattr(loading, "load_tokenizer", lambda source: TOKENIZER)
    calls = []
    monkeypatch.setattr(agilerl.algorithms, cls, lambda **kwargs: calls.append(kwargs))
    exec(compile(snippet, "<snippet>", "exec"), {})
    assert len(calls) == 1
    return calls[0]


def _default(cls: type, name: str):
    """The default the class (or the base its ``**kwargs`` reach) gives argument ``name``."""
    for klass in cls.__mro__:
        parameter = inspect.signature(klass.__init__).parameters.get(name)
        if parameter is not None and parameter.default is not inspect.Parameter.empty:
            return parameter.default
    raise AssertionError(f"{cls.__name__} takes no {name}")


@pytest.mark.parametrize("args", PLANS.values(), ids=PLANS.keys())
def test_the_snippet_builds_what_the_trainer_builds_from_the_manifest(args, capsys, monkeypatch):
    import agilerl.algorithms

    code, snippet = _emit(args, "python", capsys)
    same_code, manifest_text = _emit(args, "yaml", capsys)
    assert code == same_code
    cls, trainer = _trainer_arguments(load_manifest(yaml.safe_load(manifest_text)), monkeypatch)
    algorithm = getattr(agilerl.algorithms, cls)  # the real class, before the snippet's stand-in
    ours = _snippet_arguments(snippet, cls, monkeypatch)
    assert set(ours) <= set(trainer), f"the trainer passes no {sorted(set(ours) - set(trainer))}"
    assert ours == {k: trainer[k] for k in ours}
    left = {k: v for k, v in trainer.items() if k not in ours and k not in NOT_PLANNED}
    assert left == {k: _default(algorithm, k) for k in left}, "the snippet leaves these to other defaults"


def test_what_the_qlora_plan_spells_out(capsys, monkeypatch):
    code, snippet = _emit(PLANS["qlora, rank 64 on two targets"], "python", capsys)
    assert code == 0
    ours = _snippet_arguments(snippet, "GRPO", monkeypatch)
    lora = ours["lora_config"]
    assert (lora.r, lora.lora_alpha, set(lora.target_modules)) == (64, 128, {"q_proj", "v_proj"})
    assert ours["load_in_4bit"] is True and ours["dtype"] == "float16" and ours["update_epochs"] == 2
    assert ours["temperature"] == 0.7


def test_a_multimodal_checkpoints_manifest_says_the_trainer_loads_its_exported_text_model(capsys):
    code, manifest = _emit(["google/gemma-3-27b-it", "--gpus", "4"], "yaml", capsys)
    assert code == 0
    notes = [line for line in manifest.splitlines() if line.startswith("# note: ")]
    assert len(notes) == 1 and "the text model of Gemma3ForConditionalGeneration" in notes[0]
    assert "python -m agilerl.utils.text_model SOURCE OUT_DIR" in notes[0]
    code, manifest = _emit(["Qwen/Qwen2.5-7B", "--gpus", "4"], "yaml", capsys)
    assert "# note: " not in manifest  # a text model's manifest runs as written


@pytest.mark.parametrize("args", PLANS.values(), ids=PLANS.keys())
def test_the_snippet_says_whether_it_fits_and_imports_only_what_it_uses(args, capsys):
    code, snippet = _emit(args, "python", capsys)
    assert ("DOES NOT FIT" in snippet) == (code == 3)
    tree = ast.parse(snippet)
    imported = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for a in node.names}
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    assert imported <= used, f"unused imports {sorted(imported - used)}"


@pytest.mark.parametrize(
    "plan, field, value",
    [
        # the rollout phase was planned with the trainer's weights on the host
        ("vllm, weights offloaded during rollouts", "offload_weights_during_rollout", True),
        # the learn phase was planned holding eager attention's scores, and the default with SDPA's
        ("eager attention", "attn_implementation", "eager"),
        ("fsdp on 8 gpus", "attn_implementation", "sdpa"),
    ],
)
def test_the_manifest_keeps_what_the_plan_modelled(plan, field, value, capsys, monkeypatch):
    """The run must do what the estimate assumed: the manifest says it, and the trainer is built so."""
    code, text = _emit(PLANS[plan], "yaml", capsys)
    assert code == 0
    manifest = load_manifest(yaml.safe_load(text))
    assert getattr(manifest.algorithm, field) == value
    _, trainer = _trainer_arguments(manifest, monkeypatch)
    assert trainer[field] == value


def test_the_manifest_keeps_the_planned_lora_dropout(capsys, monkeypatch):
    """Dropout's saved masks were planned at the rate asked for: the run drops at that rate."""
    code, text = _emit(["Qwen/Qwen2.5-7B", "--lora-dropout", "0.1"], "yaml", capsys)
    assert code == 0
    manifest = load_manifest(yaml.safe_load(text))
    assert manifest.lora.dropout == 0.1
    _, trainer = _trainer_arguments(manifest, monkeypatch)
    assert trainer["lora_config"].lora_dropout == 0.1


@pytest.mark.parametrize(
    "gpus, per_node, engines, nproc",
    [(["--gpus", "2"], 2, 1, 3), (["--gpus", "16", "--gpus-per-node", "8"], 8, 2, 9)],
    ids=["one node", "two nodes"],
)
def test_a_rollout_planned_off_the_trainer_gpus_gets_engine_ranks_of_its_own(gpus, per_node, engines, nproc, capsys):
    """generation='none' plans nothing generating on the trainer GPUs: the manifest puts the
    rollout on engine ranks of their own (one more GPU per node), where it had the trainers run
    Hugging Face generate, and says what each engine rank's GPU holds: the step's 16 x 8
    completions split over the nodes."""
    code, text = _emit(["Qwen/Qwen2.5-7B", *gpus, "--generation", "none", "--prompts-per-step", "16"], "yaml", capsys)
    assert code == 0
    manifest = load_manifest(yaml.safe_load(text))
    assert manifest.training.rollout_engines_per_agent == engines
    assert f"# run: agilerl-train --nproc-per-node={nproc} " in text
    assert "# an engine rank's estimated peak: " in text
    assert f"(fits), the whole model and Hugging Face generate's cache of {16 * 8 // engines} completions" in text
    code, report = _emit(["Qwen/Qwen2.5-7B", *gpus, "--generation", "none", "--prompts-per-step", "16"], "json", capsys)
    engine = json.loads(report)["engine_rank"]
    assert (engine["count"], engine["completions"]) == (engines, 16 * 8 // engines)
    assert engine["components"]["weights"] == 7_615_616_512 * 2  # Qwen2.5-7B's 7.62B parameters, whole, in bf16
    assert engine["total"] < 80 * 10**9
    layout = manifest.training.layout(nproc * engines)  # the launch the line gives: every node's ranks
    assert (layout.trainers, layout.engines) == (per_node * engines, engines)
    code, sft = _emit(["Qwen/Qwen2.5-7B", *gpus, "--algorithm", "sft"], "yaml", capsys)
    assert load_manifest(yaml.safe_load(sft)).training.rollout_engines_per_agent == 0
    assert f"--nproc-per-node={per_node} " in sft and "engine rank" not in sft


def test_the_host_memory_given_is_judged_in_every_output(capsys):
    """--host-memory: the table, JSON, manifest and exit status judge the busiest node's host
    against it (a 70B full fine-tune whose Adam state and saved checkpoint wait on the host);
    without it the table says the host is not judged."""
    run = ["meta-llama/Llama-3.1-70B", "--full-finetune", "--gpus", "16", "--gpus-per-node", "8"]
    code, free = _emit(run, "table", capsys)
    assert code == 0 and "GiB (host memory not given: not judged)" in free
    code, text = _emit([*run, "--host-memory", "1024"], "table", capsys)
    assert code == 3
    # under the headline, with the phase: rank 0's gathered checkpoint beside the ranks' Adam state
    over = "GiB of host memory on a node in phase save (rank 0 gathers the checkpoint), over the 972.80 GiB"
    assert over in text.splitlines()[2]
    assert "GiB of 1024.00 GiB (over the limit; the margin leaves 972.80)" in text
    assert "  - give each node at least " in text
    code, report = _emit([*run, "--host-memory", "1024"], "json", capsys)
    plan = json.loads(report)
    assert code == 3 and not plan["fits"]
    assert plan["cluster"]["host_memory_per_node_bytes"] == 1024 * 2**30
    assert plan["host_peak_bytes_per_node"] > plan["host_limit_bytes_per_node"] > 0.95 * 1024 * 2**30 - 2
    assert plan["host_peak_phase"] == "save"
    # what is over, for scripts: the host alone (its GPUs fit), need and limit as above
    assert plan["over"] == [
        {
            "what": "host",
            "need_bytes": plan["host_peak_bytes_per_node"],
            "limit_bytes": plan["host_limit_bytes_per_node"],
            "phase": "save",
        }
    ]
    assert plan["host_fits"] is False
    for host, fits in (("4096", True), (None, None)):
        _, report = _emit(run + (["--host-memory", host] if host else []), "json", capsys)
        assert json.loads(report)["host_fits"] is fits
    code, yaml_text = _emit([*run, "--host-memory", "4096"], "yaml", capsys)
    assert code == 0 and "GiB of 4096.00 GiB (fits; the margin leaves 3891.20)" in yaml_text
    code, yaml_text = _emit([*run, "--host-memory", "1024"], "yaml", capsys)  # the GPUs fit, the host does not
    assert code == 3 and yaml_text.splitlines()[1].endswith("DOES NOT FIT (the GPUs fit; a node's host does not)")
    assert yaml_text.splitlines()[2].startswith("# host per trainer rank ")


def test_the_table_says_how_the_gpus_sit_on_nodes(capsys):
    """Several nodes: GPUs per node. Part of one node (--gpus-per-node above --gpus, accepted as a
    node partly used): which part, so the reader sees the host figure is those GPUs' ranks'."""
    heads = {}
    for gpus in (["--gpus", "8", "--gpus-per-node", "16"], ["--gpus", "16", "--gpus-per-node", "8"], ["--gpus", "8"]):
        code, text = _emit(["Qwen/Qwen2.5-7B", *gpus], "table", capsys)
        assert code == 0
        heads[" ".join(gpus)] = text.splitlines()[0]
    assert heads["--gpus 8 --gpus-per-node 16"].endswith("(79.2 GiB, 8 of a node's 16): FITS")
    assert heads["--gpus 16 --gpus-per-node 8"].endswith("(79.2 GiB, 8 per node): FITS")
    assert heads["--gpus 8"].endswith("x H100-80GB (79.2 GiB): FITS")


def test_a_small_gpus_figures_are_in_mib_in_the_reasons_as_in_the_table(capsys):
    """A 0.5 GiB device (a CPU probe's budget): the table says MiB, and so do its reasons and its
    verdict (they said 0.74 GiB of 0.48 GiB), each figure the table's."""
    code, out = _emit(["tiny:llama", "--gpu-memory", "0.5"], "table", capsys)
    assert code == 3, out  # does not fit
    peak = re.search(r"^peak ([\d.]+) MiB per GPU in phase (\w+)", out, re.M)
    assert peak, out
    fits = re.search(
        r"fits = False: the most frugal settings need ([\d.]+) MiB per GPU in phase (\w+), over the 486.40 MiB", out
    )
    assert fits, out
    assert (fits[1], fits[2]) == (peak[1], peak[2])
    assert "GiB per GPU" not in out


def test_a_small_hosts_figures_are_in_mib_in_the_table_the_reasons_and_the_manifest(capsys):
    """A 1 GiB host: the host line, the reasons and the manifest's header speak its figures in
    MiB, each the same figure (the host line said GiB under reasons in MiB). A host not given
    keeps GiB."""
    args = ["tiny:llama", "--gpu-memory", "2", "--host-memory", "1"]
    _, out = _emit(args, "table", capsys)
    host = re.search(r"^host per trainer rank [\d.]+ MiB \(rank 0's\), per node ([\d.]+) MiB of 1024.00 MiB", out, re.M)
    assert host, out
    reason = re.search(r"fits = False: the most frugal settings need ([\d.]+) MiB of host memory on a node", out)
    assert reason and reason[1] == host[1], out
    _, manifest = _emit(args, "yaml", capsys)
    header = [line for line in manifest.splitlines() if line.startswith("# ")][:3]
    assert re.fullmatch(r"# estimated peak [\d.]+ MiB per GPU \(phase \w+\) of 2048.00 MiB; .*", header[1]), header
    assert header[2].startswith("# host per trainer rank ") and f"per node {host[1]} MiB of 1024.00 MiB" in header[2]
    _, roomy = _emit(["tiny:llama", "--gpu-memory", "2"], "table", capsys)
    assert re.search(
        r"^host per trainer rank [\d.]+ GiB \(rank 0's\), per node [\d.]+ GiB \(host memory not given", roomy, re.M
    )
