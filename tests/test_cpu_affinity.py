"""Binding the engine to the cores next to its GPU: the sysfs cpulist parser and the CPU no-op
(tests/gpu/test_engine_gpu.py checks the binding itself where a GPU is); a GPU engine's torch CPU
operations on one thread."""

from __future__ import annotations

import os

import pytest
import torch

from radixserve.engine.cpu_affinity import bind_near_gpu, one_host_thread, parse_cpulist


def test_parse_cpulist_reads_the_kernel_format():
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("5") == {5}
    assert parse_cpulist("") == set()


def test_a_cpu_engine_is_left_where_it_is():
    before = os.sched_getaffinity(0)
    assert bind_near_gpu(torch.device("cpu")) is None
    assert os.sched_getaffinity(0) == before


@pytest.fixture
def restore_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_a_gpu_engine_runs_its_cpu_ops_on_one_thread(restore_torch_threads, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    assert not one_host_thread(torch.device("cpu"))  # a CPU engine computes with the pool
    assert torch.get_num_threads() == 2
    assert one_host_thread(torch.device("cuda", 0))  # only sets the thread count: no GPU needed
    assert torch.get_num_threads() == 1


def test_an_explicit_omp_num_threads_is_kept(restore_torch_threads, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)
    assert not one_host_thread(torch.device("cuda", 0))
    assert torch.get_num_threads() == 2
