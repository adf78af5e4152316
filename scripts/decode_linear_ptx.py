"""Compile the decode-row GEMMs (radixserve.kernels.decode_linear, decode_linear_fp8) for sm90 in
every epilogue and FP8 mode, without a GPU, and print a digest of each one's PTX instructions
(debug sections and line markers left out): a change meant to leave the kernels as they are (a
helper factored out, a comment) prints the same digests before and after.

    python scripts/decode_linear_ptx.py > after.txt; git stash; python scripts/decode_linear_ptx.py > before.txt
"""

import hashlib
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from radixserve.kernels import decode_linear as dl, decode_linear_fp8 as dl8

target = GPUTarget("cuda", 90, 32)


def compile_one(fn, signature, constexprs, num_warps=4, num_stages=4):
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    k = triton.compile(src, target=target, options=dict(num_warps=num_warps, num_stages=num_stages))
    ptx = k.asm["ptx"].split(".section")[0]  # the DWARF sections name the source and its helpers
    ptx = "\n".join(line for line in ptx.splitlines()
                    if not re.match(r"\s*(//|\.loc|\.file|\$L__tmp|\$L__func)", line))
    return hashlib.sha256(ptx.encode()).hexdigest()[:16], len(ptx)


sig = {"X": "*bf16", "W": "*bf16", "Bias": "*bf16", "Y": "*bf16", "M": "i32", "N": "i32", "K": "i32",
       "stride_xm": "i32", "stride_ym": "i32", "tiles_per_split": "i32"}
for gated in (False, True):
    for partial in (False, True):
        for bias in (False, True):
            c = dict(HAS_BIAS=bias, WRITE_PARTIAL=partial, GATED=gated, EVEN_N=True, BLOCK_M=16, BLOCK_N=64,
                     BLOCK_K=128)
            s = dict(sig); s.update({k: "constexpr" for k in c})
            if partial: s["Y"] = "*fp32"
            print("bf16", gated, partial, bias, compile_one(dl._decode_linear_kernel, s, c))
sig8 = {"X": "*fp8e4nv", "W": "*fp8e4nv", "Scale": "*fp32", "XScale": "*fp32", "Bias": "*bf16", "Y": "*bf16",
        "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_ym": "i32", "tiles_per_split": "i32"}
for gated in (False, True):
    for partial in (False, True):
        for xfp8, terms, fp16 in ((True, 0, False), (False, 1, False), (False, 2, False), (False, 0, True),
                                  (False, 0, False)):
            c = dict(HAS_BIAS=not gated, WRITE_PARTIAL=partial, GATED=gated, EVEN_N=False, X_FP8=xfp8, DOT_FP16=fp16,
                     X_TILE_TERMS=terms, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128)
            s = dict(sig8); s.update({k: "constexpr" for k in c})
            if not xfp8: s["X"] = "*bf16"
            if partial: s["Y"] = "*fp32"
            print("fp8", gated, partial, xfp8, terms, fp16, compile_one(dl8._decode_linear_fp8_kernel, s, c))
