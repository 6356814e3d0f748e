"""relax.train on real megatron-core (local spec, CPU, fp32, gloo): the HF <-> Megatron model families
against HF transformers, and the actor (logprobs, DP/TP/PP training, MoE routing replayed from SGLang's engine).

Every Megatron case runs on two spawned ranks sharing one gloo group, started once for this module:
TP=1 runs as two data-parallel replicas; TP=2, PP=2, EP=2 and CP=2 split the model (or the rows) across the two
ranks. Context parallelism with TP=2 runs on four ranks of their own.
"""

import dataclasses
import datetime
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relax.hf_checkpoint import read_hf_checkpoint, transformer_config
from relax.tools.tiny_model import build_tiny_model

from spawned_ranks import SpawnedRanks

NPU_TESTS = Path(__file__).resolve().parents[1] / "npu"
sys.path.insert(0, str(NPU_TESTS))
from cpu_mindspeed import mindspeed_in_use, use_mindspeed_on_cpu  # noqa: E402

WORLD_SIZE = 2
RELAX = Path(sys.executable).parent / "relax"  # the console script of this virtualenv
TASK_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def ranks():
    pool = SpawnedRanks(WORLD_SIZE, TASK_TIMEOUT_S)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    families = ("qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next")
    dirs = {family: str(build_tiny_model(tmp_path_factory.mktemp(family), family)) for family in families}
    # Small Qwen3 checkpoints (0.6B to 4B) tie lm_head to the embedding.
    dirs["qwen3_tied"] = str(build_tiny_model(tmp_path_factory.mktemp("qwen3_tied"), "qwen3", tie_word_embeddings=True))
    return dirs


def _megatron_model(hf_dir: str, tp: int, ep: int = 1, grouped_experts: bool = False):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from relax.train.model import build_gpt_model, load_hf_weights

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(0)
    hf = read_hf_checkpoint(hf_dir)
    config = transformer_config(
        hf,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        sequence_parallel=tp > 1 and ep > 1,
        use_cpu_initialization=True,
        perform_initialization=False,
        moe_grouped_gemm=grouped_experts,
    )
    model = build_gpt_model(hf, config)
    load_hf_weights(model, hf)
    return model.eval(), hf


def _parity(hf_dir: str, tp: int, ep: int, grouped_experts: bool = False) -> dict:
    """Max |logits - HF logits| and whether the exported weights equal the checkpoint's, on this rank."""
    import transformers
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from safetensors.torch import load_file

    from relax.train.model import export_hf_weights

    model, hf = _megatron_model(hf_dir, tp, ep, grouped_experts)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, hf.text_config["vocab_size"], (2, 13), generator=generator)
    position_ids = torch.arange(13).expand(2, -1)
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = gather_from_tensor_model_parallel_region(model(input_ids, position_ids, None))
        expected = reference(input_ids).logits
    exported = dict(export_hf_weights(model, hf))
    on_disk = load_file(os.path.join(hf_dir, "model.safetensors"))
    return {
        "logits_max_abs_diff": (logits - expected).abs().max().item(),
        "same_names": sorted(exported) == sorted(on_disk),
        "exact": sorted(exported) == sorted(on_disk) and all(torch.equal(exported[k], on_disk[k]) for k in on_disk),
    }


@pytest.mark.parametrize(
    "family, tp, ep, grouped_experts",
    [
        ("qwen3", 1, 1, False),
        ("qwen3", 2, 1, False),
        ("qwen3_moe", 1, 1, False),
        ("qwen3_moe", 2, 1, False),
        ("qwen3_moe", 1, 2, False),
        # --moe-grouped-gemm: whole experts, expert TP 2 (with the dense TP), and experts over EP 2
        ("qwen3_moe", 1, 1, True),
        ("qwen3_moe", 2, 1, True),
        ("qwen3_moe", 1, 2, True),
        ("qwen2", 2, 1, False),
        ("qwen3_tied", 2, 1, False),
    ],
)
def test_logits_equal_hf_and_export_is_exact(ranks, hf_dirs, family, tp, ep, grouped_experts):
    for rank, result in enumerate(ranks.run(_parity, hf_dirs[family], tp, ep, grouped_experts)):
        assert result["logits_max_abs_diff"] <= 1e-4, (rank, result)
        assert result["same_names"] and result["exact"], (rank, result)


def _load_error(hf_dir: str) -> str:
    try:
        _megatron_model(hf_dir, tp=1)
    except (KeyError, ValueError) as error:
        return str(error)
    return "no error"


def test_mis_shaped_and_missing_tensors_are_named(ranks, hf_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(hf_dirs["qwen3"], "model.safetensors"))
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    (bad_dir / "config.json").write_text((Path(hf_dirs["qwen3"]) / "config.json").read_text())
    name = "model.layers.1.self_attn.k_proj.weight"
    save_file({**tensors, name: torch.zeros(16, 64)}, bad_dir / "model.safetensors")
    message = ranks.run(_load_error, str(bad_dir))[0]
    assert name in message and "[16, 64]" in message and "[32, 64]" in message, message

    del tensors["model.norm.weight"]
    save_file(tensors, bad_dir / "model.safetensors")
    message = ranks.run(_load_error, str(bad_dir))[0]
    assert "model.norm.weight" in message and "missing" in message, message


# --- the actor ---------------------------------------------------------------------------------------

# (prompt length, response length) of the samples; rank r of a DP=2 run takes samples r, r+2, ...
SHAPES = [(5, 3), (7, 4), (3, 1), (9, 5), (4, 6), (6, 2)]


def _samples(vocab_size: int):
    from relax.train.batch import RolloutBatch

    generator = torch.Generator().manual_seed(2)
    # Real samples never contain the pad token (the last id of the tiny vocabulary); HF's embedding gives
    # its row no gradient (padding_idx), Megatron's does, so it is left out to compare gradients.
    tokens = [torch.randint(0, vocab_size - 1, (p + r,), generator=generator) for p, r in SHAPES]
    advantages = [torch.full((r,), 1.0 if i % 3 else -1.0) for i, (_, r) in enumerate(SHAPES)]
    # Arbitrary rollout logprobs: the mismatch metrics against them combine over micro-batches and ranks.
    rollout_logprobs = [-3 * torch.rand(r, generator=generator) for _, r in SHAPES]
    return RolloutBatch(tokens, [r for _, r in SHAPES], advantages=advantages, rollout_logprobs=rollout_logprobs)


def _my_samples(actor):
    """This data-parallel rank's share of the samples: every dp_size-th one."""
    from megatron.core import parallel_state

    from relax.train.batch import RolloutBatch

    batch = _samples(actor.hf_checkpoint.text_config["vocab_size"])
    pick = range(parallel_state.get_data_parallel_rank(), len(batch), parallel_state.get_data_parallel_world_size())
    return RolloutBatch(
        [batch.tokens[i] for i in pick],
        [batch.response_lengths[i] for i in pick],
        advantages=[batch.advantages[i] for i in pick],
        rollout_logprobs=[batch.rollout_logprobs[i] for i in pick],
    )


