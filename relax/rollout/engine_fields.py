"""The ServerArgs fields relax sets on an SGLang engine beyond the user's (its defaults per platform, decode graphs
sized to the rollout), and what an engine's fields imply for a rollout: decode graphs that stop below its batch,
requests its scheduler holds back for the KV cache it reserves (relax.rollout.engine starts the engine with them)."""

import math
from collections.abc import Mapping
from dataclasses import dataclass

# relax's own defaults for engine fields nobody else sets: SGLang's "info" logs every batch.
RELAX_SERVER_DEFAULTS = {"log_level": "warning"}
ENGINE_LOGS_DEFAULTS = {"log_level": "info"}  # --engine-logs: SGLang's batch lines (throughput, cache hits)


def server_defaults(platform, engine_logs: bool = False) -> dict:
    """ServerArgs fields relax sets on `platform` (a relax.platform record) unless the user sets them; with
    `engine_logs` (--engine-logs), SGLang logs at info level."""
    return {**RELAX_SERVER_DEFAULTS, **(ENGINE_LOGS_DEFAULTS if engine_logs else {}), **platform.sglang_server_defaults}


def decode_graph_max(fields: Mapping) -> int | None:
    """The largest decode batch SGLang captures a graph for under these ServerArgs fields, where they name one: a
    list of sizes (its largest) wins over a maximum, and --cuda-graph-config's decode sizes over the
    --cuda-graph-*-decode flags, as SGLang resolves them. None: SGLang's default, which it sets from the device's
    memory at the engine's start."""
    decode = _decode_graph_config(fields)
    sizes = decode.get("bs") or fields.get("cuda_graph_bs_decode")
    if sizes:
        return max(sizes)
    return decode["max_bs"] if "max_bs" in decode else fields.get("cuda_graph_max_bs_decode")


def decode_graphs_off(fields: Mapping) -> bool:
    """Whether these ServerArgs fields turn SGLang's decode graphs off (the CPU's defaults do)."""
    backends = (fields.get("cuda_graph_backend_decode"), _decode_graph_config(fields).get("backend"))
    return bool(fields.get("disable_cuda_graph") or fields.get("disable_decode_cuda_graph")) or "disabled" in backends


def rollout_decode_graph_fields(fields: Mapping, requests_per_engine: int) -> dict:
    """The decode graph size relax adds to an engine's ServerArgs `fields`: graphs up to the most requests the engine
    decodes at once in a rollout (_most_running).

    Why: SGLang sizes its largest decode graph by the device's memory (256 on an H100 or H200 below TP 4; 64 on a
    64 GB Ascend NPU below TP 4, 256 from TP 4), while one engine may run 1,024 sequences of a rollout at once, and
    a decode step of a batch above the largest graph runs without one: in a rollout, every step until enough
    sequences have finished. SGLang captures no size above its request pool. Nothing is added where the fields name
    their own sizes (the user's win) or turn decode graphs off (the CPU runs none)."""
    if decode_graphs_off(fields) or decode_graph_max(fields) is not None:
        return {}
    return {"cuda_graph_max_bs_decode": _most_running(fields, requests_per_engine)}


def decode_graph_shortfall(fields: Mapping, requests_per_engine: int) -> str | None:
    """Where the decode graphs that `fields` name stop below the most requests the engine decodes at once in a
    rollout (_most_running), says so; None otherwise."""
    largest, most = decode_graph_max(fields), _most_running(fields, requests_per_engine)
    if decode_graphs_off(fields) or largest is None or largest >= most:
        return None
    return (
        f"the sizes given (--sglang-cuda-graph-max-bs-decode, --sglang-cuda-graph-bs-decode or "
        f"--sglang-cuda-graph-config) stop at {largest} requests, while an engine runs up to {most} at once in a "
        "rollout: decode steps of larger batches run without a graph (without those flags relax sizes the graphs "
        "to the rollout)"
    )


@dataclass(frozen=True)
class AdmissionBudget:
    """What an engine's scheduler admits new requests against. SGLang starts a waiting request only while its KV
    cache holds the request's prompt and, for each running request, the tokens it may still generate (clipped at
    `reserve_clip`) x the new-token ratio; the ratio starts every busy spell at `init_ratio` x `conservativeness`
    (at most 1) and decays as decode steps pass."""

    kv_cache_tokens: int
    conservativeness: float  # --sglang-schedule-conservativeness, as the scheduler resolved it
    init_ratio: float  # SGLANG_INIT_NEW_TOKEN_RATIO
    reserve_clip: int  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
    max_running_requests: int

    @property
    def reserve_ratio(self) -> float:
        return min(self.init_ratio * self.conservativeness, 1.0)


def admission_holdback(budget: AdmissionBudget, requests_per_engine: int, max_response_len: int) -> str | None:
    """Where SGLang starts fewer of the requests an engine gets at once in a rollout than it could run (its
    max_running_requests), because of the tokens it reserves for the running ones, says how many it starts and the
    --sglang-schedule-conservativeness that starts them all; None otherwise.

    Why: the requests held back start one or a few at a time as others finish, each admission a prefill pass of
    its own, while the KV cache the reservation protects stays mostly unused (a rollout's responses are mostly far
    shorter than their budget). Over-sampling multiplies the requests in flight, and so the holdback."""
    most = min(requests_per_engine, budget.max_running_requests)
    budget_tokens = min(max_response_len, budget.reserve_clip)
    reserved = budget_tokens * budget.reserve_ratio  # per running request
    if reserved == 0 or budget.kv_cache_tokens >= most * reserved:
        return None
    starts = int(budget.kv_cache_tokens // reserved)
    starting_all = math.floor(100 * budget.kv_cache_tokens / (most * budget_tokens * budget.init_ratio)) / 100
    return (
        f"SGLang starts about {starts} of the {most} requests an engine runs at once in a rollout, the rest as "
        f"those finish: its KV cache holds {budget.kv_cache_tokens} tokens and it reserves "
        f"{budget.reserve_ratio:.2f} x min(--rollout-max-response-len, {budget.reserve_clip}) = {reserved:.0f} of "
        f"them for each running request ({budget.init_ratio:g} x --sglang-schedule-conservativeness "
        f"{budget.conservativeness:g}). --sglang-schedule-conservativeness {starting_all:g} or less starts them all "
        "at once (less still leaves room for the prompts); if their tokens then fill the cache, SGLang retracts some "
        "requests and computes them again later"
    )


def _most_running(fields: Mapping, requests_per_engine: int) -> int:
    """The most requests one engine decodes at once in a rollout: those it gets from a generate call
    (`requests_per_engine`), or fewer where the fields' max_running_requests holds the rest back."""
    cap = fields.get("max_running_requests")
    return requests_per_engine if cap is None else min(requests_per_engine, cap)


def _decode_graph_config(fields: Mapping) -> dict:
    """The decode phase of --cuda-graph-config (SGLang parses its JSON into a dict of phases)."""
    return (fields.get("cuda_graph_config") or {}).get("decode", {})
