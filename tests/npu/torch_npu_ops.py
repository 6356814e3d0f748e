"""CPU stand-ins for the torch_npu operators relax calls, bound by the real schemas of the paired torch-npu wheel.

torch_npu defines its operators in the `npu` namespace of torch's dispatcher and exposes each as
`torch_npu.<name> = torch.ops.npu.<name>`. This module does the same with the schemas in torch_npu_schemas.json
(extracted from the wheel by extract_torch_npu_schemas.py): a call therefore goes through torch's own argument
binding against the wheel's declaration, overloads included, and a wrong keyword, a missing argument or a wrong type
fails there with torch's message naming the operator and the argument. Behind the binding, a torch CPU computation of
the op for the cases relax and MindSpeed use (registered as CompositeImplicitAutograd, so autograd differentiates it);
any other mode, and every documented constraint the computation relies on, raises an error naming the op and the
argument. The semantics follow the wheel's own documentation (torch_npu/_op_plugin_docs.py) and the output shapes its
meta functions give (torch_npu/op_plugin/meta/_meta_registrations.py).

    import torch_npu_ops
    torch_npu_ops.install(module)   # module.npu_fusion_attention etc. = torch.ops.npu.<name>
"""

import functools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

SCHEMAS = json.loads(Path(__file__).with_name("torch_npu_schemas.json").read_text())

# npu_fusion_attention's causal sparse modes read a compressed 2048 x 2048 mask, True above the diagonal (wheel docs:
# "sparse_mode为2/3时 ... atten_mask为优化后的压缩下三角矩阵(2048*2048)").
CAUSAL_MASK_SIZE = 2048
LEFT_UP_CAUSAL, RIGHT_DOWN_CAUSAL = 2, 3
SOFTMAX_STAT_WIDTH = 8  # softmax_max / softmax_sum are [T, N, 8] in TND (the wheel's meta function)
# The TND limits of npu_fusion_attention (wheel docs, 约束说明): at most 1K sequences per call in varlen, T up to 1M,
# head dims Dq = Dk >= Dv up to 768, up to 256 query heads.
FUSION_ATTENTION_MAX_SEQUENCES = 1024
FUSION_ATTENTION_MAX_TOKENS = 1024 * 1024
FUSION_ATTENTION_MAX_HEAD_DIM = 768
FUSION_ATTENTION_MAX_HEADS = 256
GROUPED_MATMUL_MAX_WEIGHTS = 128  # a weight list holds at most 128 tensors (wheel docs)
GROUPED_MATMUL_MAX_GROUPS = 1024  # a single 3-D weight takes at most 1024 groups (wheel docs)


class NpuOpError(ValueError):
    """A call the real operator refuses (a documented constraint), named by op and argument."""


class NotComputed(NotImplementedError):
    """A mode of the operator this CPU stand-in does not compute (relax does not use it)."""


def _require(condition: bool, op: str, argument: str, message: str) -> None:
    if not condition:
        raise NpuOpError(f"torch_npu.{op}: {argument}: {message}")


def _refuse_unused(op: str, **arguments) -> None:
    for name, value in arguments.items():
        if value is not None:
            raise NotComputed(f"torch_npu.{op}: {name} is not computed by the CPU stand-in (relax passes None)")


def _causal_keep(sparse_mode: int, q_len: int, kv_len: int, device) -> torch.Tensor:
    """[q_len, kv_len], True where a query attends a key: leftUpCausal aligns the diagonal to the top-left corner,
    rightDownCausal to the bottom-right (the two coincide when q_len == kv_len)."""
    shift = kv_len - q_len if sparse_mode == RIGHT_DOWN_CAUSAL else 0
    rows = torch.arange(q_len, device=device)[:, None]
    cols = torch.arange(kv_len, device=device)[None, :]
    return cols <= rows + shift


def _check_sequence_ends(op: str, ends, total: int, argument: str) -> None:
    _require(ends is not None, op, argument, "required with input_layout='TND'")
    _require(
        all(b >= a for a, b in zip([0] + list(ends), ends)), op, argument,
        f"cumulative sequence ends must not decrease, got {list(ends)}",
    )
    _require(
        len(ends) > 0 and ends[-1] == total, op, argument,
        f"the last cumulative end {ends[-1] if ends else None} must equal the packed length {total}",
    )