def _actor(
    hf_dir: str, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1, distributed_optimizer: bool = False,
    memory_saver_stand_in: bool = False, grouped_experts: bool = False, lr: float = 1e-3, routing_replay: bool = False,
    recompute: dict | None = None, bf16: bool = False, optimizer: str = "adam", **settings,
):
    """memory_saver_stand_in: sleep through the memory saver route, with the CPU record's do-nothing saver.
    recompute: TransformerConfig's recompute_* fields, as the --recompute-* flags set them. bf16: --bf16's
    parameters and optimizer. optimizer: megatron's OptimizerConfig.optimizer ("adam" or "sgd")."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from relax.platform import get_platform
    from relax.train.actor import ActorSettings, MegatronActor
    from relax.train.losses import LossSettings

    transformer = transformer_config(
        read_hf_checkpoint(hf_dir),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        context_parallel_size=cp,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        perform_initialization=False,
        moe_grouped_gemm=grouped_experts,
        moe_enable_routing_replay=routing_replay,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        **(recompute or {}),
    )
    optimizer = OptimizerConfig(
        optimizer=optimizer, lr=lr, min_lr=lr / 10, clip_grad=1.0, use_distributed_optimizer=distributed_optimizer,
        bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
    )
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer)
    loss = LossSettings(kl_coef=0.05, entropy_coef=0.01)
    settings = ActorSettings(**{"loss": loss, "lr_decay_style": "linear", "lr_decay_steps": 4, **settings})
    platform = get_platform()
    if memory_saver_stand_in:
        class WithSaverRoute(type(platform)):  # load_memory_saver stays the CPU's do-nothing saver
            memory_saver = "stand-in"

        platform = WithSaverRoute()
    return MegatronActor(hf_dir, transformer, optimizer, ddp, settings, platform=platform)


def _hf_logprob_difference(hf_dir: str, batch, logprobs, entropy=None) -> tuple[float, float]:
    """Max |actor - HF| over the samples' response logprobs (and entropies when given)."""
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    logprob_diff = entropy_diff = 0.0
    for i, (tokens, length) in enumerate(zip(batch.tokens, batch.response_lengths)):
        with torch.no_grad():
            hf_logprobs = reference(tokens[None]).logits[0, -length - 1 : -1].log_softmax(-1)
        expected = hf_logprobs.gather(-1, tokens[-length:, None]).squeeze(-1)
        logprob_diff = max(logprob_diff, (logprobs[i] - expected).abs().max().item())
        if entropy is not None:
            expected_entropy = -(hf_logprobs.exp() * hf_logprobs).sum(-1)
            entropy_diff = max(entropy_diff, (entropy[i] - expected_entropy).abs().max().item())
    return logprob_diff, entropy_diff


def _logprobs_vs_hf(hf_dir: str, settings: dict) -> dict:
    """Max |actor - HF| of this DP rank's samples' response logprobs and entropies."""
    actor = _actor(hf_dir, **settings)
    batch = _my_samples(actor)
    logprobs, entropy = actor.compute_logprobs(batch, with_entropy=True)
    logprob_diff, entropy_diff = _hf_logprob_difference(hf_dir, batch, logprobs, entropy)
    return {"logprobs": logprob_diff, "entropy": entropy_diff, "samples": len(batch)}


@pytest.mark.parametrize(
    "model, settings",
    [
        ("qwen3", dict(micro_batch_size=2)),
        ("qwen3", dict(micro_batch_size=1, max_tokens_per_micro_batch=20)),  # packed rows, several samples each
        ("qwen3", dict(tp=2, micro_batch_size=3)),
        ("qwen3", dict(pp=2, max_tokens_per_micro_batch=16)),
        ("qwen3_tied", dict(pp=2, micro_batch_size=2)),  # the last stage's output layer is the embedding's copy
    ],
    ids=["dp2", "dp2-packed", "tp2", "pp2-packed", "tied-pp2"],
)
def test_actor_logprobs_and_entropy_equal_hf(ranks, hf_dirs, model, settings):
    for result in ranks.run(_logprobs_vs_hf, hf_dirs[model], settings):
        assert result["logprobs"] <= 1e-5 and result["entropy"] <= 1e-5, result
        assert result["samples"] > 0


