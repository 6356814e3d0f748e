"""relax.kernels.gdn_chunk_triton, relax's chunked gated delta rule for training, against relax.kernels.gdn_reference
on CPU via TRITON_INTERPRET=1 (in one interpreter subprocess, as tests/unit/test_kernels_triton.py explains):
outputs, final states and the gradients of every input, on packed sequences of many lengths (one token, exactly one
chunk, several chunks with a tail), with and without initial states, grouped value heads, value widths that are and
are not multiples of the kernel's tile, context parallelism's widened values, and gates of -1e3; and what autograd
keeps for the backward."""

import pytest
import torch

from helpers import chunk_rule_case, chunk_rule_outputs_and_gradients
from test_kernels_triton import run_interpreted


def check_matches_reference(lengths, key_heads, value_heads, K, V, initial, output_final_state, gate_scale,
                            dtype_name):
    from relax.kernels import gdn_chunk_triton
    from relax.kernels import gdn_reference as ref
    from relax.kernels.launch import TritonLaunch

    case = chunk_rule_case(lengths, key_heads, value_heads, K, V, initial, gate_scale, dtype_name)
    # 3 programs: each loops over several (sequence, head, value tile) items
    out, final, grads = chunk_rule_outputs_and_gradients(
        gdn_chunk_triton.chunk_gated_delta_rule, case, output_final_state, launch=TritonLaunch(num_programs=3))
    expected_out, expected_final, expected_grads = chunk_rule_outputs_and_gradients(
        ref.chunk_gated_delta_rule, case, output_final_state)
    assert out.dtype == case["v"].dtype and out.shape == expected_out.shape
    exact = dtype_name == "float32"
    tolerance = dict(atol=2e-5, rtol=2e-5) if exact else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, expected_out, **tolerance)
    if output_final_state:
        torch.testing.assert_close(final, expected_final, **tolerance)
    else:
        assert final is None
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        expected = expected_grads[name]
        assert torch.isfinite(grad).all(), name
        error = (grad.float() - expected.float()).abs().max().item() / expected.float().abs().max().item()
        assert error < (1e-5 if exact else 2e-2), (name, error)


def check_packed_equals_sequences_one_at_a_time():
    """Sequences packed with cu_seqlens give what each gives alone, and a batch of equal lengths without cu_seqlens
    gives its rows' results."""
    from relax.kernels import gdn_chunk_triton
    from relax.kernels.launch import TritonLaunch

    launch = TritonLaunch(num_programs=2)
    case = chunk_rule_case([3, 70], 1, 2, 16, 16, initial=True, gate_scale=1.0, dtype_name="float32")
    out, final = gdn_chunk_triton.chunk_gated_delta_rule(**case, output_final_state=True, launch=launch)
    for n, (start, end) in enumerate(zip(case["cu_seqlens"][:-1].tolist(), case["cu_seqlens"][1:].tolist())):
        alone = {name: case[name][:, start:end] for name in ("q", "k", "v", "g", "beta")}
        out_n, final_n = gdn_chunk_triton.chunk_gated_delta_rule(
            **alone, initial_state=case["initial_state"][n:n + 1], output_final_state=True, launch=launch)
        torch.testing.assert_close(out[:, start:end], out_n)
        torch.testing.assert_close(final[n], final_n[0])
    rows = {name: case[name][:, :70].reshape(2, 35, *case[name].shape[2:]) for name in ("q", "k", "v", "g", "beta")}
    out_rows, _ = gdn_chunk_triton.chunk_gated_delta_rule(**rows, launch=launch)
    out_packed, _ = gdn_chunk_triton.chunk_gated_delta_rule(**{n: x.reshape(1, 70, *x.shape[2:]) for n, x in
                                                               rows.items()}, cu_seqlens=torch.tensor([0, 35, 70]),
                                                            launch=launch)
    torch.testing.assert_close(out_rows.reshape(out_packed.shape), out_packed)


def check_backward_keeps_only_the_inputs():
    """What autograd keeps for the backward: relax's rule its inputs alone (its chunk terms are computed again in the
    backward), the reference's several times as much."""
    from relax.kernels import gdn_chunk_triton
    from relax.kernels import gdn_reference as ref
    from relax.kernels.launch import TritonLaunch

    case = chunk_rule_case([100, 30], 1, 2, 16, 16, initial=False, gate_scale=1.0, dtype_name="bfloat16")
    inputs = {name: x.clone().requires_grad_(x.is_floating_point()) for name, x in case.items() if x is not None}
    input_bytes = sum(x.numel() * x.element_size() for x in inputs.values() if x.requires_grad)

    def kept_bytes(rule, **kwargs):
        kept = []

        def pack(x):
            kept.append(x.numel() * x.element_size())
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            out, _ = rule(**inputs, **kwargs)
        out.float().sum().backward()
        return sum(kept)

    assert kept_bytes(gdn_chunk_triton.chunk_gated_delta_rule, launch=TritonLaunch(num_programs=2)) == input_bytes
    assert kept_bytes(ref.chunk_gated_delta_rule) > 5 * input_bytes


# (lengths, key heads, value heads, K, V, initial state, final state wanted, gate scale, dtype)
CASES = [
    # one token, a tail, exactly one chunk, several chunks; 3 value heads per key head; V = 40: a tile and a tail
    ([1, 70, 64, 130, 5], 1, 3, 16, 40, True, True, 1.0, "float32"),
    # no initial state, no final state wanted (no gradient through it); per-token gates down to -1e3
    ([100, 33], 2, 2, 32, 16, False, False, 1e3, "float32"),
    # V = 2K with an initial state and the final state: the shape of context parallelism's call (values widened by K
    # columns)
    ([64, 20], 2, 4, 16, 32, True, True, 1.0, "float32"),
    # the actor's half-precision q/k/v/beta (float32 gates)
    ([90, 7], 2, 4, 16, 16, False, True, 1.0, "bfloat16"),
]


def check_every_case_and_property():
    """One interpreter subprocess for all the checks (each start costs seconds)."""
    for case in CASES:
        check_matches_reference(*case)
    check_packed_equals_sequences_one_at_a_time()
    check_backward_keeps_only_the_inputs()


def test_chunk_rule_matches_the_reference_interpreted():
    run_interpreted("check_every_case_and_property", module=__name__)


def test_unsupported_arguments_and_mismatched_states_are_refused():
    from relax.kernels import gdn_chunk_triton
    from relax.kernels.launch import TritonLaunch

    case = chunk_rule_case([4, 4], 1, 1, 16, 16, initial=True, gate_scale=1.0, dtype_name="float32")
    launch = TritonLaunch(num_programs=1)
    with pytest.raises(TypeError, match="head_first"):
        gdn_chunk_triton.chunk_gated_delta_rule(**case, head_first=False, launch=launch)
    with pytest.raises(ValueError, match="initial_state has 1 states for 2 sequences"):
        gdn_chunk_triton.chunk_gated_delta_rule(**{**case, "initial_state": case["initial_state"][:1]}, launch=launch)