def _check_attention_call(
    op, query, key, value, head_num, input_layout, atten_mask, keep_prob, actual_seq_qlen, actual_seq_kvlen,
    sparse_mode, softmax_layout, **unused,
) -> None:
    """The arguments npu_fusion_attention and its gradient share, against the wheel's documented constraints (and the
    modes the stand-in computes)."""
    if input_layout != "TND":
        raise NotComputed(f"torch_npu.{op}: input_layout {input_layout!r}: the CPU stand-in computes 'TND' only")
    _refuse_unused(op, **unused)
    if keep_prob != 1.0:
        raise NotComputed(f"torch_npu.{op}: keep_prob {keep_prob}: dropout is not computed by the CPU stand-in")
    if softmax_layout not in ("", "TND"):
        raise NpuOpError(
            f"torch_npu.{op}: softmax_layout: only '' or 'TND' with input_layout='TND', got {softmax_layout!r}"
        )
    _require(query.dim() == 3 and key.dim() == 3 and value.dim() == 3, op, "query/key/value", "TND takes [T, N, D]")
    _require(query.dtype == key.dtype == value.dtype, op, "key/value", "query, key and value need one dtype")
    heads, kv_heads = query.shape[1], key.shape[1]
    _require(head_num == heads, op, "head_num", f"{head_num} differs from query's {heads} heads")
    _require(
        heads <= FUSION_ATTENTION_MAX_HEADS, op, "query", f"at most {FUSION_ATTENTION_MAX_HEADS} heads, got {heads}"
    )
    _require(key.shape == value.shape[:2] + key.shape[2:], op, "value", "key and value differ in tokens or heads")
    _require(heads % kv_heads == 0, op, "key", f"{kv_heads} key/value heads do not divide {heads} query heads")
    _require(query.shape[2] == key.shape[2], op, "key", "query and key head dims differ")
    _require(
        value.shape[2] <= key.shape[2] <= FUSION_ATTENTION_MAX_HEAD_DIM, op, "value",
        f"head dims need Dv <= Dk <= {FUSION_ATTENTION_MAX_HEAD_DIM}, got Dk={key.shape[2]}, Dv={value.shape[2]}",
    )
    _require(query.shape[0] <= FUSION_ATTENTION_MAX_TOKENS, op, "query", f"T {query.shape[0]} is above 1M tokens")
    _check_sequence_ends(op, actual_seq_qlen, query.shape[0], "actual_seq_qlen")
    _check_sequence_ends(op, actual_seq_kvlen, key.shape[0], "actual_seq_kvlen")
    _require(len(actual_seq_qlen) == len(actual_seq_kvlen), op, "actual_seq_kvlen", "one end per query sequence")
    _require(
        len(actual_seq_qlen) <= FUSION_ATTENTION_MAX_SEQUENCES, op, "actual_seq_qlen",
        f"at most {FUSION_ATTENTION_MAX_SEQUENCES} sequences per call in TND, got {len(actual_seq_qlen)}",
    )
    if sparse_mode in (LEFT_UP_CAUSAL, RIGHT_DOWN_CAUSAL):
        _require(atten_mask is not None, op, "atten_mask", f"sparse_mode {sparse_mode} reads the 2048 x 2048 mask")
        _require(
            atten_mask.dtype in (torch.bool, torch.uint8)
            and tuple(atten_mask.shape) == (CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE)
            and torch.equal(atten_mask.bool(), _compressed_causal_mask(atten_mask.device)),
            op, "atten_mask",
            f"sparse_mode {sparse_mode} needs the 2048 x 2048 bool/uint8 mask, True above the diagonal",
        )
    elif not (sparse_mode == 0 and atten_mask is None):
        # sparse_mode 0 without a mask attends every key, whatever pre_tockens and next_tockens say (wheel docs)
        raise NotComputed(
            f"torch_npu.{op}: sparse_mode {sparse_mode} (with this atten_mask) is not computed by the CPU stand-in"
        )


