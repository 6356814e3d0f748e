"""GDN decode step on a GPU: relax's fused Triton kernel vs the chain of flash-linear-attention 0.6.0 kernels.

Shapes are Qwen3.5-9B's linear-attention layers: 16 key heads, 32 value heads, head dim 128, conv kernel 4,
bf16 activations and conv state, fp32 recurrent state. Both sides are timed in the same run as CUDA-graph
replays (how SGLang runs decode), median of 200, L2 flushed before every replay (FLUSHES says how).

    fused:     relax.kernels.gdn_triton.gdn_decode, one launch; pools indexed by a shuffled slot table.
    fla chain: fla causal_conv1d_update -> fused_recurrent_gated_delta_rule (gating, beta sigmoid and q/k
               l2norm fused in, as fla 0.6.0 offers) -> rms_norm_gated. fla has no slot-indexed state, so it
               gets the batch's states as one [B, Hv, K, V] tensor (no gather/scatter: in its favour).

Roofline: the recurrent state read once and written once per token, B * Hv * K * V * 4 B * 2, at 4.8 TB/s
(the run also prints the measured device-to-device copy bandwidth, the practical ceiling). fla's recurrent
kernel is also timed alone, and the outputs of both sides are compared from identical float32 inputs.

    python benchmarks/gdn_decode.py --batch-sizes 1 64 256 --sweep
    python benchmarks/gdn_decode.py --policy
    python benchmarks/gdn_decode.py --batch-sizes 64 --flush clean   # under ncu: DRAM bytes of each flush

--policy times what SGLang's glue runs (relax.rollout.sglang_gdn_decode: the device's launch record through
gdn_triton.decode_tiling) against the fla chain at batch 1 to 256, beside every other tiling the policy could
have picked (unsplit, and each value head split 1, 2, 4, ... ways), so one run shows where splitting stops
paying and whether the glue beats the fla chain at every batch size.
"""

import argparse
from typing import NamedTuple

import torch
import triton

from relax.kernels import gdn_reference as ref
from relax.kernels.gdn_triton import DecodeTiling, decode_tiling, gdn_decode, split_tiling, unsplit_tiling
from relax.kernels.launch import TritonLaunch

HK, HV, K, V, WIDTH = 16, 32, 128, 128, 4
CONV_DIM = 2 * HK * K + HV * V
HBM_BYTES_PER_S = 4.8e12


def make_inputs(batch, device, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0, dtype=dtype):
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
        tickets=torch.zeros(batch * HK, dtype=torch.int32, device=device),
    )


def fused_step(inputs, tiling: DecodeTiling):
    return gdn_decode(inputs["mixed_qkvz"], inputs["mixed_ba"], inputs["conv_state_pool"], inputs["conv_weight"],
                      inputs["conv_bias"], inputs["state_pool"], inputs["slot_indices"], inputs["A_log"],
                      inputs["dt_bias"], inputs["norm_weight"], inputs["norm_eps"], HK, K, V, "contiguous",
                      tiling.launch, tiling.block_v, tiling.programs_per_group, inputs["tickets"])


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


# How L2 is emptied before each timed replay, so that no state is served from it (256 MB > 4x an H200's L2):
#   dirty (the default, as triton.testing.do_bench): zero a buffer. L2 is left full of dirty lines, which the
#       timed kernel writes back while its own last writes stay in L2: ncu at batch 64 counts 136-138 MB written
#       during the step, about its own 134 MB of state.
#   clean: read the buffer instead. The step then leaves the last ~25 MB of its own writes dirty in L2 for what
#       runs next (ncu: 109-113 MB written), and times ~6% faster at batch 64 than the traffic it causes.
FLUSHES = ("dirty", "clean")


