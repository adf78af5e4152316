"""Binding the engine to the cores next to its GPU: the sysfs cpulist parser and the CPU no-op
(tests/gpu/test_engine_gpu.py checks the binding itself where a GPU is)."""

from __future__ import annotations

import os

import torch

from radixserve.engine.cpu_affinity import bind_near_gpu, parse_cpulist


def test_parse_cpulist_reads_the_kernel_format():
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("5") == {5}
    assert parse_cpulist("") == set()


def test_a_cpu_engine_is_left_where_it_is():
    before = os.sched_getaffinity(0)
    assert bind_near_gpu(torch.device("cpu")) is None
    assert os.sched_getaffinity(0) == before
