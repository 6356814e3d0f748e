"""How relax's Triton kernels launch: the launch record every kernel takes, and each Triton target's tuning.

A TritonLaunch bounds the 1-D grid, gives the launch keywords, and sets the fused GDN decode kernel's tiling, which
relax.kernels.gdn_triton.decode_tiling turns into one call's block_v / programs_per_group / launch, and the
vocabulary tile of relax.kernels.logprobs_triton. `triton_launch`
builds the record of a device from two facts its platform states (relax.platform: Platform.triton_target and
Platform.triton_compute_units); tests and benchmarks may build one themselves.
"""

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping


@dataclass(frozen=True)
class TritonLaunch:
    num_programs: int  # upper bound of the 1-D grid: NPU vector cores, or GPU SMs x programs resident per SM
    options: Mapping[str, Any] = field(default_factory=dict)  # launch keywords (num_warps, num_stages); {} on NPU
    # gdn_decode: state rows per on-chip tile when one program does a key head's whole group of value heads.
    decode_block_v: int = 64
    # gdn_decode: a key head's group is split over several programs only while rows x key heads x programs per
    # group stays at most this many work items (small batches, where one program per group leaves the device
    # mostly idle); 0: never split.
    decode_split_items: int = 0
    decode_split_min_block_v: int = 16  # the smallest state tile a split may take
    # launch keywords a split launch sets over `options` (e.g. num_stages=2: load each tile one step ahead)
    decode_split_options: Mapping[str, Any] = field(default_factory=dict)
    # relax.kernels.logprobs_triton: logits per on-chip tile of a vocabulary row (a power of two).
    logprob_block_vocab: int = 2048
    # relax.kernels.gdn_chunk_triton's state pass: value columns of the state per work item (a power of two, at least
    # 16: tl.dot's smallest), and the launch keywords it sets over `options`.
    chunk_state_block_v: int = 16
    chunk_state_options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LaunchTuning:
    """A Triton target's launch numbers, per compute unit where they scale with the device."""

    programs_per_unit: int
    options: Mapping[str, Any] = field(default_factory=dict)
    decode_block_v: int = 64
    decode_split_items_per_unit: int = 0
    decode_split_min_block_v: int = 16
    decode_split_options: Mapping[str, Any] = field(default_factory=dict)
    logprob_block_vocab: int = 2048
    chunk_state_block_v: int = 16
    chunk_state_options: Mapping[str, Any] = field(default_factory=dict)

    def launch(self, compute_units: int) -> TritonLaunch:
        return TritonLaunch(
            num_programs=compute_units * self.programs_per_unit, options=self.options,
            decode_block_v=self.decode_block_v, decode_split_items=compute_units * self.decode_split_items_per_unit,
            decode_split_min_block_v=self.decode_split_min_block_v, decode_split_options=self.decode_split_options,
            logprob_block_vocab=self.logprob_block_vocab, chunk_state_block_v=self.chunk_state_block_v,
            chunk_state_options=self.chunk_state_options,
        )


# NVIDIA GPUs, per SM. Measured on an H200 (docs/benchmarks.md, "GDN decode (H200)"; 132 SMs): a grid of 16 programs
# per SM with 4 warps and num_stages=2, which gdn_decode reads as "load each state tile one step ahead": 2-17% faster
# than without at batch 1 to 256 (80.1 against 82.3 us at batch 64), since the kernel fits that in 127 registers per
# thread (4 programs per SM). Other NVIDIA GPUs get the same numbers per SM: not measured on any GPU but the H200.
NVIDIA = LaunchTuning(
    programs_per_unit=16,
    options=MappingProxyType({"num_warps": 4, "num_stages": 2}),
    # gdn_decode's tile when one program does a key head's group: 32 rows measured 2-3% faster than 64 at batch 64
    # and 256, and 16 rows slower.
    decode_block_v=32,
    # Split a key head's group over programs while the work items fit 2 per SM, the fewest resident programs per SM
    # measured. At Qwen3.5-9B's shape (16 key heads, 32 value heads, head dim 128) that splits batches 1 to 8 (16,
    # 8, 4, 2 ways) and runs 16 up unsplit; benchmarks/gdn_decode.py --policy times every choice against the others.
    decode_split_items_per_unit=2,
    decode_split_min_block_v=16,  # the smallest tile measured (batch 1's fastest)
    # The logprob kernels' vocabulary tile: 32 float32 logits per thread of 4 warps. Not measured yet:
    # benchmarks/logprob_entropy.py --block-vocab times other tiles.
    logprob_block_vocab=4096,
    # The chunked GDN rule's state pass (forward and backward), float32 products: 16 value columns per work item with
    # 8 warps and no prefetch measured fastest on an H100 at Qwen3.5-9B's GDN shape (16384 packed tokens, 32 heads of
    # 128; benchmarks/gdn_chunk_rule.py): a layer's forward + backward 45.8 ms, against 48.0 with num_stages=2, 82.7
    # with 32 columns and 201 with 32 columns and 4 warps (the programs spill their tiles).
    chunk_state_block_v=16,
    chunk_state_options=MappingProxyType({"num_warps": 8, "num_stages": 1}),
)
# Ascend NPUs (triton-ascend), per vector core: one program per core (relax's kernels have no matrix-unit work) and no
# num_warps/num_stages, as triton-ascend's porting rules ask. gdn_decode keeps TritonLaunch's defaults (64-row tiles,
# never split a key head's group), the logprob kernels theirs (2048-logit tiles): no other tiling was measured on an
# NPU. Unverified: no NPU was available.
ASCEND = LaunchTuning(programs_per_unit=1)
# TRITON_INTERPRET=1 on the host (one unit: programs run one after another), where the numbers only choose which code
# paths run: a few programs looping over work items, 8-row tiles, and key-head groups split up to 4 rows of the tiny
# test models (2 key heads of 2 value heads), so CPU tests, SGLang's engine with the tiny Qwen3.5 and its 3-row decode
# batches included, go through both of gdn_decode's work splits; 16-logit vocabulary tiles, so the logprob kernels
# stream a test's vocabulary in several tiles.
INTERPRETER = LaunchTuning(
    programs_per_unit=4, decode_block_v=8, decode_split_items_per_unit=16, decode_split_min_block_v=4,
    decode_split_options=MappingProxyType({"num_stages": 2}), logprob_block_vocab=16,
)
TUNINGS = {"nvidia": NVIDIA, "ascend": ASCEND, "interpreter": INTERPRETER}  # by Triton target


def triton_launch(triton_target: str, compute_units: int) -> TritonLaunch:
    """The launch record of a device: its Triton target's tuning scaled to its compute units."""
    if triton_target not in TUNINGS:
        raise ValueError(f"no Triton launch tuning for target {triton_target!r}: known {', '.join(TUNINGS)}")
    return TUNINGS[triton_target].launch(compute_units)
