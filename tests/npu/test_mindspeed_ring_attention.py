"""The NPU platform's context-parallel attention, MindSpeed's ring attention (relax.platform.attention.mindspeed_ring),
on two CPU ranks over gloo under MindSpeed (tests/npu/cpu_mindspeed.py): this rank's part of a packed row attends as the
whole row does, forward and backward. With the contract double (CI) it checks what relax passes MindSpeed; with
RELAX_MINDSPEED_CHECKOUT set, MindSpeed's own ring (AttentionWithCp) computes, its npu_fusion_attention and
npu_fusion_attention_grad calls on the stand-ins of torch_npu_ops.py."""

import datetime
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

from relax.platform import attention
from relax.ports import free_port

NPU_TESTS = Path(__file__).resolve().parent
# A packed row of sequences of 4 to 16 tokens (multiples of 2 x CP = 4): one chunk of a token, chunks of 4.
ROW = [0, 4, 16, 28, 44]
HEADS, KV_HEADS, HEAD_DIM, SCALE = 4, 2, 8, 0.3


def _rank(rank: int, size: int, port: int, results) -> None:
    torch.set_num_threads(1)
    sys.path.insert(0, str(NPU_TESTS))
    from cpu_mindspeed import mindspeed_in_use, use_mindspeed_on_cpu

    use_mindspeed_on_cpu()
    from relax.platform import get_platform

    get_platform("cpu").prepare_megatron()
    from relax.train.context_parallel import split_row

    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        generator = torch.Generator().manual_seed(0)
        tokens = ROW[-1]
        q, k, v = (
            torch.randn(tokens, heads, HEAD_DIM, generator=generator) for heads in (HEADS, KV_HEADS, KV_HEADS)
        )
        d_out = torch.randn(tokens, HEADS, HEAD_DIM, generator=generator)
        split = split_row(ROW, size, rank, torch.distributed.group.WORLD, "cpu")
        local = [split.local(x[None])[0].clone().requires_grad_() for x in (q, k, v)]
        out = attention.mindspeed_ring(*local, split.query_cu_seqlens, split.group, SCALE)
        out.backward(split.local(d_out[None])[0])
        whole = [x.clone().requires_grad_() for x in (q, k, v)]
        expected = attention.packed("sdpa", *whole, torch.tensor(ROW, dtype=torch.int32), 16, SCALE)
        expected.backward(d_out)
        mine = split.token_index
        results.put((rank, mindspeed_in_use(), {
            "out": (out - expected[mine]).abs().max().item(),
            **{name: (got.grad - want.grad[mine]).abs().max().item()
               for name, got, want in zip(("dq", "dk", "dv"), local, whole)},
        }))
    finally:
        torch.distributed.destroy_process_group()


def test_mindspeed_ring_attention_of_a_ranks_chunks_equals_the_whole_rows():
    context = mp.get_context("spawn")
    results = context.Queue()
    ranks = mp.start_processes(_rank, args=(2, free_port(), results), nprocs=2, join=False, start_method="spawn")
    # read before joining: a process exits only once what it put on the queue is taken
    outcomes = [results.get(timeout=300) for _ in range(2)]
    while not ranks.join():  # one call returns once any rank has exited
        pass
    for rank, mindspeed, differences in outcomes:
        print(f"rank {rank}, {mindspeed}: max |ring - whole row| {differences}")
        assert max(differences.values()) < 1e-5, (rank, mindspeed, differences)


def test_mindspeed_ring_takes_rows_of_at_most_1024_sequences():
    """The ring attends all of a row's sequences in one npu_fusion_attention call per block (TND: at most 1024
    sequences a call); the core attention takes relax's all-gather for more."""
    def chunk_bounds(sequences):  # two chunks of one token per sequence
        return torch.arange(2 * sequences + 1, dtype=torch.int32)

    assert attention.mindspeed_ring_takes(chunk_bounds(1024))
    assert not attention.mindspeed_ring_takes(chunk_bounds(1025))
