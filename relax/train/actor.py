"""The training actor: a megatron-core GPTModel with DDP, Megatron's optimizer and LR schedule.

    actor = MegatronActor(hf_dir, transformer_config, optimizer_config, ddp_config, ActorSettings(...))
    old = actor.compute_logprobs(batch)                      # per sample, response tokens
    ref = actor.compute_logprobs(batch, reference=True)      # frozen initial weights
    metrics = actor.train_step(batch_with_advantages_and_logprobs)

Every method is collective over all ranks of the actor. Each data-parallel rank passes its own samples;
the ranks of one data-parallel replica (its TP, PP and CP ranks) pass the same samples. Under context parallelism
each CP rank runs the model on its part of every packed row (relax.train.context_parallel). Results come back on
every rank: logprobs for this rank's samples, metrics for the whole batch (all DP ranks).

With TransformerConfig.moe_enable_routing_replay (--use-rollout-routing-replay) every forward sends each token to
the experts the batch's routed_experts name, those the rollout engine chose (relax.train.routing_replay).

The configuration is megatron-core's own objects (TransformerConfig with the parallel sizes,
OptimizerConfig, DistributedDataParallelConfig; relax.args builds them) plus ActorSettings for what
Megatron has no field for. The architecture fields of the TransformerConfig come from the HF config.json.
torch.distributed must be initialised (platform backend) before the actor is built; the actor creates
megatron's model-parallel groups itself.
"""

import dataclasses
import datetime
from functools import partial
import torch

from relax.hf_checkpoint import read_hf_checkpoint, transformer_config
from relax.metric_names import extreme
from relax.train.batch import MicroBatch, RolloutBatch, make_micro_batches, plan_micro_batches, plan_shape
from relax.train.context_parallel import REFUSED, split_row, with_row_split
from relax.train.logprobs import logprobs_and_entropy, output_logprobs_and_entropy, platform_launch
from relax.train.losses import aggregation_denominator
from relax.train.model import build_gpt_model, load_hf_weights, unwrap
from relax.train.off_policy import corrected_policy_loss
from relax.train.offload import training_memory
from relax.train.process_groups import ReloadableGroups
from relax.train.routing_replay import RoutingReplay
from relax.train.settings import ActorSettings


def _whole_batch_metrics(outputs: list[dict[str, torch.Tensor]], data_parallel_group) -> dict[str, float]:
    """The micro-batches' metrics of every data-parallel rank combined: shares summed, extremes (*_max, *_min)
    by max and min. Two all-reduces, one device-to-host copy."""
    keys = sorted(outputs[0])
    shares = [key for key in keys if extreme(key) is None]
    extremes = [key for key in keys if extreme(key) is not None]
    values = [torch.stack([sum(output[key] for output in outputs) for key in shares])]
    torch.distributed.all_reduce(values[0], group=data_parallel_group)
    if extremes:  # a minimum is the maximum of the negated values
        sign = torch.tensor([1.0 if extreme(key) == "max" else -1.0 for key in extremes], device=values[0].device)
        maxima = torch.stack([torch.stack([output[key] for output in outputs]) for key in extremes])
        maxima = (maxima * sign.unsqueeze(-1)).max(-1).values
        torch.distributed.all_reduce(maxima, op=torch.distributed.ReduceOp.MAX, group=data_parallel_group)
        values.append(maxima * sign)
    return dict(zip(shares + extremes, torch.cat(values).tolist()))


def _vocab_slice(local_vocab: int) -> dict:
    """relax.train.logprobs' vocab_start and all_reduce for this tensor-parallel rank's slice of the vocabulary
    (none at TP 1)."""
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return {}
    return dict(
        vocab_start=parallel_state.get_tensor_model_parallel_rank() * local_vocab,
        all_reduce=partial(torch.distributed.all_reduce, group=parallel_state.get_tensor_model_parallel_group()),
    )


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, launch=None):
    """log p(label) and the entropy per position, both differentiable, from logits [..., vocab / TP] whose vocab is
    split across megatron's tensor-parallel ranks (relax.train.logprobs; the backward overwrites `logits`); with the
    fused Triton kernels given a launch record (relax.train.logprobs.platform_launch)."""
    return logprobs_and_entropy(logits, labels, temperature, launch=launch, **_vocab_slice(logits.shape[-1]))


