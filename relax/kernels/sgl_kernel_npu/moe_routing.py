"""The MoE routing front in one launch: scores from the router's logits (softmax over the experts, as Qwen3-MoE
and Qwen3.5-MoE route, or an independent sigmoid per expert), the top-k experts, and their k weights renormalised
to sum to one. Reference: relax.kernels.moe_reference.route_topk."""

import torch
import triton
import triton.language as tl

from .launch import grid_size

SCORING_FUNCS = ("softmax", "sigmoid")
MAX_EXPERTS = 4096  # one row's scores stay on chip (16 KB of float32)


@triton.jit
def _route_topk_kernel(logits_ptr, weights_ptr, ids_ptr, rows, experts, logits_row_stride,
                       TOP_K: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, SOFTMAX: tl.constexpr,
                       RENORMALIZE: tl.constexpr):
    """One work item = one token row. The k experts are taken one at a time, highest score first (the lowest
    expert index among equal scores), each then masked out of the row."""
    offs = tl.arange(0, BE)
    in_row = offs < experts
    picks = tl.arange(0, BK)
    for row in range(tl.program_id(0), rows, tl.num_programs(0)):
        logits = tl.load(logits_ptr + row * logits_row_stride + offs, mask=in_row, other=-float("inf"))
        logits = logits.to(tl.float32)
        if SOFTMAX:
            exps = tl.exp(logits - tl.max(logits, axis=0))
            scores = exps / tl.sum(exps, axis=0)
        else:
            scores = tl.sigmoid(logits)
        scores = tl.where(in_row, scores, -1.0)  # below every score, so padding is never picked
        weights = tl.zeros([BK], dtype=tl.float32)
        ids = tl.zeros([BK], dtype=tl.int32)
        for j in tl.static_range(TOP_K):
            best = tl.max(scores, axis=0)
            expert = tl.min(tl.where(scores == best, offs, BE), axis=0)
            weights = tl.where(picks == j, best, weights)
            ids = tl.where(picks == j, expert, ids)
            scores = tl.where(offs == expert, -1.0, scores)
        if RENORMALIZE:
            weights = weights / tl.sum(weights, axis=0)
        tl.store(weights_ptr + row * TOP_K + picks, weights, mask=picks < TOP_K)
        tl.store(ids_ptr + row * TOP_K + picks, ids, mask=picks < TOP_K)


def fused_topk(router_logits: torch.Tensor, top_k: int, scoring_func: str = "softmax", renormalize: bool = True,
               num_programs: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [N, top_k], expert ids int32 [N, top_k]) of router_logits [N, E], highest score first.

    scoring_func: "softmax" over the E experts or "sigmoid" per expert; renormalize: divide the k weights by their
    sum. num_programs: the grid's bound (default: the NPU's vector cores).
    """
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func={scoring_func!r}: use one of {SCORING_FUNCS}")
    if router_logits.dim() != 2 or router_logits.stride(1) != 1:
        raise ValueError(f"router_logits must be [N, E] with contiguous rows, got {tuple(router_logits.shape)}")
    rows, experts = router_logits.shape
    if not 1 <= top_k <= experts or experts > MAX_EXPERTS:
        raise ValueError(f"top_k={top_k} of {experts} experts: need 1 <= top_k <= experts <= {MAX_EXPERTS}")
    weights = torch.empty(rows, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(rows, top_k, dtype=torch.int32, device=router_logits.device)
    if rows:
        _route_topk_kernel[(grid_size(rows, router_logits.device, num_programs),)](
            router_logits, weights, ids, rows, experts, router_logits.stride(0), TOP_K=top_k,
            BE=triton.next_power_of_2(experts), BK=triton.next_power_of_2(top_k), SOFTMAX=scoring_func == "softmax",
            RENORMALIZE=renormalize)
    return weights, ids