def _sequences(actual_seq_qlen, actual_seq_kvlen):
    """(query start, query end, key start, key end) of each sequence of a TND call."""
    return zip([0] + list(actual_seq_qlen[:-1]), actual_seq_qlen, [0] + list(actual_seq_kvlen[:-1]), actual_seq_kvlen)


def _heads_first(x, start: int, end: int, group: int = 1) -> torch.Tensor:
    """Rows start:end of a [T, N, D] tensor as float32 [N * group, s, D] (key/value heads repeated to the query's)."""
    return x[start:end].float().repeat_interleave(group, dim=1).transpose(0, 1)


def _masked_logits(q, k, scale: float, sparse_mode: int) -> torch.Tensor:
    logits = scale * q @ k.transpose(1, 2)  # [N, sq, skv]
    if sparse_mode != 0:
        logits = logits.masked_fill(~_causal_keep(sparse_mode, q.shape[1], k.shape[1], q.device), float("-inf"))
    return logits


# softmax_max / softmax_sum in TND: [T, N, 8] (the wheel's meta function), each row's value repeated 8 times. Their
# order in memory: with softmax_layout "TND", token-major; by default "NTD" (the wheel's docs), which MindSpeed's TND
# ring attention reads sequence by sequence, each sequence's [N, s, 8] block after the previous one's
# (context_parallel/utils.py flatten_softmax and get_selection_indices_for_tnd_softmax_update). The two readings of
# "NTD" agree for a call of one sequence; the stand-in follows MindSpeed's.
def _stats_out(per_sequence: list, layout: str, total: int, heads: int) -> torch.Tensor:
    """[T, N, 8] from each sequence's [N, s, 1]."""
    if layout == "TND":
        return torch.cat(per_sequence, dim=1).transpose(0, 1).expand(-1, -1, SOFTMAX_STAT_WIDTH).contiguous()
    blocks = [stat.expand(-1, -1, SOFTMAX_STAT_WIDTH).reshape(-1, SOFTMAX_STAT_WIDTH) for stat in per_sequence]
    return torch.cat(blocks).view(total, heads, SOFTMAX_STAT_WIDTH)


def _stat_in(stat: torch.Tensor, layout: str, start: int, end: int) -> torch.Tensor:
    """Sequence start:end's [N, s, 1] of a [T, N, 8] statistic in `layout` (_stats_out's inverse)."""
    heads = stat.shape[1]
    if layout == "TND":
        return stat[start:end, :, :1].transpose(0, 1).float()
    rows = stat.reshape(-1, SOFTMAX_STAT_WIDTH)[start * heads : end * heads]
    return rows.view(heads, end - start, SOFTMAX_STAT_WIDTH)[..., :1].float()


def npu_fusion_attention(
    query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None, scale=1.0,
    keep_prob=1.0, pre_tockens=2147483647, next_tockens=2147483647, inner_precise=0, prefix=None,
    actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False,
    softmax_layout="", sink=None, dropout_mask=None, seed=0, offset=0,
):
    op = "npu_fusion_attention"
    _check_attention_call(
        op, query, key, value, head_num, input_layout, atten_mask, keep_prob, actual_seq_qlen, actual_seq_kvlen,
        sparse_mode, softmax_layout, pse=pse, padding_mask=padding_mask, prefix=prefix, sink=sink,
        dropout_mask=dropout_mask,
    )
    group = query.shape[1] // key.shape[1]
    outputs, maxima, sums = [], [], []
    for q_start, q_end, kv_start, kv_end in _sequences(actual_seq_qlen, actual_seq_kvlen):
        q = _heads_first(query, q_start, q_end)
        k, v = _heads_first(key, kv_start, kv_end, group), _heads_first(value, kv_start, kv_end, group)
        logits = _masked_logits(q, k, scale, sparse_mode)
        row_max = logits.amax(dim=-1, keepdim=True)
        valid = torch.isfinite(row_max)  # a row with no key left outputs zeros
        weights = torch.where(valid, (logits - torch.where(valid, row_max, 0)).exp(), 0)
        row_sum = weights.sum(dim=-1, keepdim=True)
        outputs.append((weights / row_sum.clamp_min(torch.finfo(torch.float32).tiny)) @ v)
        maxima.append(torch.where(valid, row_max, 0))
        sums.append(row_sum)
    attention = torch.cat(outputs, dim=1).transpose(0, 1).to(query.dtype)  # [T, N, Dv]
    total, heads = query.shape[:2]
    softmax_max = _stats_out(maxima, softmax_layout, total, heads).detach()
    softmax_sum = _stats_out(sums, softmax_layout, total, heads).detach()
    return attention, softmax_max, softmax_sum, query.new_empty(0), 0, 0, 0


