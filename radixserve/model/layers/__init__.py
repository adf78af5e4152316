"""The model's layers, each of which picks its kernel once, when it is built, from a KernelChoice:
Triton kernels on CUDA in bfloat16/float16, torch ops elsewhere (the reference path).

A model is written once against these layers; tensor parallelism or another weight format
changes a layer (its shapes, its kernel, its `load_weight`), not the model.
"""

from radixserve.model.layers.activation import SiluAndMul
from radixserve.model.layers.kernel_choice import KernelChoice
from radixserve.model.layers.linear import Linear, MergedLinear, ShardId, copy_weight
from radixserve.model.layers.norm import RMSNorm
from radixserve.model.layers.rotary import RotaryEmbedding, rope_cos_sin

__all__ = ["KernelChoice", "Linear", "MergedLinear", "RMSNorm", "RotaryEmbedding", "ShardId", "SiluAndMul",
           "copy_weight", "rope_cos_sin"]
