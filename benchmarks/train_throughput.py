"""Training throughput and MFU of relax's Megatron actor against plain megatron-core, on one GPU, in one run.

    python benchmarks/train_throughput.py --seq 2048 --micro-batch-size 4 --micro-batches 4

The model is a random Qwen3-shaped HF checkpoint (~1.7B parameters: 24 layers, hidden 2048, 16 query / 4 KV heads
of 128, SwiGLU 5504, vocabulary 151936, untied), written once. Both sides use the same megatron-core
TransformerConfig (bf16, megatron's local layer spec, no TransformerEngine), megatron's DDP and its Adam
optimizer, and the same tokens per step (micro-batches of full-length rows):
    megatron-core  GPTModel + forward_backward_func with GPT's own labels loss (vocab-parallel cross entropy),
                   the causal mask made inside the attention (attention_mask=None); and again with an explicit
                   [rows, 1, seq, seq] causal mask (megatron_core_explicit_mask), the kind the actor passed before
                   it packed rows
    relax          MegatronActor.train_step on a RolloutBatch of the same shape (half of each sequence a
                   response): each micro-batch's sequences packed into one row (THD) and attended with the
                   platform's kernel, fp32 per-token logprobs over the vocabulary, the PPO-clip policy loss
Each side: 3 warm-up steps, then the mean of --steps timed steps (device synchronized). MFU counts the model
FLOPs (matmuls x 3 for forward + backward) against 989 TFLOP/s (H100/H200 dense bf16) in two attention conventions:
mfu_attention_full, Megatron's own formula (causal attention counted whole), and mfu_attention_causal (half of the
s x s, the count Megatron-LM's and torchtitan's published MFU figures use); the ratio relax / megatron-core is the
figure to read.

--profile adds, per side, after the timed steps: (1) torch.profiler over --profile-steps steps: device busy time
against wall time, the top kernels and the top ops (by device time, or host time on the CPU); (2) the step cut
into phases (host batch building, copies, forward, logprobs, loss, backward, grad all-reduce, optimizer step, the
rest), timed with the device synchronized at every phase boundary. The synchronizations lose the overlap of host
and device work, so the phases of one step add up to somewhat more than an untimed step. At the end the kernels
and ops whose time differs most between megatron_core and relax are listed side by side.
"""

import argparse
import contextlib
import json
import queue
import re
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.multiprocessing as mp

from relax.ports import free_port
from single_rank import init_distributed

QWEN3_1_7B = dict(
    hidden_size=2048, intermediate_size=5504, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4,
    head_dim=128, vocab_size=151936, tie_word_embeddings=False,
)
TINY = dict(  # for a smoke run on the CPU (--device cpu --shape tiny)
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=1000, tie_word_embeddings=False,
)
SHAPES = {"1.7b": QWEN3_1_7B, "tiny": TINY}
PEAK_FLOPS = 989e12
KEPT_ROWS = 60  # kernels and ops kept per side, so the comparison finds one side's top rows on the other