def npu_fusion_attention_grad(
    query, key, value, dy, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None, softmax_max=None,
    softmax_sum=None, softmax_in=None, attention_in=None, scale_value=1.0, keep_prob=1.0, pre_tockens=2147483647,
    next_tockens=2147483647, inner_precise=0, seed=0, offset=0, numels=0, prefix=None, actual_seq_qlen=None,
    actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False, softmax_layout="", sink=None,
):
    """(dq, dk, dv, dpse, dsink) of npu_fusion_attention's output given its gradient dy, from the forward's softmax
    statistics and output (softmax_max, softmax_sum, attention_in), not from a softmax of its own: the probabilities
    are exp(scale q.k - max) / sum, so statistics of a longer key sequence give this call's keys' share of that
    attention (how ring attention differentiates its blocks). Dropout, pse and sink are not computed."""
    op = "npu_fusion_attention_grad"
    _check_attention_call(
        op, query, key, value, head_num, input_layout, atten_mask, keep_prob, actual_seq_qlen, actual_seq_kvlen,
        sparse_mode, softmax_layout, pse=pse, padding_mask=padding_mask, softmax_in=softmax_in, prefix=prefix,
        sink=sink,
    )
    for name, given in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum), ("attention_in", attention_in)):
        _require(given is not None, op, name, "required: the gradient reads the forward's statistics and output")
    stat_shape = (query.shape[0], query.shape[1], SOFTMAX_STAT_WIDTH)
    for name, stat in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
        _require(tuple(stat.shape) == stat_shape, op, name, f"[T, N, 8] {stat_shape}, got {tuple(stat.shape)}")
    _require(
        dy.shape == attention_in.shape == query.shape[:2] + value.shape[2:], op, "dy",
        "dy and attention_in are [T, N, Dv]",
    )
    heads, kv_heads = query.shape[1], key.shape[1]
    group = heads // kv_heads
    grads_q, grads_k, grads_v = [], [], []
    for q_start, q_end, kv_start, kv_end in _sequences(actual_seq_qlen, actual_seq_kvlen):
        q = _heads_first(query, q_start, q_end)
        k, v = _heads_first(key, kv_start, kv_end, group), _heads_first(value, kv_start, kv_end, group)
        d_out, out = _heads_first(dy, q_start, q_end), _heads_first(attention_in, q_start, q_end)
        row_max = _stat_in(softmax_max, softmax_layout, q_start, q_end)
        row_sum = _stat_in(softmax_sum, softmax_layout, q_start, q_end)
        logits = _masked_logits(q, k, scale_value, sparse_mode)
        probabilities = torch.where(row_sum > 0, (logits - row_max).exp() / row_sum.clamp_min(1e-38), 0)
        d_probabilities = d_out @ v.transpose(1, 2)
        d_logits = probabilities * (d_probabilities - (d_out * out).sum(dim=-1, keepdim=True))
        grads_q.append(scale_value * d_logits @ k)
        # a key/value head's gradient sums its group of query heads
        grads_k.append((scale_value * d_logits.transpose(1, 2) @ q).unflatten(0, (kv_heads, group)).sum(1))
        grads_v.append((probabilities.transpose(1, 2) @ d_out).unflatten(0, (kv_heads, group)).sum(1))

    def tokens_first(parts, like):
        return torch.cat(parts, dim=1).transpose(0, 1).to(like.dtype).contiguous()

    return (
        tokens_first(grads_q, query), tokens_first(grads_k, key), tokens_first(grads_v, value), query.new_empty(0),
        query.new_empty(0),
    )


