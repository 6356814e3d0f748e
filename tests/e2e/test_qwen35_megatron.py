"""Qwen3.5 dense and MoE (and Qwen3-Next at TP=2) on megatron-core 0.16.1's GatedDeltaNet (relax/train/model/
qwen3_5.py, qwen3_next.py, gdn_spec.py; no TransformerEngine, relax.kernels' torch GDN on the CPU): logits equal
HF transformers' (fp32, max abs diff <= 1e-4) on an 80-token batch (the chunked GDN runs two 64-token chunks) at
TP=1 and TP=2 (with sequence parallelism) and on samples packed into one row as the actor packs them, the
exported weights are the checkpoint's exactly, and a backward pass reaches every parameter. Every parameter's
gradient equals HF's (DDP and finalize_model_grads as the actor runs them; TP=2 with and without sequence
parallelism: without it the GDN output norm's gradient was each rank's own heads' part).
The same for the language model of Qwen3.5 vision-language checkpoints (dense and MoE, laid out as the released
Qwen3.5 ones, relax/hf_checkpoint/layout.py): logits equal Qwen3_5(Moe)ForConditionalGeneration's on
text-only input, and the export holds exactly the checkpoint's language-model tensors under their names (the vision
tower and MTP head are not trained; the MoE one's fused experts are exported per expert).

Two spawned ranks share one gloo group, started once for this module: TP=1 runs as two replicas.
"""

import pytest
import torch

from relax.tools.tiny_model import build_tiny_model
from relax.hf_checkpoint import TensorReader, read_hf_checkpoint, trained_names, transformer_config

from spawned_ranks import SpawnedRanks

WORLD_SIZE = 2
TASK_TIMEOUT_S = 300
SEQUENCE_LENGTH = 80


@pytest.fixture(scope="module")
def run_on_ranks():
    pool = SpawnedRanks(WORLD_SIZE, TASK_TIMEOUT_S)
    yield pool.run
    pool.close()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    families = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_5_vl", "qwen3_5_moe_vl")
    return {family: str(build_tiny_model(tmp_path_factory.mktemp(family), family)) for family in families}