def graph_time_us(step, flush="dirty", warmup=25, reps=200):
    """Median microseconds of one CUDA-graph replay of `step`, L2 flushed (FLUSHES) before each replay."""
    for _ in range(3):  # compile / autotune outside the graph
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    buffer = torch.ones(2**26, dtype=torch.int32, device="cuda")
    flush_l2 = buffer.zero_ if flush == "dirty" else buffer.sum
    for _ in range(warmup):
        flush_l2()
        graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        flush_l2()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return sorted(start.elapsed_time(end) for start, end in zip(starts, ends))[reps // 2] * 1e3


def roofline_fraction(batch, microseconds):
    state_bytes = batch * HV * K * V * 4 * 2
    return state_bytes / (microseconds * 1e-6) / HBM_BYTES_PER_S


def check_against_fla(batch, tiling):
    """Max |fused - fla chain| of the outputs and of the new states, from identical float32 inputs and states
    (in bf16 the two differ by where they round: fla stores the conv output and o in bf16, relax keeps fp32)."""
    inputs = make_inputs(batch, "cuda", seed=1, dtype=torch.float32)
    out = fused_step(inputs, tiling)
    fla_out, fla_state = fla_chain_step(inputs)
    new_state = ref.state_from_pool_layout(inputs["state_pool"][inputs["slot_indices"]])
    return (out.float() - fla_out.float()).abs().max().item(), (new_state - fla_state).abs().max().item()


def fla_recurrent_step(inputs):
    """fla's recurrent kernel alone, on contiguous q/k/v (61% of the roofline at batch 256: docs/upstream-facts.md)."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    return fused_recurrent_gated_delta_rule(
        inputs["q"], inputs["k"], inputs["v"], g=inputs["a"], beta=inputs["b"], initial_state=inputs["fla_state"],
        output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=inputs["A_log"],
        dt_bias=inputs["dt_bias"], use_beta_sigmoid_in_kernel=True)


def copy_bandwidth_bytes_per_s():
    """Device-to-device copy of 2 GiB: the practical ceiling beside the datasheet's 4.8 TB/s."""
    src = torch.empty(2**29, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    seconds = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median") * 1e-3
    return 2 * src.numel() * 4 / seconds


class Settings(NamedTuple):
    """One way to run the fused kernel: gdn_decode's arguments and the launch record's."""

    block_v: int  # state rows per tile
    programs_per_group: int  # programs sharing one key head's value heads
    num_warps: int
    programs_per_sm: int  # grid size = SMs x this
    num_stages: int  # 2: the kernel loads each state tile one step ahead of its update; 1: no prefetch
    maxnreg: int | None = None  # register cap per thread (more resident programs per SM, maybe spills)

    def tiling(self) -> DecodeTiling:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        options = dict(num_warps=self.num_warps, num_stages=self.num_stages)
        if self.maxnreg:
            options["maxnreg"] = self.maxnreg
        return DecodeTiling(self.block_v, self.programs_per_group,
                            TritonLaunch(num_programs=sms * self.programs_per_sm, options=options))

    def describe(self):
        return (f"block_v={self.block_v} programs_per_group={self.programs_per_group} num_warps={self.num_warps} "
                f"programs/SM={self.programs_per_sm} num_stages={self.num_stages}"
                + (f" maxnreg={self.maxnreg}" if self.maxnreg else ""))


DEFAULT_SETTINGS = Settings(32, 1, 4, 16, 2)  # relax.kernels.launch's NVIDIA unsplit launch: its grid, options and tile
SWEEP = [
    # one program per key-head group (batch >= 16); num_stages=2: each state tile loaded one step ahead
    Settings(64, 1, 4, 16, 1), Settings(64, 1, 4, 16, 2), Settings(64, 1, 4, 16, 2, maxnreg=168),
    Settings(32, 1, 4, 16, 1), Settings(32, 1, 4, 16, 2), Settings(32, 1, 4, 16, 2, maxnreg=128),
    Settings(16, 1, 4, 16, 1), Settings(16, 1, 4, 16, 2), Settings(64, 1, 8, 16, 2, maxnreg=128),
    Settings(128, 1, 8, 16, 1, maxnreg=128), Settings(128, 1, 16, 16, 1),
    # a group split over programs (batch 1)
    Settings(64, 2, 4, 16, 1), Settings(32, 2, 4, 16, 1), Settings(32, 4, 4, 16, 2), Settings(32, 8, 4, 16, 1),
    Settings(32, 8, 4, 16, 2), Settings(16, 16, 4, 16, 1), Settings(16, 16, 4, 16, 2),
]


POLICY_BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def policy_candidates(launch: TritonLaunch) -> dict[str, DecodeTiling]:
    """Every tiling decode_tiling can pick at this shape on this device, by name."""
    candidates = {"unsplit": unsplit_tiling(launch)}
    splits = 1
    while V // splits >= launch.decode_split_min_block_v:
        candidates[f"split x{splits}"] = split_tiling(splits, HK, HV, V, launch)
        splits *= 2
    return candidates


def run_policy(batch_sizes):
    """The glue's tiling per batch size against the fla chain, beside the policy's other candidates."""
    from relax.rollout.sglang_gdn_decode import launch_for_device

    launch = launch_for_device(torch.device("cuda", torch.cuda.current_device()))
    candidates = policy_candidates(launch)
    print(f"launch record: {launch}")
    rows = []
    for batch in batch_sizes:
        chosen = decode_tiling(batch, HK, HV, V, launch)
        chosen_name = next(name for name, tiling in candidates.items() if tiling == chosen)
        out_diff, state_diff = check_against_fla(batch, chosen)
        inputs = make_inputs(batch, "cuda")
        times = {}
        for name, tiling in candidates.items():
            times[name] = graph_time_us(lambda: fused_step(inputs, tiling))
            print(f"B={batch} fused {name} ({tiling.describe()}): {times[name]:.1f} us "
                  f"({roofline_fraction(batch, times[name]):.1%})" + (" <- the glue's choice" if name == chosen_name
                                                                     else ""), flush=True)
        fla_us = graph_time_us(lambda: fla_chain_step(inputs))
        print(f"B={batch} fla chain: {fla_us:.1f} us", flush=True)
        rows.append((batch, chosen_name, times, fla_us, out_diff, state_diff))
        del inputs
        torch.cuda.empty_cache()

    print("\n| batch | glue's choice | glue (us) | fla chain (us) | speedup vs fla | glue % of roofline | fastest "
          "candidate (us) | glue / fastest | " + " | ".join(f"{name} (us)" for name in candidates)
          + " | max abs diff vs fla, fp32: out / state |")
    print("|---|---|---|---|---|---|---|---|" + "---|" * len(candidates) + "---|")
    for batch, chosen_name, times, fla_us, out_diff, state_diff in rows:
        glue_us, fastest = times[chosen_name], min(times, key=times.get)
        print(f"| {batch} | {chosen_name} | {glue_us:.1f} | {fla_us:.1f} | {fla_us / glue_us:.2f}x "
              f"| {roofline_fraction(batch, glue_us):.1%} | {fastest}, {times[fastest]:.1f} "
              f"| {glue_us / times[fastest]:.2f} | " + " | ".join(f"{times[name]:.1f}" for name in candidates)
              + f" | {out_diff:.1e} / {state_diff:.1e} |")
    slower = [batch for batch, name, times, fla_us, _, _ in rows if times[name] >= fla_us]
    off = [batch for batch, name, times, _, _, _ in rows if times[name] > 1.03 * min(times.values())]
    print(f"\nglue faster than the fla chain at every batch size: {'yes' if not slower else f'no, not at {slower}'}")
    print(f"glue's choice within 3% of the fastest candidate at every batch size: "
          f"{'yes' if not off else f'no, not at {off}'}")
    short = [batch for batch, name, times, _, _, _ in rows
             if batch >= 64 and roofline_fraction(batch, times[name]) < 0.7]
    print(f"glue at 70% of the HBM roofline or more from batch 64 up: {'yes' if not short else f'no, not at {short}'}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+",
                        help=f"default: 1 64 256; with --policy {' '.join(map(str, POLICY_BATCH_SIZES))}")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--sweep", action="store_true",
                      help="time the SWEEP settings at every batch size and report the fastest per batch size")
    mode.add_argument("--policy", action="store_true",
                      help="time the glue's tiling (decode_tiling) and the policy's other candidates against fla")
    parser.add_argument("--flush", choices=FLUSHES, default="dirty",
                        help="how L2 is emptied before each timed replay, without --policy (FLUSHES in the source)")
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    copy_bw = copy_bandwidth_bytes_per_s()
    print(f"device-to-device copy: {copy_bw / 1e12:.2f} TB/s ({copy_bw / HBM_BYTES_PER_S:.0%} of 4.8 TB/s)")
    if args.policy:
        run_policy(args.batch_sizes or POLICY_BATCH_SIZES)
        return
    args.batch_sizes = args.batch_sizes or [1, 64, 256]

    rows, sweep_times = [], {}
    for batch in args.batch_sizes:
        try:
            diffs = [check_against_fla(batch, settings.tiling())  # one program per group, and 8
                     for settings in (DEFAULT_SETTINGS, Settings(32, 8, 4, 16, 2))]
            out_diff, state_diff = max(d[0] for d in diffs), max(d[1] for d in diffs)
        except Exception as error:
            if not args.sweep:
                raise
            print(f"B={batch} check against fla failed: {type(error).__name__}: {error}"[:300])
            out_diff = state_diff = float("nan")
        inputs = make_inputs(batch, "cuda")
        times = {}
        for settings in ([DEFAULT_SETTINGS] + [s for s in SWEEP if s != DEFAULT_SETTINGS] if args.sweep
                         else [DEFAULT_SETTINGS]):
            tiling = settings.tiling()
            try:
                times[settings] = graph_time_us(lambda: fused_step(inputs, tiling), args.flush)
            except Exception as error:  # one setting the compiler refuses must not end the sweep
                if not args.sweep:
                    raise
                print(f"B={batch} fused {settings.describe()}: failed: {type(error).__name__}: {error}"[:300])
                continue
            print(f"B={batch} fused {settings.describe()}: {times[settings]:.1f} us "
                  f"({roofline_fraction(batch, times[settings]):.1%})", flush=True)
        sweep_times[batch] = times
        best = min(times, key=times.get)
        fla_us = graph_time_us(lambda: fla_chain_step(inputs), args.flush)
        b, a = inputs["mixed_ba"].split([HV, HV], dim=-1)
        q, k, v = inputs["mixed_qkvz"][:, :CONV_DIM].split([HK * K, HK * K, HV * V], dim=-1)
        inputs.update(q=q.reshape(batch, 1, HK, K).contiguous(), k=k.reshape(batch, 1, HK, K).contiguous(),
                      v=v.reshape(batch, 1, HV, V).contiguous(), a=a.reshape(batch, 1, HV).contiguous(),
                      b=b.reshape(batch, 1, HV).contiguous())
        recurrent_us = graph_time_us(lambda: fla_recurrent_step(inputs), args.flush)
        rows.append((batch, times.get(DEFAULT_SETTINGS, float("nan")), times[best], best, fla_us, recurrent_us,
                     out_diff, state_diff))
        del inputs
        torch.cuda.empty_cache()

    def frac(batch, us):
        return f"{roofline_fraction(batch, us):.1%}"

    if args.sweep:
        print("\n| settings | " + " | ".join(f"B={batch} (us)" for batch in args.batch_sizes) + " |")
        print("|---|" + "---|" * len(args.batch_sizes))
        for settings in [DEFAULT_SETTINGS] + [s for s in SWEEP if s != DEFAULT_SETTINGS]:
            cells = [f"{sweep_times[batch][settings]:.1f}" if settings in sweep_times[batch] else "failed"
                     for batch in args.batch_sizes]
            print(f"| {settings.describe()} | " + " | ".join(cells) + " |")
    print(f"\ndefault settings: {DEFAULT_SETTINGS.describe()}")
    print("\n| batch | fused, default (us) | fused, fastest (us) | fastest settings | fla chain (us) "
          "| speedup (fastest) | fused % of roofline | fla chain % | fla recurrent kernel alone (us, %) "
          "| max abs diff vs fla, fp32: out / state |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for batch, default_us, best_us, best, fla_us, recurrent_us, out_diff, state_diff in rows:
        print(f"| {batch} | {default_us:.1f} | {best_us:.1f} | {best.describe()} | {fla_us:.1f} "
              f"| {fla_us / best_us:.2f}x | {frac(batch, best_us)} | {frac(batch, fla_us)} "
              f"| {recurrent_us:.1f}, {frac(batch, recurrent_us)} | {out_diff:.1e} / {state_diff:.1e} |")


if __name__ == "__main__":
    main()
