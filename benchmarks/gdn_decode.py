"""GDN decode step on a GPU: relax's fused Triton kernel vs the chain of flash-linear-attention 0.6.0 kernels.

Shapes are Qwen3.5-9B's linear-attention layers: 16 key heads, 32 value heads, head dim 128, conv kernel 4,
bf16 activations and conv state, fp32 recurrent state. Both sides are timed in the same run as CUDA-graph
replays (how SGLang runs decode), with triton.testing.do_bench flushing L2 before every replay.

    fused:     relax.kernels.gdn_triton.gdn_decode, one launch; pools indexed by a shuffled slot table.
    fla chain: fla causal_conv1d_update -> fused_recurrent_gated_delta_rule (gating, beta sigmoid and q/k
               l2norm fused in, as fla 0.6.0 offers) -> rms_norm_gated. fla has no slot-indexed state, so it
               gets the batch's states as one [B, Hv, K, V] tensor (no gather/scatter: in its favour).

Roofline: the recurrent state read once and written once per token, B * Hv * K * V * 4 B * 2, at 4.8 TB/s.

    python benchmarks/gdn_decode.py --batch-sizes 1 64 256
"""

import argparse
import itertools

import torch
import triton

from relax.kernels import gdn_reference as ref
from relax.kernels.gdn_triton import TritonLaunch, gdn_decode

HK, HV, K, V, WIDTH = 16, 32, 128, 128, 4
CONV_DIM = 2 * HK * K + HV * V
HBM_BYTES_PER_S = 4.8e12


