"""torch_npu calls against the schemas of the paired torch-npu wheel (tests/npu/torch_npu_schemas.json): every
`torch_npu.npu_*` call in relax has a schema; relax's NPU attention and grouped-linear paths, run through the
schema-bound CPU stand-ins (torch_npu_ops), equal the CPU platform's kernels, forward and backward; and the binding
refuses what the real operator's signature refuses."""

import inspect
import re
import sys
import types
from pathlib import Path

import pytest
import torch

from relax.platform import attention, grouped_linear
from relax import pins
from tests.npu import extract_torch_npu_schemas, torch_npu_ops

RELAX = Path(__file__).resolve().parents[2] / "relax"
CALL = re.compile(r"\btorch_npu\.(npu_\w+)\s*\(")


@pytest.fixture
def torch_npu():
    """A torch_npu module with the stand-in ops, in sys.modules for relax's `import torch_npu`."""
    module = types.ModuleType("torch_npu")
    torch_npu_ops.install(module)
    previous = sys.modules.get("torch_npu")
    sys.modules["torch_npu"] = module
    yield module
    if previous is None:
        del sys.modules["torch_npu"]
    else:
        sys.modules["torch_npu"] = previous


def relax_calls() -> dict:
    """{op name: [file:line, ...]} of every torch_npu.npu_* call in relax's sources."""
    calls = {}
    for path in sorted(RELAX.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for name in CALL.findall(line):
                calls.setdefault(name, []).append(f"{path.relative_to(RELAX.parent)}:{number}")
    return calls


def test_schemas_come_from_the_pinned_wheel_and_parse():
    assert torch_npu_ops.SCHEMAS["version"] == pins.TORCH_NPU
    assert torch_npu_ops.SCHEMAS["wheel"].startswith(f"torch_npu-{pins.TORCH_NPU}-")
    for entry in torch_npu_ops.SCHEMAS["ops"].values():
        for schema in entry["schemas"]:
            torch._C.parse_schema(schema)


def test_the_data_holds_the_extraction_scripts_ops():
    assert list(torch_npu_ops.SCHEMAS["ops"]) == list(extract_torch_npu_schemas.OPS)
    assert torch_npu_ops.SCHEMAS["yaml"] == extract_torch_npu_schemas.SCHEMA_YAML


def test_the_extraction_gathers_overloads_across_the_yamls_sections():
    text = """
backend: NPU
custom:
  - func: npu_op(Tensor x) -> Tensor
    exposed: true
  - func: npu_op.List(Tensor[] x) -> Tensor
  - func: npu_op_grad(Tensor x) -> Tensor
symint:
  - func: npu_op(Tensor x) -> Tensor
  - func: npu_other(SymInt n) -> Tensor
"""
    assert extract_torch_npu_schemas.schemas_in(text) == {
        "npu_op": ["npu_op(Tensor x) -> Tensor", "npu_op.List(Tensor[] x) -> Tensor"],
        "npu_op_grad": ["npu_op_grad(Tensor x) -> Tensor"],
        "npu_other": ["npu_other(SymInt n) -> Tensor"],
    }


def test_every_relax_call_has_a_schema_and_a_computation():
    calls = relax_calls()
    assert {"npu_fusion_attention", "npu_grouped_matmul"} <= set(calls)  # the scan sees relax's known calls
    missing = {name: sites for name, sites in calls.items() if name not in torch_npu_ops.SCHEMAS["ops"]}
    assert not missing, f"torch_npu calls without a schema (add them to extract_torch_npu_schemas.py's OPS): {missing}"


def test_each_computation_takes_the_schema_arguments_by_name():
    """The dispatcher hands keyword-only arguments over by their schema names."""
    overloads = [schema for entry in torch_npu_ops.SCHEMAS["ops"].values() for schema in entry["schemas"]]
    assert sorted(torch_npu_ops.COMPUTATIONS) == sorted(map(torch_npu_ops.overload_name, overloads))
    for schema in overloads:
        computation = torch_npu_ops.COMPUTATIONS[torch_npu_ops.overload_name(schema)]
        parameters = inspect.signature(computation).parameters
        if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
            continue  # a computation that refuses the overload whatever its arguments
        assert list(parameters) == [argument.name for argument in torch._C.parse_schema(schema).arguments]


LENGTHS = [5, 1, 9, 3]


def _qkv(total, heads=4, kv_heads=2, dim=8, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(total, heads, dim), (total, kv_heads, dim), (total, kv_heads, dim)]
    return [torch.randn(shape, generator=generator).to(dtype).requires_grad_() for shape in shapes]


def _cu_seqlens(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_packed_npu_attention_equals_sdpa(torch_npu, heads, kv_heads, dtype, tolerance):
    q, k, v = _qkv(sum(LENGTHS), heads, kv_heads, dtype=dtype)
    cu_seqlens, scale = _cu_seqlens(LENGTHS), 0.3
    got = attention.packed("npu_fusion", q, k, v, cu_seqlens, max(LENGTHS), scale)
    expected = attention.packed("sdpa", q, k, v, cu_seqlens, max(LENGTHS), scale)
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
    grad = torch.randn_like(got)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad)
    for got_grad, expected_grad in zip(got_grads, expected_grads):
        torch.testing.assert_close(got_grad, expected_grad, atol=tolerance, rtol=tolerance)


def test_npu_attention_of_queries_at_the_end_of_their_keys_equals_sdpa(torch_npu):
    """Context parallelism's query chunks against their sequences' keys up to the chunk's end (rightDownCausal)."""
    query_lengths, key_lengths = [2, 2, 3], [2, 6, 9]
    q = _qkv(sum(query_lengths))[0].detach()
    k, v = (t.detach() for t in _qkv(sum(key_lengths), seed=1)[1:])
    cu_q, cu_k = _cu_seqlens(query_lengths), _cu_seqlens(key_lengths)
    torch.testing.assert_close(
        attention.packed_with_keys("npu_fusion", q, k, v, cu_q, cu_k, 3, 9, 0.3),
        attention.packed_with_keys("sdpa", q, k, v, cu_q, cu_k, 3, 9, 0.3),
        atol=1e-5, rtol=1e-5,
    )


def test_packed_npu_attention_splits_more_than_1024_sequences_over_calls(torch_npu):
    lengths = [1, 2] * 700  # 1400 sequences: two calls
    q, k, v = (t.detach() for t in _qkv(sum(lengths)))
    cu_seqlens = _cu_seqlens(lengths)
    torch.testing.assert_close(
        attention.packed("npu_fusion", q, k, v, cu_seqlens, 2, 0.3),
        attention.packed("sdpa", q, k, v, cu_seqlens, 2, 0.3),
        atol=1e-5, rtol=1e-5,
    )


def test_padded_npu_attention_equals_sdpa(torch_npu):
    q, k, v = (t.detach().view(3, 6, *t.shape[1:]) for t in _qkv(18))
    torch.testing.assert_close(
        attention.padded("npu_fusion", q, k, v, 0.25), attention.padded("sdpa", q, k, v, 0.25), atol=1e-5, rtol=1e-5
    )


def test_attention_statistics_have_the_wheels_tnd_shapes(torch_npu):
    q, k, v = (t.detach() for t in _qkv(sum(LENGTHS)))
    ends = _cu_seqlens(LENGTHS)[1:].tolist()
    out, softmax_max, softmax_sum, softmax_out, *ints = torch_npu.npu_fusion_attention(
        q, k, v, 4, input_layout="TND", scale=0.5, sparse_mode=3, atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1),
        actual_seq_qlen=ends, actual_seq_kvlen=ends,
    )
    assert out.shape == q.shape and softmax_max.shape == softmax_sum.shape == (sum(LENGTHS), 4, 8)
    assert softmax_out.numel() == 0 and ints == [0, 0, 0]
    assert torch.all(softmax_sum >= 1)  # each row's largest term is exp(0)