@functools.cache
def _compressed_causal_mask(device) -> torch.Tensor:
    return torch.ones(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE, dtype=torch.bool, device=device).triu(1)


def _group_sizes(group_list, group_list_type, total: int) -> list:
    op = "npu_grouped_matmul"
    _require(group_list is not None, op, "group_list", "required when grouping (group_type 0 or 2)")
    _require(group_list.dim() == 1, op, "group_list", "a 1-D tensor")
    values = group_list.tolist()
    _require(all(value >= 0 for value in values), op, "group_list", f"must not be negative, got {values}")
    if group_list_type == 0:  # cumulative ends
        _require(all(b >= a for a, b in zip(values, values[1:])), op, "group_list", f"cumulative ends must not decrease, got {values}")
        sizes = [b - a for a, b in zip([0] + values, values)]
    elif group_list_type == 1:  # sizes; the wheel's docs: "当group_list_type为1时 ... 长度不能为1"
        _require(len(values) != 1, op, "group_list", "with group_list_type=1 it may not hold a single group")
        sizes = values
    else:
        raise NpuOpError(f"torch_npu.{op}: group_list_type: 0 (cumulative ends) or 1 (sizes), got {group_list_type}")
    _require(sum(sizes) == total, op, "group_list", f"groups cover {sum(sizes)} rows, the grouped axis has {total}")
    return sizes


def npu_grouped_matmul(
    x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
    per_token_scale=None, group_list=None, activation_input=None, activation_quant_scale=None,
    activation_quant_offset=None, split_item=0, group_type=None, group_list_type=0, act_type=0, tuning_config=None,
    output_dtype=None, x_dtype=None, weight_dtype=None, scale_dtype=None, per_token_scale_dtype=None,
):
    """Non-quantised grouped matmul, y_i = x_i @ weight_i. group_type -1: independent pairs; 0: the rows (M) of one
    x split into groups, group i times weight i (a list of 2-D [K, N] or one 3-D [G, K, N]); 2: the contraction (K)
    of one x [M, K] and one weight [K, N] split into groups, one [M, N] product per group ([G, M, N] stacked).
    split_item 0/1 return one tensor per group, 2/3 one tensor."""
    op = "npu_grouped_matmul"
    _refuse_unused(
        op, bias=bias, scale=scale, offset=offset, antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset,
        per_token_scale=per_token_scale, activation_input=activation_input,
        activation_quant_scale=activation_quant_scale, activation_quant_offset=activation_quant_offset,
        output_dtype=output_dtype, x_dtype=x_dtype, weight_dtype=weight_dtype, scale_dtype=scale_dtype,
        per_token_scale_dtype=per_token_scale_dtype,
    )
    if act_type != 0:
        raise NotComputed(f"torch_npu.{op}: act_type {act_type}: activations are not computed by the CPU stand-in")
    _require(split_item in (0, 1, 2, 3), op, "split_item", f"0, 1, 2 or 3, got {split_item}")
    _require(len(weight) <= GROUPED_MATMUL_MAX_WEIGHTS, op, "weight", f"at most {GROUPED_MATMUL_MAX_WEIGHTS} tensors, got {len(weight)}")
    single_output = split_item in (2, 3)

    if group_type == -1:
        _require(group_list is None, op, "group_list", "must be None with group_type=-1")
        _require(not single_output, op, "split_item", "group_type=-1 supports split_item 0 or 1 only")
        _require(len(x) == len(weight), op, "weight", "one weight per x with group_type=-1")
        return [xi @ wi for xi, wi in zip(x, weight)]

    _require(len(x) == 1, op, "x", f"the CPU stand-in computes one x tensor with group_type {group_type}")
    (inputs,) = x
    _require(inputs.dim() == 2, op, "x", "a 2-D tensor when grouping")
    if group_type == 0:
        sizes = _group_sizes(group_list, group_list_type, inputs.shape[0])
        if len(weight) == 1 and weight[0].dim() == 3:
            weights = list(weight[0])
            _require(len(sizes) <= GROUPED_MATMUL_MAX_GROUPS, op, "group_list", f"at most {GROUPED_MATMUL_MAX_GROUPS} groups")
        else:
            weights = list(weight)
        _require(len(weights) == len(sizes), op, "weight", f"{len(weights)} weights for {len(sizes)} groups")
        _require(single_output, op, "split_item", "one x with group_type=0 takes split_item 2 or 3")
        _require(len({w.shape[-1] for w in weights}) == 1, op, "weight", "every weight needs the same N")
        for index, w in enumerate(weights):
            _require(w.shape[0] == inputs.shape[1], op, "weight", f"weight {index} has K={w.shape[0]}, x has K={inputs.shape[1]}")
        products = [part @ w for part, w in zip(inputs.split(sizes), weights)]
        return [torch.cat(products)]
    if group_type == 2:
        _require(len(weight) == 1 and weight[0].dim() == 2, op, "weight", "one 2-D tensor with group_type=2")
        (other,) = weight
        _require(other.shape[0] == inputs.shape[1], op, "weight", f"K={other.shape[0]} differs from x's K={inputs.shape[1]}")
        _require(single_output, op, "split_item", "group_type=2 takes split_item 2 or 3")
        sizes = _group_sizes(group_list, group_list_type, inputs.shape[1])
        products = [a @ b for a, b in zip(inputs.split(sizes, dim=1), other.split(sizes, dim=0))]
        return [torch.stack(products)]
    raise NpuOpError(f"torch_npu.{op}: group_type: -1, 0 or 2 (the wheel's meta function), got {group_type}")


