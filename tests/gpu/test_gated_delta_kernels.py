"""Gated DeltaNet kernels (causal conv, recurrent delta rule, fla's chunked prefill) against the torch
reference, on ragged batches that continue some sequences' pool states and start others.

Runs on a CUDA GPU; TRITON_INTERPRET=1 runs the Triton ones on the CPU at small shapes (fla's and
the CUDA-graph replay skip there). The torch reference itself equals transformers' torch
fallback: tests/test_gated_delta.py.
"""

from __future__ import annotations

import pytest
import torch

from triton_device import DEVICE  # skips this module without a GPU or the Triton interpreter

pytestmark = pytest.mark.gpu

from radixserve.kernels import fla_gdn  # noqa: E402
from radixserve.kernels import gated_delta as kg  # noqa: E402
from radixserve.model.layers.gated_delta import (causal_conv1d, chunk_gated_delta_rule, gdn_gates,  # noqa: E402
                                                 recurrent_gated_delta_rule)

LOW = torch.bfloat16 if DEVICE == "cuda" else torch.float16
# Small under the interpreter; Qwen3.5-27B's per-rank shapes at tp 1 (16 key heads, 48 value heads of 128) on CUDA.
SHAPES = {"tiny": (2, 4, 16, 8)} if DEVICE == "cpu" else {"tiny": (2, 4, 16, 8), "27b": (16, 48, 128, 128)}
LENS = [5, 40, 1, 67] if DEVICE == "cpu" else [5, 700, 1, 1300, 64]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def tol(dtype: torch.dtype) -> float:
    return 2e-5 if dtype == torch.float32 else 2e-2


def ragged(lens: list[int]):
    """cu_seqlens, pool rows (shuffled, not 0..N-1) and which sequences continue their state."""
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64, device=DEVICE)
    rows = torch.randperm(len(lens) + 3)[:len(lens)].to(DEVICE)
    cont = torch.tensor([i % 2 == 0 for i in range(len(lens))], dtype=torch.int64, device=DEVICE)
    return cu, rows, cont


@pytest.mark.parametrize("dtype", [LOW, torch.float32])
@pytest.mark.parametrize("kernel", [4, 2])
def test_causal_conv_varlen_and_decode_equal_the_reference(dtype, kernel):
    torch.manual_seed(0)
    channels = 136 if DEVICE == "cpu" else 10240
    cu, rows, cont = ragged(LENS)
    x = torch.randn(int(cu[-1]), channels, device=DEVICE).to(dtype)
    weight = torch.randn(channels, kernel, device=DEVICE).to(dtype)
    states = torch.randn(len(LENS) + 3, kernel - 1, channels, device=DEVICE).to(dtype)
    before = states.clone()
    seqs, starts = kg.conv_tiles(LENS)
    out = kg.causal_conv1d_varlen(x, weight, states, rows, cont, cu, torch.tensor(seqs, device=DEVICE),
                                  torch.tensor(starts, device=DEVICE))
    for i, (row, c) in enumerate(zip(rows.tolist(), cont.tolist())):
        part = slice(int(cu[i]), int(cu[i + 1]))
        y, window = causal_conv1d(x[part].float(), weight.float(), before[row].float() if c else None)
        assert rel_err(out[part], y) < tol(dtype)
        torch.testing.assert_close(states[row].float(), window.to(dtype).float(), atol=0, rtol=0)
    # A decode step on top: one token each, windows moved on in place.
    xs = torch.randn(len(LENS), channels, device=DEVICE).to(dtype)
    before = states.clone()
    out = kg.causal_conv1d_decode(xs, weight, states, rows, cont)
    for b, (row, c) in enumerate(zip(rows.tolist(), cont.tolist())):
        y, window = causal_conv1d(xs[b:b + 1].float(), weight.float(), before[row].float() if c else None)
        assert rel_err(out[b:b + 1], y) < tol(dtype)
        torch.testing.assert_close(states[row].float(), window.to(dtype).float(), atol=0, rtol=0)