def write_checkpoint(out_dir: Path, shape: dict, device: torch.device, max_position_embeddings: int = 4096) -> Path:
    import transformers

    from relax.tools.tiny_model import build_tokenizer

    if (out_dir / "config.json").is_file():
        return out_dir
    tokenizer = build_tokenizer(out_dir)
    config = transformers.Qwen3Config(
        **shape, max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6, rope_theta=1e6,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    torch.manual_seed(0)
    with device:
        model = transformers.Qwen3ForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the sides run in child processes on the same GPU
    return out_dir


# How the attention's scores and weighted sum are counted in an MFU figure: "full", Megatron's formula over the
# whole s x s (the figure relax's earlier records give), or "causal", half of it: the work a causal kernel does and
# the count Megatron-LM's and torchtitan's published MFU figures use. Every MFU relax reports names its convention.
ATTENTION_CONVENTIONS = {"full": 1.0, "causal": 0.5}


def flops_per_step(shape: dict, seq: int, tokens: int, attention: str = "full") -> float:
    """2 FLOPs per multiply-add, x3 for forward + backward; the attention over s x s times the convention's share."""
    h, layers, vocab = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    scores = 2 * 2 * seq * q * ATTENTION_CONVENTIONS[attention]
    per_token_layer = 2 * h * (q + 2 * kv) + 2 * q * h + 2 * 3 * h * shape["intermediate_size"] + scores
    return 3 * tokens * (layers * per_token_layer + 2 * h * vocab)


def mfu(flops_of, seconds: float) -> dict:
    """The MFU under each attention convention: `flops_of(convention)` FLOPs in `seconds` against PEAK_FLOPS."""
    return {f"mfu_attention_{name}": flops_of(name) / seconds / PEAK_FLOPS for name in ATTENTION_CONVENTIONS}


def parameter_count(shape: dict) -> int:
    h, q_heads, kv_heads, head_dim = (
        shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    )
    embeddings = shape["vocab_size"] * h * (1 if shape["tie_word_embeddings"] else 2)
    per_layer = h * (q_heads + 2 * kv_heads) * head_dim + q_heads * head_dim * h + 3 * h * shape["intermediate_size"]
    return embeddings + shape["num_hidden_layers"] * per_layer


def megatron_configs(hf, context_parallel_size: int = 1):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from relax.hf_checkpoint import transformer_config

    transformer = transformer_config(hf, bf16=True, params_dtype=torch.bfloat16, perform_initialization=False,
                                     context_parallel_size=context_parallel_size)
    optimizer = OptimizerConfig(optimizer="adam", lr=1e-5, clip_grad=1.0, bf16=True, params_dtype=torch.bfloat16)
    return transformer, optimizer, DistributedDataParallelConfig()


def timed_steps(step, args, platform) -> dict:
    """Mean seconds per step after warm-up, the peaks of allocated and reserved device memory, and how often the
    caching allocator had to free its cache and retry during the timed steps (each retry synchronizes the device;
    None on the CPU)."""
    cuda = platform.device_type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.warmup):
        step()
    platform.device_module.synchronize()
    retries_before = torch.cuda.memory_stats().get("num_alloc_retries", 0) if cuda else None
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    platform.device_module.synchronize()
    seconds = (time.perf_counter() - start) / args.steps
    return {
        "seconds_per_step": seconds,
        "peak_allocated_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
        "peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9 if cuda else None,
        "alloc_retries_in_timed_steps": (
            torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries_before if cuda else None
        ),
    }


class PhaseClock:
    """Wall seconds per named phase of a step, the device synchronized at every phase boundary. Phases nest: a
    phase's time excludes the phases inside it. What no phase covers is the step's "other"."""

    def __init__(self, synchronize):
        self.synchronize = synchronize
        self.seconds = defaultdict(float)
        self.steps_seconds = 0.0
        self._open: list[str] = []
        self._since = 0.0

    def _switch(self) -> None:
        self.synchronize()
        now = time.perf_counter()
        if self._open:
            self.seconds[self._open[-1]] += now - self._since
        self._since = now

    @contextlib.contextmanager
    def phase(self, name: str):
        self._switch()
        self._open.append(name)
        try:
            yield
        finally:
            self._switch()
            self._open.pop()

    def timed(self, name: str, function):
        """`function` with each call timed as phase `name` (a plain function: it can replace a method too)."""

        def timed_function(*args, **kwargs):
            with self.phase(name):
                return function(*args, **kwargs)

        return timed_function

    def run(self, step, steps: int) -> None:
        for _ in range(steps):
            self.synchronize()
            start = time.perf_counter()
            step()
            self.synchronize()
            self.steps_seconds += time.perf_counter() - start

    def report(self, steps: int) -> dict:
        """Milliseconds per step of each phase, slowest first, then "other" and the synchronized step's total."""
        phases = dict(sorted(((k, 1e3 * v / steps) for k, v in self.seconds.items()), key=lambda kv: -kv[1]))
        total = 1e3 * self.steps_seconds / steps
        return {**phases, "other (not in a phase)": total - sum(phases.values()), "step (synchronized)": total}


def _instrument_schedule(clock: PhaseClock, forward_name: str, model, optimizer, config) -> None:
    """Phases both sides share: forward (the model call), backward, grad all-reduce, optimizer step, zeroing."""
    from megatron.core.pipeline_parallel import schedules

    model.forward = clock.timed(forward_name, model.forward)
    schedules.backward_step = clock.timed("backward", schedules.backward_step)
    config.finalize_model_grads_func = clock.timed(
        "grad all-reduce (finalize_model_grads)", config.finalize_model_grads_func
    )
    optimizer.step = clock.timed("optimizer step (incl. grad norm, clip)", optimizer.step)
    model.zero_grad_buffer = clock.timed("zero grads", model.zero_grad_buffer)
    optimizer.zero_grad = clock.timed("zero grads", optimizer.zero_grad)


