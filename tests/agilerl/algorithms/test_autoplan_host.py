"""fsdp_config="auto" on a GPU judges its node's host memory: the RAM, or a cgroup's lower limit."""

from __future__ import annotations

import re

import pytest

from agilerl.algorithms.core import autoplan
from tests.agilerl.algorithms._common import make_agent

GIB = 2**30


def _node(tmp_path, *, mem_total_kib: int | None, cgroup: str | None, limits: dict[str, str]):
    """A /proc and a /sys/fs/cgroup of files: ``limits`` maps a path under the cgroup mount to its text."""
    proc, fs = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    fs.mkdir()
    if mem_total_kib is not None:
        (proc / "meminfo").write_text(
            f"MemTotal:       {mem_total_kib} kB\nMemFree:         1024 kB\nMemAvailable:    2048 kB\n"
        )
    if cgroup is not None:
        (proc / "self" / "cgroup").write_text(cgroup)
    for path, text in limits.items():
        (fs / path).parent.mkdir(parents=True, exist_ok=True)
        (fs / path).write_text(text + "\n")
    return proc, fs


SIXTY_FOUR_GIB_KIB = 64 * 2**20


@pytest.mark.parametrize(
    "cgroup, limits, expected",
    [
        # no cgroup file (not Linux's procfs, say): the RAM
        (None, {}, 64 * GIB),
        # cgroup v2, a Slurm job's limit two levels above the task's own cgroup, which has none
        (
            "0::/system.slice/job_7/step_0/task_0\n",
            {
                "system.slice/job_7/memory.max": str(8 * GIB),
                "system.slice/job_7/step_0/memory.max": "max",
                "system.slice/job_7/step_0/task_0/memory.max": "max",
            },
            8 * GIB,
        ),
        # cgroup v2 in a container's namespace: its own cgroup is the mount's root
        ("0::/\n", {"memory.max": str(12 * GIB)}, 12 * GIB),
        # v2 without a namespace, the container's cgroup mounted alone: the path is not there
        ("0::/docker/0123abcd\n", {"memory.max": str(6 * GIB)}, 6 * GIB),
        # cgroup v1: the memory controller's hierarchy, the lowest limit on the way up
        (
            "12:pids:/docker/abc\n4:memory:/docker/abc\n0::/\n",
            {
                "memory/docker/abc/memory.limit_in_bytes": "9223372036854771712",  # v1's "unlimited"
                "memory/docker/memory.limit_in_bytes": str(3 * GIB),
                "memory/memory.limit_in_bytes": "9223372036854771712",
            },
            3 * GIB,
        ),
        # a limit above the RAM limits nothing
        ("0::/big\n", {"big/memory.max": str(128 * GIB)}, 64 * GIB),
        # what is no count of bytes is no limit: a zero, a sign, a superscript digit, a path out of the mount
        ("0::/odd\n", {"odd/memory.max": "0", "memory.max": "-5"}, 64 * GIB),
        ("0::/odd\n", {"odd/memory.max": "\u00b2"}, 64 * GIB),
        ("0::/../../elsewhere\n", {"memory.max": str(GIB)}, 64 * GIB),
    ],
    ids=[
        "no-cgroup",
        "v2-slurm",
        "v2-namespace",
        "v2-own-mount",
        "v1-docker",
        "above-ram",
        "zero-and-sign",
        "superscript",
        "dot-dot",
    ],
)
def test_node_memory_is_the_ram_or_the_lowest_cgroup_limit_above_the_process(tmp_path, cgroup, limits, expected):
    proc, fs = _node(tmp_path, mem_total_kib=SIXTY_FOUR_GIB_KIB, cgroup=cgroup, limits=limits)
    assert autoplan.node_memory_bytes(proc, fs) == expected


def test_a_cgroup_file_that_is_not_text_is_no_limit(tmp_path):
    proc, fs = _node(tmp_path, mem_total_kib=SIXTY_FOUR_GIB_KIB, cgroup="0::/bin\n", limits={})
    (fs / "bin").mkdir()
    (fs / "bin" / "memory.max").write_bytes(b"\xff\xfe\x00")
    assert autoplan.node_memory_bytes(proc, fs) == 64 * GIB
    (proc / "self" / "cgroup").write_bytes(b"\xff\xfe")  # nor is such a cgroup list
    assert autoplan.node_memory_bytes(proc, fs) == 64 * GIB


