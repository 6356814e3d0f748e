"""The colocate switch and the weight push of relax's Megatron actor at world size 2, against one receiver process
per device that stands in for the rollout engine, with the machine's copy bandwidth measured in the same run.

    python benchmarks/weight_sync.py --device cpu --size tiny --tp 1             # CPU: gloo, shared memory
    python benchmarks/weight_sync.py --device cuda --size 1.7b --tp 2 --seq 1024  # two GPUs: NCCL, CUDA IPC

Two training ranks (relax.train.actor.MegatronActor, DP=2 with --tp 1 or TP=2 with --tp 2) and, per device, one
receiver process holding the same HF checkpoint as a transformers model. SGLang (and Ray) are not on the lent GPU
machine and cannot be carried there, so the receiver is not SGLang: it takes what SGLang's
update_weights_from_tensor(load_format="flattened_bucket") takes, and does what SGLang does with it (unpickle the
handles, rebuild the tensors with sglang's FlattenedTensorBucket, copy them into the parameters of the same name).

Every step is the colocated loop's (relax/run/loop.py), one phase at a time, each timed after a device sync and a
barrier:
    engine_release  the receivers' weights leave the device (relax.train.offload.HostCopies over their parameters)
    wake            MegatronActor.wake(): process groups rebuilt, training state back on the device
    train           old-policy logprobs, then MegatronActor.train_step
    engine_resume   the receivers' weights come back
    push            the weights under HF names (relax.train.weight_export.weight_buckets, TP shards gathered), bucket by
                    bucket from rank 0 (data- and tensor-parallel rank 0, the rank TrainWorker.push_weights sends
                    from) to every receiver: packed by relax.sync.bucket.flatten_bucket (sglang's
                    FlattenedTensorBucket, as serialize_bucket packs), pickled as serialize_flattened does (CUDA IPC
                    handles on a GPU through torch's ForkingPickler, the bytes themselves on the CPU), each
                    bucket kept alive until every receiver has copied it
    sleep           MegatronActor.sleep(): training state to host memory, process groups destroyed
On a GPU not serialize_flattened itself: its IPC serializer is in sglang.srt.utils, which needs SGLang's whole
dependency set.
The push's time is split into export (gathers, HF names), pack (flatten + pickle), deliver (receivers unpickle,
i.e. open the handle, and copy), from marks taken after a device synchronize.

Checks (returned, asserted by tests/gpu/test_colocate_two_gpus.py and printed here): after the last push every
receiver's weights equal the actor's export exactly, its logprobs equal the actor's within tolerance (and moved
away from the initial ones), every receiver parameter was updated, the process groups were unusable while asleep
and came back with their timeout, and sleep handed back the training state's device memory.

Figures: per phase seconds and peak device memory (torch.cuda.max_memory_allocated of the actor and of the
receivers, and the device's used memory sampled through NVML every 5 ms); push GB/s (bf16/fp32 weight bytes
delivered to one receiver per second) against a device-to-device copy of 1 GiB in the same run (bytes copied per
second) and, on two GPUs, a GPU0 -> GPU1 copy.
"""

import argparse
import datetime
import json
import os
import pickle
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.multiprocessing as mp
from multiprocessing.reduction import ForkingPickler

from relax.ports import free_port

WORLD_SIZE = 2
GiB = 1 << 30

# Qwen3 shapes with the real vocabulary; "tiny" is relax.tools.tiny_model's (its character tokenizer's vocabulary).
QWEN3_SHAPES = {
    "0.1b": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=64, vocab_size=151936, tie_word_embeddings=True),
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
}
SIZES = ("tiny", *QWEN3_SHAPES)


