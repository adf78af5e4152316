"""The torch reference of Gated DeltaNet (radixserve.model.layers.gated_delta): its chunked and
recurrent forms equal each other and transformers' torch fallback in float32, and prefill chunks
and decode steps chain through the returned states. The Triton kernels are checked against it in
tests/gpu/test_gated_delta_kernels.py."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from radixserve.model.layers.gated_delta import (causal_conv1d, chunk_gated_delta_rule, gdn_gates,
                                                 recurrent_gated_delta_rule)

ATOL = 2e-6


def inputs(t: int, hk: int = 2, hv: int = 4, dk: int = 16, dv: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(t, hk, dk, generator=g), torch.randn(t, hk, dk, generator=g)
    v = torch.randn(t, hv, dv, generator=g)
    a, b = torch.randn(t, hv, generator=g), torch.randn(t, hv, generator=g)
    gate, beta = gdn_gates(a, b, torch.randn(hv, generator=g) * 0.5, torch.randn(hv, generator=g))
    state = torch.randn(hv, dk, dv, generator=g)
    return q, k, v, gate, beta, state


@pytest.mark.parametrize("t", [1, 63, 64, 150])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_and_recurrent_forms_equal_transformers(t, with_state):
    q, k, v, g, beta, state = inputs(t)
    state = state if with_state else None
    o_rec, s_rec = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    o_chunk, s_chunk = chunk_gated_delta_rule(q, k, v, g, beta, state)
    hf_state = None if state is None else state[None]
    o_hf, s_hf = hf.torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                                 initial_state=hf_state, output_final_state=True,
                                                 use_qk_l2norm_in_kernel=True)
    o_hf_rec, s_hf_rec = hf.torch_recurrent_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                                             initial_state=hf_state, output_final_state=True,
                                                             use_qk_l2norm_in_kernel=True)
    for o, s in ((o_chunk, s_chunk), (o_hf[0], s_hf[0]), (o_hf_rec[0], s_hf_rec[0])):
        torch.testing.assert_close(o, o_rec, atol=ATOL, rtol=0)
        torch.testing.assert_close(s, s_rec, atol=ATOL * 10, rtol=0)


def test_the_state_chains_prefill_chunks_and_decode_steps():
    q, k, v, g, beta, _ = inputs(100, seed=1)
    whole, final = chunk_gated_delta_rule(q, k, v, g, beta)
    o1, s = chunk_gated_delta_rule(q[:37], k[:37], v[:37], g[:37], beta[:37])
    o2, s = chunk_gated_delta_rule(q[37:98], k[37:98], v[37:98], g[37:98], beta[37:98], s)
    steps = []
    for t in (98, 99):
        o, s = recurrent_gated_delta_rule(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], s)
        steps.append(o)
    torch.testing.assert_close(torch.cat([o1, o2, *steps]), whole, atol=ATOL, rtol=0)
    torch.testing.assert_close(s, final, atol=ATOL * 10, rtol=0)


def test_grouped_value_heads_read_their_key_head():
    """Value heads 2h and 2h + 1 read key head h (transformers' repeat_interleave)."""
    q, k, v, g, beta, _ = inputs(20, hk=2, hv=4, seed=2)
    o, _ = recurrent_gated_delta_rule(q, k, v, g, beta)
    alone, _ = recurrent_gated_delta_rule(q[:, 1:2], k[:, 1:2], v[:, 2:4], g[:, 2:4], beta[:, 2:4])
    torch.testing.assert_close(o[:, 2:4], alone, atol=0, rtol=0)


def test_causal_conv_equals_transformers_and_chains():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(30, 12, generator=g), torch.randn(12, 4, generator=g)
    y, window = causal_conv1d(x, w)
    y_hf = hf.causal_conv1d_fn(x.t()[None], w, None, activation="silu")[0].t()
    torch.testing.assert_close(y, y_hf, atol=ATOL, rtol=0)
    torch.testing.assert_close(window, x[-3:], atol=0, rtol=0)
    y1, s = causal_conv1d(x[:2], w)  # shorter than the window: part of it is the zeros before
    y2, s = causal_conv1d(x[2:29], w, s)
    # transformers' decode step: its conv state holds the last `kernel` inputs
    hf_state = torch.cat((torch.zeros(1, 12), s), dim=0).t()[None].clone()
    y3 = hf.causal_conv1d_update(x[29:].t()[None], hf_state, w, None, "silu")[0].t()
    torch.testing.assert_close(torch.cat([y1, y2, y3]), y, atol=ATOL, rtol=0)


def test_a_batched_decode_step_equals_each_sequence_alone():
    from radixserve.model.layers.gated_delta import recurrent_step

    q, k, v, g, beta, _ = inputs(3, seed=4)  # three sequences of one token each
    states = torch.randn(3, 4, 16, 8, generator=torch.Generator().manual_seed(5))
    o, new = recurrent_step(q, k, v, g, beta, states)
    for b in range(3):
        s = slice(b, b + 1)
        o_b, new_b = recurrent_gated_delta_rule(q[s], k[s], v[s], g[s], beta[s], states[b])
        torch.testing.assert_close(o[b], o_b[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(new[b], new_b, atol=ATOL, rtol=0)
