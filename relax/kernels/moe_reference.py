"""The MoE routing front in plain torch: the reference of relax.kernels.sgl_kernel_npu.moe_routing."""

import torch


def route_topk(router_logits: torch.Tensor, top_k: int, scoring_func: str = "softmax", renormalize: bool = True):
    """(weights float32 [N, top_k], expert ids int64 [N, top_k]), highest score first: scores are the softmax of
    router_logits [N, E] over the experts (Qwen3-MoE, Qwen3.5-MoE) or a sigmoid per expert; with renormalize the k
    weights are divided by their sum (HF's norm_topk_prob)."""
    logits = router_logits.float()
    if scoring_func == "softmax":
        scores = logits.softmax(dim=-1)
    elif scoring_func == "sigmoid":
        scores = logits.sigmoid()
    else:
        raise ValueError(f"scoring_func={scoring_func!r}: use 'softmax' or 'sigmoid'")
    weights, ids = scores.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