def gdn_inputs(shape: str, lens: list[int], dtype: torch.dtype):
    hk, hv, dk, dv = SHAPES[shape]
    t = sum(lens)
    q, k = (torch.randn(t, hk, dk, device=DEVICE).to(dtype) for _ in range(2))
    v = torch.randn(t, hv, dv, device=DEVICE).to(dtype)
    a, b = (torch.randn(t, hv, device=DEVICE).to(dtype) for _ in range(2))
    a_log = (torch.rand(hv, device=DEVICE) * 2 - 1).to(dtype)
    dt_bias = torch.randn(hv, device=DEVICE).to(dtype)
    states = torch.randn(len(lens) + 3, hv, dk, dv, device=DEVICE) * 0.1
    return q, k, v, a, b, a_log, dt_bias, states


def reference(q, k, v, a, b, a_log, dt_bias, before, cu, rows, cont):
    """Per sequence: (o, final state) of the chunked torch reference, in float32."""
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    for i, (row, c) in enumerate(zip(rows.tolist(), cont.tolist())):
        part = slice(int(cu[i]), int(cu[i + 1]))
        yield part, row, chunk_gated_delta_rule(q[part].float(), k[part].float(), v[part].float(), g[part],
                                                beta[part].float(), before[row] if c else None)


@pytest.mark.parametrize("dtype", [LOW, torch.float32])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fused_recurrent_equals_the_reference(dtype, shape):
    torch.manual_seed(1)
    lens = ([3, 17, 1, 9] if DEVICE == "cpu" else LENS) if shape == "tiny" else [3, 1, 200, 1]
    cu, rows, cont = ragged(lens)
    q, k, v, a, b, a_log, dt_bias, states = gdn_inputs(shape, lens, dtype)
    before = states.clone()
    out = kg.fused_recurrent_gated_delta_rule(q, k, v, a, b, a_log, dt_bias, states, rows, cont, cu)
    for part, row, (o, final) in reference(q, k, v, a, b, a_log, dt_bias, before, cu, rows, cont):
        assert rel_err(out[part], o) < tol(dtype)
        assert rel_err(states[row], final) < tol(dtype)


@pytest.mark.skipif(DEVICE != "cuda", reason="the interpreter holds bfloat16 as integers")
def test_fused_recurrent_over_bfloat16_states():
    """--mamba-ssm-dtype bfloat16: the state is read and written in bf16, computed in float32."""
    torch.manual_seed(6)
    cu, rows, cont = ragged(LENS)
    q, k, v, a, b, a_log, dt_bias, states = gdn_inputs("27b", LENS, torch.bfloat16)
    states = states.to(torch.bfloat16)
    before = states.float()
    out = kg.fused_recurrent_gated_delta_rule(q, k, v, a, b, a_log, dt_bias, states, rows, cont, cu)
    for part, row, (o, final) in reference(q, k, v, a, b, a_log, dt_bias, before, cu, rows, cont):
        assert rel_err(out[part], o) < 2e-2 and rel_err(states[row], final) < 2e-2


def test_fused_recurrent_reads_q_k_v_as_views_of_the_conv_output():
    """The layer hands q|k|v as column views of one [T, 2 Hk Dk + Hv Dv] tensor, a and b as views of the projection."""
    torch.manual_seed(2)
    hk, hv, dk, dv = SHAPES["tiny"]
    lens = [4, 9]
    cu, rows, cont = ragged(lens)
    t = sum(lens)
    mixed = torch.randn(t, 2 * hk * dk + hv * dv, device=DEVICE)
    proj = torch.randn(t, 2 * hv + 5, device=DEVICE)
    q = mixed[:, :hk * dk].view(t, hk, dk)
    k = mixed[:, hk * dk:2 * hk * dk].view(t, hk, dk)
    v = mixed[:, 2 * hk * dk:].view(t, hv, dv)
    b, a = proj[:, 5:5 + hv], proj[:, 5 + hv:]
    a_log, dt_bias = torch.zeros(hv, device=DEVICE), torch.ones(hv, device=DEVICE)
    states = torch.zeros(len(lens) + 3, hv, dk, dv, device=DEVICE)
    before = states.clone()
    out = kg.fused_recurrent_gated_delta_rule(q, k, v, a, b, a_log, dt_bias, states, rows, cont, cu)
    for part, row, (o, final) in reference(q, k, v, a, b, a_log, dt_bias, before, cu, rows, cont):
        assert rel_err(out[part], o) < 2e-5 and rel_err(states[row], final) < 2e-5