def vocab_parallel_output_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                   sequence_parallel: bool, temperature: float = 1.0, launch=None):
    """vocab_parallel_logprobs of the output layer's logits, [...] as labels, from its input hidden [1, t, hidden]
    (under sequence parallelism this rank's [1, t / TP, hidden]) and its weight [vocab / TP, hidden], without the
    logits (relax.train.logprobs.output_logprobs_and_entropy). The hidden states pass megatron's own mappings as in
    its ColumnParallelLinear: all-gathered over the TP ranks under sequence parallelism (the backward
    reduce-scatters their gradient), else copied (the backward all-reduces it): each rank's gradient is its slice of
    the vocabulary's part."""
    from megatron.core import tensor_parallel

    hidden = hidden.reshape(-1, hidden.shape[-1])
    if sequence_parallel:
        hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden)
    else:
        hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden)
    logprobs, entropy = output_logprobs_and_entropy(
        hidden, weight, labels, temperature, launch=launch, **_vocab_slice(weight.shape[0])
    )
    return logprobs.view(labels.shape), entropy.view(labels.shape)


def _hidden_states_out(input_, weight=None, runtime_gather_output=None):
    """The output layer's forward with fused output logprobs: its input, as (output, bias)."""
    return input_, None


class MegatronActor:
    def __init__(self, hf_dir, transformer, optimizer, ddp, settings: ActorSettings | None = None, platform=None):
        from relax.platform import get_platform

        self.settings = settings or ActorSettings()
        self.platform = platform or get_platform()
        self.device = self.platform.current_device()
        self.logprob_launch = platform_launch(self.platform, self.device.index or 0)  # None: the torch pieces
        if self.settings.loss.aggregation == "seq_mean_token_sum_norm" and self.settings.loss.norm_length is None:
            raise ValueError(
                "aggregation seq_mean_token_sum_norm needs LossSettings.norm_length (e.g. the longest allowed "
                "response) so every data-parallel rank divides by the same length"
            )
        self.hf_checkpoint = read_hf_checkpoint(hf_dir)
        # Every group made while the actor builds itself can be destroyed on sleep and rebuilt on wake.
        self.process_groups = ReloadableGroups(datetime.timedelta(minutes=self.settings.distributed_timeout_minutes))
        # Where the training state lives so that sleep can hand its device memory back.
        self.memory = training_memory(self.platform, self._training_state_tensors, self.settings.memory_saver)
        with self.process_groups.recording():
            self._build(transformer, optimizer, ddp)
        self.reference_weights = self._host_copy() if self.settings.keep_reference else None

    def _build(self, transformer, optimizer, ddp) -> None:
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        from megatron.core.transformer.module import Float16Module

        if transformer.context_parallel_size > 1:
            for refusal in REFUSED:
                if refusal.applies(transformer):
                    raise ValueError(f"context parallelism with {refusal.what} is not supported: {refusal.reason}")
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=transformer.tensor_model_parallel_size,
            pipeline_model_parallel_size=transformer.pipeline_model_parallel_size,
            context_parallel_size=transformer.context_parallel_size,
            expert_model_parallel_size=transformer.expert_model_parallel_size,
            expert_tensor_parallel_size=transformer.expert_tensor_parallel_size,
            distributed_timeout_minutes=self.settings.distributed_timeout_minutes,
        )
        model_parallel_cuda_manual_seed(self.settings.seed)
        self.config = transformer_config(self.hf_checkpoint, transformer)
        # use_cpu_initialization builds on the host
        model = build_gpt_model(
            self.hf_checkpoint,
            self.config,
            attention_kernel=self.platform.attention_kernel,
            gdn_kernel=self.settings.gdn_training_kernel,
            context_parallel_attention=self.platform.context_parallel_attention,
        ).to(self.device)
        load_hf_weights(model, self.hf_checkpoint)
        if self.settings.fused_output_logprobs and model.post_process:
            # megatron-core 0.16.1's GPTModel cannot return the last stage's hidden states: its _postprocess always
            # applies output_layer (to the embedding's weight where the two are tied) and returns the logits [1, t,
            # vocab / TP]. This instance's output layer returns its input instead, so the model returns the final
            # norm's output [1, t, hidden] (under sequence parallelism this rank's part, not gathered), and the
            # logprobs project it piece by piece (_token_logprobs). The layer keeps its weight where checkpoints,
            # the weight export and DDP's buffers have it; output_weight reads it as _postprocess does.
            model.output_layer.forward = _hidden_states_out
        # --use-rollout-routing-replay: every forward routes as the rollout engine did (relax.train.routing_replay)
        self.routing_replay = (
            RoutingReplay(model, self.config.sequence_parallel) if self.config.moe_enable_routing_replay else None
        )
        # Float16Module would hand back an fp32 copy of the [tokens, vocab] logits; relax.train.logprobs reads the
        # model's own bf16/fp16 logits piece by piece in fp32 instead (the same values and gradient, half the memory).
        self.forward_options = {}
        if self.config.fp16 or self.config.bf16:
            model = Float16Module(self.config, model)
            self.forward_options = {"fp32_output": False}
        # DDP's buffers and the optimizer's main parameters are made inside the memory route's region (the
        # weights are loaded outside: its temporaries must not stay in the region, relax.train.offload).
        with self.memory.allocating():
            self.model = DistributedDataParallel(config=self.config, ddp_config=ddp, module=model)
            self.optimizer = get_megatron_optimizer(optimizer, [self.model])
        self._adopt_parameters()
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=self.settings.lr_warmup_init if self.settings.lr_warmup_steps else optimizer.lr,
            max_lr=optimizer.lr,
            min_lr=optimizer.min_lr or 0.0,
            lr_warmup_steps=self.settings.lr_warmup_steps,
            lr_decay_steps=max(self.settings.lr_decay_steps, self.settings.lr_warmup_steps + 1),
            lr_decay_style=self.settings.lr_decay_style,
            start_wd=optimizer.weight_decay,
            end_wd=optimizer.weight_decay,
            wd_incr_steps=1,
            wd_incr_style="constant",
        )
        # The schedule reduces DP gradients through this hook; without it they are never all-reduced.
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = self.model.no_sync
        self.config.grad_scale_func = self.optimizer.scale_loss

    # --- sleep and wake --------------------------------------------------------------------------------
    def _optimizers(self):
        return getattr(self.optimizer, "chained_optimizers", [self.optimizer])

    def _training_state_tensors(self):
        """Every tensor of the training state: parameters, their grads, DDP's flat buffers, the optimizer's
        main parameters and state (Adam's moments appear after the first step). Not the main parameters'
        grads, which each step makes from the main_grads and sleep drops."""
        for param in self.model.parameters():
            yield param
            if getattr(param, "main_grad", None) is not None:
                yield param.main_grad
        for buffer in [*self.model.buffers, *self.model.expert_parallel_buffers]:
            if buffer.param_data is not None:
                yield buffer.param_data
            yield buffer.grad_data
        for optimizer in self._optimizers():
            for group in optimizer.optimizer.param_groups:
                yield from group["params"]
            for state in optimizer.optimizer.state.values():
                yield from (value for value in state.values() if torch.is_tensor(value))

    def _adopt_parameters(self) -> None:
        """Parameters that DDP does not keep in its own buffer (it does with the distributed optimizer) move
        into the memory route's region. Megatron gives every parameter its own storage."""
        in_buffers = {
            buffer.param_data.untyped_storage().data_ptr()
            for buffer in [*self.model.buffers, *self.model.expert_parallel_buffers]
            if buffer.param_data is not None
        }
        for param in self.model.parameters():
            if param.untyped_storage().data_ptr() not in in_buffers:
                param.data = self.memory.adopt(param.data)

    def _adopt_optimizer_state(self) -> None:
        """Optimizer state made outside the memory route's region (Adam's moments at the first step, a
        loaded checkpoint's) moves into it; a tensor shared by several parameters stays shared."""
        for optimizer in self._optimizers():
            adopted = {}
            for state in optimizer.optimizer.state.values():
                for key, value in state.items():
                    if torch.is_tensor(value):
                        if id(value) not in adopted:
                            adopted[id(value)] = self.memory.adopt(value)
                        state[key] = adopted[id(value)]

    @property
    def asleep(self) -> bool:
        return self.memory.released

    def sleep(self) -> None:
        """Hand back the device memory of weights, grads and optimizer state (relax.train.offload: paused
        by the platform's memory saver, or copied to host memory) and destroy the actor's process groups.
        Collective over the actor's ranks."""
        if self.asleep:
            raise RuntimeError("the actor is already asleep")
        self.optimizer.zero_grad()  # the main parameters' grads: the next step makes them again
        self._adopt_optimizer_state()
        self.memory.release()
        self.process_groups.destroy()

    def wake(self) -> None:
        """Rebuild the process groups as they were made, and bring weights, grads and optimizer state back
        onto the device, byte for byte. Collective over the actor's ranks."""
        if not self.asleep:
            raise RuntimeError("the actor is not asleep")
        self.process_groups.rebuild()
        self.memory.restore()

    def free_cached_blocks(self) -> None:
        """Hand the caching allocator's free blocks (the last step's activations) back to the device. Before the
        weight push, which runs while the engines' weights are back on the device, so that the push peaks at the
        training state plus the engines' weights and a bucket, not also at the step's activations."""
        self.platform.device_module.empty_cache()

    def _check_awake(self) -> None:
        if self.asleep:
            raise RuntimeError("the actor is asleep: call wake() first")

    # --- weights -------------------------------------------------------------------------------------
    def _host_copy(self) -> dict[str, torch.Tensor]:
        """This rank's parameters copied to host memory."""
        return {name: p.detach().to("cpu", copy=True) for name, p in unwrap(self.model).named_parameters()}

    def _copy_into_model(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, param in unwrap(self.model).named_parameters():
                param.copy_(weights[name])

    # --- forward ---------------------------------------------------------------------------------------
    def _micro_batches(self, batch: RolloutBatch, forward_only: bool) -> list[MicroBatch]:
        from megatron.core import parallel_state

        settings = self.settings
        max_tokens = settings.max_tokens_per_micro_batch
        if forward_only and settings.max_tokens_per_forward is not None:
            max_tokens = settings.max_tokens_per_forward
        # Context parallelism cuts each sequence into 2 x CP equal chunks and puts 1/CP of the row on each rank, so
        # the token budget, one device's, packs CP times as many tokens into a row.
        cp = self.config.context_parallel_size
        sequence_multiple = 2 * cp if cp > 1 else 1
        if max_tokens is not None:
            max_tokens *= cp
        # Sequence parallelism splits each rank's tokens of a row over the tensor-parallel ranks.
        multiple = sequence_multiple * (self.config.tensor_model_parallel_size if self.config.sequence_parallel else 1)
        uniform_shape = None
        # Pipeline stages exchange activations of the one shape the schedule is given; expert-parallel
        # ranks (different DP ranks) exchange tokens in every micro-batch, forward and backward, so they
        # need as many micro-batches, of one shape. (Dense DP ranks only meet in the gradient all-reduce.)
        if self.config.pipeline_model_parallel_size > 1 or self.config.expert_model_parallel_size > 1:
            counts = batch.token_counts()
            plan = plan_micro_batches(counts, settings.micro_batch_size, max_tokens)
            shape = torch.tensor(plan_shape(counts, plan, multiple), device=self.device)
            if self.config.expert_model_parallel_size > 1:
                torch.distributed.all_reduce(
                    shape, op=torch.distributed.ReduceOp.MAX, group=parallel_state.get_data_parallel_group()
                )
            uniform_shape = tuple(shape.tolist())
        return make_micro_batches(
            batch,
            settings.micro_batch_size,
            max_tokens,
            pad_token_id=self.hf_checkpoint.text_config.get("pad_token_id") or 0,
            multiple=multiple,
            uniform_shape=uniform_shape,
            sequence_multiple=sequence_multiple,
        )

    def output_weight(self) -> torch.Tensor:
        """The output layer's weight [vocab / TP, hidden] on the last pipeline stage, as GPTModel's _postprocess reads
        it: the word embedding's where the two are tied (a stage without the embedding: the output layer's copy,
        which megatron keeps equal to it)."""
        model = unwrap(self.model)
        if model.share_embeddings_and_output_weights:
            return model.shared_embedding_or_output_weight()
        return model.output_layer.weight

    def _token_logprobs(self, output: torch.Tensor, micro_batch: MicroBatch, entropy_grad: bool = False):
        """Per sample: response-token logprobs and entropies (the entropies differentiable with entropy_grad) from
        the model output [1, t, vocab/TP] (under CP [1, t/CP, vocab/TP], this rank's tokens: their values are
        gathered into the whole row), which the backward overwrites with its gradient; with fused output logprobs
        the output is the output layer's input [1, t, hidden] (relax.train.logprobs.output_logprobs_and_entropy)."""
        labels = torch.roll(micro_batch.tokens, shifts=-1, dims=1)  # the last position's label is never read
        split = micro_batch.row_split
        if split is not None:
            labels = split.local(labels)
        temperature, launch = self.settings.temperature, self.logprob_launch
        if self.settings.fused_output_logprobs:
            logprobs, entropy = vocab_parallel_output_logprobs(
                output, self.output_weight(), labels, self.config.sequence_parallel, temperature, launch
            )
        else:
            logprobs, entropy = vocab_parallel_logprobs(output, labels, temperature, launch)
        if not entropy_grad:
            entropy = entropy.detach()
        if split is not None:
            logprobs, entropy = split.whole_row(logprobs), split.whole_row(entropy)
        return micro_batch.response_values(logprobs), micro_batch.response_values(entropy)

    def _run(self, micro_batches: list[MicroBatch], loss_func, forward_only: bool) -> list[dict]:
        """Megatron's forward(-backward) schedule over the micro-batches; the last stage's loss outputs."""
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        cp = parallel_state.get_context_parallel_world_size()
        gated_delta_net = self.config.experimental_attention_variant == "gated_delta_net"
        conv_width = self.config.linear_conv_kernel_dim if gated_delta_net else None

        def forward_step(data_iterator, model):
            micro_batch = next(data_iterator)
            row_split = None
            if cp > 1:
                row_split = split_row(
                    micro_batch.cu_seqlens.tolist(), cp, parallel_state.get_context_parallel_rank(),
                    parallel_state.get_context_parallel_group(), self.device, conv_width,
                )
            micro_batch = dataclasses.replace(micro_batch.to(self.device), row_split=row_split)
            if self.routing_replay is not None:
                self.routing_replay.replay(micro_batch)
            tokens, position_ids = micro_batch.tokens, micro_batch.position_ids
            packed_seq_params = micro_batch.packed_seq_params()
            if row_split is not None:  # this rank's part of the row; rotary embedding and attention read the whole row
                tokens, position_ids = row_split.local(tokens), row_split.local(position_ids)
                packed_seq_params = with_row_split(packed_seq_params, row_split)
            output = model(tokens, position_ids, None, packed_seq_params=packed_seq_params, **self.forward_options)
            return output, partial(loss_func, micro_batch)

        try:
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(micro_batches),
                model=[self.model],
                num_microbatches=len(micro_batches),
                seq_length=max(mb.num_tokens for mb in micro_batches),
                micro_batch_size=1,  # one packed row
                forward_only=forward_only,
            )
        finally:
            if self.routing_replay is not None:
                self.routing_replay.clear()

    def _from_last_stage(self, value):
        """`value` of the last pipeline stage, on every stage."""
        from megatron.core import parallel_state

        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return value
        holder = [value]
        torch.distributed.broadcast_object_list(
            holder,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
        return holder[0]

    @torch.no_grad()
    def compute_logprobs(
        self, batch: RolloutBatch, reference: bool = False, with_entropy: bool = False
    ) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Response-token logprobs of every sample (with entropies when asked) under the current weights,
        or the initial ones (reference=True: swapped in from the host copy for this call only)."""
        self._check_awake()
        if reference and self.reference_weights is None:
            raise ValueError("reference logprobs need ActorSettings.keep_reference=True")
        micro_batches = self._micro_batches(batch, forward_only=True)

        def loss_func(micro_batch, output):
            logprobs, entropy = self._token_logprobs(output, micro_batch)
            logprobs = [values.cpu() for values in logprobs]
            entropy = [values.cpu() for values in entropy] if with_entropy else None
            return torch.zeros((), device=output.device), {
                "indices": micro_batch.sample_indices,
                "logprobs": logprobs,
                "entropy": entropy,
            }

        actor_weights = None
        if reference:
            actor_weights = self._host_copy()
            self._copy_into_model(self.reference_weights)
        self.model.eval()
        try:
            outputs = self._run(micro_batches, loss_func, forward_only=True)
        finally:
            if actor_weights is not None:
                self._copy_into_model(actor_weights)
        outputs = self._from_last_stage(outputs)
        logprobs, entropy = [None] * len(batch), [None] * len(batch)
        for output in outputs:
            for k, index in enumerate(output["indices"]):
                logprobs[index] = output["logprobs"][k]
                if with_entropy:
                    entropy[index] = output["entropy"][k]
        return (logprobs, entropy) if with_entropy else logprobs

    # --- train -----------------------------------------------------------------------------------------
    def _batch_denominators(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole batch's (over all DP ranks) aggregation denominator and trained response-token count."""
        from megatron.core import parallel_state

        loss = self.settings.loss
        mask = torch.nn.utils.rnn.pad_sequence(batch.loss_mask, batch_first=True)
        totals = torch.stack(
            [aggregation_denominator(mask, loss.aggregation, loss.norm_length).float(), mask.sum()]
        )
        totals = totals.to(self.device)
        torch.distributed.all_reduce(totals, group=parallel_state.get_data_parallel_group())
        return totals[0], totals[1]

    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """One optimizer step on the batch. Returns the whole batch's loss, pg_loss, clip_fraction, dual_clip_fraction, ppo_kl,
        kl (with ref_logprobs), entropy, the mismatch/* metrics (with rollout_logprobs), and grad_norm, lr,
        update_successful."""
        from megatron.core import parallel_state

        self._check_awake()
        if batch.advantages is None:
            raise ValueError("train_step needs advantages for every sample (relax.train.advantages)")
        loss_settings = self.settings.loss
        entropy_in_loss = loss_settings.entropy_coef != 0.0  # otherwise the entropy is only reported
        denominator, num_tokens = self._batch_denominators(batch)
        micro_batches = self._micro_batches(batch, forward_only=False)
        # The schedule divides each micro-batch loss by their number and DDP averages gradients over DP; each
        # micro-batch's loss here is its share of the whole batch's, so undo both. Under CP, DDP averages over DP x CP
        # and the schedule multiplies each loss by the CP size, which undoes the CP part: every CP rank computes its
        # rows' whole loss and gets the gradient of its own tokens only, and the CP ranks' gradients add up to the
        # rows' (relax.train.context_parallel).
        loss_scale = len(micro_batches) * parallel_state.get_data_parallel_world_size()

        def padded(values: list[torch.Tensor]) -> torch.Tensor:
            return torch.nn.utils.rnn.pad_sequence(values, batch_first=True).to(self.device)

        def loss_func(micro_batch, output):
            if not micro_batch.sample_indices:  # all padding (expert parallelism): runs for its collectives
                zero = output.sum() * 0.0
                if self.settings.fused_output_logprobs:  # the model's forward leaves the output weight out, and
                    zero = zero + self.output_weight().sum() * 0.0  # DDP waits for its gradient too
                return zero, {}
            logprobs, entropy = self._token_logprobs(output, micro_batch, entropy_grad=entropy_in_loss)
            pick = micro_batch.sample_indices
            logprobs = padded(logprobs)
            mask = padded([batch.loss_mask[i] for i in pick])

            def given(values):  # an optional per-sample field of the batch, padded, or None
                return padded([values[i] for i in pick]) if values else None

            loss, metrics = corrected_policy_loss(
                loss_settings,
                self.settings.rollout_correction,
                logprobs,
                padded([batch.advantages[i] for i in pick]),
                mask,
                old_logprobs=given(batch.old_logprobs),  # None: the current logprobs, detached
                rollout_logprobs=given(batch.rollout_logprobs),
                ref_logprobs=given(batch.ref_logprobs),
                entropy=padded(entropy),
                denominator=denominator,
                num_tokens=num_tokens,
            )
            return loss * loss_scale, metrics

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self._run(micro_batches, loss_func, forward_only=False)
        lr = self.optimizer.param_groups[0]["lr"]  # the one this step uses; the scheduler moves it after
        update_successful, grad_norm, _ = self.optimizer.step()
        if update_successful:
            self.scheduler.step(increment=1)

        metrics = None
        if parallel_state.is_pipeline_last_stage():
            outputs = [output for output in outputs if output]  # all-padding micro-batches report nothing
            metrics = _whole_batch_metrics(outputs, parallel_state.get_data_parallel_group())
        metrics = self._from_last_stage(metrics)
        metrics.update(
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            lr=lr,
            update_successful=bool(update_successful),
        )
        return metrics
