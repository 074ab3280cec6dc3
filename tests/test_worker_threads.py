"""The worker's torch threads: the CPUs the process may use (affinity, cgroup quota), and one kept for the rest of
a local stack."""

from __future__ import annotations

import os

import pytest

import segserve.launcher as launcher
from worker.threads import available_cpus, cgroup_cpu_quota


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


@pytest.mark.parametrize(("cpus", "num_workers", "threads"), [(2, 1, 1), (1, 1, 1), (16, 1, 15), (16, 2, 7), (3, 4, 1)])
def test_local_workers_leave_one_cpu_to_the_rest_of_the_stack(monkeypatch, cpus, num_workers, threads):
    monkeypatch.setattr(launcher, "available_cpus", lambda: cpus)
    assert launcher.local_worker_threads(num_workers) == threads


@pytest.mark.parametrize(("cpus", "quota", "num_workers", "expected"), [
    ({0, 1}, 2, 1, ([{1}], {0})),
    ({4, 5, 6, 7}, 4, 2, ([{5}, {6}], {4})),  # one thread each, as local_worker_threads counts
    (set(range(16)), 16, 1, ([set(range(1, 16))], {0})),
    ({3}, 1, 1, None),  # one CPU: nothing to split
    ({0, 1, 2}, 3, 4, None),  # fewer CPUs than workers + 1
    (set(range(8)), 2, 1, None),  # a cgroup quota below the mask
])
def test_a_local_stack_pins_its_workers_apart_from_the_other_services(monkeypatch, cpus, quota, num_workers, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: cpus)
    monkeypatch.setattr(launcher, "available_cpus", lambda: quota)
    assert launcher.local_cpu_sets(num_workers) == expected
