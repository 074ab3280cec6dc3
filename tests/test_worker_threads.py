"""The worker's torch threads: the CPUs the process may use (affinity, cgroup quota), and one kept for the rest of
a local stack."""

from __future__ import annotations

import os

import pytest

import segserve.launcher as launcher
from worker.threads import available_cpus, cgroup_cpu_quota


@pytest.fixture
def cgroup(tmp_path):
    v2, quota, period = tmp_path / "cpu.max", tmp_path / "cfs_quota_us", tmp_path / "cfs_period_us"
    return v2, quota, period


def test_a_cgroup_v2_quota_caps_the_cpus(cgroup, monkeypatch):
    v2, quota, period = cgroup
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    v2.write_text("250000 100000\n")  # 2.5 CPUs
    assert cgroup_cpu_quota(v2, quota, period) == 2.5
    assert available_cpus(v2, quota, period) == 2
    v2.write_text("max 100000\n")  # no quota: the affinity mask counts
    assert cgroup_cpu_quota(v2, quota, period) is None
    assert available_cpus(v2, quota, period) == 64
    v2.write_text("50000 100000\n")  # half a CPU: still one thread
    assert available_cpus(v2, quota, period) == 1


def test_a_cgroup_v1_quota_counts_when_there_is_no_v2_file(cgroup, monkeypatch):
    v2, quota, period = cgroup
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    quota.write_text("300000\n")
    period.write_text("100000\n")
    assert available_cpus(v2, quota, period) == 3
    quota.write_text("-1\n")  # v1's "no quota"
    assert available_cpus(v2, quota, period) == 8


def test_the_affinity_mask_caps_a_larger_quota(cgroup, monkeypatch):
    v2, quota, period = cgroup
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    v2.write_text("800000 100000\n")
    assert available_cpus(v2, quota, period) == 2


@pytest.mark.parametrize(("cpus", "num_workers", "threads"), [(2, 1, 1), (1, 1, 1), (16, 1, 15), (16, 2, 7), (3, 4, 1)])
def test_local_workers_leave_one_cpu_to_the_rest_of_the_stack(monkeypatch, cpus, num_workers, threads):
    monkeypatch.setattr(launcher, "available_cpus", lambda: cpus)
    assert launcher.local_worker_threads(num_workers) == threads
