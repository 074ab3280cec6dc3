"""The worker's torch threads: the CPUs the process may use (affinity, cgroup quota), and one kept for the rest of
a local stack."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from torch import nn

import segserve.launcher as launcher
from worker.config import WorkerConfig
from worker.threads import (available_cpus, bind_compute_thread, cgroup_cpu_quota, format_cpu_list, parse_cpu_list,
                            threads_for)


@pytest.fixture
def cgroup(tmp_path):
    """(root, v2 cpu.max, v1 quota, v1 period) of a cgroup tree with no file written yet."""
    v1 = tmp_path / "cpu"
    v1.mkdir()
    return tmp_path, tmp_path / "cpu.max", v1 / "cpu.cfs_quota_us", v1 / "cpu.cfs_period_us"


def test_a_cgroup_v2_quota_caps_the_cpus(cgroup, monkeypatch):
    root, v2, quota, period = cgroup
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    v2.write_text("250000 100000\n")  # 2.5 CPUs
    assert cgroup_cpu_quota(root) == 2.5
    assert available_cpus(root) == 2
    v2.write_text("max 100000\n")  # no quota: the affinity mask counts
    assert cgroup_cpu_quota(root) is None
    assert available_cpus(root) == 64
    v2.write_text("50000 100000\n")  # half a CPU: still one thread
    assert available_cpus(root) == 1


def test_a_cgroup_v1_quota_counts_when_there_is_no_v2_file(cgroup, monkeypatch):
    root, v2, quota, period = cgroup
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    quota.write_text("300000\n")
    period.write_text("100000\n")
    assert available_cpus(root) == 3
    quota.write_text("-1\n")  # v1's "no quota"
    assert available_cpus(root) == 8


def test_the_affinity_mask_caps_a_larger_quota(cgroup, monkeypatch):
    root, v2, quota, period = cgroup
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    v2.write_text("800000 100000\n")
    assert available_cpus(root) == 2


@pytest.mark.parametrize(("cpus", "num_workers", "threads"), [
    (2, 1, 2), (3, 1, 3), (2, 2, 1), (1, 1, 1),  # below SERVICE_CPU_MIN_CPUS: every CPU computes
    (4, 1, 3), (16, 1, 15), (16, 2, 7), (3, 4, 1),
])
def test_local_workers_leave_one_cpu_to_the_rest_of_the_stack_from_four_on(monkeypatch, cpus, num_workers, threads):
    monkeypatch.setattr(launcher, "available_cpus", lambda: cpus)
    assert launcher.local_worker_threads(num_workers) == threads


@pytest.mark.parametrize(("cpus", "quota", "num_workers", "expected"), [
    ({0, 1}, 2, 1, ([{0, 1}], {0, 1})),  # two CPUs: the worker computes on both, the services take turns
    ({0, 1}, 2, 2, ([{0}, {1}], {0, 1})),
    ({0, 1, 2, 3}, 4, 1, ([{1, 2, 3}], {0})),
    ({4, 5, 6, 7}, 4, 2, ([{5}, {6}], {4})),  # one thread each, as local_worker_threads counts
    (set(range(16)), 16, 1, ([set(range(1, 16))], {0})),
    ({3}, 1, 1, None),  # one CPU: nothing to split
    ({0, 1, 2}, 3, 4, None),  # fewer CPUs than workers
    (set(range(8)), 2, 1, None),  # a cgroup quota below the mask
])
def test_a_local_stack_pins_its_workers_apart_from_the_other_services_from_four_cpus_on(monkeypatch, cpus, quota,
                                                                                       num_workers, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: cpus)
    monkeypatch.setattr(launcher, "available_cpus", lambda: quota)
    assert launcher.local_cpu_sets(num_workers) == expected


def test_binding_the_compute_thread_binds_the_threads_it_starts_not_those_started_before():
    everywhere = os.sched_getaffinity(0)
    one = {max(everywhere)}
    masks: dict[str, set[int]] = {}
    started, stop = threading.Event(), threading.Event()

    def helper() -> None:  # started before the binding, like gRPC's threads
        started.set()
        stop.wait(10)
        masks["helper"] = os.sched_getaffinity(0)

    def compute() -> None:
        bind_compute_thread(one)
        masks["compute"] = os.sched_getaffinity(0)
        child = threading.Thread(target=lambda: masks.update(child=os.sched_getaffinity(0)))
        child.start()
        child.join()

    helper_thread = threading.Thread(target=helper)
    helper_thread.start()
    started.wait(10)
    compute_thread = threading.Thread(target=compute)
    compute_thread.start()
    compute_thread.join(10)
    stop.set()
    helper_thread.join(10)
    assert masks == {"compute": one, "child": one, "helper": everywhere}
    assert os.sched_getaffinity(0) == everywhere  # this thread, and so the process's mask, as before


def test_compute_cpus_is_a_cpu_list():
    assert parse_cpu_list("1-3, 6") == {1, 2, 3, 6} and parse_cpu_list("") == set()
    assert parse_cpu_list(format_cpu_list({4, 0, 2})) == {0, 2, 4}
    for garbage in ("x", "3-1", "-1", "1-", "1.5"):
        with pytest.raises(ValueError, match="compute_cpus"):
            WorkerConfig(compute_cpus=garbage)


def test_compute_cpus_outside_the_process_are_refused_by_name():
    outside = max(os.sched_getaffinity(0)) + 1024
    with pytest.raises(ValueError, match=f"compute_cpus {outside}: cannot bind"):
        bind_compute_thread({outside})


def test_a_forward_takes_more_than_one_thread_only_when_its_layers_weights_pay_for_the_barriers():
    def model(width: int, vocab: int) -> nn.Module:
        layers = nn.Sequential(nn.Linear(width, width), nn.Linear(width, width // 2))
        layers.get_output_embeddings = lambda: head
        head = nn.Linear(width // 2, vocab)
        layers.add_module("head", head)
        return layers

    assert threads_for(model(64, 5000), 2) == 1  # the head is the largest weight, not a layer's
    assert threads_for(model(1 << 10, 64), 2) == 2  # a 1024 x 1024 layer weight: PARALLEL_MIN_WEIGHTS
    assert threads_for(model(1 << 10, 64), 1) == 1
    assert threads_for(model(1000, 64), 2) == 1


def test_a_runner_steps_at_the_threads_its_row_policies_were_probed_at(tiny_gemma3_dir):
    from tests.worker.test_model_runner import make_runner

    before = torch.get_num_threads()
    try:
        runner = make_runner(tiny_gemma3_dir)
        assert runner.num_threads == 1  # the tiny model's weights do not pay for a second thread
        torch.set_num_threads(2)  # as another runner of this process does for its model
        runner.warm_up()  # a step
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