CAUSAL_MASK = torch.ones(2048, 2048, dtype=torch.bool).triu(1)


def _fusion_attention(torch_npu, q, k, v, q_lengths, kv_lengths, sparse_mode=3, softmax_layout=""):
    return torch_npu.npu_fusion_attention(
        q, k, v, q.shape[1], input_layout="TND", scale=0.3, sparse_mode=sparse_mode,
        atten_mask=CAUSAL_MASK if sparse_mode else None, actual_seq_qlen=_cu_seqlens(q_lengths)[1:].tolist(),
        actual_seq_kvlen=_cu_seqlens(kv_lengths)[1:].tolist(), softmax_layout=softmax_layout,
    )


def _fusion_attention_grad(torch_npu, q, k, v, dy, forward, q_lengths, kv_lengths, sparse_mode=3, softmax_layout=""):
    out, softmax_max, softmax_sum = forward[:3]
    return torch_npu.npu_fusion_attention_grad(
        q, k, v, dy, q.shape[1], "TND", atten_mask=CAUSAL_MASK if sparse_mode else None, softmax_max=softmax_max,
        softmax_sum=softmax_sum, attention_in=out, scale_value=0.3, pre_tockens=k.shape[0],
        next_tockens=0 if sparse_mode else k.shape[0], sparse_mode=sparse_mode,
        actual_seq_qlen=_cu_seqlens(q_lengths)[1:].tolist(), actual_seq_kvlen=_cu_seqlens(kv_lengths)[1:].tolist(),
        softmax_layout=softmax_layout,
    )