def _packed_rows_max_abs_diff(model, reference, vocab_size: int, tp: int) -> float:
    """Samples of different lengths packed into one THD row as the actor packs them (relax.train.batch: cu_seqlens,
    no mask; padded to a multiple of TP for sequence parallelism): each sample's logits against HF's on that sample
    alone, so neither attention nor the GDN layers' conv and recurrent state cross a sequence boundary."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from relax.train.batch import RolloutBatch, make_micro_batches

    generator = torch.Generator().manual_seed(3)
    samples = [torch.randint(0, vocab_size, (length,), generator=generator) for length in (70, 9, 1 + 1, 66)]
    (micro_batch,) = make_micro_batches(RolloutBatch(samples, [1] * len(samples)), micro_batch_size=4, multiple=tp)
    with torch.no_grad():
        logits = gather_from_tensor_model_parallel_region(
            model(micro_batch.tokens, micro_batch.position_ids, None, packed_seq_params=micro_batch.packed_seq_params())
        )
        bounds = micro_batch.cu_seqlens.tolist()
        diffs = [
            (logits[0, bounds[i] : bounds[i + 1]] - reference(samples[index][None]).logits[0]).abs().max().item()
            for i, index in enumerate(micro_batch.sample_indices)
        ]
    return max(diffs)


def _parity(hf_dir: str, tp: int, grouped_experts: bool = False) -> dict:
    import transformers
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region, model_parallel_cuda_manual_seed
    from relax.train.model import build_gpt_model, export_hf_weights, load_hf_weights

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(0)
    hf = read_hf_checkpoint(hf_dir)
    vocab_size = hf.text_config["vocab_size"]
    config = transformer_config(
        hf, tensor_model_parallel_size=tp, sequence_parallel=tp > 1, use_cpu_initialization=True,
        perform_initialization=False, moe_grouped_gemm=grouped_experts,
    )
    model = build_gpt_model(hf, config)
    load_hf_weights(model, hf)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab_size, (2, SEQUENCE_LENGTH), generator=generator)
    position_ids = torch.arange(SEQUENCE_LENGTH).expand(2, -1)
    # The whole vision-language model for a VL checkpoint: its text-only forward (3D rope positions) is the reference.
    auto_class = (
        transformers.AutoModelForImageTextToText if hf.vision_language else transformers.AutoModelForCausalLM
    )
    reference = auto_class.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(input_ids).logits
    logits = gather_from_tensor_model_parallel_region(model(input_ids, position_ids, None))
    logits.float().logsumexp(-1).mean().backward()
    without_grad = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    packed_diff = _packed_rows_max_abs_diff(model, reference, vocab_size, tp)
    exported = dict(export_hf_weights(model, hf))
    # What the checkpoint holds, fused experts per expert (the MoE VL one stores them fused, as the released one)
    tensors = TensorReader(hf)
    on_disk = {name: tensors.get(name) for name in trained_names(hf.tensors)}
    return {
        "logits_max_abs_diff": (logits.detach() - expected).abs().max().item(),
        "packed_rows_max_abs_diff": packed_diff,
        "names_differ": sorted(set(exported) ^ set(on_disk)),
        "not_equal": sorted(k for k in on_disk if k in exported and not torch.equal(exported[k], on_disk[k])),
        "without_grad": without_grad,
    }


@pytest.mark.parametrize("family, tp", [("qwen3_5", 1), ("qwen3_5", 2), ("qwen3_5_moe", 1), ("qwen3_5_moe", 2),
                                        ("qwen3_next", 2), ("qwen3_5_vl", 2), ("qwen3_5_moe_vl", 1)])
def test_logits_equal_hf_export_is_exact_and_backward_reaches_every_parameter(run_on_ranks, hf_dirs, family, tp):
    for rank, result in enumerate(run_on_ranks(_parity, hf_dirs[family], tp)):
        assert result["logits_max_abs_diff"] <= 1e-4, (rank, result)
        assert result["packed_rows_max_abs_diff"] <= 1e-4, (rank, result)
        assert result["names_differ"] == [] and result["not_equal"] == [], (rank, result)
        assert result["without_grad"] == [], (rank, result)


@pytest.mark.parametrize("family, tp", [("qwen3_5_moe", 2), ("qwen3_5_moe_vl", 1)])
def test_grouped_experts_logits_equal_hf_and_export_is_exact(run_on_ranks, hf_dirs, family, tp):
    """--moe-grouped-gemm: the same with the routed experts as relax's GroupedExperts (expert TP 2 at TP=2; the VL
    checkpoint stores its experts fused, as transformers 5 does)."""
    for rank, result in enumerate(run_on_ranks(_parity, hf_dirs[family], tp, True)):
        assert result["logits_max_abs_diff"] <= 1e-4 and result["packed_rows_max_abs_diff"] <= 1e-4, (rank, result)
        assert result["names_differ"] == [] and result["not_equal"] == [], (rank, result)
        assert result["without_grad"] == [], (rank, result)


def _vl_actor_saves_and_converts(hf_dir: str, checkpoint_dir: str, out_dir: str) -> dict:
    """A TP=2 actor of a vision-language checkpoint, its weights moved off the checkpoint's, saved as an actor
    checkpoint and converted back to HF at TP=1 (resharded): the export it had, for the comparison."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from relax.train.actor import ActorSettings, MegatronActor
    from relax.train.checkpoint import checkpoint_to_hf, save_checkpoint
    from relax.train.model import export_hf_weights, unwrap

    transformer = transformer_config(
        read_hf_checkpoint(hf_dir), tensor_model_parallel_size=2, pipeline_dtype=torch.float32,
        use_cpu_initialization=True, perform_initialization=False,
    )
    actor = MegatronActor(
        hf_dir, transformer, OptimizerConfig(optimizer="adam", lr=1e-3), DistributedDataParallelConfig(),
        ActorSettings(keep_reference=False),
    )
    with torch.no_grad():  # stands in for training: every trained tensor changes
        for param in unwrap(actor.model).parameters():
            param.add_(0.5)
    exported = dict(export_hf_weights(actor.model, actor.hf_checkpoint))
    save_checkpoint(actor, checkpoint_dir, step=1)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    checkpoint_to_hf(checkpoint_dir, out_dir)
    return exported


