"""Names of the hand-written passes and where they live, in default run order.

This module is data: it imports nothing from mfusion, so the config (which validates pass names
against it) stays a leaf and no import cycle runs through the registry. The pass manager turns a
name into an instance (:func:`mfusion.passes.manager.build_pass`).
"""

from __future__ import annotations

# Order matters: the fused norms claim their patterns before the plain ones; matmul rewrites that
# change operands (casts, transposes) run before those that restructure the call.
PASS_REGISTRY: dict[str, str] = {
    "add_rmsnorm": "mfusion.passes.add_rmsnorm:AddRMSNormPass",
    "rmsnorm": "mfusion.passes.rmsnorm:RMSNormPass",
    "layernorm": "mfusion.passes.layernorm:LayerNormPass",
    "meanvar": "mfusion.passes.meanvar:MeanVarPass",
    "rope": "mfusion.passes.rope:RoPEPass",
    "attention": "mfusion.passes.attention:AttentionPass",
    "gelu": "mfusion.passes.gelu:GELUPass",
    "swiglu": "mfusion.passes.swiglu:SwiGLUPass",
    "patch_conv": "mfusion.passes.patch_conv:PatchConvPass",
    "conv_layout": "mfusion.passes.conv_layout:ConvLayoutPass",
    "matmul_cast": "mfusion.passes.matmul_cast:MatMulCastPass",
    "matmul_transpose": "mfusion.passes.matmul_transpose:MatMulTransposePass",
    "bmm_to_mm": "mfusion.passes.bmm_to_mm:BMMToMMPass",
    "k1_matmul": "mfusion.passes.k1_matmul:K1MatMulPass",
    "matmul_reshape_bias": "mfusion.passes.matmul_reshape_bias:MatMulReshapeBiasPass",
    "matmul_bias": "mfusion.passes.matmul_bias:MatMulBiasPass",
    "linear_kernel": "mfusion.passes.linear_kernel:LinearKernelPass",
    # last: linear_kernel recognises the activation after a GEMM by what it computes, to offer
    # oneDNN's fused epilogue first; whatever erf/tanh is left becomes a rational function
    "rational": "mfusion.passes.rational:RationalPass",
}