def test_decode_steps_chain_like_one_recurrence():
    """Prefill then decode tokens one at a time through the in-place kernels: the same outputs and
    state as the reference over the whole sequence."""
    torch.manual_seed(3)
    hk, hv, dk, dv = SHAPES["tiny"]
    n, steps = 6, 4
    q, k, v, a, b, a_log, dt_bias, _ = gdn_inputs("tiny", [n + steps], torch.float32)
    states = torch.zeros(2, hv, dk, dv, device=DEVICE)
    row = torch.tensor([1], device=DEVICE)
    outs = [kg.fused_recurrent_gated_delta_rule(q[:n], k[:n], v[:n], a[:n], b[:n], a_log, dt_bias, states, row,
                                                torch.tensor([0], device=DEVICE),
                                                torch.tensor([0, n], device=DEVICE))]
    for t in range(n, n + steps):
        s = slice(t, t + 1)
        outs.append(kg.fused_recurrent_gated_delta_rule(q[s], k[s], v[s], a[s], b[s], a_log, dt_bias, states, row,
                                                        torch.tensor([1], device=DEVICE),
                                                        torch.tensor([0, 1], device=DEVICE)))
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    o, final = recurrent_gated_delta_rule(q, k, v, g, beta)
    assert rel_err(torch.cat(outs), o) < 2e-5 and rel_err(states[1], final) < 2e-5


@pytest.mark.skipif(DEVICE != "cuda", reason="flash-linear-attention runs on CUDA only")
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fla_chunked_prefill_equals_the_reference(shape):
    if not fla_gdn.available():
        pytest.skip("fla-core is not installed")
    torch.manual_seed(4)
    cu, rows, cont = ragged(LENS)
    q, k, v, a, b, a_log, dt_bias, states = gdn_inputs(shape, LENS, torch.bfloat16)
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    initial = states[rows] * cont[:, None, None, None]
    out, final = fla_gdn.chunk_gated_delta_rule(q, k, v, g, beta, initial, cu)
    for i, (part, row, (o, f)) in enumerate(reference(q, k, v, a, b, a_log, dt_bias, states, cu, rows, cont)):
        assert rel_err(out[part], o) < 2e-2 and rel_err(final[i], f) < 2e-2


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need CUDA")
def test_decode_kernels_replay_in_a_cuda_graph():
    """Captured once, replayed with new rows and inputs written into the same buffers: the state
    indices are read from device memory."""
    torch.manual_seed(5)
    hk, hv, dk, dv = SHAPES["27b"]
    bs, channels, kernel = 8, 2 * hk * dk + hv * dv, 4
    x = torch.randn(bs, channels, device=DEVICE, dtype=torch.bfloat16)
    weight = torch.randn(channels, kernel, device=DEVICE, dtype=torch.bfloat16)
    conv = torch.randn(bs + 1, kernel - 1, channels, device=DEVICE, dtype=torch.bfloat16)
    a, b = (torch.randn(bs, hv, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    a_log, dt_bias = torch.zeros(hv, device=DEVICE), torch.ones(hv, device=DEVICE)
    ssm = torch.randn(bs + 1, hv, dk, dv, device=DEVICE) * 0.1
    rows = torch.arange(bs, device=DEVICE)
    cont = torch.ones(bs, dtype=torch.int64, device=DEVICE)
    cu = torch.arange(bs + 1, device=DEVICE)

    def step():
        y = kg.causal_conv1d_decode(x, weight, conv, rows, cont)
        q = y[:, :hk * dk].view(bs, hk, dk)
        k = y[:, hk * dk:2 * hk * dk].view(bs, hk, dk)
        v = y[:, 2 * hk * dk:].view(bs, hv, dv)
        return kg.fused_recurrent_gated_delta_rule(q, k, v, a, b, a_log, dt_bias, ssm, rows, cont, cu)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    rows.copy_(torch.randperm(bs + 1, device=DEVICE)[:bs])
    x.copy_(torch.randn_like(x))
    conv_before, ssm_before = conv.clone(), ssm.clone()
    graph.replay()
    conv_after, ssm_after = conv.clone(), ssm.clone()
    conv.copy_(conv_before)
    ssm.copy_(ssm_before)
    eager = step().clone()
    torch.testing.assert_close(out, eager, atol=0, rtol=0)
    torch.testing.assert_close(conv_after, conv, atol=0, rtol=0)
    torch.testing.assert_close(ssm_after, ssm, atol=0, rtol=0)