def test_a_vision_language_actor_checkpoint_converts_to_a_whole_vision_language_checkpoint(
    run_on_ranks, hf_dirs, tmp_path
):
    """checkpoint_to_hf of a Qwen3.5 VL actor: the trained tensors as the actor had them, under the checkpoint's
    names, the vision tower and MTP head unchanged, and transformers loads it as the VL model."""
    import transformers
    from safetensors import safe_open

    hf_dir, out_dir = hf_dirs["qwen3_5_vl"], tmp_path / "hf"
    exported, _ = run_on_ranks(_vl_actor_saves_and_converts, hf_dir, str(tmp_path / "step1"), str(out_dir))
    names = read_hf_checkpoint(hf_dir).tensors.keys()
    original, converted = TensorReader(read_hf_checkpoint(hf_dir)), TensorReader(read_hf_checkpoint(out_dir))
    assert converted.checkpoint.tensors.keys() == names
    frozen = names - trained_names(names)
    assert frozen and set(exported) == names - frozen
    assert all(torch.equal(converted.get(name), exported[name]) for name in exported)
    assert all(not torch.equal(converted.get(name), original.get(name)) for name in exported)
    assert all(torch.equal(converted.get(name), original.get(name)) for name in frozen)
    with safe_open(str(out_dir / "model-00001-of-00002.safetensors"), framework="pt") as trained_file:
        assert set(trained_file.keys()) == set(exported)  # the frozen ones in a file of their own, with an index
    model = transformers.AutoModelForImageTextToText.from_pretrained(out_dir, dtype=torch.float32)
    vision_weight = "model.visual.pos_embed.weight"
    assert torch.equal(model.state_dict()[vision_weight], original.get(vision_weight))


def _hf_gradients(model) -> dict[str, torch.Tensor]:
    """HF parameter name -> gradient, fused experts tensors per expert (as relax exports them)."""
    from relax.hf_checkpoint.layout import per_expert_views

    grads = {}
    for name, param in model.named_parameters():
        views = per_expert_views(name, param.shape)
        grads.update({view_name: param.grad[view.expert, view.rows] for view_name, view in views.items()}
                     if views else {name: param.grad})
    return grads


def _gradient_parity(hf_dir: str, tp: int, sequence_parallel: bool) -> dict:
    """Per HF tensor, the largest abs difference between the Megatron model's gradient (DDP + finalize_model_grads
    as the actor runs them, exported under HF names) and HF transformers' for loss = sum of log p(label)."""
    import transformers
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from relax.train.actor import vocab_parallel_logprobs
    from relax.train.model import build_gpt_model, export_hf_weights, load_hf_weights

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(0)
    hf = read_hf_checkpoint(hf_dir)
    config = transformer_config(
        hf, tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel, use_cpu_initialization=True,
        perform_initialization=False,
    )
    model = build_gpt_model(hf, config)
    load_hf_weights(model, hf)
    model = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(), module=model)
    generator = torch.Generator().manual_seed(4)
    vocab_size, pad = hf.text_config["vocab_size"], hf.text_config["pad_token_id"]
    # No pad token in the batch: HF's nn.Embedding(padding_idx=pad) never updates that row, Megatron's embedding does.
    input_ids, labels = torch.randint(0, vocab_size - 1, (2, 2, SEQUENCE_LENGTH), generator=generator)
    input_ids[input_ids >= pad] += 1
    logprobs, _ = vocab_parallel_logprobs(model(input_ids, torch.arange(SEQUENCE_LENGTH).expand(2, -1), None), labels)
    logprobs.sum().backward()
    finalize_model_grads([model])
    with torch.no_grad():  # export the gradients the way weights are exported
        for param in model.parameters():
            param.copy_(param.main_grad)
    megatron_grads = dict(export_hf_weights(model, hf))

    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    reference(input_ids).logits.log_softmax(-1).gather(-1, labels[..., None]).sum().backward()
    hf_grads = _hf_gradients(reference)
    return {
        "names_differ": sorted(set(megatron_grads) ^ set(hf_grads)),
        "max_abs_diff": {
            name: ((megatron_grads[name] - grad).abs().max().item(), grad.abs().max().item())
            for name, grad in hf_grads.items() if name in megatron_grads
        },
    }