def npu_grouped_matmul_list(x, weight, **options):
    raise NotComputed(
        "torch_npu.npu_grouped_matmul with an int[] group_list (the .List overload) is not computed by the CPU "
        "stand-in: relax passes group_list as a tensor"
    )


def npu_swiglu(self, dim=-1):
    """silu of the first half along dim times the second half."""
    _require(self.shape[dim] % 2 == 0, "npu_swiglu", "self", f"dim {dim} has odd size {self.shape[dim]}")
    gate, up = self.chunk(2, dim=dim)
    return F.silu(gate) * up


def npu_rms_norm(self, gamma, epsilon=1e-06):
    """(self * rstd * gamma, rstd): rstd = 1 / sqrt(mean of squares + epsilon) over gamma's trailing dims, in float32,
    with size 1 in those dims (the wheel's meta function)."""
    normalised_dims = tuple(range(self.dim() - gamma.dim(), self.dim()))
    _require(tuple(self.shape[-gamma.dim():]) == tuple(gamma.shape), "npu_rms_norm", "gamma", "must match self's trailing dims")
    rstd = torch.rsqrt(self.float().pow(2).mean(dim=normalised_dims, keepdim=True) + epsilon)
    return (self.float() * rstd * gamma.float()).to(self.dtype), rstd


# Each overload (name or name.overload as in the schemas) and its CPU computation.
COMPUTATIONS = {
    "npu_fusion_attention": npu_fusion_attention,
    "npu_fusion_attention_grad": npu_fusion_attention_grad,
    "npu_grouped_matmul": npu_grouped_matmul,
    "npu_grouped_matmul.List": npu_grouped_matmul_list,
    "npu_swiglu": npu_swiglu,
    "npu_rms_norm": npu_rms_norm,
}


def overload_name(schema: str) -> str:
    return schema.split("(", 1)[0]


@functools.cache
def _library() -> torch.library.Library:
    """Defines every schema of torch_npu_schemas.json in torch's `npu` namespace, once per process."""
    library = torch.library.Library("npu", "FRAGMENT")
    for entry in SCHEMAS["ops"].values():
        for schema in entry["schemas"]:
            library.define(schema)
            library.impl(overload_name(schema), COMPUTATIONS[overload_name(schema)], "CompositeImplicitAutograd")
    return library


def install(module) -> None:
    """Put the stand-in ops on `module` (a torch_npu stand-in) as torch_npu does: module.<name> = torch.ops.npu.<name>."""
    _library()
    for name in SCHEMAS["ops"]:
        setattr(module, name, getattr(torch.ops.npu, name))