def test_node_memory_is_unknown_without_meminfo(tmp_path):
    proc, fs = _node(tmp_path, mem_total_kib=None, cgroup="0::/\n", limits={"memory.max": str(GIB)})
    assert autoplan.node_memory_bytes(proc, fs) is None


def test_this_machines_node_memory_is_at_most_its_ram():
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert 0 < autoplan.node_memory_bytes() <= total


def _on_an_h100_node(monkeypatch, host_gib: float) -> None:
    """fsdp_config="auto" as it plans on a GPU node whose host memory is ``host_gib`` (this machine
    has no GPU: the cluster visible_cluster would read there)."""
    from planner.hardware import Cluster, gpu_by_name

    gpu = gpu_by_name("H100-80GB")
    host = int(host_gib * GIB)
    monkeypatch.setattr(
        autoplan,
        "visible_cluster",
        lambda world_size, judge_host=False: Cluster(
            gpu=gpu, num_gpus=1, host_memory_per_node_bytes=host if judge_host else None
        ),
    )


def _least_gib_that_holds(need_gib: float, margin: float = 0.05) -> int:
    """The least whole GiB of host memory whose share less the margin holds ``need_gib``."""
    gib = 1
    while gib - int(gib * GIB * margin) / GIB < need_gib:
        gib += 1
    return gib


def test_auto_fsdp_on_a_gpu_refuses_a_run_its_nodes_host_cannot_hold(monkeypatch):
    """The GPU fits; a host of 1 GiB cannot hold even the trainer's process. One line saying what
    is over and by how much, and the least host that would hold it, in the trainer's terms (no
    planner flag)."""
    _on_an_h100_node(monkeypatch, host_gib=1)
    with pytest.raises(ValueError) as err:
        make_agent(fsdp_config="auto")
    message = str(err.value)
    assert "\n" not in message, message
    match = re.fullmatch(
        r"fsdp_config='auto': the plan fits the GPUs, but it needs ([\d.]+) MiB of host memory on a node in phase "
        r"\w+, over the ([\d.]+) MiB available \(this node's RAM, or its cgroup's limit, less the margin\); "
        r"what would fit: .*give each node at least (\d+) GiB of host memory(;.*)?",
        message,
    )  # in MiB beside a host under 4 GiB, as the plan's table says a GPU's
    assert match, message
    need, limit, least = float(match[1]) / 1024, float(match[2]) / 1024, int(match[3])
    assert need > limit == pytest.approx(0.95, abs=0.01)
    assert least == _least_gib_that_holds(need)
    assert "--host-memory" not in message


def test_auto_fsdp_names_the_save_when_rank_0s_gathered_checkpoint_is_what_the_host_cannot_hold(monkeypatch):
    """A full fine-tune of a 7B-shaped model on a GPU of 1 TiB: every phase fits the GPU and a
    64 GiB host holds the run, but not the checkpoint a save gathers on rank 0 (its weights and
    AdamW moments, 78 GB and more): refused before any weight is built, the save named."""
    from planner.hardware import Cluster, gpu_by_name, with_memory

    big = "tiny:llama?hidden_size=4096&intermediate_size=11008&num_layers=32&num_heads=32&num_kv_heads=32"
    gpu = with_memory(gpu_by_name("H100-80GB"), 1024)
    cluster = Cluster(gpu=gpu, num_gpus=1, host_memory_per_node_bytes=64 * GIB)
    monkeypatch.setattr(autoplan, "visible_cluster", lambda world_size, judge_host=False: cluster)
    with pytest.raises(ValueError) as err:
        make_agent(model_name=big, fsdp_config="auto", lora_config=None, max_model_len=64)
    message = str(err.value)
    assert "in phase save (rank 0 gathers the checkpoint), over the 60.80 GiB available" in message, message
    need = float(re.search(r"needs ([\d.]+) GiB of host memory", message)[1])
    blocks = 32 * (4 * 4096**2 + 3 * 4096 * 11008)  # the tokenizer's vocabulary is a few dozen rows
    assert need > blocks * (4 + 8) / GIB  # fp32 weights and AdamW's two moments of every parameter, at least


