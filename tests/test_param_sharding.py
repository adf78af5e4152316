"""The weight formats' shard declarations: for each format and each of its checkpoint parameters,
what a rank of tp 2 holds after loading a whole checkpoint tensor is the slice worked out by hand
(column-parallel fused shards, row-parallel input columns, the routed experts' intermediate), block
scales whose tensor ends in a partial block included; and the loaders never switch on a
parameter's name.

Real layers, real loading (`load_weight`, as the loader calls it), on the CPU; the ranks are
`TensorParallel` values (rank, size) with no process group: loading runs no collective.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from radixserve.distributed import TensorParallel
from radixserve.model.layers import KernelChoice
from radixserve.model.layers.fp8 import FP8_DTYPE, quantize_rows, quantize_with, row_scales
from radixserve.model.layers.moe import FusedExperts
from radixserve.model.layers.parallel import ColumnParallelLinear, RowParallelLinear
from radixserve.model.layers.quant_method import ExpertsMethod, LinearMethod
from radixserve.model.quantization import Fp8Config

CPU = KernelChoice.for_device("cpu", torch.float32)
PACKAGE = Path(__file__).resolve().parents[1] / "radixserve"

CHANNEL = Fp8Config(from_checkpoint=True, weight_scales="channel", source="test")
TENSOR_STATIC = Fp8Config(from_checkpoint=True, weight_scales="tensor", activations="static", source="test")
AT_LOAD = Fp8Config(from_checkpoint=False)
BLOCK = Fp8Config(from_checkpoint=True, weight_scales="block", block=(16, 32), source="test")


@pytest.fixture(autouse=True)
def as_the_loader():
    with torch.no_grad():  # the loader fills parameters without autograd
        yield


def rank(r: int) -> TensorParallel:
    return TensorParallel(rank=r, size=2, device=torch.device("cpu"))


def e4m3(*shape: int, seed: int) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 8).to(FP8_DTYPE)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def column(r: int, fp8=None, k: int = 48, bias: bool = False) -> ColumnParallelLinear:
    """gate|up of an intermediate of 64 (32 rows a rank) over k input columns, rank r of 2."""
    return ColumnParallelLinear(k, {0: (32 * r, 32), 1: (32 * r, 32)}, bias=bias, dtype=torch.float32,
                                kernels=CPU, fp8=fp8)


def row(r: int, fp8=None, n: int = 40) -> RowParallelLinear:
    """down_proj of 64 input columns (32 a rank) into n output rows, rank r of 2."""
    return RowParallelLinear(32, n, start=32 * r, dtype=torch.float32, kernels=CPU, tp=None, fp8=fp8)


# --------------------------------------------------------------------------- projections

@pytest.mark.parametrize("r", [0, 1])
def test_plain_weight_and_bias_take_their_rows_or_columns(r):
    gate, up, bias_g, bias_u = torch.randn(64, 48), torch.randn(64, 48), torch.randn(64), torch.randn(64)
    layer = column(r, bias=True)
    for shard, w, b in ((0, gate, bias_g), (1, up, bias_u)):
        layer.load_weight("weight", w, shard)
        layer.load_weight("bias", b, shard)
    mine = slice(32 * r, 32 * r + 32)
    assert torch.equal(layer.weight, torch.cat([gate[mine], up[mine]]))
    assert torch.equal(layer.bias, torch.cat([bias_g[mine], bias_u[mine]]))
    down = torch.randn(40, 64)
    layer = row(r)
    layer.load_weight("weight", down)
    assert torch.equal(layer.weight, down[:, mine])


@pytest.mark.parametrize("r", [0, 1])
def test_per_channel_fp8_rows_with_their_scales(r):
    gate, up = e4m3(64, 48, seed=1), e4m3(64, 48, seed=2)
    gate_scale = torch.rand(64, 1) + 0.5  # per channel, as compressed-tensors writes it
    layer = column(r, CHANNEL)
    layer.load_weight("weight", gate, 0)
    layer.load_weight("weight", up, 1)
    layer.load_weight("weight_scale", gate_scale, 0)
    layer.load_weight("weight_scale", torch.tensor([0.25]), 1)  # one value: the whole tensor's
    mine = slice(32 * r, 32 * r + 32)
    assert same_bytes(layer.weight, torch.cat([gate[mine], up[mine]]))
    assert torch.equal(layer.weight_scale, torch.cat([gate_scale[mine, 0], torch.full((32,), 0.25)]))
    # Row-parallel: its input columns of the e4m3 weight, every output row's whole scale.
    down, down_scale = e4m3(40, 64, seed=3), torch.rand(40, 1) + 0.5
    layer = row(r, CHANNEL)
    layer.load_weight("weight", down)
    layer.load_weight("weight_scale", down_scale)
    assert same_bytes(layer.weight, down[:, mine]) and torch.equal(layer.weight_scale, down_scale[:, 0])


@pytest.mark.parametrize("r", [0, 1])
def test_static_input_scales_are_replicated_one_per_shard(r):
    layer = column(r, TENSOR_STATIC)
    for shard, (w_scale, x_scale) in enumerate(((0.5, 0.02), (2.0, 0.03))):
        layer.load_weight("weight_scale", torch.tensor(w_scale), shard)  # shape [], as the fp8 format writes it
        layer.load_weight("input_scale", torch.tensor(x_scale), shard)
    assert layer.weight_scale.tolist() == [0.5] * 32 + [2.0] * 32
    assert layer.input_scale.tolist() == pytest.approx([0.02, 0.03])
    layer = row(r, TENSOR_STATIC)
    layer.load_weight("input_scale", torch.tensor(0.04))
    layer.load_weight("weight_scale", torch.tensor(3.0))
    assert layer.input_scale.tolist() == pytest.approx([0.04]) and layer.weight_scale.tolist() == [3.0] * 40


@pytest.mark.parametrize("r", [0, 1])
def test_quantized_at_load_rows_keep_the_whole_rows_scale(r):
    gate, down = torch.randn(64, 48), torch.randn(40, 64)
    down[7, 50] = 30.0  # row 7's largest value lies in rank 1's columns
    mine = slice(32 * r, 32 * r + 32)
    layer = column(r, AT_LOAD)
    layer.load_weight("weight", gate, 0)
    wq, scale = quantize_rows(gate[mine])
    assert same_bytes(layer.weight[:32], wq) and torch.equal(layer.weight_scale[:32], scale)
    layer = row(r, AT_LOAD)
    layer.load_weight("weight", down)
    whole = row_scales(down)
    assert torch.equal(layer.weight_scale, whole)
    assert same_bytes(layer.weight, quantize_with(down[:, mine], whole[:, None]))


@pytest.mark.parametrize("r", [0, 1])
def test_block_scales_take_their_block_rows_or_block_columns(r):
    """Blocks of 16 rows x 32 columns. Column-parallel: 32 rows a shard (2 block rows) over 48
    input columns (2 block columns, the second half-full); row-parallel: 32 input columns a rank (1
    block column) into 40 output rows (3 block rows, the last half-full)."""
    gate, up = e4m3(64, 48, seed=4), e4m3(64, 48, seed=5)
    gate_s, up_s = torch.rand(4, 2), torch.rand(4, 2)
    layer = column(r, BLOCK)
    assert layer.weight_scale_inv.shape == (4, 2)
    for shard, w, s in ((0, gate, gate_s), (1, up, up_s)):
        layer.load_weight("weight", w, shard)
        layer.load_weight("weight_scale_inv", s, shard)
    mine, blocks = slice(32 * r, 32 * r + 32), slice(2 * r, 2 * r + 2)
    assert same_bytes(layer.weight, torch.cat([gate[mine], up[mine]]))
    assert torch.equal(layer.weight_scale_inv, torch.cat([gate_s[blocks], up_s[blocks]]))
    down, down_s = e4m3(40, 64, seed=6), torch.rand(3, 2)
    layer = row(r, BLOCK)
    layer.load_weight("weight", down)
    layer.load_weight("weight_scale_inv", down_s)
    assert same_bytes(layer.weight, down[:, mine]) and torch.equal(layer.weight_scale_inv, down_s[:, r:r + 1])


def test_a_tensor_too_small_for_the_ranks_part_is_refused():
    with pytest.raises(ValueError, match=r"has shape \(48, 48\): this rank reads output rows 32..63"):
        column(1).load_weight("weight", torch.randn(48, 48), 0)
    with pytest.raises(ValueError, match="block-wise scales are `weight_scale_inv` under a weight_block_size"):
        column(0, CHANNEL).load_weight("weight_scale", torch.ones(64, 2), 0)
    with pytest.raises(ValueError, match="has no checkpoint parameter 'weight_scale'"):
        column(0).load_weight("weight_scale", torch.ones(64), 0)


# --------------------------------------------------------------------------- routed experts

E, H, INTER = 2, 48, 64  # INTER: the whole intermediate (32 a rank)


def experts(r: int, fp8=None) -> FusedExperts:
    return FusedExperts(E, H, INTER, dtype=torch.float32, kernels=CPU, tp=rank(r), fp8=fp8)


@pytest.mark.parametrize("r", [0, 1])
def test_experts_hold_their_slice_of_every_experts_intermediate(r):
    mine = slice(32 * r, 32 * r + 32)
    layer = experts(r)
    for e in range(E):
        gate, up, down = torch.randn(INTER, H), torch.randn(INTER, H), torch.randn(H, INTER)
        layer.load_weight("w13_weight", gate, (e, "gate"))
        layer.load_weight("w13_weight", up, (e, "up"))
        layer.load_weight("w2_weight", down, (e, "down"))
        assert torch.equal(layer.w13_weight[e], torch.cat([gate[mine], up[mine]]))
        assert torch.equal(layer.w2_weight[e], down[:, mine])


@pytest.mark.parametrize("r", [0, 1])
def test_fp8_experts_scales_follow_their_weights(r):
    mine = slice(32 * r, 32 * r + 32)
    # Per channel: gate/up scales by rows (or one value), down's whole.
    layer = experts(r, CHANNEL)
    gate_s, down_s = torch.rand(INTER, 1), torch.rand(H)
    layer.load_weight("w13_weight", e4m3(INTER, H, seed=7), (1, "gate"))
    layer.load_weight("w13_weight_scale", gate_s, (1, "gate"))
    layer.load_weight("w13_weight_scale", torch.tensor(0.75), (1, "up"))
    layer.load_weight("w2_weight_scale", down_s, (1, "down"))
    assert torch.equal(layer.w13_weight_scale[1], torch.cat([gate_s[mine, 0], torch.full((32,), 0.75)]))
    assert torch.equal(layer.w2_weight_scale[1], down_s)
    # Block-wise (16 x 32): gate/up by block rows, down by block columns, H = 48 ends in a half block.
    layer = experts(r, BLOCK)
    up_s, down_bs, down = torch.rand(4, 2), torch.rand(3, 2), e4m3(H, INTER, seed=8)
    layer.load_weight("w13_weight_scale_inv", up_s, (0, "up"))
    layer.load_weight("w2_weight_scale_inv", down_bs, (0, "down"))
    layer.load_weight("w2_weight", down, (0, "down"))
    assert torch.equal(layer.w13_weight_scale_inv[0, 2:], up_s[2 * r:2 * r + 2])
    assert torch.equal(layer.w2_weight_scale_inv[0], down_bs[:, r:r + 1])
    assert same_bytes(layer.w2_weight[0], down[:, mine])
    # Quantized at load: a down row's scale is the whole row's, on every rank.
    layer = experts(r, AT_LOAD)
    plain = torch.randn(H, INTER)
    layer.load_weight("w2_weight", plain, (0, "down"))
    assert torch.equal(layer.w2_weight_scale[0], row_scales(plain))
    assert same_bytes(layer.w2_weight[0], quantize_with(plain[:, mine], row_scales(plain)[:, None]))


def test_an_expert_tensor_of_another_size_is_refused():
    with pytest.raises(ValueError, match=r"has shape \(65, 48\), expected 64 along dim 0"):
        experts(0).load_weight("w13_weight", torch.randn(INTER + 1, H), (0, "gate"))
    with pytest.raises(ValueError, match="has no shard"):
        experts(0).load_weight("w13_weight", torch.randn(INTER, H), (0, "side"))


# --------------------------------------------------------------------------- structure

def test_every_format_implements_the_protocol():
    """Each format has the protocol's members, and a declaration for every parameter the loader
    can route to it (a bias the layer does not have is declared anyway)."""
    layers = [column(0), column(0, CHANNEL), column(0, AT_LOAD), column(0, BLOCK), row(0, TENSOR_STATIC)]
    for layer in layers:
        method = layer.quant_method
        for name in ("create_weights", "choose_kernels", "takes_fp8_activations", "finish_loading", "fill_dummy",
                     "apply"):
            assert callable(getattr(method, name)), (type(method).__name__, name)
        assert {n for n, _ in layer.named_parameters()} <= set(method.params), type(method).__name__
        assert LinearMethod.__annotations__.keys() <= set(vars(type(method))) | set(vars(method))
    for fp8 in (None, CHANNEL, AT_LOAD, BLOCK):
        layer = experts(0, fp8)
        method = layer.quant_method
        for name in ("create_weights", "finish_loading", "fill_dummy", "dequantized", "kernel_args", "fit_configs"):
            assert callable(getattr(method, name)), (type(method).__name__, name)
        assert set(method.params) == {n for n, _ in layer.named_parameters()}
        assert ExpertsMethod.__annotations__.keys() <= set(vars(type(method))) | set(vars(method))


# The modules that route and cut checkpoint tensors: none may name a weight format's parameter.
LOADER_MODULES = ("model/loader.py", "model/layers/linear.py", "model/layers/parallel.py", "model/layers/moe.py",
                  "model/layers/param_sharding.py", "model/layers/gated_delta_net.py", "distributed/sharding.py")
FORMAT_NAMES = re.compile(r"weight_scale|input_scale|scale_inv")


def _code_strings(path: Path) -> list[str]:
    """Every string constant of a module but its docstrings (f-string parts included)."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return [n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]


def test_no_loader_switches_on_a_quantized_parameters_name():
    found = {module: hits for module in LOADER_MODULES
             if (hits := [s for s in _code_strings(PACKAGE / module) if FORMAT_NAMES.search(s)])}
    assert found == {}, "the weight formats declare how their parameters shard (param_sharding): cut from those"
    # The check sees such names where they are (the formats' own modules hold them).
    assert any(FORMAT_NAMES.search(s) for s in _code_strings(PACKAGE / "model/layers/fp8.py"))
