"""planner's package namespace: the public API, each name the object its module defines."""

from __future__ import annotations

import importlib

import pytest

import planner


@pytest.mark.parametrize("name", planner.__all__)
def test_each_public_name_is_its_modules_object(name):
    module = importlib.import_module(f"planner.{planner._LAZY[name]}")
    assert name in module.__all__, f"planner.{name} is not public in {module.__name__}"
    assert getattr(planner, name) is getattr(module, name)
    assert vars(planner)[name] is getattr(module, name)  # kept: the next access is a plain lookup


def test_unknown_names_raise_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'estimte'"):
        planner.estimte  # noqa: B018
    assert set(dir(planner)) == set(planner.__all__)


def test_a_plan_through_the_package_namespace():
    spec = planner.load_model_spec("Qwen/Qwen2.5-0.5B")
    result = planner.plan(spec, planner.Workload(), planner.Cluster(gpu=planner.gpu_by_name("H100-80GB"), num_gpus=2))
    assert isinstance(result, planner.Plan) and result.fits
    assert result.estimate.peak_bytes == planner.estimate(spec, result.workload, result.cluster, result.fsdp).peak_bytes