def make_inputs(batch, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    state = randn(batch, HV, K, V, scale=0.05, dtype=torch.float32)  # HF/fla layout [B, Hv, K, V]
    conv_state = randn(batch, CONV_DIM, WIDTH - 1)
    slots = torch.randperm(batch, generator=gen, device=device)
    inverse = torch.empty_like(slots)
    inverse[slots] = torch.arange(batch, device=device)
    return dict(
        mixed_qkvz=randn(batch, CONV_DIM + HV * V), mixed_ba=randn(batch, 2 * HV),
        conv_weight=randn(CONV_DIM, WIDTH, scale=0.5), conv_bias=None,
        A_log=randn(HV, dtype=torch.float32), dt_bias=randn(HV, dtype=torch.float32),
        norm_weight=randn(V, dtype=torch.float32), norm_eps=1e-6,
        # the fused kernel's pools: row i lives in slot slots[i]
        slot_indices=slots,
        conv_state_pool=conv_state[inverse].contiguous(),
        state_pool=ref.state_to_pool_layout(state)[inverse].contiguous(),
        # fla's batch-ordered state: its conv cache keeps W columns (the first one unread)
        fla_conv_cache=ref.conv_state_to_hf(conv_state).contiguous(),
        fla_state=state,
    )


def fused_step(inputs, launch, block_v):
    return gdn_decode(inputs["mixed_qkvz"], inputs["mixed_ba"], inputs["conv_state_pool"], inputs["conv_weight"],
                      inputs["conv_bias"], inputs["state_pool"], inputs["slot_indices"], inputs["A_log"],
                      inputs["dt_bias"], inputs["norm_weight"], inputs["norm_eps"], HK, K, V, "contiguous",
                      launch, block_v)


def fla_chain_step(inputs):
    from fla.modules.causal_conv1d import causal_conv1d_update
    from fla.modules.norm.fused_norm_gate import rms_norm_gated
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    batch = inputs["mixed_qkvz"].shape[0]
    qkvz = inputs["mixed_qkvz"]
    mixed_qkv, _ = causal_conv1d_update(qkvz[:, :CONV_DIM], inputs["fla_conv_cache"], weight=inputs["conv_weight"],
                                        bias=inputs["conv_bias"], activation="silu")
    q, k, v = mixed_qkv.split([HK * K, HK * K, HV * V], dim=-1)
    b, a = inputs["mixed_ba"].split([HV, HV], dim=-1)
    o, final_state = fused_recurrent_gated_delta_rule(
        q.reshape(batch, 1, HK, K), k.reshape(batch, 1, HK, K), v.reshape(batch, 1, HV, V),
        g=a.reshape(batch, 1, HV), beta=b.reshape(batch, 1, HV), initial_state=inputs["fla_state"],
        output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=inputs["A_log"],
        dt_bias=inputs["dt_bias"], use_beta_sigmoid_in_kernel=True)
    z = qkvz[:, CONV_DIM:].reshape(batch * HV, V)
    out = rms_norm_gated(o.reshape(batch * HV, V), z, inputs["norm_weight"], None, activation="swish",
                         eps=inputs["norm_eps"])
    return out.reshape(batch, HV, V), final_state


def graph_time_us(step):
    """Median microseconds of one CUDA-graph replay of `step`, L2 flushed before each replay."""
    for _ in range(3):  # compile / autotune outside the graph
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median") * 1e3


def roofline_fraction(batch, microseconds):
    state_bytes = batch * HV * K * V * 4 * 2
    return state_bytes / (microseconds * 1e-6) / HBM_BYTES_PER_S


def check_against_fla(batch, launch, block_v):
    """Max |fused - fla chain| of the outputs and of the new states, from identical starting states."""
    inputs = make_inputs(batch, "cuda", seed=1)
    out = fused_step(inputs, launch, block_v)
    fla_out, fla_state = fla_chain_step(inputs)
    new_state = ref.state_from_pool_layout(inputs["state_pool"][inputs["slot_indices"]])
    return (out.float() - fla_out.float()).abs().max().item(), (new_state - fla_state).abs().max().item()


def cuda_launch(programs_per_sm, num_warps, num_stages):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return TritonLaunch(num_programs=sms * programs_per_sm, options=dict(num_warps=num_warps, num_stages=num_stages))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--sweep", action="store_true", help="time a few launch settings and use the fastest")
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")

    # (block_v, num_warps, num_stages, programs per SM); the first is the default.
    configs = [(32, 4, 2, 16)]
    if args.sweep:
        configs += [(c[0], c[1], c[2], c[3]) for c in itertools.product([16, 32, 64], [4, 8], [2, 3], [8, 32])
                    if c != configs[0]]
    best = configs[0]
    if len(configs) > 1:
        # Every batch size is timed; the settings are picked by the total over batch sizes >= 64 (bandwidth-bound).
        inputs = {b: make_inputs(b, "cuda") for b in args.batch_sizes}
        picked_by = [b for b in args.batch_sizes if b >= 64] or args.batch_sizes
        totals = {}
        for block_v, warps, stages, per_sm in configs:
            launch = cuda_launch(per_sm, warps, stages)
            times = {b: graph_time_us(lambda: fused_step(inputs[b], launch, block_v)) for b in args.batch_sizes}
            totals[(block_v, warps, stages, per_sm)] = sum(times[b] for b in picked_by)
            print(f"sweep block_v={block_v} num_warps={warps} num_stages={stages} programs/SM={per_sm}: "
                  + ", ".join(f"B={b} {t:.1f} us" for b, t in times.items()), flush=True)
        best = min(totals, key=totals.get)
        del inputs
    block_v, warps, stages, per_sm = best
    launch = cuda_launch(per_sm, warps, stages)
    print(f"fused kernel settings: block_v={block_v} num_warps={warps} num_stages={stages} "
          f"grid <= {launch.num_programs} programs ({per_sm} per SM)")

    rows = []
    for batch in args.batch_sizes:
        out_diff, state_diff = check_against_fla(batch, launch, block_v)
        inputs = make_inputs(batch, "cuda")
        fused_us = graph_time_us(lambda: fused_step(inputs, launch, block_v))
        fla_us = graph_time_us(lambda: fla_chain_step(inputs))
        rows.append((batch, fused_us, fla_us, fla_us / fused_us, roofline_fraction(batch, fused_us),
                     roofline_fraction(batch, fla_us), out_diff, state_diff))
        del inputs
        torch.cuda.empty_cache()

    print("\n| batch | fused (us) | fla chain (us) | speedup | fused % of roofline | fla chain % of roofline "
          "| max abs diff out / state |")
    print("|---|---|---|---|---|---|---|")
    for batch, fused_us, fla_us, speedup, fused_frac, fla_frac, out_diff, state_diff in rows:
        print(f"| {batch} | {fused_us:.1f} | {fla_us:.1f} | {speedup:.2f}x | {fused_frac:.0%} | {fla_frac:.0%} "
              f"| {out_diff:.1e} / {state_diff:.1e} |")


if __name__ == "__main__":
    main()