def _bf16_logits_and_their_fp32_copy(hf_dir: str) -> dict:
    """A bf16 actor's logprobs from the model's own bf16 logits and from Float16Module's fp32 copy of them."""
    import relax.train.actor as actor_module

    actor = _actor(hf_dir, bf16=True, micro_batch_size=2)
    batch = _my_samples(actor)
    computed = actor_module.vocab_parallel_logprobs
    dtypes = []

    def recording(logits, *args, **kwargs):
        dtypes.append(logits.dtype)
        return computed(logits, *args, **kwargs)

    actor_module.vocab_parallel_logprobs = recording
    try:
        own = actor.compute_logprobs(batch, with_entropy=True)
        actor.forward_options = {}  # Float16Module's default: an fp32 copy of the logits
        copied = actor.compute_logprobs(batch, with_entropy=True)
    finally:
        actor_module.vocab_parallel_logprobs = computed
    return {
        "dtypes": sorted({str(dtype) for dtype in dtypes[: len(dtypes) // 2]}),
        "copy_dtypes": sorted({str(dtype) for dtype in dtypes[len(dtypes) // 2 :]}),
        "equal": all(torch.equal(a, b) for values, copies in zip(own, copied) for a, b in zip(values, copies)),
        "hf": _hf_logprob_difference(hf_dir, batch, *own),
    }


def test_a_bf16_actor_reads_its_bf16_logits_with_the_values_of_an_fp32_copy(ranks, hf_dirs):
    """No fp32 [tokens, vocab] copy of the logits (relax.train.logprobs computes in fp32 piece by piece)."""
    for result in ranks.run(_bf16_logits_and_their_fp32_copy, hf_dirs["qwen3"]):
        assert result["dtypes"] == ["torch.bfloat16"] and result["copy_dtypes"] == ["torch.float32"], result
        assert result["equal"], result
        assert max(result["hf"]) < 0.1, result  # bf16 weights against HF's fp32 reference: rounding only


def _packed_vs_one_sample_per_micro_batch(hf_dir: str) -> dict:
    """Max |packed - unpacked| of the response logprobs and entropies: every sample in one packed micro-batch (one
    THD row) against one sample per micro-batch."""
    actor = _actor(hf_dir, micro_batch_size=1)
    batch = _my_samples(actor)
    alone, alone_entropy = actor.compute_logprobs(batch, with_entropy=True)
    actor.settings = dataclasses.replace(actor.settings, max_tokens_per_micro_batch=sum(batch.token_counts()))
    assert len(actor._micro_batches(batch, forward_only=True)) == 1
    packed, packed_entropy = actor.compute_logprobs(batch, with_entropy=True)
    return {
        "logprobs": max((a - b).abs().max().item() for a, b in zip(alone, packed)),
        "entropy": max((a - b).abs().max().item() for a, b in zip(alone_entropy, packed_entropy)),
    }


@pytest.mark.parametrize("model", ["qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_packed_rows_give_the_logprobs_of_one_sample_per_micro_batch(ranks, hf_dirs, model):
    for result in ranks.run(_packed_vs_one_sample_per_micro_batch, hf_dirs[model]):
        assert result["logprobs"] <= 1e-5 and result["entropy"] <= 1e-5, result


def _one_step_with_and_without_old_policy_pass(hf_dir: str) -> dict:
    """A rollout trained in one optimizer step, its old-policy logprobs from their own forward pass against none
    (train_step takes its own, detached, as TrainWorker.train does then): the gradients and metrics of both. lr=0
    keeps the weights, so both steps start from the same ones."""
    actor = _actor(hf_dir, lr=0.0, micro_batch_size=1, max_tokens_per_micro_batch=24)
    batch = _my_samples(actor)
    batch.ref_logprobs = actor.compute_logprobs(batch, reference=True)  # the KL term still needs its own pass
    results = []
    for old_logprobs in (actor.compute_logprobs(batch), None):
        batch.old_logprobs = old_logprobs
        metrics = actor.train_step(batch)
        grads = [p.main_grad.detach().clone() for p in actor.model.parameters()]
        results.append((metrics, grads))
    (with_pass, grads_with), (without, grads_without) = results
    return {
        "metrics": (with_pass, without),
        "grad_difference": max((a - b).abs().max().item() for a, b in zip(grads_with, grads_without)),
        "grad_size": max(g.abs().max().item() for g in grads_with),
    }


def test_skipping_the_old_policy_pass_of_a_one_step_rollout_changes_nothing(ranks, hf_dirs):
    for result in ranks.run(_one_step_with_and_without_old_policy_pass, hf_dirs["qwen3"]):
        with_pass, without = result["metrics"]
        assert result["grad_size"] > 0 and result["grad_difference"] <= 1e-7, result
        for key in ("loss", "pg_loss", "clip_fraction", "ppo_kl", "grad_norm"):
            assert without[key] == pytest.approx(with_pass[key], abs=1e-7), key


def _training_state(actor) -> list[torch.Tensor]:
    return [t.detach().clone() for t in actor._training_state_tensors()]


def _group_timeouts(actor) -> list:
    return [group._get_backend(torch.device("cpu")).options._timeout for group in actor.process_groups.groups]


def _sleep_and_wake(actor) -> dict:
    from megatron.core import parallel_state

    before = _training_state(actor)
    timeouts_before = _group_timeouts(actor)
    actor.sleep()
    device_bytes_asleep = sum(t.untyped_storage().nbytes() for t in actor._training_state_tensors())
    try:
        parallel_state.get_data_parallel_group().size()
        group_usable_asleep = True
    except RuntimeError:
        group_usable_asleep = False
    actor.wake()
    after = _training_state(actor)
    return {
        "bytes_before": sum(t.untyped_storage().nbytes() for t in before),
        "bytes_asleep": device_bytes_asleep,
        "identical": len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after)),
        "group_usable_asleep": group_usable_asleep,
        "timeouts": (timeouts_before, _group_timeouts(actor)),
        "num_groups": len(actor.process_groups.groups),
        "route": type(actor.memory).__name__,
    }


def _train(
    hf_dir: str, settings: dict, steps: int = 3, sleep_between_steps: bool = False, logprob_check: bool = False
) -> dict:
    """Metrics of `steps` train steps on the shared samples, this rank's exported weights after them, and
    checks of the reference and old-policy logprobs."""
    from relax.train.model import export_hf_weights

    actor = _actor(hf_dir, **settings)
    batch = _my_samples(actor)
    initial = actor.compute_logprobs(batch)
    hf_difference = _hf_logprob_difference(hf_dir, batch, initial) if logprob_check else None
    batch.old_logprobs = initial
    batch.ref_logprobs = actor.compute_logprobs(batch, reference=True)
    metrics, sleep_checks = [], []
    for _ in range(steps):
        metrics.append(actor.train_step(batch))
        if sleep_between_steps:
            sleep_checks.append(_sleep_and_wake(actor))
    reference_after = actor.compute_logprobs(batch, reference=True)
    current_after = actor.compute_logprobs(batch)
    return {
        "metrics": metrics,
        "weights": dict(export_hf_weights(actor.model, actor.hf_checkpoint)),
        "reference_unchanged": all(torch.equal(a, b) for a, b in zip(initial, reference_after)),
        "policy_moved": max((a - b).abs().max().item() for a, b in zip(initial, current_after)),
        "sleep_checks": sleep_checks,
        "hf_logprob_difference": hf_difference,
    }


@pytest.fixture(scope="module")
def dp2_run(ranks, hf_dirs):
    return ranks.run(_train, hf_dirs["qwen3"], dict(micro_batch_size=2))


def test_dp2_training_keeps_replicas_identical(dp2_run):
    first, second = dp2_run
    assert first["metrics"] == second["metrics"]
    assert all(torch.equal(first["weights"][k], second["weights"][k]) for k in first["weights"])
    losses = [m["loss"] for m in first["metrics"]]
    assert losses[-1] < losses[0], losses
    assert [m["lr"] for m in first["metrics"]] == pytest.approx([1e-3, 7.75e-4, 5.5e-4])  # linear to 1e-4 in 4
    assert first["metrics"][0]["kl"] == 0.0 and first["metrics"][-1]["kl"] > 0.0
    mismatch = first["metrics"][0]
    assert mismatch["mismatch/ratio_min"] < mismatch["mismatch/ratio_mean"] < mismatch["mismatch/ratio_max"]
    assert 0 < mismatch["mismatch/logprob_abs_diff_mean"] < mismatch["mismatch/logprob_abs_diff_max"]
    assert first["reference_unchanged"] and first["policy_moved"] > 1e-3


def _assert_same_training(run, baseline):
    """Step 1 (same weights, same data) must agree to float rounding; Adam then amplifies rounding in
    near-zero gradients (its update is about lr * sign there), so later steps agree less tightly."""
    for rank_result in run:
        for step, (got, expected) in enumerate(zip(rank_result["metrics"], baseline[0]["metrics"])):
            assert got.keys() == expected.keys()
            rel = 1e-4 if step == 0 else 2e-3
            for key in expected:
                assert got[key] == pytest.approx(expected[key], rel=rel, abs=1e-6), (step, key, got, expected)
        assert rank_result["reference_unchanged"]


@pytest.mark.parametrize(
    "settings",
    [
        dict(tp=2, micro_batch_size=4),
        dict(pp=2, micro_batch_size=1),
        dict(micro_batch_size=3, max_tokens_per_micro_batch=16, distributed_optimizer=True),
    ],
    ids=["tp2", "pp2", "dp2-packed-distributed-optimizer"],
)
def test_parallel_layouts_train_like_dp2(ranks, hf_dirs, dp2_run, settings):
    """The same 6 samples: whole-batch losses, metrics and grad norms equal the DP=2 run's, and so do the
    weights after 3 steps (TP=2 and PP=2 see all 6 samples on one replica)."""
    run = ranks.run(_train, hf_dirs["qwen3"], settings)
    _assert_same_training(run, dp2_run)
    for rank_result in run:
        weights = rank_result["weights"]
        expected = dp2_run[0]["weights"]
        names = set(weights) if settings.get("pp") else set(expected)  # a PP stage exports its own layers
        assert names <= set(expected) and names
        for name in names:
            difference = (weights[name] - expected[name]).abs()
            # Adam moves a weight by about lr per step where the gradient is near zero, whatever its size,
            # so a rounding-level gradient difference can move a few weights by up to steps * lr.
            assert difference.max() <= 3 * 1e-3 and difference.mean() <= 1e-5, (name, difference)


def _one_step_counting_forwards(hf_dir: str, recompute: dict) -> dict:
    """One train step at lr=0 with these recompute settings: its metrics, the gradients, and how often each kind of
    submodule ran forward (a recomputed one runs again in the backward)."""
    from collections import Counter

    from relax.train.model import unwrap

    actor = _actor(hf_dir, lr=0.0, micro_batch_size=2, recompute=recompute)
    batch = _my_samples(actor)
    batch.ref_logprobs = actor.compute_logprobs(batch, reference=True)  # the loss's KL term; before the counting
    forwards = Counter()
    for layer in unwrap(actor.model).decoder.layers:
        kinds = {"layer": layer, "mlp": layer.mlp, "input_layernorm": layer.input_layernorm}
        if hasattr(layer.self_attention, "core_attention"):  # softmax attention (a GDN layer has none)
            kinds["core_attention"] = layer.self_attention.core_attention
        if hasattr(layer.mlp, "router"):  # a MoE layer, whose recompute runs its parts, not the layer module again
            kinds["router"] = layer.mlp.router
        for kind, module in kinds.items():
            module.register_forward_hook(lambda *_, kind=kind: forwards.update([kind]))
    metrics = actor.train_step(batch)
    return {"metrics": metrics, "forwards": dict(forwards),
            "gradients": [param.main_grad.clone() for param in actor.model.parameters()]}


WHOLE_LAYERS = {"layer", "core_attention", "mlp", "input_layernorm", "router"}


@pytest.mark.parametrize(
    "model, recompute, recomputed",
    [
        ("qwen3", dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1), WHOLE_LAYERS),
        ("qwen3", dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2), WHOLE_LAYERS),
        ("qwen3_moe", dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
         WHOLE_LAYERS),
        ("qwen3", dict(recompute_granularity="selective"), {"core_attention"}),  # megatron's default module
        ("qwen3", dict(recompute_granularity="selective", recompute_modules=["mlp", "core_attn"]),
         {"mlp", "core_attention"}),
        ("qwen3_moe", dict(recompute_granularity="selective", recompute_modules=["moe"]), {"router"}),
        ("qwen3_5", dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
         WHOLE_LAYERS),
        ("qwen3_5", dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]),
         {"core_attention", "mlp"}),
    ],
    ids=["full-uniform", "full-block", "moe-full-uniform", "selective-core-attn", "selective-mlp", "selective-moe",
         "gdn-full-uniform", "gdn-selective"],
)
def test_recomputed_activations_give_the_same_step(ranks, hf_dirs, model, recompute, recomputed):
    """The --recompute-* flags reach megatron-core: the submodules they name run forward again in the backward (and
    only those), and the step's metrics and gradients equal those of a step that keeps every activation."""
    baseline = ranks.run(_one_step_counting_forwards, hf_dirs[model], {})
    run = ranks.run(_one_step_counting_forwards, hf_dirs[model], recompute)
    for got, expected in zip(run, baseline):
        assert got["metrics"] == expected["metrics"]
        assert all(torch.equal(a, b) for a, b in zip(got["gradients"], expected["gradients"]))
        assert got["forwards"].keys() == expected["forwards"].keys()
        for kind, count in expected["forwards"].items():
            assert got["forwards"][kind] == (2 * count if kind in recomputed else count), (kind, got, expected)


# --- weight export for sync --------------------------------------------------------------------------


def _buckets(hf_dir: str, tp: int, ep: int, bucket_bytes: int) -> dict:
    import relax.train.model as model_module
    from relax.train.weight_export import weight_buckets
    from safetensors.torch import load_file

    model, hf = _megatron_model(hf_dir, tp, ep)
    gathered = []
    original_all_gather = model_module._all_gather

    def counting_all_gather(tensor, size, group):
        gathered.append(tensor.shape)
        return original_all_gather(tensor, size, group)

    model_module._all_gather = counting_all_gather
    try:
        buckets = weight_buckets(model, hf, bucket_bytes, dtype=torch.bfloat16)
        first = next(buckets)
        gathered_for_first = len(gathered)
        all_buckets = [first, *buckets]
    finally:
        model_module._all_gather = original_all_gather
    on_disk = load_file(os.path.join(hf_dir, "model.safetensors"))
    exported = [item for bucket in all_buckets for item in bucket]
    sizes = [sum(t.numel() * t.element_size() for _, t in bucket) for bucket in all_buckets]
    return {
        "num_buckets": len(all_buckets),
        "within_limit": all(size <= bucket_bytes or len(b) == 1 for size, b in zip(sizes, all_buckets)),
        "names_once": sorted(name for name, _ in exported) == sorted(on_disk),
        "equal": all(t.dtype == torch.bfloat16 and torch.equal(t, on_disk[n].to(torch.bfloat16)) for n, t in exported),
        "lazy": gathered_for_first < len(gathered) / 2,
    }


@pytest.mark.parametrize("tp, ep", [(2, 1), (1, 2)])
def test_weight_buckets_are_bounded_complete_and_lazy(ranks, hf_dirs, tp, ep):
    for result in ranks.run(_buckets, hf_dirs["qwen3_moe"], tp, ep, 8 * 1024):
        assert result["num_buckets"] > 3 and result["within_limit"], result
        assert result["names_once"] and result["equal"], result
        assert result["lazy"], result


# --- sleep and wake ----------------------------------------------------------------------------------


def test_sleep_and_wake_between_steps_changes_nothing(ranks, hf_dirs, dp2_run):
    """The DP=2 run again, asleep between steps: the training state is released (0 bytes) and comes back
    bit-identical, the process groups are destroyed and come back with their timeout, and metrics and final
    weights equal the run that never slept exactly."""
    settings = dict(micro_batch_size=2, distributed_timeout_minutes=7)
    run = ranks.run(_train, hf_dirs["qwen3"], settings, 3, True)
    seven_minutes = datetime.timedelta(minutes=7)
    for rank_result, baseline in zip(run, dp2_run):
        for check in rank_result["sleep_checks"]:
            assert check["bytes_before"] > 0 and check["bytes_asleep"] == 0 and check["identical"], check
            assert check["route"] == "HostCopies", check
            assert not check["group_usable_asleep"] and check["num_groups"] > 5, check
            before, after = check["timeouts"]
            assert before == after and set(before) == {seven_minutes}, check  # none at torch's default
        assert rank_result["metrics"] == baseline["metrics"]
        assert all(torch.equal(rank_result["weights"][k], baseline["weights"][k]) for k in baseline["weights"])


def test_sleep_through_a_memory_saver_trains_like_dp2(ranks, hf_dirs, dp2_run):
    """The memory saver route's own logic (relax.train.offload.SaverRegion) on the CPU, with the CPU record's
    do-nothing saver standing in (it releases nothing; tests/gpu runs torch_memory_saver): DDP's buffers and
    the optimizer are built inside its region, the parameters and Adam's moments copied into it; the state
    comes back bit-identical and metrics and final weights equal the run that never slept."""
    run = ranks.run(_train, hf_dirs["qwen3"], dict(micro_batch_size=2, memory_saver_stand_in=True), 3, True)
    for rank_result, baseline in zip(run, dp2_run):
        for check in rank_result["sleep_checks"]:
            assert check["route"] == "SaverRegion" and check["identical"], check
        assert rank_result["metrics"] == baseline["metrics"]
        assert all(torch.equal(rank_result["weights"][k], baseline["weights"][k]) for k in baseline["weights"])


# --- checkpoints -------------------------------------------------------------------------------------


def _dp_batch(actor):
    batch = _my_samples(actor)
    batch.old_logprobs = actor.compute_logprobs(batch, reference=True)  # the initial weights' logprobs
    batch.ref_logprobs = batch.old_logprobs
    return batch


def _train_one_step_and_save(hf_dir: str, checkpoint_dir: str, hf_out: str, settings: dict) -> dict:
    """One step, then the checkpoint and (as --save-hf does) the HF directory `hf_out`: transformers' logprobs
    of the HF directory against the trained actor's."""
    from relax.train.checkpoint import save_checkpoint, save_hf
    from relax.train.model import export_hf_weights

    actor = _actor(hf_dir, **settings)
    actor.train_step(_dp_batch(actor))
    save_checkpoint(actor, checkpoint_dir, step=1)
    rng_after_save = torch.rand(3)
    save_hf(actor.model, actor.hf_checkpoint, hf_out)
    batch = _my_samples(actor)
    logprob_difference, _ = _hf_logprob_difference(hf_out, batch, actor.compute_logprobs(batch))
    return {
        "rng_after_save": rng_after_save,
        "weights": dict(export_hf_weights(actor.model, actor.hf_checkpoint)),
        "saved_hf_logprob_difference": logprob_difference,
    }


def _resume_and_train(hf_dir: str, checkpoint_dir: str, settings: dict) -> dict:
    from relax.train.checkpoint import load_checkpoint
    from relax.train.model import export_hf_weights

    actor = _actor(hf_dir, **settings)
    batch = _dp_batch(actor)
    step = load_checkpoint(actor, checkpoint_dir)
    rng = torch.rand(3)
    metrics = [actor.train_step(batch) for _ in range(2)]
    weights = dict(export_hf_weights(actor.model, actor.hf_checkpoint))
    return {"step": step, "rng": rng, "metrics": metrics, "weights": weights}


def _convert(checkpoint_dir: str, out_dir: str, tp: int) -> None:
    from megatron.core import parallel_state

    from relax.train.checkpoint import checkpoint_to_hf

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    checkpoint_to_hf(checkpoint_dir, out_dir)


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["optimizer", "distributed-optimizer"])
def test_checkpoint_resume_equals_uninterrupted_and_converts_to_hf(
    ranks, hf_dirs, dp2_run, tmp_path, distributed_optimizer
):
    """One DP=2 step, save; a fresh actor loads it and trains 2 steps: metrics and weights equal steps 2-3 of
    the uninterrupted DP=2 run exactly, and RNG continues where it was saved. The trained actor's HF directory
    (--save-hf's save_hf) gives transformers the actor's logprobs. The checkpoint converted at TP=2 (resharded),
    and by `relax convert` on one CPU process, is an HF directory transformers loads, with the saved weights
    exactly; `relax convert` refuses a checkpoint with a truncated shard in one line."""
    import transformers

    settings = dict(micro_batch_size=2, distributed_optimizer=distributed_optimizer)
    baseline_run = ranks.run(_train, hf_dirs["qwen3"], settings) if distributed_optimizer else dp2_run
    step_dir = tmp_path / "step_000001"  # laid out as `relax train --save` lays out a step
    checkpoint_dir, hf_out, saved_hf = str(step_dir / "actor"), str(tmp_path / "hf"), str(tmp_path / "saved_hf")
    saved = ranks.run(_train_one_step_and_save, hf_dirs["qwen3"], checkpoint_dir, saved_hf, settings)
    resumed = ranks.run(_resume_and_train, hf_dirs["qwen3"], checkpoint_dir, settings)
    for saved_rank, resumed_rank, baseline in zip(saved, resumed, baseline_run):
        assert saved_rank["saved_hf_logprob_difference"] <= 1e-5, saved_rank["saved_hf_logprob_difference"]
        assert resumed_rank["step"] == 1
        assert torch.equal(resumed_rank["rng"], saved_rank["rng_after_save"])
        assert resumed_rank["metrics"] == baseline["metrics"][1:]
        assert all(torch.equal(resumed_rank["weights"][k], baseline["weights"][k]) for k in baseline["weights"])

    ranks.run(_convert, checkpoint_dir, hf_out, 2)
    outs = [hf_out, saved_hf]
    if distributed_optimizer:  # `relax convert` reads only the model's tensors: once is enough
        outs.append(tmp_path / "converted")
        convert = [str(RELAX), "convert", "--load", str(step_dir), "--hf-checkpoint", hf_dirs["qwen3"]]
        subprocess.run([*convert, "--out", str(outs[-1])], check=True, capture_output=True, timeout=300)
    for out in outs:
        model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(out)
        original_tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dirs["qwen3"])
        assert tokenizer("12+7").input_ids == original_tokenizer("12+7").input_ids
        state = model.state_dict()
        assert sorted(state) == sorted(saved[0]["weights"])
        assert all(torch.equal(state[k], v) for k, v in saved[0]["weights"].items())

    if not distributed_optimizer:
        return
    corrupt = tmp_path / "corrupt"
    shutil.copytree(step_dir, corrupt)
    shard = sorted(corrupt.glob("actor/*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:1000])
    refused = subprocess.run(
        [str(RELAX), "convert", "--load", str(corrupt), "--out", str(tmp_path / "none")],
        capture_output=True, text=True, timeout=300,
    )
    errors = [line for line in refused.stderr.splitlines() if line.startswith("relax convert:")]
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert errors == [
        f"relax convert: cannot read the model's tensors in checkpoint {corrupt / 'actor'} (EOFError): it is "
        "incomplete, corrupt, or not of the model in its hf/config.json"
    ], refused.stderr


# --- MoE ---------------------------------------------------------------------------------------------


def test_moe_actor_logprobs_equal_hf_and_expert_parallel_trains_like_dp2(ranks, hf_dirs):
    """Qwen3-MoE: the actor's logprobs equal HF's, and EP=2 (experts split over the two DP ranks, packed
    micro-batches) trains like plain DP=2 with every expert on both ranks."""
    dp2 = ranks.run(_train, hf_dirs["qwen3_moe"], dict(micro_batch_size=2), 2, False, True)
    # Packed to 14 tokens, rank 0's samples (8, 4, 10 tokens) make 2 micro-batches and rank 1's (11, 14, 8)
    # make 3: rank 0 runs an all-padding one so the two meet in every expert exchange.
    ep2 = ranks.run(_train, hf_dirs["qwen3_moe"], dict(max_tokens_per_micro_batch=14, ep=2), 2, False, True)
    for result in dp2 + ep2:
        assert result["hf_logprob_difference"][0] <= 1e-5, result["hf_logprob_difference"]
    _assert_same_training(ep2, dp2)
    losses = [m["loss"] for m in ep2[0]["metrics"]]
    assert losses[1] < losses[0], losses
    # --moe-grouped-gemm: the same training, grouped experts split over the two ranks (zero tokens for some)
    grouped_ep2 = ranks.run(
        _train, hf_dirs["qwen3_moe"], dict(max_tokens_per_micro_batch=14, ep=2, grouped_experts=True), 2
    )
    _assert_same_training(grouped_ep2, dp2)


def _near_tied_routers(hf_dir: str, out_dir: Path) -> str:
    """A copy of the checkpoint whose routers score the experts nearly alike: each layer's gate rows are its first
    row plus perturbations of 1e-6 of it, so which experts win is decided near float rounding, where the engine's
    and the actor's kernels differ (as for a large model's near-tied experts)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(hf_dir, out_dir)
    tensors = load_file(out_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(3)
    for name in [name for name in tensors if name.endswith("mlp.gate.weight")]:
        gate = tensors[name]
        tensors[name] = gate[:1] * (1 + 1e-6 * torch.randn(gate.shape, generator=generator))
    save_file(tensors, out_dir / "model.safetensors")
    return str(out_dir)


def _routing_against_the_engine(hf_dir: str, batch, routing_replay: bool) -> dict:
    """The actor's old-policy forward over this DP rank's share of the engine's samples (several packed in a row):
    the fraction of engine-recorded tokens whose experts the actor's routers chose alike in every layer, and the
    mean |actor - engine| logprob. With replay, the reference forward and a training step too (its router weights
    get gradients)."""
    from megatron.core.transformer.moe.router import TopKRouter

    from relax.train.off_policy import mismatch_metrics

    actor = _actor(hf_dir, max_tokens_per_micro_batch=64, routing_replay=routing_replay)
    rank = torch.distributed.get_rank()
    batch = batch.select(range(rank, len(batch), 2))
    chosen = []  # per router call: (layer, the experts it chose [tokens, top-k])
    routers = [module for module in actor.model.modules() if isinstance(module, TopKRouter)]
    hooks = [
        router.register_forward_hook(
            lambda module, inputs, output: chosen.append(
                (module.layer_number - 1, output[1].nonzero()[:, 1].view(output[1].shape[0], -1))
            )
        )
        for router in routers
    ]
    logprobs = actor.compute_logprobs(batch)
    for hook in hooks:
        hook.remove()
    agree = total = 0
    micro_batches = actor._micro_batches(batch, forward_only=True)
    for index, (layer, experts) in enumerate(chosen):
        micro_batch = micro_batches[index // len(routers)]
        bounds = micro_batch.cu_seqlens.tolist()[: len(micro_batch.sample_indices) + 1]
        recorded = torch.cat([torch.arange(start, end - 1) for start, end in zip(bounds, bounds[1:])])
        engine = micro_batch.routed_experts[recorded, layer].long().sort(-1).values
        agree += (experts[recorded].sort(-1).values == engine).all(-1).sum().item()
        total += len(recorded)
    padded = torch.nn.utils.rnn.pad_sequence
    mask = padded([torch.ones(len(values)) for values in logprobs], batch_first=True)
    mismatch = mismatch_metrics(padded(logprobs, batch_first=True), padded(batch.rollout_logprobs, batch_first=True), mask)
    result = {"agreement": agree / total, "abs_diff_mean": mismatch["mismatch/logprob_abs_diff_mean"].item()}
    if routing_replay:
        batch.advantages = [torch.ones(length) for length in batch.response_lengths]
        batch.ref_logprobs = actor.compute_logprobs(batch, reference=True)  # the reference forward replays too
        result["reference_equals_old"] = all(torch.equal(a, b) for a, b in zip(batch.ref_logprobs, logprobs))
        result["loss"] = actor.train_step(batch)["loss"]
        result["router_grad"] = sum(router.weight.main_grad.abs().sum().item() for router in routers)
    return result


@pytest.mark.parametrize("family", [pytest.param("qwen3_moe", marks=pytest.mark.long), "qwen3_5_moe"])
def test_routing_replay_routes_every_token_as_the_engine_did(ranks, hf_dirs, tmp_path, family):
    """--use-rollout-routing-replay on SGLang's real engine and the actor: with replay the actor's routers choose
    the engine's experts for every token the engine ran (prompt and response) and its logprobs come closer to the
    engine's than without; without replay some tokens are routed otherwise (the check can fail)."""
    from relax.platform import get_platform
    from relax.rollout.engine import RolloutEngine, SamplingConfig
    from relax.train.batch import RolloutBatch

    hf_dir = _near_tied_routers(hf_dirs[family], tmp_path / "near_tied")
    prompts = [[5, 17, 3], [40, 41, 42, 43, 44, 45, 46], [(7 * i) % 50 + 3 for i in range(11)]]
    # Batch-invariant numerics: each request's logprobs are its own, however its requests were batched (they are
    # sent one by one), so with replay the only gap left to the actor's is float noise.
    server_args = {
        "max_total_tokens": 4096, "enable_return_routed_experts": True, "enable_deterministic_inference": True
    }
    sampling = SamplingConfig(n=2, max_new_tokens=10, seed=7)
    with RolloutEngine(server_args, model_path=hf_dir, platform=get_platform("cpu")) as engine:
        completions = [c for group in engine.generate(prompts, sampling) for c in group]
    batch = RolloutBatch(
        tokens=[prompt + c.token_ids for prompt, c in zip([p for p in prompts for _ in range(2)], completions)],
        response_lengths=[len(c.token_ids) for c in completions],
        rollout_logprobs=[c.logprobs for c in completions],
        routed_experts=[c.routed_experts for c in completions],
    )
    replayed = ranks.run(_routing_against_the_engine, hf_dir, batch, True)
    chosen = ranks.run(_routing_against_the_engine, hf_dir, batch, False)
    for with_replay, without in zip(replayed, chosen):
        assert with_replay["agreement"] == 1.0 and without["agreement"] < 1.0, (with_replay, without)
        assert with_replay["abs_diff_mean"] < without["abs_diff_mean"] / 10, (with_replay, without)
        assert with_replay["reference_equals_old"]  # (the weights have not moved yet)
        assert math.isfinite(with_replay["loss"]) and with_replay["router_grad"] > 0, with_replay


def _expert_modules(tp: int, ep: int):
    """SequentialMLP and GroupedExperts over this rank's experts of a 4-expert SwiGLU MoE, the grouped one holding
    the sequential one's weights."""
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from relax.train.model.grouped_experts import GroupedExperts

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, num_moe_experts=4,
        moe_ffn_hidden_size=24, moe_router_topk=2, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
        use_cpu_initialization=True,
    )
    local_experts = 4 // ep
    pg_collection = get_default_pg_collection()
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    sequential = SequentialMLP(local_experts, config, submodules, pg_collection=pg_collection)
    grouped = GroupedExperts(local_experts, config, pg_collection=pg_collection)
    with torch.no_grad():
        for name in ("linear_fc1", "linear_fc2"):
            getattr(grouped, name).weight.copy_(
                torch.stack([getattr(expert, name).weight for expert in sequential.local_experts])
            )
    return sequential, grouped


def _grouped_vs_sequential_experts(tp: int, ep: int, tokens_per_expert: list[int]) -> dict:
    """Max |difference| of GroupedExperts' output and gradients (inputs, routing probabilities, weights) from
    SequentialMLP's on the same weights and permuted tokens, on this rank's shard."""
    sequential, grouped = _expert_modules(tp, ep)
    counts = torch.tensor(tokens_per_expert[: len(sequential.local_experts)])
    generator = torch.Generator().manual_seed(4 + torch.distributed.get_rank())
    hidden = torch.randn(int(counts.sum()), 32, generator=generator)
    probs = torch.rand(int(counts.sum()), generator=generator)
    grad_output = torch.randn(int(counts.sum()), 32, generator=generator)
    results = {}
    for name, module in (("sequential", sequential), ("grouped", grouped)):
        inputs = (hidden.clone().requires_grad_(), probs.clone().requires_grad_())
        output, bias = module(inputs[0], counts, inputs[1])
        output.backward(grad_output)
        weights = {
            projection: torch.stack([getattr(expert, projection).weight.grad for expert in module.local_experts])
            if name == "sequential" else getattr(module, projection).weight.grad
            for projection in ("linear_fc1", "linear_fc2")
        }
        results[name] = {"output": output, "hidden": inputs[0].grad, "probs": inputs[1].grad, **weights, "bias": bias}
    assert results["grouped"]["bias"] is None
    expected = results.pop("sequential")
    return {
        key: (value - expected[key]).abs().max().item() if value.numel() else 0.0
        for key, value in results["grouped"].items()
        if key != "bias"
    }


@pytest.mark.parametrize(
    "tp, ep, tokens_per_expert",
    [
        (1, 1, [5, 0, 9, 1]),  # uneven, one expert without tokens
        (1, 1, [0, 0, 0, 0]),  # no tokens at all
        (2, 1, [0, 7, 3, 0]),  # expert TP 2: each rank holds half of every expert's ffn
        (1, 2, [6, 0, 0, 0]),  # EP 2: rank r's counts are its 2 experts' (the first two of the list)
    ],
)
def test_grouped_experts_equal_sequential_experts(ranks, tp, ep, tokens_per_expert):
    for rank, differences in enumerate(ranks.run(_grouped_vs_sequential_experts, tp, ep, tokens_per_expert)):
        assert max(differences.values()) <= 1e-6, (rank, differences)


def _checkpoint_crosses_expert_modules(hf_dir: str, checkpoint_dir: str, tp: int, ep: int, save_grouped: bool):
    """A model with one expert module saves a megatron checkpoint; a model with the other (its weights left
    uninitialised) loads it: what each exports."""
    from megatron.core import dist_checkpointing

    from relax.train.model import export_hf_weights

    saver, hf = _megatron_model(hf_dir, tp, ep, grouped_experts=save_grouped)
    with torch.no_grad():  # weights that are not the HF checkpoint's
        for param in saver.parameters():
            param.mul_(1.5)
    dist_checkpointing.save({"model": saver.sharded_state_dict()}, checkpoint_dir)
    from relax.train.model import build_gpt_model

    loader = build_gpt_model(hf, dataclasses.replace(saver.config, moe_grouped_gemm=not save_grouped))
    state = dist_checkpointing.load({"model": loader.sharded_state_dict()}, checkpoint_dir)
    loader.load_state_dict(state["model"])
    return dict(export_hf_weights(saver, hf)), dict(export_hf_weights(loader, hf))


@pytest.mark.parametrize("tp, ep, save_grouped", [(1, 1, True), (2, 1, False), (1, 2, True), (1, 2, False)])
def test_megatron_checkpoints_load_across_grouped_and_sequential_experts(
    ranks, hf_dirs, tmp_path, tp, ep, save_grouped
):
    results = ranks.run(_checkpoint_crosses_expert_modules, hf_dirs["qwen3_moe"], str(tmp_path), tp, ep, save_grouped)
    for saved, loaded in results:
        assert sorted(saved) == sorted(loaded)
        assert all(torch.equal(saved[name], loaded[name]) for name in saved)


def test_tied_embeddings_train_alike_with_pipeline_stages(ranks, hf_dirs):
    """With tied embeddings and PP=2 the first stage's embedding and the last stage's output layer are two
    copies whose gradients megatron sums; training then equals DP=2 with one shared matrix. So it does with
    --fused-output-logprobs, where the last stage's copy gets its gradient from the fused output layer."""
    dp2 = ranks.run(_train, hf_dirs["qwen3_tied"], dict(micro_batch_size=2), 2)
    for fused in (False, True):
        pp2 = ranks.run(_train, hf_dirs["qwen3_tied"], dict(pp=2, micro_batch_size=3, fused_output_logprobs=fused), 2)
        _assert_same_training(pp2, dp2)
        embedding = "model.embed_tokens.weight"
        first_stage = pp2[0]["weights"]  # the embedding is exported by the first stage only
        assert "lm_head.weight" not in first_stage and "lm_head.weight" not in pp2[1]["weights"]
        assert (first_stage[embedding] - dp2[0]["weights"][embedding]).abs().max() <= 2 * 1e-3


# --- context parallelism -------------------------------------------------------------------------------

# (prompt length, response length): rows of sequences of different lengths, the first (3 tokens) shorter than the
# 2 x CP = 4 chunks context parallelism cuts each sequence into
CP_SHAPES = [(2, 1), (7, 4), (5, 6), (9, 5)]  # padded under CP=2 to a multiple of 4: 4, 12, 12, 16 tokens


def _step_on_the_whole_batch(hf_dir: str, layout: dict) -> dict:
    """Every rank passes all of CP_SHAPES's samples (so data-parallel replicas repeat one another, and each is the whole
    batch's step): their logprobs and entropies, one step's metrics at lr=0 and this rank's gradients, with the
    sequence-mean aggregation, the KL and a differentiable entropy in the loss; and how many tokens each forward of the
    logprob pass ran on this rank (its first layer's, on every pipeline stage). With `routing_replay` in the layout,
    every token is routed to experts drawn at random, as if the engine had chosen them."""
    from relax.train.batch import RolloutBatch
    from relax.train.losses import LossSettings
    from relax.train.model import unwrap

    loss = LossSettings(kl_coef=0.05, entropy_coef=0.01, aggregation="seq_mean_token_mean")
    actor = _actor(hf_dir, lr=0.0, micro_batch_size=2, loss=loss, **layout)
    generator = torch.Generator().manual_seed(3)
    vocab_size = actor.hf_checkpoint.text_config["vocab_size"]
    batch = RolloutBatch(
        [torch.randint(0, vocab_size - 1, (p + r,), generator=generator) for p, r in CP_SHAPES],
        [r for _, r in CP_SHAPES],
        advantages=[torch.randn(r, generator=generator) for _, r in CP_SHAPES],
    )
    if layout.get("routing_replay"):
        config = actor.config
        batch.routed_experts = [
            torch.rand(p + r - 1, config.num_layers, config.num_moe_experts, generator=generator)
            .argsort(-1)[..., : config.moe_router_topk].to(torch.int32)
            for p, r in CP_SHAPES
        ]
    tokens_seen = []
    hook = unwrap(actor.model).decoder.layers[0].register_forward_pre_hook(
        lambda _, args, kwargs: tokens_seen.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
    )
    logprobs, entropy = actor.compute_logprobs(batch, with_entropy=True)
    hook.remove()
    batch.old_logprobs = [values + 0.1 * torch.randn(values.shape, generator=generator) for values in logprobs]
    batch.ref_logprobs = [values - 0.2 * torch.rand(values.shape, generator=generator) for values in logprobs]
    metrics = actor.train_step(batch)
    return {
        "logprobs": logprobs, "entropy": entropy, "metrics": metrics, "tokens_seen": tokens_seen,
        "gradients": [param.main_grad.clone() for param in actor.model.parameters()],
    }


def _assert_same_step(runs: list[dict], baseline: list[dict], tokens_seen: list[int]) -> None:
    """Rank r of a run of _step_on_the_whole_batch against rank r of the baseline's: the same TP shard, the same
    samples, the same values and gradients; each forward of the logprob pass ran on `tokens_seen` tokens."""
    for got, expected in zip(runs, baseline):
        assert got["tokens_seen"] == tokens_seen, got["tokens_seen"]
        for name in ("logprobs", "entropy"):
            for got_values, expected_values in zip(got[name], expected[name]):
                torch.testing.assert_close(got_values, expected_values, rtol=1e-5, atol=1e-5)
        assert got["metrics"].keys() == expected["metrics"].keys()
        for key, value in expected["metrics"].items():
            assert got["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
        assert len(got["gradients"]) == len(expected["gradients"])
        assert max(gradient.abs().max().item() for gradient in expected["gradients"]) > 1e-3
        for got_gradient, expected_gradient in zip(got["gradients"], expected["gradients"]):
            torch.testing.assert_close(got_gradient, expected_gradient, rtol=1e-4, atol=1e-6)


def _assert_context_parallel_equals_one_rank(split: list[dict], baseline: list[dict], rows=(16, 28)) -> None:
    """Rank r of the CP=2 run against rank r of the CP=1 run. Each CP rank runs the model on half of each row: `rows`
    tokens, two padded sequences each."""
    _assert_same_step(split, baseline, [tokens // 2 for tokens in rows])


@pytest.mark.parametrize(
    "family, layout",
    [("qwen3", {}), ("qwen3_5", {}), ("qwen3_moe", {}), ("qwen3_5_moe", {}),
     ("qwen3_moe", dict(routing_replay=True)), ("qwen3_5_moe", dict(routing_replay=True))],
)
def test_context_parallel_rows_give_the_logprobs_and_gradients_of_one_rank(ranks, hf_dirs, family, layout):
    """GDN layers and MoE layers, with routing replay too (each CP rank replays its own tokens' experts)."""
    baseline = ranks.run(_step_on_the_whole_batch, hf_dirs[family], layout)
    split = ranks.run(_step_on_the_whole_batch, hf_dirs[family], dict(layout, cp=2))
    _assert_context_parallel_equals_one_rank(split, baseline)


@pytest.fixture(scope="module")
def four_ranks():
    pool = SpawnedRanks(4, TASK_TIMEOUT_S)
    yield pool
    pool.close()


@pytest.mark.long  # four ranks of their own (pytest.ini: not in CI's run)
@pytest.mark.parametrize(
    "family, layout", [("qwen3", dict(tp=2)), ("qwen3_5", dict(tp=2)), ("qwen3_moe", dict(ep=2)),
                       ("qwen3_5_moe", dict(ep=2)), ("qwen3", dict(pp=2)), ("qwen3_5", dict(pp=2))],
)
def test_context_parallel_rows_with_model_parallelism_give_the_logprobs_and_gradients_of_one_rank(
    four_ranks, hf_dirs, family, layout
):
    """CP=2 x TP=2 against TP=2 (two data-parallel replicas of the whole batch), CP=2 x EP=2 against EP=2 (the
    experts' tokens exchanged over ranks that are CP ranks of one replica and DP ranks of two), and CP=2 x PP=2
    against PP=2 (each stage's ranks pass their halves of the rows on). (Sequence parallelism needs a norm
    megatron-core has only with TransformerEngine or Apex, so not on the CPU.)"""
    baseline = four_ranks.run(_step_on_the_whole_batch, hf_dirs[family], layout)
    split = four_ranks.run(_step_on_the_whole_batch, hf_dirs[family], dict(layout, cp=2))
    # expert-parallel and pipeline ranks run micro-batches of one shape: both rows padded to the longer
    uniform = "ep" in layout or "pp" in layout
    _assert_context_parallel_equals_one_rank(split, baseline, rows=(28, 28) if uniform else (16, 28))


@pytest.fixture(scope="module")
def mindspeed_ranks():
    """Two ranks of the CPU platform with the NPU platform's MindSpeed path (tests/npu/cpu_mindspeed.py): MindSpeed's
    preparation of Megatron, and its ring attention for context parallelism."""
    pool = SpawnedRanks(WORLD_SIZE, TASK_TIMEOUT_S, prologue=use_mindspeed_on_cpu)
    yield pool
    pool.close()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_context_parallel_rows_under_mindspeeds_ring_attention_give_the_logprobs_and_gradients_of_one_rank(
    mindspeed_ranks, hf_dirs, family
):
    """The NPU platform's context parallelism: each rank's queries attend through MindSpeed's ring attention (the
    contract double, or MindSpeed's own with RELAX_MINDSPEED_CHECKOUT set: AttentionWithCp computing with the stand-in
    npu_fusion_attention and npu_fusion_attention_grad of tests/npu/torch_npu_ops.py), against CP = 1 under
    MindSpeed too. The step's optimizer is SGD (nothing moves at lr 0): MindSpeed puts torch's SGD in apex's place, and
    its AdamW in place of apex's Adam, which needs an accelerator device a CPU build of torch lacks (docs/npu.md)."""
    baseline = mindspeed_ranks.run(_step_on_the_whole_batch, hf_dirs[family], dict(optimizer="sgd"))
    split = mindspeed_ranks.run(_step_on_the_whole_batch, hf_dirs[family], dict(optimizer="sgd", cp=2))
    try:
        _assert_context_parallel_equals_one_rank(split, baseline)
    except AssertionError as error:
        raise AssertionError(f"under {mindspeed_in_use()}: {error}") from error


# --- the output layer fused with the logprobs ----------------------------------------------------------------------


def _fused_step_in_pieces(hf_dir: str, layout: dict) -> dict:
    """_step_on_the_whole_batch with --fused-output-logprobs, its logits a few pieces of each row: of 2 positions
    forward (4 at TP=2), of about a third of the vocabulary backward."""
    from relax.train import logprobs

    whole = logprobs.CHUNK_BYTES
    logprobs.CHUNK_BYTES = 4 * read_hf_checkpoint(hf_dir).text_config["vocab_size"] * 2
    try:
        return _step_on_the_whole_batch(hf_dir, dict(layout, fused_output_logprobs=True))
    finally:
        logprobs.CHUNK_BYTES = whole


@pytest.mark.parametrize(
    "model, layout",
    [("qwen3", {}), ("qwen3_tied", {}), ("qwen3", dict(tp=2)), ("qwen3_tied", dict(tp=2))],
)
def test_fused_output_logprobs_give_the_step_of_the_logits(ranks, hf_dirs, model, layout):
    """--fused-output-logprobs against the model's logits: the same logprobs, entropies, loss metrics and gradients
    of every parameter (the output weight, or the embedding it is tied to, and every layer), with the entropy and
    the KL in the loss, at TP=1 (two data-parallel replicas) and TP=2 (each rank its half of the vocabulary)."""
    baseline = ranks.run(_step_on_the_whole_batch, hf_dirs[model], layout)
    fused = ranks.run(_fused_step_in_pieces, hf_dirs[model], layout)
    _assert_same_step(fused, baseline, [14, 25])  # two rows of two samples, unpadded


@pytest.mark.long  # pytest.ini: not in CI's run
def test_fused_output_logprobs_under_context_parallelism_give_the_step_of_one_rank(ranks, hf_dirs):
    """Each CP rank projects and scores its own tokens; their values are gathered into the rows as without fusion."""
    baseline = ranks.run(_step_on_the_whole_batch, hf_dirs["qwen3_tied"], {})
    split = ranks.run(_fused_step_in_pieces, hf_dirs["qwen3_tied"], dict(cp=2))
    _assert_context_parallel_equals_one_rank(split, baseline)