@pytest.mark.parametrize("softmax_layout", ["", "TND"])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2)])
def test_attention_statistics_are_each_rows_max_and_sum_in_their_layout(torch_npu, softmax_layout, heads, kv_heads):
    """softmax_max / softmax_sum of each query row: by default each sequence's [N, s, 8] after the previous one's (as
    MindSpeed's TND ring attention reads them), token-major [T, N, 8] with softmax_layout='TND'."""
    q, k, v = (t.detach() for t in _qkv(sum(LENGTHS), heads, kv_heads))
    _, softmax_max, softmax_sum, *_ = _fusion_attention(
        torch_npu, q, k, v, LENGTHS, LENGTHS, softmax_layout=softmax_layout
    )
    maxima, sums = [], []
    for start, end in zip(_cu_seqlens(LENGTHS)[:-1].tolist(), _cu_seqlens(LENGTHS)[1:].tolist()):
        keys = k[start:end].repeat_interleave(heads // kv_heads, dim=1)
        logits = 0.3 * torch.einsum("qnd,knd->nqk", q[start:end], keys)
        logits = logits.masked_fill(torch.ones(end - start, end - start, dtype=torch.bool).triu(1), float("-inf"))
        row_max = logits.amax(-1)  # [N, s]
        maxima.append(row_max)
        sums.append((logits - row_max[..., None]).exp().sum(-1))
    for got, rows in ((softmax_max, maxima), (softmax_sum, sums)):
        assert got.shape == (sum(LENGTHS), heads, 8) and torch.equal(got, got[..., :1].expand_as(got))
        if softmax_layout == "TND":
            expected = torch.cat(rows, dim=1).transpose(0, 1)
        else:
            expected = torch.cat([row.flatten() for row in rows]).view(sum(LENGTHS), heads)
        torch.testing.assert_close(got[..., 0], expected)


@pytest.mark.parametrize("softmax_layout", ["", "TND"])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_attention_gradient_equals_autograd_of_the_attention(torch_npu, softmax_layout, heads, kv_heads):
    q, k, v = _qkv(sum(LENGTHS), heads, kv_heads)
    forward = _fusion_attention(torch_npu, q, k, v, LENGTHS, LENGTHS, softmax_layout=softmax_layout)
    dy = torch.randn_like(forward[0])
    expected = torch.autograd.grad(forward[0], (q, k, v), dy)
    q, k, v, forward = q.detach(), k.detach(), v.detach(), [x.detach() if torch.is_tensor(x) else x for x in forward]
    dq, dk, dv, dpse, dsink = _fusion_attention_grad(
        torch_npu, q, k, v, dy, forward, LENGTHS, LENGTHS, softmax_layout=softmax_layout
    )
    for got, want in zip((dq, dk, dv), expected):
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert dpse.numel() == dsink.numel() == 0


def test_attention_gradient_of_a_block_of_keys_is_its_share_of_the_whole(torch_npu):
    """With the statistics and output of the attention to all keys, the gradient of a call on a block of the keys
    gives that block's dk, dv and its part of dq (the step of ring attention's backward)."""
    q_lengths, kv_lengths = [3, 2], [6, 4]  # queries attending every key of their sequence (sparse_mode 0)
    first, second = [3, 2], [3, 2]  # each sequence's keys in two blocks
    q = _qkv(sum(q_lengths))[0].detach()
    k, v = (t.detach() for t in _qkv(sum(kv_lengths), seed=1)[1:])
    forward = _fusion_attention(torch_npu, q, k, v, q_lengths, kv_lengths, sparse_mode=0)
    dy = torch.randn_like(forward[0])
    whole = _fusion_attention_grad(torch_npu, q, k, v, dy, forward, q_lengths, kv_lengths, sparse_mode=0)
    rows = [torch.arange(0, 3), torch.arange(6, 8)], [torch.arange(3, 6), torch.arange(8, 10)]
    dq = torch.zeros_like(q)
    for block, lengths in zip(rows, (first, second)):
        index = torch.cat(block)
        dq_part, dk, dv, *_ = _fusion_attention_grad(
            torch_npu, q, k[index], v[index], dy, forward, q_lengths, lengths, sparse_mode=0
        )
        dq += dq_part
        torch.testing.assert_close(dk, whole[1][index], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dv, whole[2][index], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dq, whole[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens_per_group", [[3, 0, 5, 1], [7], [0, 0, 6], [0, 4]])
def test_npu_grouped_linear_equals_the_cpu_loop(torch_npu, tokens_per_group):
    generator = torch.Generator().manual_seed(len(tokens_per_group))
    counts = torch.tensor(tokens_per_group)
    x = torch.randn(int(counts.sum()), 6, generator=generator, requires_grad=True)
    weights = torch.randn(len(tokens_per_group), 5, 6, generator=generator, requires_grad=True)
    got = grouped_linear.npu_grouped_linear(x, weights, counts)
    expected = grouped_linear.looped_grouped_linear(x, weights, counts)
    torch.testing.assert_close(got, expected)
    grad = torch.randn(got.shape, generator=generator)
    got_grads = torch.autograd.grad(got, (x, weights), grad)
    expected_grads = torch.autograd.grad(expected, (x, weights), grad, materialize_grads=True)
    for got_grad, expected_grad in zip(got_grads, expected_grads):
        torch.testing.assert_close(got_grad, expected_grad)


def test_npu_grouped_linear_takes_more_than_128_experts(torch_npu):
    """One [groups, K, N] weight: the wheel bounds a weight list at 128 tensors, not a 3-D weight's groups."""
    counts = torch.ones(256, dtype=torch.int64)
    x, weights = torch.randn(256, 4), torch.randn(256, 3, 4)
    torch.testing.assert_close(
        grouped_linear.npu_grouped_linear(x, weights, counts), grouped_linear.looped_grouped_linear(x, weights, counts)
    )


def test_swiglu_and_rms_norm_compute_mindspeeds_calls(torch_npu):
    """As MindSpeed calls them: npu_swiglu(x, dim=-1) (fused_bias_swiglu.py), npu_rms_norm(x, w, epsilon=)[0]."""
    x, weight = torch.randn(3, 8), torch.rand(8) + 0.5
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(torch_npu.npu_swiglu(x, dim=-1), torch.nn.functional.silu(gate) * up)
    normed, rstd = torch_npu.npu_rms_norm(x, weight, epsilon=1e-6)
    torch.testing.assert_close(normed, torch.nn.functional.rms_norm(x, (8,), weight, eps=1e-6))
    assert rstd.shape == (3, 1) and rstd.dtype == torch.float32


def test_binding_refuses_what_the_signature_refuses(torch_npu):
    q, k, v = (t.detach() for t in _qkv(4))
    with pytest.raises(RuntimeError, match=r"npu_fusion_attention\(\) is missing value for argument 'input_layout'"):
        torch_npu.npu_fusion_attention(q, k, v, 4, layout="TND")
    with pytest.raises(RuntimeError, match=r"Expected a value of type 'Optional\[List\[int\]\]' for argument 'actual_seq_qlen'"):
        torch_npu.npu_fusion_attention(q, k, v, 4, input_layout="TND", actual_seq_qlen=torch.tensor([4]))
    with pytest.raises(RuntimeError, match=r"npu_fusion_attention\(\) Expected a value of type 'int' for argument 'head_num'"):
        torch_npu.npu_fusion_attention(q, k, v, 4.0, input_layout="TND")
    x, weights = torch.randn(4, 6), torch.randn(2, 6, 5)
    with pytest.raises(RuntimeError, match="Unknown keyword argument 'group_typ' for operator 'npu::npu_grouped_matmul'"):
        torch_npu.npu_grouped_matmul([x], [weights], group_list=torch.tensor([2, 4]), split_item=3, group_typ=0)
    with pytest.raises(RuntimeError, match="npu_grouped_matmul"):
        torch_npu.npu_grouped_matmul(x, [weights], group_list=torch.tensor([2, 4]))  # x is a list of tensors


def test_documented_constraints_are_named(torch_npu):
    q, k, v = (t.detach() for t in _qkv(6))
    mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    with pytest.raises(torch_npu_ops.NpuOpError, match="npu_fusion_attention: actual_seq_qlen: the last cumulative end 5"):
        torch_npu.npu_fusion_attention(
            q, k, v, 4, input_layout="TND", sparse_mode=3, atten_mask=mask, actual_seq_qlen=[2, 5], actual_seq_kvlen=[2, 6]
        )
    with pytest.raises(torch_npu_ops.NpuOpError, match="npu_fusion_attention: atten_mask: sparse_mode 3 needs the 2048"):
        torch_npu.npu_fusion_attention(
            q, k, v, 4, input_layout="TND", sparse_mode=3, atten_mask=mask[:6, :6], actual_seq_qlen=[6], actual_seq_kvlen=[6]
        )
    many = list(range(1, 1026))
    with pytest.raises(torch_npu_ops.NpuOpError, match="npu_fusion_attention: actual_seq_qlen: at most 1024 sequences"):
        torch_npu.npu_fusion_attention(
            *_qkv(1025), 4, input_layout="TND", sparse_mode=3, atten_mask=mask, actual_seq_qlen=many, actual_seq_kvlen=many
        )
    with pytest.raises(torch_npu_ops.NpuOpError, match="npu_fusion_attention: head_num: 2 differs"):
        torch_npu.npu_fusion_attention(q, k, v, 2, input_layout="TND", actual_seq_qlen=[6], actual_seq_kvlen=[6])
    with pytest.raises(torch_npu_ops.NpuOpError, match="npu_fusion_attention_grad: softmax_max: required"):
        torch_npu.npu_fusion_attention_grad(
            q, k, v, torch.randn_like(q), 4, "TND", attention_in=q, actual_seq_qlen=[6], actual_seq_kvlen=[6]
        )
    with pytest.raises(torch_npu_ops.NpuOpError, match="npu_fusion_attention_grad: actual_seq_kvlen: the last"):
        torch_npu.npu_fusion_attention_grad(
            q, k, v, torch.randn_like(q), 4, "TND", softmax_max=torch.zeros(6, 4, 8), softmax_sum=torch.ones(6, 4, 8),
            attention_in=q, actual_seq_qlen=[6], actual_seq_kvlen=[5],
        )
    x = torch.randn(4, 6)
    many = [torch.randn(6, 5) for _ in range(129)]
    with pytest.raises(torch_npu_ops.NpuOpError, match="npu_grouped_matmul: weight: at most 128 tensors"):
        torch_npu.npu_grouped_matmul([x], many, group_list=torch.arange(1, 130), split_item=3, group_type=0)
    with pytest.raises(torch_npu_ops.NpuOpError, match="npu_grouped_matmul: group_list: with group_list_type=1"):
        torch_npu.npu_grouped_matmul([x], [torch.randn(1, 6, 5)], group_list=torch.tensor([4]), split_item=3,
                                     group_type=0, group_list_type=1)
    with pytest.raises(torch_npu_ops.NpuOpError, match="npu_grouped_matmul: group_list: groups cover 3 rows"):
        torch_npu.npu_grouped_matmul([x], [torch.randn(2, 6, 5)], group_list=torch.tensor([1, 3]), split_item=3,
                                     group_type=0)