def _short_kernel_name(name: str) -> str:
    """A kernel's name without its parameter list, return type and the usual namespaces."""
    depth, cut = 0, len(name)
    for i, c in enumerate(name):  # the parameter list starts at the first "(" outside template brackets
        depth += {"<": 1, ">": -1}.get(c, 0)
        if c == "(" and depth == 0 and i > 0:
            cut = i
            break
    name = name[:cut].removeprefix("void ")
    name = re.sub(r"\(anonymous namespace\)::|at::native::|at::|c10::|std::", "", name)
    return name[:90]


def _profile_tables(step, args, platform) -> dict:
    """torch.profiler over --profile-steps steps: milliseconds per step of device work (kernels, copies), the
    device events and the ops by time (device time on a device, host time on the CPU)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_device = platform.device_type != "cpu"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    platform.device_module.synchronize()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(args.profile_steps):
            step()
        platform.device_module.synchronize()
        wall_ms = 1e3 * (time.perf_counter() - start) / args.profile_steps
    per_step = 1e3 * args.profile_steps  # profiler microseconds -> milliseconds per step
    kernels, ops = defaultdict(lambda: [0.0, 0.0]), {}
    for event in prof.key_averages():
        if event.device_type != DeviceType.CPU:
            entry = kernels[_short_kernel_name(event.key)]
            entry[0] += event.device_time_total / per_step
            entry[1] += event.count / args.profile_steps
        else:
            ms = (event.self_device_time_total if on_device else event.self_cpu_time_total) / per_step
            if ms > 0:
                ops[event.key] = [ms, event.count / args.profile_steps]
    return {
        "wall_ms": wall_ms,
        "device_busy_ms": sum(ms for ms, _ in kernels.values()) if on_device else None,
        "kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1][0])[:KEPT_ROWS]),
        "ops": dict(sorted(ops.items(), key=lambda kv: -kv[1][0])[:KEPT_ROWS]),
    }


def _measure(step, instrument, args, platform) -> dict:
    """timed_steps, and with --profile the profiler tables and then the phases (instrument(clock) installs the timed
    phases; it runs last because the synchronizations would distort everything after it)."""
    result = timed_steps(step, args, platform)
    if args.profile:
        result["profile"] = _profile_tables(step, args, platform)
        clock = PhaseClock(platform.device_module.synchronize)
        instrument(clock)
        clock.run(step, args.profile_steps)
        result["profile"]["phases_ms"] = clock.report(args.profile_steps)
    return result


def plain_gpt(hf, platform, load_weights: bool = False):
    """megatron-core's own model for an HF Qwen3 config: GPTModel (local spec: unfused DotProductAttention), DDP
    and Adam, with the checkpoint `hf`'s weights when `load_weights` (else uninitialised: perform_initialization
    is off). Returns (model, optimizer, TransformerConfig), the config's hooks set for forward_backward_func."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    from relax.train.model import load_hf_weights

    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    config, optimizer_config, ddp_config = megatron_configs(hf)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=True, normalization=config.normalization),
        vocab_size=hf.text_config["vocab_size"], max_sequence_length=hf.text_config["max_position_embeddings"],
        share_embeddings_and_output_weights=False, position_embedding_type="rope", rotary_base=1e6,
    ).to(platform.current_device())
    if load_weights:
        load_hf_weights(model, hf)
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=Float16Module(config, model))
    optimizer = get_megatron_optimizer(optimizer_config, [model])
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    config.grad_scale_func = optimizer.scale_loss
    return model, optimizer, config