def test_auto_fsdp_on_a_gpu_with_a_roomy_host_plans_and_says_the_host_fits(monkeypatch, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="agilerl")
    _on_an_h100_node(monkeypatch, host_gib=512)
    make_agent(fsdp_config="auto")
    assert re.search(r"per node [\d.]+ GiB of 512\.00 GiB \(fits; the margin leaves 486\.40\)", caplog.text)


@pytest.mark.parametrize("host", ["roomy", "between", "tiny"])
def test_optim_cpu_offload_none_moves_adam_to_the_host_only_where_the_host_holds_it(monkeypatch, caplog, host):
    """A GPU just too small for Adam beside everything else: a roomy host takes it. A host that
    holds the run with Adam on the GPU but not with Adam beside it, or that holds neither, keeps
    it on the GPU, where running out of memory is an error that says so, and the log warns that
    it fits nowhere, saying when the host is over without Adam too."""
    import logging

    from agilerl.distributed import FSDPConfig
    from planner.calibration import coefficients_for
    from planner.choose import host_judge
    from planner.hardware import Cluster, gpu_by_name, with_memory
    from planner.memory import estimate

    agent = make_agent()
    agent.fsdp_config = FSDPConfig()  # as an FSDP2 run is given it (the decision needs no ranks)
    micro = agent.micro_batch_size_per_gpu
    gpu = gpu_by_name("H100-80GB")
    spec, workload = autoplan._spec_for(agent, None), autoplan._as_resolved(agent, micro)

    def run(adam_on_host: bool, cluster: Cluster):
        fsdp = FSDPConfig(optim_cpu_offload=adam_on_host)
        return estimate(spec, workload, cluster, fsdp, coefficients=coefficients_for(cluster.gpu))

    need = run(False, Cluster(gpu=gpu)).peak_bytes
    small = with_memory(gpu, (need / 0.95 - 2**20) / GIB)  # Adam on it is just over its limit
    sized = Cluster(gpu=small, num_gpus=1, host_memory_per_node_bytes=GIB)
    judge = host_judge(spec, workload, sized, engine_ranks=False)
    with_adam, without = judge(run(True, sized)).need_bytes, judge(run(False, sized)).need_bytes
    assert with_adam > without  # Adam's state on the host
    host_bytes = {"roomy": 512 * GIB, "between": int((with_adam + without) / 2 / 0.95), "tiny": GIB}[host]
    cluster = sized.model_copy(update={"host_memory_per_node_bytes": host_bytes})
    monkeypatch.setattr(autoplan, "visible_cluster", lambda world_size, judge_host=False: cluster)
    caplog.set_level(logging.INFO, logger="agilerl")
    agent._resolve_optim_offload(None)
    assert agent.fsdp_config.optim_cpu_offload is (host == "roomy")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if host == "roomy":
        assert not warned and "optim_cpu_offload=True: Adam steps on the CPU" in caplog.text
        return
    (line,) = warned
    assert line.startswith("[agilerl] optim_cpu_offload=False: the memory estimate fits Adam nowhere: on the GPU ")
    assert "of host memory on a node in phase " in line
    assert ("over with Adam on the GPU too" in line) == (host == "tiny")


def test_the_other_auto_knobs_are_chosen_for_the_gpu_alone(monkeypatch):
    """Checkpointing and the log-prob chunk move nothing to or from the host: they are chosen for
    the GPU whatever the node's host holds. Judged against a host too small for the run (1 GiB),
    the planner would fall back to its most frugal knobs."""
    from planner.hardware import Cluster, gpu_by_name

    gpu = gpu_by_name("H100-80GB")

    def knobs(cluster_of) -> tuple:
        monkeypatch.setattr(autoplan, "visible_cluster", cluster_of)
        agent = make_agent(gradient_checkpointing="auto", logprob_chunk_size="auto")
        return agent.gradient_checkpointing, agent.logprob_chunk_size

    def small_host(world_size, judge_host=False):
        return Cluster(gpu=gpu, num_gpus=1, host_memory_per_node_bytes=GIB if judge_host else None)

    unknown = knobs(lambda world_size, judge_host=False: Cluster(gpu=gpu, num_gpus=1))
    assert knobs(small_host) == unknown == (False, 4096)  # a tiny model: no checkpointing, the largest chunk
    judged = knobs(lambda world_size, judge_host=False: Cluster(gpu=gpu, num_gpus=1, host_memory_per_node_bytes=GIB))
    assert judged != unknown
