"""The chunked gated delta rule and the q/k l2norm that the training actor's GDN layers compute with, by name.

    "fla"        flash-linear-attention's Triton kernels (what megatron-core's GatedDeltaNet imports), with
                 cu_seqlens for packed rows; needs the fla package and a Triton that compiles them
    "mindspeed"  MindSpeed's Triton kernels for Ascend NPUs (mindspeed.core.ssm.chunk_gated_delta_rule and
                 mindspeed.ops.triton.l2norm, on MindSpeed's branch core_r0.16.0): forward and backward, with
                 cu_seqlens; needs MindSpeed and triton-ascend (relax's NPU image installs both) and half-precision
                 q/k/v (they refuse float32)
    "reference"  relax.kernels.gdn_reference: float32 torch, differentiable by autograd, on any device; the fallback
                 that always runs (slower: per-sequence chunked loops)
    "relax"      relax.kernels.gdn_chunk_triton: relax's float32 rule with every packed sequence at once, the state
                 passed between chunks by Triton kernels (forward and backward), the rest batched torch; where Triton
                 compiles (CUDA), or interpreted (TRITON_INTERPRET=1) on the CPU

The platform record names its default (Platform.gdn_training_kernel); `--gdn-training-kernel` overrides it. All
take fla's arguments: chunk_gated_delta_rule(q, k, v, g=, beta=, initial_state=, output_final_state=,
use_qk_l2norm_in_kernel=, cu_seqlens=) on [1, t, heads, d], and l2norm(x); relax's rule also the keyword launch=
(Platform.triton_launch of the device). MindSpeed's functions take exactly these
(its rule was written as a drop-in for fla's, and its adaptor puts it at fla's entry point), so they are used as
they are.
"""

GDN_TRAINING_KERNELS = ("fla", "mindspeed", "reference", "relax")

# MindSpeed's l2norm kernels take the row count (tokens x heads) as a tl.constexpr and autotune per cdiv(rows, 2048)
# (mindspeed/ops/triton/l2norm.py at e4772499f7eb): triton-ascend compiles them anew, forward and backward, for every
# packed length, and packed micro-batches rarely repeat one. Padding the packed tokens with zero rows to a multiple of
# this many bounds the compilations by the token budget / 1024 for at most 1023 rows of extra work per call.
L2NORM_BUCKET_TOKENS = 1024

# The package each kernel imports, as an error tells the user to get it.
KERNEL_PACKAGES = {
    "fla": ("fla", "flash-linear-attention (pip install flash-linear-attention)"),
    "mindspeed": (
        "mindspeed",
        "MindSpeed (github.com/Ascend/MindSpeed, branch core_r0.16.0; relax's NPU image, docker/Dockerfile.npu, "
        "installs it)",
    ),
}


def gdn_training_kernel(name: str):
    """(chunk_gated_delta_rule, l2norm) of the kernel `name`."""
    if name == "fla":
        from fla.modules.l2norm import l2norm
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        return chunk_gated_delta_rule, l2norm
    if name == "mindspeed":
        from mindspeed.core.ssm.chunk_gated_delta_rule import chunk_gated_delta_rule
        from mindspeed.ops.triton.l2norm import l2norm

        return chunk_gated_delta_rule, bucketed_l2norm(l2norm)
    if name == "reference":
        from relax.kernels import gdn_reference

        return gdn_reference.chunk_gated_delta_rule, gdn_reference.l2norm
    if name == "relax":
        from relax.kernels import gdn_chunk_triton, gdn_reference

        return gdn_chunk_triton.chunk_gated_delta_rule, gdn_reference.l2norm
    raise ValueError(f"unknown GDN training kernel {name!r}: choose one of {', '.join(GDN_TRAINING_KERNELS)}")


def bucketed_l2norm(l2norm):
    """l2norm over [1, t, heads, d] computed on t padded with zero rows to a multiple of L2NORM_BUCKET_TOKENS (a zero
    row normalises to zero and gets no gradient), sliced back to t."""
    import torch.nn.functional as F

    def padded(x):
        tokens = x.shape[1]
        extra = -tokens % L2NORM_BUCKET_TOKENS
        if extra == 0:
            return l2norm(x)
        return l2norm(F.pad(x, (0, 0, 0, 0, 0, extra)))[:, :tokens]

    return padded
