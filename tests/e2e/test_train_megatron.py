"""HF <-> Megatron model families on real megatron-core (local spec, CPU, fp32) against HF transformers.

Every Megatron case runs on two spawned ranks sharing one gloo group (built once for the module):
TP=1 runs as two data-parallel replicas, TP=2 and EP=2 split the model across the two ranks.
"""

import json
import os
import socket
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from relax.tiny_model import build_tiny_model
from relax.train.model import family_of, read_hf_config

WORLD_SIZE = 2
TASK_TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, conn) -> None:
    torch.set_num_threads(1)
    from relax.platform import get_platform

    get_platform("cpu").prepare_megatron()
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE
    )
    from megatron.core import parallel_state

    while (task := conn.recv()) is not None:
        fn, args = task
        try:
            conn.send(("ok", fn(*args)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
        finally:
            parallel_state.destroy_model_parallel()


class Ranks:
    """Two spawned processes in one gloo group; `run(fn, *args)` calls fn on both and returns both results."""

    def __init__(self):
        context = mp.get_context("spawn")
        port = _free_port()
        self.conns, self.procs = [], []
        for rank in range(WORLD_SIZE):
            parent, child = context.Pipe()
            proc = context.Process(target=_rank_main, args=(rank, port, child), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(self, fn, *args):
        for conn in self.conns:
            conn.send((fn, args))
        results = []
        for rank, conn in enumerate(self.conns):
            if not conn.poll(TASK_TIMEOUT_S):
                self.close()
                raise TimeoutError(f"rank {rank} did not finish {fn.__name__} in {TASK_TIMEOUT_S} s")
            status, value = conn.recv()
            if status == "error":
                raise AssertionError(f"rank {rank} failed in {fn.__name__}:\n{value}")
            results.append(value)
        return results

    def close(self):
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():
                try:
                    conn.send(None)
                except OSError:
                    pass
                proc.join(10)
            if proc.is_alive():
                proc.kill()


@pytest.fixture(scope="module")
def ranks():
    pool = Ranks()
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    return {family: str(build_tiny_model(tmp_path_factory.mktemp(family), family)) for family in ("qwen2", "qwen3", "qwen3_moe")}


def _megatron_model(hf_dir: str, tp: int, ep: int = 1):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from relax.train.model import build_gpt_model, load_hf_weights, transformer_config

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(0)
    hf = read_hf_config(hf_dir)
    config = transformer_config(
        hf,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        sequence_parallel=tp > 1 and ep > 1,
        use_cpu_initialization=True,
        perform_initialization=False,
    )
    model = build_gpt_model(hf, config)
    load_hf_weights(model, hf_dir)
    return model.eval(), hf


def _parity(hf_dir: str, tp: int, ep: int) -> dict:
    """Max |logits - HF logits| and whether the exported weights equal the checkpoint's, on this rank."""
    import transformers
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from safetensors.torch import load_file

    from relax.train.model import export_hf_weights

    model, hf = _megatron_model(hf_dir, tp, ep)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, hf["vocab_size"], (2, 13), generator=generator)
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
    "family, tp, ep",
    [("qwen3", 1, 1), ("qwen3", 2, 1), ("qwen3_moe", 1, 1), ("qwen3_moe", 2, 1), ("qwen3_moe", 1, 2), ("qwen2", 2, 1)],
)
def test_logits_equal_hf_and_export_is_exact(ranks, hf_dirs, family, tp, ep):
    for rank, result in enumerate(ranks.run(_parity, hf_dirs[family], tp, ep)):
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
    (bad_dir / "config.json").write_text(json.dumps(read_hf_config(hf_dirs["qwen3"])))
    name = "model.layers.1.self_attn.k_proj.weight"
    save_file({**tensors, name: torch.zeros(16, 64)}, bad_dir / "model.safetensors")
    message = ranks.run(_load_error, str(bad_dir))[0]
    assert name in message and "[16, 64]" in message and "[32, 64]" in message, message

    del tensors["model.norm.weight"]
    save_file(tensors, bad_dir / "model.safetensors")
    message = ranks.run(_load_error, str(bad_dir))[0]
    assert "model.norm.weight" in message and "missing" in message, message


def test_unsupported_architecture_lists_supported_ones():
    with pytest.raises(ValueError, match=r"qwen2.*qwen3.*qwen3_moe"):
        family_of({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
