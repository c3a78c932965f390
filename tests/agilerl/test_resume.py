"""Training resumes: periodic atomic checkpoints, a restart from the newest complete one, the same result.

An interrupted run restarted from its last checkpoint must end with exactly the
adapters of an uninterrupted run with the same seed: adapters, optimizer state,
step, every rank's RNG states and the data position all come back.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from agilerl.manifest import load_manifest
from agilerl.train import STEP_PREFIX, train
from agilerl.utils.arithmetic_env import ArithmeticEnv

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny:qwen2?hidden_size=32&intermediate_size=64&num_layers=2"


def _manifest(checkpoint_dir: Path, *, max_steps: int, interval: int = 2, fsdp=False, gpus: int = 1) -> dict:
    return {
        "algorithm": {
            "name": "GRPO",
            "model_name": MODEL,
            "group_size": 2,
            "max_output_tokens": 3,
            "lr": 0.01,
            "dtype": "float32",
            "gradient_checkpointing": False,
            "logprob_chunk_size": 16,
            "fsdp": fsdp,
        },
        "training": {
            "rollout_batch_size": 2,
            "training_gpus_per_agent": gpus,
            "max_steps": max_steps,
            "seed": 3,
            "log_every": 1,
            "checkpoint_dir": str(checkpoint_dir),
            "checkpoint_interval": interval,
        },
        "lora": {"r": 4, "alpha": 8, "dropout": 0.1},  # dropout: the RNG must come back too
    }


def _adapters(folder: Path) -> dict[str, torch.Tensor]:
    payload = torch.load(folder / "agent0" / "attributes.pt", map_location="cpu", weights_only=False)
    assert payload["adapters"]["actor"], "no adapter weights saved"
    return payload["adapters"]["actor"], payload


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    worst = max((x - b[k]).abs().max().item() for k, x in a.items())
    assert worst <= 1e-6, f"adapters differ by {worst:g}"


@pytest.fixture(autouse=True)
def _single_device(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.timeout(300)
def test_one_device_run_interrupted_and_restarted_ends_as_the_uninterrupted_one(tmp_path, monkeypatch):
    whole = tmp_path / "whole"
    train(load_manifest(_manifest(whole, max_steps=5)), device="cpu")
    reference, payload = _adapters(whole)
    assert payload["steps"] == 5
    assert sorted(p.name for p in (whole / "agent0").glob(f"{STEP_PREFIX}*")) == ["step-00000002", "step-00000004"]

    # The run dies in step 5's rollout (after step 4's checkpoint), as a crash would.
    broken = tmp_path / "broken"
    calls = {"n": 0}
    sample = ArithmeticEnv.sample

    def dying_sample(self, n):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("simulated crash")
        return sample(self, n)

    monkeypatch.setattr(ArithmeticEnv, "sample", dying_sample)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(load_manifest(_manifest(broken, max_steps=5)), device="cpu")
    monkeypatch.setattr(ArithmeticEnv, "sample", sample)
    assert not (broken / "agent0" / "attributes.pt").exists()
    # A torn newest checkpoint (as a kill mid-write without the atomic rename would leave) is skipped.
    torn = broken / "agent0" / "step-00000004" / "attributes.pt"
    torn.write_bytes(torn.read_bytes()[:100])
    history = train(load_manifest(_manifest(broken, max_steps=5)), device="cpu")
    assert len(history[0]) == 5  # steps 1-2 from the checkpoint's history, 3-5 run again
    resumed, payload = _adapters(broken)
    assert payload["steps"] == 5
    _assert_same(resumed, reference)

    # A control: resuming without the data position and RNG states does not reproduce the run.
    control = tmp_path / "control"
    train(load_manifest(_manifest(control, max_steps=2)), device="cpu")
    ckpt = control / "agent0" / "attributes.pt"
    data = torch.load(ckpt, map_location="cpu", weights_only=False)
    data["extra"].pop("env_rng")
    data.pop("rng")
    torch.save(data, ckpt)
    train(load_manifest(_manifest(control, max_steps=5)), device="cpu")
    different, _ = _adapters(control)
    assert max((x - reference[k]).abs().max().item() for k, x in different.items()) > 1e-4


@pytest.mark.timeout(300)
def test_a_finished_run_run_again_trains_nothing_saves_nothing_and_says_so(tmp_path, caplog):
    """Each periodic checkpoint is logged as it is written. Run again once finished (or with a
    max_steps below its checkpoint's step), a run resumes at the checkpoint's step: it says there
    is nothing to train, and the final checkpoint is left as it was (it was written again).
    Resumed from a periodic checkpoint with nothing to train, the run writes that state as its
    final checkpoint."""
    import logging

    caplog.set_level(logging.INFO, logger="agilerl")
    folder = tmp_path / "ckpt"
    train(load_manifest(_manifest(folder, max_steps=3)), device="cpu")
    assert f"agent 0: checkpoint {folder / 'agent0' / 'step-00000002'}" in caplog.text
    final = folder / "agent0" / "attributes.pt"
    written = final.stat().st_mtime_ns, final.read_bytes()
    for max_steps, said in ((3, "at step 3, so there is nothing"), (2, "at step 3, beyond max_steps 2, so there is")):
        caplog.clear()
        history = train(load_manifest(_manifest(folder, max_steps=max_steps)), device="cpu")
        assert len(history[0]) == 3  # the checkpoint's own history
        assert f"agent 0: the checkpoint is {said}" in caplog.text, caplog.text
        assert "saved " not in caplog.text and (final.stat().st_mtime_ns, final.read_bytes()) == written
    # resumed from a periodic checkpoint with nothing left to train: that state is the final one
    final.unlink()
    caplog.clear()
    train(load_manifest(_manifest(folder, max_steps=2)), device="cpu")
    assert f"resumed at step 2 from {folder / 'agent0' / 'step-00000002'}" in caplog.text, caplog.text
    assert f"saved {folder / 'agent0'}" in caplog.text and torch.load(final, weights_only=False)["steps"] == 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "change, names",
    [
        ({"lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}}, "holds adapters of other modules"),
        ({"lora": None}, "is a LoRA checkpoint; this agent trains every parameter"),
        # the same modules at another rank: a shape mismatch, once read as a damaged file and skipped
        ({"lora": {"r": 2, "alpha": 8, "dropout": 0.1}}, r"holds adapters of another rank: .*lora_A.* is \[4, "),
    ],
)
def test_another_runs_checkpoints_stop_the_run_and_stay_as_they_were(tmp_path, change, names):
    """A checkpoint_dir of another run (other adapters, full fine-tuning for LoRA) is refused in one
    line (agilerl.train: exit 2) before any step: training from step 1 there would prune the old
    run's checkpoints against the new one's."""
    from agilerl.train import main

    folder = tmp_path / "ckpt"
    train(load_manifest(_manifest(folder, max_steps=4)), device="cpu")
    before = {p: p.stat().st_mtime_ns for p in folder.rglob("*.pt")}
    other = {**_manifest(folder, max_steps=6), **change}
    with pytest.raises(ValueError, match=f"holds another run's checkpoints .*{names}"):
        train(load_manifest(other), device="cpu")
    assert {p: p.stat().st_mtime_ns for p in folder.rglob("*.pt")} == before
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(other))
    assert main([str(tmp_path / "other.yaml"), "--device", "cpu"]) == 2


def _marked(mark: str) -> list[int]:
    from tests._procs import with_env

    return with_env("AGILERL_TEST_MARK", mark)


def _torchrun(manifest: Path, log: Path, mark: str = "", *, launcher: str = "torchrun") -> subprocess.Popen:
    """Two ranks of agilerl.train under torchrun, or under agilerl-train (``launcher="agilerl-train"``)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "AGILERL_TEST_MARK": mark}
    run = ["torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "agilerl.train"]
    if launcher == "agilerl-train":
        run = ["agilerl.launch", "--nproc-per-node=2"]
    cmd = [sys.executable, "-m", *run, str(manifest), "--device", "cpu"]
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.multiproc
@pytest.mark.timeout(420)
def test_fsdp2_two_ranks_killed_mid_step_resume_to_the_same_adapters(tmp_path):
    fsdp = {"param_dtype": "float32", "reduce_dtype": "float32", "param_persistence_threshold": 0}
    whole_dir, broken_dir = tmp_path / "whole", tmp_path / "broken"
    for name, folder in (("whole", whole_dir), ("broken", broken_dir)):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(_manifest(folder, max_steps=8, fsdp=fsdp, gpus=2)))

    run = _torchrun(tmp_path / "whole.yaml", tmp_path / "whole.log")
    assert run.wait(timeout=240) == 0, (tmp_path / "whole.log").read_text()[-3000:]
    reference, _ = _adapters(whole_dir)

    mark = f"resume-{os.getpid()}-{time.monotonic_ns()}"
    run = _torchrun(tmp_path / "broken.yaml", tmp_path / "broken-1.log", mark)
    checkpoint = broken_dir / "agent0" / "step-00000002" / "attributes.pt"
    deadline = time.monotonic() + 240
    try:
        while not checkpoint.exists():
            assert run.poll() is None and time.monotonic() < deadline, (tmp_path / "broken-1.log").read_text()[-3000:]
            time.sleep(0.01)
    finally:
        # kill -9 of the launcher and of both ranks (torchrun starts its ranks in their own sessions),
        # as a node failure would: nothing gets to clean up.
        for pid in [run.pid, *_marked(mark)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        run.wait()
    time.sleep(0.2)
    assert not _marked(mark)
    assert not (broken_dir / "agent0" / "attributes.pt").exists(), "the run finished before it was killed"

    run = _torchrun(tmp_path / "broken.yaml", tmp_path / "broken-2.log", launcher="agilerl-train")  # the same run
    assert run.wait(timeout=240) == 0, (tmp_path / "broken-2.log").read_text()[-3000:]
    log = (tmp_path / "broken-2.log").read_text()
    assert "resumed at step" in log, log[-3000:]
    resumed_at = int(log.split("resumed at step ")[1].split()[0])
    assert resumed_at in (2, 4, 6), log[-3000:]
    resumed, payload = _adapters(broken_dir)
    assert payload["steps"] == 8 and payload["world_size"] == 2
    _assert_same(resumed, reference)


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_kill_9_of_torchrun_alone_ends_the_training_ranks_within_2_s(tmp_path):
    """torchrun starts its ranks in sessions of their own; without a parent-death signal they would run on."""
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(_manifest(tmp_path / "ckpt", max_steps=10_000, gpus=2)))
    mark = f"orphan-{os.getpid()}-{time.monotonic_ns()}"
    run = _torchrun(tmp_path / "run.yaml", tmp_path / "run.log", mark)
    checkpoint = tmp_path / "ckpt" / "agent0" / "step-00000002" / "attributes.pt"
    deadline = time.monotonic() + 180
    try:
        while not checkpoint.exists():  # both ranks are training
            assert run.poll() is None and time.monotonic() < deadline, (tmp_path / "run.log").read_text()[-3000:]
            time.sleep(0.05)
        ranks = [p for p in _marked(mark) if p != run.pid]
        assert len(ranks) >= 2
    finally:
        os.kill(run.pid, signal.SIGKILL)  # the launcher only
        run.wait()
    killed_at = time.monotonic()
    while _marked(mark) and time.monotonic() - killed_at < 2.0:
        time.sleep(0.05)
    left = _marked(mark)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"training ranks outlived kill -9 of torchrun by 2 s: {left}"
