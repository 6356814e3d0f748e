"""Triton kernels relax writes for sgl-kernel-npu, SGLang's Ascend kernel package.

patches/sgl-kernel-npu carries every module of this directory, byte for byte, into sgl-kernel-npu's tree as
python/sgl_kernel_npu/sgl_kernel_npu/relax/ (relax/tools/sgl_kernel_npu_patches.py writes the patches from these
files; tests/unit/test_sgl_kernel_npu_patches.py fails when a patch and its file differ). So the modules import
only torch, triton and each other (relative imports), and the same source runs in relax (tests under
TRITON_INTERPRET=1, the CUDA decode kernel's shared steps) and in sgl_kernel_npu on an NPU.

- launch: the 1-D grid of every kernel here, one program per vector core of the NPU.
- sigmoid_mul: x * sigmoid(gate), elementwise or with one gate per row (Qwen3.5's attention output gate, the
  shared expert's gate of Qwen2/3/3.5-MoE blocks).
- gdn_decode: the gated delta rule's recurrent update with the sigmoid gating fused in, over SGLang's slot-indexed
  state pool (what SGLang's Ascend GDN backend calls for a decode batch).
- moe_routing: the MoE routing front, softmax or sigmoid scores, top-k and the k weights renormalised.

Written to triton-ascend's porting rules: 1-D grids of at most the vector cores with programs looping over work
items, power-of-two block shapes, float32 tiles bounded well inside the vector core's unified buffer, no
num_warps / num_stages and no CUDA-only intrinsics. None of it has run on an NPU.
"""
