"""The core attention of relax's layer specs: fused causal attention without TransformerEngine.

megatron-core's local spec computes attention with DotProductAttention: unfused (the [b, heads, s, s] scores
materialised), with a mask tensor, and no packed (THD) rows. This module takes its place in every layer spec
relax builds. It computes causal attention with the platform's kernel (relax.platform.attention): over packed
rows when megatron passes PackedSeqParams (qkv_format "thd": each sequence attends to itself only), else over
right-padded rows with causality alone. It takes no attention mask: relax never builds one. Under context parallelism
the packed row's PackedSeqParams carry how the row is split over the CP ranks (relax.train.context_parallel), and
this rank's queries attend to the keys and values of the whole row the platform's way
(relax.platform.attention.CONTEXT_PARALLEL_ATTENTION): gathered over the CP group, or passed around it by MindSpeed's
ring attention.
"""

import math

import torch

from relax.platform import attention


class CoreAttention(torch.nn.Module):
    """Causal softmax attention with megatron's core-attention interface (DotProductAttention's arguments).
    It has no parameters, so it needs nothing of MegatronModule (and importing this module imports no megatron)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        kernel: str = "sdpa",
        context_parallel_attention: str = "all-gather",
    ):
        super().__init__()
        attention.check_kernel(kernel)
        attention.check_context_parallel_attention(context_parallel_attention)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"attention dropout {dropout} is not supported by relax's core attention: use 0")
        if config.window_size is not None:
            raise ValueError("relax's core attention has no sliding window")
        if attention_type != "self":
            raise ValueError(f"relax's core attention is self-attention only, not {attention_type!r}")
        self.kernel = kernel
        self.context_parallel = config.context_parallel_size > 1
        self.context_parallel_attention = context_parallel_attention
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        """query [s, b, heads, d] (or [t, heads, d] with packed_seq_params); key/value with their own head count.
        Returns [s, b, heads * d] (or [t, heads * d])."""
        if attention_mask is not None or attention_bias is not None:
            raise ValueError(
                "relax's core attention is causal and takes packed rows (PackedSeqParams), not an attention mask or "
                "bias: build micro-batches with relax.train.batch"
            )
        if self.context_parallel:
            return self._context_parallel(query, key, value, packed_seq_params)
        if packed_seq_params is None:
            out = attention.padded(
                self.kernel, query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), self.softmax_scale
            )
            return out.transpose(0, 1).flatten(2)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed rows must be in the thd format, got {packed_seq_params.qkv_format!r}")
        out = attention.packed(
            self.kernel,
            query,
            key,
            value,
            packed_seq_params.cu_seqlens_q,
            packed_seq_params.max_seqlen_q,
            self.softmax_scale,
        )
        return out.flatten(1)

    def _context_parallel(self, query, key, value, packed_seq_params):
        """This rank's queries [t / CP, heads, d] against the keys and values of the whole packed row."""
        row_split = getattr(packed_seq_params, "row_split", None)
        if row_split is None:
            raise ValueError(
                "context parallelism needs packed rows split over the CP ranks (PackedSeqParams with a row_split, "
                "relax.train.context_parallel.with_row_split): build micro-batches with relax.train.actor"
            )
        if self.context_parallel_attention == "mindspeed-ring" and attention.mindspeed_ring_takes(
            row_split.query_cu_seqlens
        ):
            out = attention.mindspeed_ring(
                query, key, value, row_split.query_cu_seqlens, row_split.group, self.softmax_scale
            )
            return out.flatten(1)
        keys, values = row_split.attention_keys_and_values(key, value)
        out = attention.packed_with_keys(
            self.kernel,
            query,
            keys,
            values,
            row_split.query_cu_seqlens,
            row_split.key_cu_seqlens,
            row_split.max_query_len,
            row_split.max_key_len,
            self.softmax_scale,
        )
        return out.flatten(1)


def with_core_attention(layer_spec, kernel: str, context_parallel_attention: str = "all-gather"):
    """A layer spec (a ModuleSpec, or TransformerBlockSubmodules of per-layer specs) whose softmax attention computes
    with CoreAttention(kernel, context_parallel_attention); layers without softmax attention (GDN) are left as they
    are."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec

    if hasattr(layer_spec, "layer_specs"):
        return dataclasses.replace(
            layer_spec,
            layer_specs=[
                with_core_attention(layer, kernel, context_parallel_attention) for layer in layer_spec.layer_specs
            ],
        )
    attention_spec = layer_spec.submodules.self_attention
    if not hasattr(attention_spec.submodules, "core_attention"):
        return layer_spec
    core = ModuleSpec(
        module=CoreAttention, params={"kernel": kernel, "context_parallel_attention": context_parallel_attention}
    )
    attention_spec = dataclasses.replace(
        attention_spec, submodules=dataclasses.replace(attention_spec.submodules, core_attention=core)
    )
    return dataclasses.replace(
        layer_spec, submodules=dataclasses.replace(layer_spec.submodules, self_attention=attention_spec)
    )