@pytest.mark.parametrize("family, tp, sequence_parallel", [
    ("qwen3_5", 2, True), ("qwen3_5", 2, False), ("qwen3_5_moe", 1, False), ("qwen3_next", 2, True),
])
def test_gradients_equal_hf(run_on_ranks, hf_dirs, family, tp, sequence_parallel):
    """Every parameter's gradient (fp32, an 80-token batch: two GDN chunks) equals HF transformers' within 1e-3 of
    the tensor's largest gradient entry + 1e-6, on every rank. The floor is for A_log and dt_bias, whose gradients
    (about 5e-4) sum cancelling terms: HF's chunked GDN takes its decays from differences of cumulative gates
    (relax.kernels' from segment sums), about 1e-6 apart there."""
    for rank, result in enumerate(run_on_ranks(_gradient_parity, hf_dirs[family], tp, sequence_parallel)):
        assert result["names_differ"] == [], (rank, result["names_differ"])
        far = {name: diff for name, diff in result["max_abs_diff"].items() if diff[0] > 1e-3 * diff[1] + 1e-6}
        assert far == {}, (rank, family, tp, sequence_parallel, far)


def _gdn_layer_against_megatrons_own_forward(hf_dir: str) -> dict:
    """One GDN layer of the model: relax's packed-rows forward with the reference training kernel against
    megatron-core's own GatedDeltaNet.forward in deterministic mode (its torch chunked rule and nn.Conv1d), rows of
    one sequence each; and two sequences packed in one row against each alone."""
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from relax.train.model import build_gpt_model, load_hf_weights

    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    hf = read_hf_checkpoint(hf_dir)
    config = transformer_config(hf, use_cpu_initialization=True, perform_initialization=False)
    model = build_gpt_model(hf, config, gdn_kernel="reference")
    load_hf_weights(model, hf)
    layer = next(m for m in model.modules() if isinstance(m, GatedDeltaNet))
    hidden = torch.randn(70, 2, config.hidden_size, generator=torch.Generator().manual_seed(5))  # [s, b, h]
    with torch.no_grad():
        relax_rows, _ = layer(hidden, None)
        config.deterministic_mode = True  # megatron's forward then runs its own torch chunked rule
        megatron_rows, _ = GatedDeltaNet.forward(layer, hidden, None)
        config.deterministic_mode = False
        lengths = [70, 41]
        row = torch.cat([hidden[:, 0], hidden[:41, 1]])[:, None]  # [111, 1, h]: both sequences in one row
        cu_seqlens = torch.tensor([0, 70, 111], dtype=torch.int32)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                 max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
        packed, _ = layer(row, None, packed_seq_params=params)
        alone = [layer(hidden[:n, b : b + 1], None)[0][:, 0] for b, n in enumerate(lengths)]
    return {
        "kernel": layer.training_kernel,
        "vs_megatron": (relax_rows - megatron_rows).abs().max().item(),
        "packed_vs_alone": (packed[:, 0] - torch.cat(alone)).abs().max().item(),
    }


def test_gdn_layer_equals_megatrons_own_forward_and_packing_keeps_sequences_apart(run_on_ranks, hf_dirs):
    for result in run_on_ranks(_gdn_layer_against_megatrons_own_forward, hf_dirs["qwen3_5"]):
        assert result["kernel"] == "reference"
        assert result["vs_megatron"] <= 1e-5 and result["packed_vs_alone"] <= 1e-5, result