def megatron_baseline(hf, args, platform, explicit_mask: bool = False) -> dict:
    """Plain megatron-core: GPTModel (local spec), DDP, Adam, forward_backward_func, GPT's labels loss.
    explicit_mask: pass a [rows, 1, seq, seq] causal mask, as the actor passed before it packed rows, instead of
    None (the attention then makes its own causal mask)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = platform.current_device()
    model, optimizer, config = plain_gpt(hf, platform)
    generator = torch.Generator(device=device).manual_seed(0)
    shape, vocab_size = (args.micro_batch_size, args.seq), hf.text_config["vocab_size"]
    batches = [
        torch.randint(0, vocab_size, shape, device=device, generator=generator) for _ in range(args.micro_batches)
    ]
    position_ids = torch.arange(args.seq, device=device).expand(shape)
    attention_mask = None
    if explicit_mask:  # True = masked, megatron's convention
        causal = torch.ones(args.seq, args.seq, dtype=torch.bool, device=device).triu(1)
        attention_mask = causal.expand(args.micro_batch_size, 1, args.seq, args.seq)

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        labels = torch.roll(tokens, -1, dims=1)
        losses = model(tokens, position_ids, attention_mask, labels=labels)

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"loss": loss.detach()}

        return losses, loss_func

    def step():
        model.zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
            num_microbatches=args.micro_batches, seq_length=args.seq, micro_batch_size=args.micro_batch_size,
            forward_only=False,
        )
        optimizer.step()

    def instrument(clock):  # the loss function (a mean) falls in "other"
        _instrument_schedule(clock, "forward (model call, with GPT's labels cross entropy)", model, optimizer, config)

    return _measure(step, instrument, args, platform)


def relax_actor(hf_dir: str, hf, args, platform) -> dict:
    """relax.train.actor.MegatronActor.train_step on batches of the same shape."""
    from relax.train.actor import ActorSettings, MegatronActor
    from relax.train.batch import RolloutBatch

    transformer, optimizer, ddp = megatron_configs(hf)
    settings = ActorSettings(micro_batch_size=args.micro_batch_size, keep_reference=False)
    actor = MegatronActor(hf_dir, transformer, optimizer, ddp, settings, platform=platform)
    generator = torch.Generator().manual_seed(0)
    count = args.micro_batch_size * args.micro_batches
    tokens = [torch.randint(0, hf.text_config["vocab_size"], (args.seq,), generator=generator) for _ in range(count)]
    response = args.seq // 2
    advantages = [torch.full((response,), 1.0 if i % 2 else -1.0) for i in range(count)]
    batch = RolloutBatch(tokens, [response] * count, advantages=advantages)
    metrics = []

    def step():
        metrics.append(actor.train_step(batch))

    def instrument(clock):
        from relax.train import batch as batch_module

        forward = "forward (model call: logits, copied to fp32 by Float16Module)"
        _instrument_schedule(clock, forward, actor.model, actor.optimizer, actor.config)
        actor._batch_denominators = clock.timed("host: batch denominators + all-reduce", actor._batch_denominators)
        actor._micro_batches = clock.timed("host: micro-batches (tokens, positions, boundaries)", actor._micro_batches)
        micro_batch = batch_module.MicroBatch
        micro_batch.to = clock.timed("host-to-device copy of micro-batch inputs", micro_batch.to)
        actor._token_logprobs = clock.timed("logprobs and entropy over the vocabulary", actor._token_logprobs)
        run = actor._run

        def run_with_timed_loss(micro_batches, loss_func, forward_only):
            return run(micro_batches, clock.timed("loss: padding, copies, policy loss", loss_func), forward_only)

        actor._run = run_with_timed_loss

    result = _measure(step, instrument, args, platform)
    grad_norms = [m["grad_norm"] for m in metrics][: args.warmup + args.steps]
    # SaverRegion: DDP buffers and optimizer built in the memory saver's region (the colocated default)
    return {**result, "memory_route": type(actor.memory).__name__, "grad_norms": grad_norms}


SIDES = ("megatron_core", "megatron_core_explicit_mask", "relax")


def print_profile(name: str, profile: dict, rows: int) -> None:
    busy = profile["device_busy_ms"]
    idle = f", device busy {busy:.1f} ms ({busy / profile['wall_ms']:.0%})" if busy is not None else ""
    print(f"--- {name}: profiled step {profile['wall_ms']:.1f} ms{idle}")
    print("  phases, ms per step (device synchronized at each boundary):")
    for phase, ms in profile["phases_ms"].items():
        print(f"    {ms:9.1f}  {phase}")
    for table, unit in (("kernels", "device"), ("ops", "self device" if busy is not None else "self host")):
        if not profile[table]:
            continue
        print(f"  top {table} by {unit} ms per step (ms, calls per step, name):")
        for key, (ms, calls) in list(profile[table].items())[:rows]:
            print(f"    {ms:9.1f} {calls:7.0f}  {key}")


def print_profile_difference(plain: dict, relax: dict, rows: int) -> None:
    """The kernels and ops whose milliseconds per step differ most, relax minus megatron_core."""
    for table in ("kernels", "ops"):
        keys = set(plain[table]) | set(relax[table])
        if not keys:
            continue
        difference = {k: relax[table].get(k, [0.0])[0] - plain[table].get(k, [0.0])[0] for k in keys}
        print(f"--- {table}: relax - megatron_core, ms per step (relax, megatron_core, difference, name):")
        for key in sorted(keys, key=lambda k: -abs(difference[k]))[:rows]:
            print(
                f"    {relax[table].get(key, [0.0])[0]:9.1f} {plain[table].get(key, [0.0])[0]:9.1f} "
                f"{difference[key]:+9.1f}  {key}"
            )
    phases = relax["phases_ms"]["step (synchronized)"] - plain["phases_ms"]["step (synchronized)"]
    print(f"--- synchronized step: relax - megatron_core = {phases:+.1f} ms")


def run_side(platform, name: str, args) -> dict:
    from relax.hf_checkpoint import read_hf_checkpoint

    hf_dir = str(Path(args.work_dir) / f"qwen3_{args.shape}")
    hf = read_hf_checkpoint(hf_dir)
    if name == "relax":
        return relax_actor(hf_dir, hf, args, platform)
    return megatron_baseline(hf, args, platform, explicit_mask=name == "megatron_core_explicit_mask")


def _side_process(device: str, rank: int, ranks: int, port: int, side, side_args: tuple, results) -> None:
    platform = init_distributed(device, rank, ranks, port)
    results.put((rank, side(platform, *side_args)))
    torch.distributed.destroy_process_group()


def _results_of(name: str, processes: list, results) -> dict:
    """Each rank's result by rank; an error, not a hang, when a rank's process died without one (its traceback is
    above)."""
    by_rank = {}
    while len(by_rank) < len(processes):
        try:
            rank, result = results.get(timeout=5)
            by_rank[rank] = result
        except queue.Empty:
            dead = [rank for rank, process in enumerate(processes) if rank not in by_rank and not process.is_alive()]
            if dead:
                try:
                    rank, result = results.get(timeout=1)  # put just before it exited
                    by_rank[rank] = result
                except queue.Empty:
                    codes = {rank: processes[rank].exitcode for rank in dead}
                    raise RuntimeError(f"side {name}: ranks exited without a result (exit codes {codes})") from None
    return by_rank


def run_in_own_process(name: str, device: str, side, *side_args, ranks: int = 1):
    """side(platform, *side_args) in fresh processes, `ranks` ranks of one process group on devices 0 to ranks - 1 of
    `device` (one: the only rank): a fresh device allocator (a side run after another one in the same process ran
    out of memory on the H200). Returns rank 0's result, with every rank's peak device memory where it has one;
    `side` must be a module-level function (the processes are spawned)."""
    context = mp.get_context("spawn")
    results, port = context.Queue(), free_port()
    processes = [
        context.Process(target=_side_process, args=(device, rank, ranks, port, side, side_args, results))
        for rank in range(ranks)
    ]
    for process in processes:
        process.start()
    by_rank = _results_of(name, processes, results)
    for process in processes:
        process.join()
    result = by_rank[0]
    if ranks > 1 and "peak_allocated_gb" in result:
        result["peak_allocated_gb_per_rank"] = [by_rank[rank].get("peak_allocated_gb") for rank in range(ranks)]
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1.7b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--work-dir", default="/tmp/relax_train_throughput")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--profile", action="store_true", help="attribute each side's step (see the module doc)")
    parser.add_argument("--profile-steps", type=int, default=2, help="steps profiled, and steps cut into phases")
    parser.add_argument("--profile-rows", type=int, default=15, help="rows printed per table")
    args = parser.parse_args(argv)

    from relax.platform import get_platform

    shape = SHAPES[args.shape]
    write_checkpoint(Path(args.work_dir) / f"qwen3_{args.shape}", shape, get_platform(args.device).current_device())
    tokens = args.seq * args.micro_batch_size * args.micro_batches
    results = {"parameters_b": parameter_count(shape) / 1e9, "tokens_per_step": tokens}
    print(json.dumps(results), flush=True)
    profiles = {}
    for name in args.sides:
        result = run_in_own_process(name, args.device, run_side, name, args)
        result["tokens_per_s"] = tokens / result["seconds_per_step"]
        flops_of = lambda attention: flops_per_step(shape, args.seq, tokens, attention)  # noqa: E731
        result.update(mfu(flops_of, result["seconds_per_step"]))
        profiles[name] = result.pop("profile", None)
        results[name] = result
        print(name, json.dumps(result), flush=True)
        if profiles[name]:
            print_profile(name, profiles[name], args.profile_rows)
    if "relax" in results and "megatron_core" in results:
        ratio = results["relax"]["tokens_per_s"] / results["megatron_core"]["tokens_per_s"]
        results["relax_over_megatron_core"] = ratio
        if profiles["relax"] and profiles["megatron_core"]:
            print_profile_difference(profiles["megatron_core"], profiles["relax"], args.profile_rows)
        print(f"relax / megatron_core tokens per second: {ratio:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), **results, "profiles": profiles}))


if __name__ == "__main__":
    main()
