"""planner.workload.Workload: each algorithm's own defaults and the combinations the trainer refuses."""

from __future__ import annotations

import inspect

import pytest

from planner.workload import ALGORITHM_CLASSES, Workload


def test_each_algorithm_takes_its_trainers_defaults():
    import agilerl.algorithms

    for key, name in ALGORITHM_CLASSES.items():
        w = Workload(algorithm=key)
        params = inspect.signature(getattr(agilerl.algorithms, name)).parameters
        grpo = inspect.signature(agilerl.algorithms.GRPO).parameters
        default = {
            p: (params[p] if p in params else grpo[p]).default
            for p in ("group_size", "beta", "update_epochs")
            if p in params or name not in ("SFT", "DPO")
        }
        if name == "SFT":
            assert (w.group_size, w.beta, w.generation) == (1, 0.0, "none")
        elif name == "DPO":
            assert (w.group_size, w.beta, w.generation) == (2, default["beta"], "none")
        else:
            assert (w.group_size, w.beta, w.update_epochs) == (
                default["group_size"],
                default["beta"],
                default["update_epochs"],
            ), name
    ppo = Workload(algorithm="ppo")
    assert ppo.has_old_policy_pass and ppo.has_reference
    assert Workload(algorithm="dpo").has_reference and not Workload(algorithm="sft").has_reference


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"algorithm": "sft", "group_size": 4}, "sft has 1 sequence"),
        ({"algorithm": "dpo", "group_size": 4}, r"dpo has 2 sequence\(s\) per example \(chosen, rejected\)"),
        ({"algorithm": "dpo", "generation": "hf"}, "dpo learns from a dataset"),
        ({"algorithm": "sft", "update_epochs": 2}, "one pass per batch"),
        ({"algorithm": "grpo", "group_size": 1}, "at least 2 completions"),
        ({"algorithm": "dpo", "beta": 0.0}, "must be > 0"),
        ({"algorithm": "sft", "beta": 0.1}, "no reference policy"),
        ({"full_finetune": True, "load_in_4bit": True}, "4-bit weights do not train"),
        ({"full_finetune": True, "use_separate_reference_adapter": True}, "frozen copy of the model"),
    ],
)
def test_combinations_the_trainer_refuses_are_one_clear_error(fields, message):
    with pytest.raises(ValueError, match=message):
        Workload(**fields)
