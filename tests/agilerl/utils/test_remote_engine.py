"""agilerl.utils.remote_engine.HFGenerateEngine, as an engine rank of agilerl.train builds it."""

from __future__ import annotations

import torch

from agilerl.utils.tiny import save_tiny_model

SIZES = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


def test_the_engine_samples_from_the_policy_not_the_checkpoints_shipped_sampling_settings(tmp_path):
    """A checkpoint's generation_config.json (Qwen2.5-Instruct ships repetition_penalty 1.05,
    top_k 20, top_p 0.8) must not reshape what an engine rank samples: the trainers score the
    completions as samples of the policy at its temperature, as their own generate does."""
    from agilerl.utils.remote_engine import HFGenerateEngine

    save_tiny_model(tmp_path / "model", "qwen2", **SIZES)
    engine = HFGenerateEngine(str(tmp_path / "model"), dtype="float32")
    prompts = [[5, 6, 7, 5, 6], [7, 6, 5, 7, 6]] * 2
    plain = engine.generate(prompts, max_tokens=12, temperature=1.0, seed=3)
    shipped = engine.model.generation_config
    shipped.repetition_penalty, shipped.no_repeat_ngram_size, shipped.min_p = 1e6, 1, 0.5
    assert engine.generate(prompts, max_tokens=12, temperature=1.0, seed=3) == plain
    assert engine.model.generation_config is shipped  # put back as it was
    # the settings do reach a generate that is not neutralised: the comparison can fail
    torch.manual_seed(3)
    ids = torch.tensor(prompts)
    raw = engine.model.generate(input_ids=ids, max_new_tokens=12, do_sample=True, top_k=0, top_p=1.0)
    assert raw[:, 5:].tolist() != plain


def test_an_engine_rank_loads_the_manifests_dtype_and_attention(monkeypatch):
    """agilerl.train's engine rank builds its engine with the manifest's dtype and attention, so
    it runs the kernel the trainers run and the planner counts."""
    import agilerl.train as train
    import agilerl.utils.remote_engine as remote_engine
    from agilerl.manifest import load_manifest

    built: dict = {}

    class Recording:
        def __init__(self, source, **kwargs):
            built.update(kwargs, source=source)

    monkeypatch.setattr(remote_engine, "HFGenerateEngine", Recording)
    monkeypatch.setattr(remote_engine, "serve_rollout_engine", lambda engine, ranks: 0)
    manifest = load_manifest(
        {
            "algorithm": {"model_name": "m", "dtype": "float32", "attn_implementation": "eager"},
            "training": {"rollout_batch_size": 2, "training_gpus_per_agent": 1, "rollout_engines_per_agent": 1},
        }
    )
    tokenizer = type("Tokenizer", (), {"pad_token_id": 0})()
    ranks = type("Ranks", (), {"engines": (1,)})()
    assert train._serve(ranks, manifest.algorithm, "/some/model", tokenizer, "cpu") == []
    assert built["source"] == "/some/model"
    assert (built["dtype"], built["attn_implementation"]) == ("float32", "eager")