def write_random_qwen3(out_dir, size: str, dtype: torch.dtype, device: str = "cpu") -> Path:
    """A random Qwen3 HF directory (config.json, safetensors in `dtype`, relax's tiny tokenizer)."""
    import transformers

    from relax.tools.tiny_model import build_tiny_model, build_tokenizer

    if size == "tiny":
        return build_tiny_model(out_dir, "qwen3")
    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(out_dir)
    config = transformers.Qwen3Config(
        **QWEN3_SHAPES[size], max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    torch.manual_seed(0)
    with torch.device(device):  # initialising 1.7B parameters on the host takes minutes
        model = transformers.Qwen3ForCausalLM(config)
    model.to(dtype).save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def copy_bandwidth(src_device: torch.device, dst_device: torch.device, nbytes: int = GiB, repeats: int = 10) -> float:
    """Bytes copied per second from a tensor on src_device into one on dst_device (each byte read once, written
    once), the mean of `repeats` copies after warm-up."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=src_device).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_device)
    cuda = src_device.type == "cuda"
    for _ in range(3):
        dst.copy_(src)
    if cuda:
        torch.cuda.synchronize(src_device)
        torch.cuda.synchronize(dst_device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    if cuda:
        torch.cuda.synchronize(src_device)
        torch.cuda.synchronize(dst_device)
    return nbytes * repeats / (time.perf_counter() - start)


class UsedMemorySampler:
    """The device's used memory (NVML: every process on it, CUDA contexts and NCCL buffers included), sampled
    every 5 ms in a thread; `peak(t0, t1)` is the largest sample in that window. A stand-in with no samples on
    the CPU."""

    def __init__(self, device: torch.device):
        self.samples: list[tuple[float, int]] = []
        if device.type != "cuda":
            return
        import pynvml

        pynvml.nvmlInit()
        # Launched with CUDA_DEVICE_ORDER=PCI_BUS_ID, so CUDA's index is NVML's.
        handle = pynvml.nvmlDeviceGetHandleByIndex(device.index)
        self._stop = threading.Event()

        def sample():
            while not self._stop.is_set():
                self.samples.append((time.perf_counter(), pynvml.nvmlDeviceGetMemoryInfo(handle).used))
                time.sleep(0.005)

        threading.Thread(target=sample, daemon=True).start()

    def peak(self, t0: float, t1: float) -> int | None:
        window = [used for t, used in self.samples if t0 <= t <= t1]
        return max(window) if window else None

    def now(self) -> int | None:
        return self.samples[-1][1] if self.samples else None


# --- the receiver: one process per device, standing in for the engine ----------------------------------------
def _receiver_main(device_name: str, index: int, hf_dir: str, dtype_name: str, conn) -> None:
    try:
        _serve(device_name, index, hf_dir, dtype_name, conn)
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _serve(device_name, index, hf_dir, dtype_name, conn) -> None:
    import transformers

    from relax.platform import get_platform
    from relax.train.offload import HostCopies

    platform = get_platform(device_name)
    platform.prepare_sglang()
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    torch.set_num_threads(1)
    device = torch.device(device_name, index) if device_name == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype_name))
    model = model.to(device).eval()
    params = dict(model.named_parameters(remove_duplicate=False))  # tied lm_head.weight under both names
    released, updated = None, set()

    def memory():
        if device.type != "cuda":
            return None
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return {"peak_allocated": peak, "allocated": torch.cuda.memory_allocated(device)}

    def logprobs(samples):
        """Response-token logprobs per sample, as lists (plain pickles: no tensor sharing over the pipe)."""
        result = []
        with torch.no_grad():
            for token_list, length in samples:
                tokens = torch.tensor(token_list, device=device)
                logits = model(tokens[None]).logits[0, -length - 1 : -1].float()
                result.append(logits.log_softmax(-1).gather(-1, tokens[-length:, None]).squeeze(-1).tolist())
        return result

    conn.send(("ok", memory()))
    while True:
        command, arg = conn.recv()
        if command == "stop":
            conn.send(("ok", None))
            return
        if command == "release" and not platform.colocation_needs_release:
            reply = None  # as SGLang on the CPU: release and resume do nothing where memory is host memory
        elif command == "resume" and not platform.colocation_needs_release:
            reply = None
        elif command == "release":
            released = HostCopies(params.values, platform.device_module, device.type)
            released.release()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            reply = None
        elif command == "resume":
            released.restore()
            released, reply = None, None
        elif command == "begin":
            updated, reply = set(), None
        elif command == "bucket":
            start = time.perf_counter()
            content = pickle.loads(arg)  # opens the IPC handle (on the CPU: rebuilds the bytes)
            unpickled = time.perf_counter()
            bucket = FlattenedTensorBucket(flattened_tensor=content["flattened_tensor"], metadata=content["metadata"])
            with torch.no_grad():
                for name, tensor in bucket.reconstruct_tensors():
                    if name not in params:
                        raise KeyError(f"received {name!r}, which the HF model has no parameter of")
                    if params[name].shape != tensor.shape:
                        raise ValueError(
                            f"{name}: received {tuple(tensor.shape)}, model has {tuple(params[name].shape)}"
                        )
                    params[name].copy_(tensor)
                    updated.add(id(params[name]))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            del bucket, content  # drop the handles before answering: the sender frees the bucket then
            reply = {"unpickle": unpickled - start, "copy": time.perf_counter() - unpickled}
        elif command == "end":
            reply = sorted(name for name, param in params.items() if id(param) not in updated)  # not updated
        elif command == "logprobs":
            reply = logprobs(arg)
        elif command == "weights":
            reply = bytes(ForkingPickler.dumps({name: param.detach() for name, param in params.items()}))
        elif command == "memory":
            reply = memory()
        else:
            raise ValueError(f"unknown receiver command {command!r}")
        conn.send(("ok", reply))


def _ask(conns, command, arg=None) -> list:
    """Send a command to receivers, then collect every answer (so they work in parallel)."""
    for conn in conns:
        conn.send((command, arg))
    answers = []
    for conn in conns:
        status, value = conn.recv()
        if status != "ok":
            raise RuntimeError(f"receiver failed on {command!r}:\n{value}")
        answers.append(value)
    return answers


# --- a training rank -------------------------------------------------------------------------------------------
def _build_actor(hf_dir: str, args, platform):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from relax.train.actor import ActorSettings, MegatronActor
    from relax.hf_checkpoint import read_hf_checkpoint, transformer_config

    dtype = getattr(torch, args.dtype)
    bf16 = dtype == torch.bfloat16
    transformer = transformer_config(
        read_hf_checkpoint(hf_dir), tensor_model_parallel_size=args.tp, bf16=bf16, params_dtype=dtype,
        perform_initialization=False,
    )
    optimizer = OptimizerConfig(optimizer="adam", lr=args.lr, clip_grad=1.0, bf16=bf16, params_dtype=dtype)
    settings = ActorSettings(
        micro_batch_size=args.micro_batch_size,
        keep_reference=False,
        distributed_timeout_minutes=args.group_timeout_minutes,
    )
    return MegatronActor(hf_dir, transformer, optimizer, DistributedDataParallelConfig(), settings, platform=platform)


def _samples(vocab_size: int, count: int, seq: int, seed: int):
    from relax.train.batch import RolloutBatch

    generator = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, vocab_size, (seq,), generator=generator) for _ in range(count)]
    response = seq // 2
    advantages = [torch.full((response,), 1.0 if i % 2 else -1.0) for i in range(count)]
    return RolloutBatch(tokens, [response] * count, advantages=advantages)


def _group_timeouts(actor, device_type: str) -> list:
    import torch.distributed as dist

    timeouts = []
    for group in actor.process_groups.groups:
        backend_device = torch.device("cpu" if dist.get_backend(group) == "gloo" else device_type)
        timeouts.append(group._get_backend(backend_device).options._timeout)
    return timeouts


def _groups_usable() -> bool:
    from megatron.core import parallel_state

    try:
        parallel_state.get_data_parallel_group().size()
        return True
    except RuntimeError:
        return False


def _rank_main(rank: int, args, port: int, hf_dir: str, receivers, results) -> None:
    try:
        results.put((rank, _rank(rank, args, port, hf_dir, receivers)))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))


def _rank(rank: int, args, port: int, hf_dir: str, receivers) -> dict:
    import torch.distributed as dist

    from relax.platform import get_platform

    torch.set_num_threads(args.threads)
    platform = get_platform(args.device)
    platform.prepare_megatron()
    if platform.device_type != "cpu":
        platform.set_device(rank)
    dist.init_process_group(
        platform.dist_backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE,
        timeout=datetime.timedelta(minutes=10),
    )
    from megatron.core import parallel_state

    from relax.train.weight_export import weight_buckets

    platform.prepare_sglang()  # relax.sync.bucket.flatten_bucket imports sglang's FlattenedTensorBucket
    from relax.sync.bucket import flatten_bucket, serialize_flattened

    device = platform.current_device()
    cuda = device.type == "cuda"
    sampler = UsedMemorySampler(device)
    actor = _build_actor(hf_dir, args, platform)
    sender = parallel_state.get_data_parallel_rank() == 0 and parallel_state.get_tensor_model_parallel_rank() == 0
    assert sender == (rank == 0), "rank 0 is data- and tensor-parallel rank 0"
    vocab = actor.hf_checkpoint.text_config["vocab_size"]
    dp_rank = parallel_state.get_data_parallel_rank()
    result = {"phases": [], "checks": {}, "metrics": []}

    def sync():
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()

    @contextmanager
    def phase(step: int, name: str):
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        yield
        sync()
        end = time.perf_counter()
        record = {"step": step, "phase": name, "seconds": end - start, "used_peak": sampler.peak(start, end)}
        if cuda:
            record["actor_peak_allocated"] = torch.cuda.max_memory_allocated()
            record["actor_allocated_after"] = torch.cuda.memory_allocated()
        if sender:
            record["receiver_memory"] = _ask(receivers, "memory")
        result["phases"].append(record)

    def push() -> int:
        """Rank 0 sends every bucket to every receiver; where the time goes is added to push_breakdown
        (the sender synchronizes its device at each mark, so GPU work is charged to the part that queued it)."""
        sent = 0
        if sender:
            _ask(receivers, "begin")
        parts = dict(export=0.0, pack=0.0, deliver=0.0, receiver_unpickle=0.0, receiver_copy=0.0, buckets=0)
        mark = time.perf_counter()

        def lap() -> float:
            nonlocal mark
            if cuda:
                torch.cuda.synchronize()
            previous, mark = mark, time.perf_counter()
            return mark - previous

        for named in weight_buckets(actor.model, actor.hf_checkpoint, args.bucket_mb << 20):
            if not sender:
                continue
            parts["export"] += lap()  # gathering TP shards, converting to HF names
            bucket = flatten_bucket(named)
            content = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
            if platform.same_node_transport == "inline":
                payloads = serialize_flattened(bucket, platform, len(receivers))
            else:
                # serialize_flattened's IPC route imports sglang.srt.utils, which needs SGLang's whole
                # dependency set; this is what its MultiprocessingSerializer does: one pickle per receiver,
                # each opening its own handle.
                payloads = [bytes(ForkingPickler.dumps(content)) for _ in receivers]
            parts["pack"] += lap()
            for conn, payload in zip(receivers, payloads):
                conn.send(("bucket", payload))
            for conn in receivers:
                status, value = conn.recv()
                if status != "ok":
                    raise RuntimeError(f"receiver failed on a bucket:\n{value}")
                parts["receiver_unpickle"] += value["unpickle"] / len(receivers)  # mean over receivers
                parts["receiver_copy"] += value["copy"] / len(receivers)
            del bucket, content, payloads  # every receiver has copied it
            parts["deliver"] += lap()
            parts["buckets"] += 1
            sent += sum(tensor.numel() * tensor.element_size() for _, tensor in named)
        if sender:
            not_updated = _ask(receivers, "end")
            assert not any(not_updated), f"receiver parameters the push never updated: {not_updated}"
            result.setdefault("push_breakdown", []).append(parts)
        return sent

    verify = _samples(vocab, 4, min(args.seq, 256), seed=999)
    verify_lists = [(tokens.tolist(), length) for tokens, length in zip(verify.tokens, verify.response_lengths)]
    if sender:
        result["initial_receiver_logprobs"] = _ask(receivers[:1], "logprobs", verify_lists)[0]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in actor._training_state_tensors()}
    state_bytes = sum(storage.nbytes() for storage in storages.values())
    timeouts_before = _group_timeouts(actor, device.type)
    actor.sleep()  # the loop starts with the engines generating and the actor asleep
    result["checks"]["groups_usable_asleep"] = _groups_usable()
    for step in range(args.steps):
        batch = _samples(vocab, args.samples_per_rank, args.seq, seed=1000 * step + dp_rank)
        with phase(step, "engine_release"):
            if sender:
                _ask(receivers, "release")
        with phase(step, "wake"):
            actor.wake()
        with phase(step, "train"):
            batch.old_logprobs = actor.compute_logprobs(batch)
            result["metrics"].append(actor.train_step(batch))
        with phase(step, "engine_resume"):
            if sender:
                _ask(receivers, "resume")
        with phase(step, "push"):
            result["pushed_bytes"] = push()
        with phase(step, "sleep"):
            if cuda:
                allocated_awake, free_awake = torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]
            actor.sleep()
        if cuda:
            # Host copies shrink storages (torch's allocated bytes fall); the memory saver unmaps its region
            # behind torch's back (the driver's free memory grows, torch still counts the blocks as allocated).
            result["phases"][-1]["freed_by_sleep"] = max(
                allocated_awake - torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0] - free_awake
            )
    result["checks"]["state_bytes"] = state_bytes

    # Verification, outside the timed steps: the actor wakes (weights as pushed) and compares.
    actor.wake()
    result["checks"]["groups_usable_awake"] = _groups_usable()
    timeouts_after = _group_timeouts(actor, device.type)
    result["checks"]["timeouts"] = [str(t) for t in timeouts_before], [str(t) for t in timeouts_after]
    sync()
    # Each rank reads the receiver on its own device (every rank's export is the whole model) and compares exactly.
    received = pickle.loads(_ask(receivers[rank : rank + 1], "weights")[0])
    mismatched, compared = [], 0
    for named in weight_buckets(actor.model, actor.hf_checkpoint, args.bucket_mb << 20):
        for name, tensor in named:
            compared += 1
            if not torch.equal(tensor, received[name].to(tensor.device)):
                mismatched.append(name)
    del received
    result["checks"]["weights_compared"] = compared
    result["checks"]["weights_mismatched"] = mismatched
    actor_logprobs = actor.compute_logprobs(verify)
    sync()
    if sender:
        final = _ask(receivers[:1], "logprobs", verify_lists)[0]
        initial = result.pop("initial_receiver_logprobs")

        def max_diff(other):
            return max((a - torch.tensor(o)).abs().max().item() for a, o in zip(actor_logprobs, other))

        result["checks"]["logprob_max_diff_after_push"] = max_diff(final)
        result["checks"]["logprob_max_diff_initial_weights"] = max_diff(initial)
        result["copy_bytes_per_s"] = copy_bandwidth(device, device)
        if cuda and torch.cuda.device_count() > 1:
            result["peer_copy_bytes_per_s"] = copy_bandwidth(device, torch.device("cuda", 1))
    result["used_memory_now"] = sampler.now()
    dist.barrier()
    dist.destroy_process_group()
    return result


def run(hf_dir: str, args) -> list[dict]:
    """Start one receiver per device and the two training ranks; return each rank's result."""
    from relax.platform import get_platform

    platform = get_platform(args.device)
    os.environ.update(platform.worker_env())
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    context = mp.get_context("spawn")
    receiver_conns, processes = [], []
    try:
        for index in range(WORLD_SIZE):
            parent, child = context.Pipe()
            proc = context.Process(target=_receiver_main, args=(platform.device_type, index, hf_dir, args.dtype, child))
            proc.start()
            receiver_conns.append(parent)
            processes.append(proc)
        for conn in receiver_conns:
            status, value = conn.recv()
            if status != "ok":
                raise RuntimeError(f"receiver failed to start:\n{value}")
        results = context.Queue()
        port = free_port()
        for rank in range(WORLD_SIZE):
            proc = context.Process(target=_rank_main, args=(rank, args, port, hf_dir, receiver_conns, results))
            proc.start()
            processes.append(proc)
        by_rank = {}
        deadline = time.monotonic() + args.timeout_s
        while len(by_rank) < WORLD_SIZE:
            rank, value = results.get(timeout=max(1.0, deadline - time.monotonic()))
            if "error" in value:
                raise RuntimeError(f"rank {rank} failed:\n{value['error']}")
            by_rank[rank] = value
        _ask(receiver_conns, "stop")
        return [by_rank[rank] for rank in range(WORLD_SIZE)]
    finally:
        for proc in processes:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
                proc.join()


def failed_checks(results: list[dict], group_timeout_minutes: int) -> list[str]:
    """The switch's checks that did not hold, one line each (empty: all held): process groups unusable asleep
    and usable awake with the actor's timeout, every optimizer step taken, and after the last push every
    receiver parameter equal to the actor's export."""
    failed = []
    timeout = str(datetime.timedelta(minutes=group_timeout_minutes))
    for rank, result in enumerate(results):
        checks = result["checks"]
        if checks["groups_usable_asleep"] or not checks["groups_usable_awake"]:
            failed.append(f"rank {rank}: process groups usable asleep: {checks['groups_usable_asleep']}, "
                          f"awake: {checks['groups_usable_awake']}")
        before, after = checks["timeouts"]
        if before != after or timeout not in before:
            failed.append(f"rank {rank}: group timeouts before sleep {before}, after wake {after}, not {timeout}")
        if not checks["weights_compared"] or checks["weights_mismatched"]:
            failed.append(f"rank {rank}: {checks['weights_compared']} receiver parameters compared, differing: "
                          f"{checks['weights_mismatched']}")
        if not all(metrics["update_successful"] for metrics in result["metrics"]):
            failed.append(f"rank {rank}: an optimizer step was skipped: {result['metrics']}")
    return failed


def summarize(results: list[dict], args) -> dict:
    """Means over the steps after the first (the first compiles and warms caches), and the ratios."""
    rank0 = results[0]
    steps = range(1, args.steps) if args.steps > 1 else range(args.steps)
    names = ["engine_release", "wake", "train", "engine_resume", "push", "sleep"]
    seconds = {
        name: sum(r["seconds"] for r in rank0["phases"] if r["phase"] == name and r["step"] in steps) / len(steps)
        for name in names
    }
    step_time = sum(seconds.values())
    switch = step_time - seconds["train"]
    push_rate = rank0["pushed_bytes"] / seconds["push"]
    summary = {
        "seconds": seconds,
        "step_time": step_time,
        "switch_share": switch / step_time,
        "pushed_gb": rank0["pushed_bytes"] / 1e9,
        "push_gb_per_s": push_rate / 1e9,
        "first_push_seconds": next(r["seconds"] for r in rank0["phases"] if r["phase"] == "push"),
        "push_breakdown_seconds": {  # means over the pushes after the first, as the phase times
            key: sum(rank0["push_breakdown"][step][key] for step in steps) / len(steps)
            for key in rank0["push_breakdown"][0]
        },
        "copy_gb_per_s": rank0["copy_bytes_per_s"] / 1e9,
        "push_over_copy": push_rate / rank0["copy_bytes_per_s"],
    }
    if "peer_copy_bytes_per_s" in rank0:
        summary["peer_copy_gb_per_s"] = rank0["peer_copy_bytes_per_s"] / 1e9
    if args.device == "cuda":
        peaks = {}
        for name in names:
            records = [(rank, r) for rank, res in enumerate(results) for r in res["phases"] if r["phase"] == name]
            peaks[name] = {
                "actor_peak_allocated_gb": max(r["actor_peak_allocated"] for _, r in records) / 1e9,
                "actor_allocated_after_gb": max(r["actor_allocated_after"] for _, r in records) / 1e9,
                "used_peak_gb_per_gpu": [
                    max((r["used_peak"] or 0) for rank, r in records if rank == gpu) / 1e9 for gpu in range(WORLD_SIZE)
                ],
                "receiver_peak_allocated_gb": [
                    max(r["receiver_memory"][gpu]["peak_allocated"] for rank, r in records if rank == 0) / 1e9
                    for gpu in range(WORLD_SIZE)
                ],
            }
        summary["memory"] = peaks
        summary["freed_by_sleep_gb"] = [
            min(r["freed_by_sleep"] for r in res["phases"] if "freed_by_sleep" in r) / 1e9 for res in results
        ]
        summary["state_gb"] = [res["checks"]["state_bytes"] / 1e9 for res in results]
    return summary


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--tp", type=int, choices=(1, 2), default=1, help="1: DP=2, 2: TP=2")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--samples-per-rank", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--group-timeout-minutes", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per training rank")
    parser.add_argument("--timeout-s", type=float, default=540)
    parser.add_argument("--hf-dir", help="use this HF checkpoint instead of writing a random one")
    parser.add_argument("--work-dir", default="/tmp/relax_weight_sync")
    parser.add_argument("--out", help="write the results as JSON here")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    hf_dir = args.hf_dir
    if hf_dir is None and (Path(args.work_dir) / args.size / "config.json").is_file():
        hf_dir = str(Path(args.work_dir) / args.size)  # written by an earlier run with the same --work-dir
    if hf_dir is None:
        start = time.perf_counter()
        out_dir = Path(args.work_dir) / args.size
        hf_dir = str(write_random_qwen3(out_dir, args.size, getattr(torch, args.dtype), args.device))
        print(f"wrote {args.size} checkpoint to {hf_dir} in {time.perf_counter() - start:.1f} s", flush=True)
    start = time.perf_counter()
    results = run(hf_dir, args)
    summary = summarize(results, args)
    layout = "TP=2" if args.tp == 2 else "DP=2"
    print(f"{args.device} {args.size} {args.dtype} {layout}: run {time.perf_counter() - start:.1f} s", flush=True)
    print(json.dumps({"summary": summary, "checks": [r["checks"] for r in results],
                      "metrics": results[0]["metrics"]}, indent=1, default=str))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "summary": summary, "results": results}, default=str))
    failed = failed_checks(results, args.group_timeout_minutes)
    print("checks: " + ("all held" if not failed else "FAILED\n" + "\n".join(failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
