"""The sglang patch set does what its messages say, run against SGLang 0.5.23's own code on the CPU.

A copy of the installed sglang (symbolic links, with the files the set touches copied for real) is
patched with `relax patches apply`; a subprocess imports it ahead of site-packages. The unpatched release
runs the same check to show the reason for the patch.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from relax.tools import patches

REPO = Path(__file__).resolve().parents[2]

CHECK = textwrap.dedent(
    """
    import os, sys, types
    from types import SimpleNamespace

    from relax.platform import get_platform

    get_platform("cpu").prepare_sglang()
    import torch
    from sglang.srt.model_executor.model_runner_components import weight_updater as wu

    assert wu.__file__.startswith(sys.argv[1]), wu.__file__
    # SGLang's runtime context, normally set up by its scheduler: no weight cache, one TP rank.
    wu.get_model = lambda: SimpleNamespace(weight_cache_mode="off")
    wu.get_parallel = lambda: SimpleNamespace(tp_rank=0)


    class GatedDeltaNetLike(torch.nn.Module):
        # what the Ascend GDN backend reads: conv1d.weight [dim, 1, width] and its [dim, width] view
        def __init__(self):
            super().__init__()
            self.conv1d = torch.nn.Module()
            self.conv1d.weight = torch.nn.Parameter(torch.randn(8, 1, 4), requires_grad=False)
            self.conv_weights = self.conv1d.weight.view(8, 4)


    model = torch.nn.Module()
    model.layer = GatedDeltaNetLike()
    # the copy ascend_gdn_backend._get_conv_weights_t caches on the layer at the first forward
    model.layer._conv_weights_t = model.layer.conv_weights.transpose(0, 1).contiguous()
    cached_ptr = model.layer._conv_weights_t.data_ptr()
    updater = wu.WeightUpdater(
        tp_rank=0, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders={}, get_model=lambda: model,
        update_model_fields=None, recapture_cuda_graph=None, get_model_runner=None,
    )
    new = torch.randn(8, 1, 4)
    ok, message = updater.update_weights_from_tensor([("layer.conv1d.weight", new)], load_format="direct")
    assert ok, message
    assert torch.equal(model.layer.conv1d.weight, new), "the weight itself was not loaded"
    print("CONV_CACHE_FRESH", torch.equal(model.layer._conv_weights_t, new.view(8, 4).t()))
    print("CONV_CACHE_SAME_STORAGE", model.layer._conv_weights_t.data_ptr() == cached_ptr)

    # init_npu_backend's two torch_npu settings, with a stand-in torch_npu that records them
    seen = {}
    torch_npu = types.ModuleType("torch_npu")
    torch_npu.npu = SimpleNamespace(
        config=SimpleNamespace(), set_compile_mode=lambda jit_compile: seen.update(jit=jit_compile)
    )
    sys.modules.update({"torch_npu": torch_npu, "torch_npu.contrib": types.ModuleType("torch_npu.contrib"),
                        "torch_npu.contrib.transfer_to_npu": types.ModuleType("torch_npu.contrib.transfer_to_npu")})
    from sglang.srt.hardware_backend.npu import utils as npu_utils

    npu_utils._is_npu = True
    for env in ({}, {"SGLANG_NPU_ALLOW_INTERNAL_FORMAT": "0", "SGLANG_NPU_JIT_COMPILE": "1"}):
        os.environ.update(env)
        npu_utils.init_npu_backend.__wrapped__()
        print("NPU_SWITCHES", sorted(env.items()), torch_npu.npu.config.allow_internal_format, seen["jit"])
    """
)


def _link_copy_of_installed_sglang(root: Path) -> Path:
    installed = Path(importlib.util.find_spec("sglang").origin).parent
    subprocess.run(["cp", "-as", str(installed), str(root / "sglang")], check=True)
    return root


def _run_check(root: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "check_sglang_patches.py"
    script.write_text(CHECK)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_NPU_") and k != "RELAX_DEVICE"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(REPO)])
    return subprocess.run(
        [sys.executable, str(script), str(root)], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.fixture(scope="module")
def patched_root(tmp_path_factory):
    """A copy of the installed sglang (links, touched files real) with the whole set applied."""
    upstream = patches.load_manifest()["sglang"]
    root = _link_copy_of_installed_sglang(tmp_path_factory.mktemp("site"))
    for patch in upstream.series:  # git apply writes files, not through links: make the touched ones real
        for hunk in patches.parse_hunks(patch.read_text()):
            target = root / Path(*Path(hunk.path).parts[upstream.strip - 1 :])
            if target.is_symlink():
                source = target.resolve()
                target.unlink()
                shutil.copy2(source, target)
    patches.apply(upstream, root)
    assert set(patches.patch_states(upstream, root).values()) == {"applied"}
    return root


@pytest.fixture(scope="module")
def patched(patched_root, tmp_path_factory):
    done = _run_check(patched_root, tmp_path_factory.mktemp("run"))
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_conv_weight_copy_is_refreshed_in_place_after_update_weights_from_tensor(patched):
    assert "CONV_CACHE_FRESH True" in patched
    assert "CONV_CACHE_SAME_STORAGE True" in patched  # captured NPU graphs keep seeing it


def test_npu_switches_default_to_todays_behaviour_and_follow_the_variables(patched):
    assert "NPU_SWITCHES [] True False" in patched
    assert (
        "NPU_SWITCHES [('SGLANG_NPU_ALLOW_INTERNAL_FORMAT', '0'), ('SGLANG_NPU_JIT_COMPILE', '1')] False True"
        in patched
    )


def test_the_unpatched_release_serves_a_stale_conv_weight(tmp_path):
    site_packages = Path(importlib.util.find_spec("sglang").origin).parents[1]
    done = _run_check(site_packages, tmp_path)
    assert "CONV_CACHE_FRESH False" in done.stdout, done.stdout + done.stderr[-3000:]


# 0004: SGLANG_RELAX_FUSED_GDN_DECODE routes Qwen3.5 GDN decode to relax's fused Triton kernel (TRITON_INTERPRET on
# the CPU). Two engines of the patched copy in one interpreter, the switch off then on: each engine's scheduler is a
# new process that reads the switch when it imports the model.
FUSED_DECODE_MARK = "relax fused GDN decode serves Qwen3.5 GDN decode steps"
GENERATE_WITH_SWITCH = textwrap.dedent(
    """
    import json, os, sys
    from relax.platform import get_platform

    root, model_dir, prompts, new_tokens = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
    platform = get_platform("cpu")
    platform.prepare_sglang()
    import sglang

    assert sglang.__file__.startswith(root), sglang.__file__
    results = {}
    for switch in ("0", "1"):
        os.environ["SGLANG_RELAX_FUSED_GDN_DECODE"] = switch
        print(f"ENGINE switch={switch}", file=sys.stderr, flush=True)
        engine = sglang.Engine(model_path=model_dir, log_level="info", **platform.sglang_server_defaults)
        try:
            out = engine.generate(
                input_ids=prompts, return_logprob=True,
                sampling_params={"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True},
            )
        finally:
            engine.shutdown()
        results[switch] = [
            {"ids": r["output_ids"], "logprobs": [lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]]}
            for r in out
        ]
    print(json.dumps(results))
    """
)


@pytest.mark.long  # two engines with the interpreted kernel (pytest.ini: not in CI's run)
def test_fused_gdn_decode_switch_generates_like_the_default_path_and_hf(patched_root, tmp_path):
    from test_qwen35_sglang import NEW_TOKENS, PROMPTS, _assert_same_generation, _hf_greedy

    from relax.tools.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "qwen3_5", family="qwen3_5", seed=0)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_") and k != "RELAX_DEVICE"}
    env.update(PYTHONPATH=os.pathsep.join([str(patched_root), str(REPO)]), TRITON_INTERPRET="1",
               SGLANG_MAMBA_CONV_DTYPE="float32")  # float32 conv state: logprobs comparable with HF's at 1e-4
    run = subprocess.run(
        [sys.executable, "-c", GENERATE_WITH_SWITCH, str(patched_root), str(model_dir), json.dumps(PROMPTS),
         str(NEW_TOKENS)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-6000:]
    off_log, _, on_log = run.stderr.partition("ENGINE switch=1")
    # the switch reached the kernel only when on, and no decode batch fell back to SGLang's path
    assert FUSED_DECODE_MARK not in off_log, "the fused decode ran with the switch off"
    assert FUSED_DECODE_MARK in on_log, f"the fused decode never ran with the switch on:\n{on_log[-3000:]}"
    fallbacks = [line for line in on_log.splitlines() if "SGLang's own decode path runs instead" in line]
    assert not fallbacks, f"decode batches fell back to SGLang's path: {fallbacks}"
    results = json.loads(run.stdout.strip().splitlines()[-1])
    hf = _hf_greedy(model_dir)
    _assert_same_generation(results["0"], hf, "switch off")
    _assert_same_generation(results["1"], hf, "switch on (relax's fused decode)")
    for prompt, off, on in zip(PROMPTS, results["0"], results["1"]):
        assert on["ids"] == off["ids"], f"{len(prompt)}-token prompt: switch on {on['ids']}, off {off['ids']}"
        diff = max(abs(a - b) for a, b in zip(on["logprobs"], off["logprobs"]))
        assert diff <= 1e-4, f"{len(prompt)}-token prompt: logprobs with the switch on and off differ by {diff:.2e}"


# Runs the prelude above it once, then the case code in one child forked per case (argv[3]: a JSON list of
# {"env": {variable: value}, "args": [...]}: the variables set, and `case` for the code), each child's stdout and
# stderr in files under argv[2]; prints the children's exit statuses. argv[1] is `root` for both codes.
FORK_PER_CASE = textwrap.dedent(
    """
    statuses = []
    for index, case in enumerate(json.loads(sys.argv[3])):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            for fd, name in ((1, "stdout"), (2, "stderr")):
                os.dup2(os.open(os.path.join(sys.argv[2], f"{index}.{name}"), os.O_WRONLY | os.O_CREAT), fd)
            try:
                os.environ.update(case["env"])
                run_case(case["args"])
                code = 0
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        statuses.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    print(json.dumps(statuses))
    """
)


def _run_forked_cases(prelude: str, case_code: str, cases: list[tuple[dict, list]], root: Path, out: Path,
                      env: dict) -> list[tuple[int, str, str]]:
    """Per case (variables to set, args): the exit status, stdout and stderr of `case_code` (a function body of
    `args`) run in a child forked from one interpreter that ran `prelude` (`root` in scope) with `env`. The prelude
    imports what the cases share: each case runs afresh on it, without the fresh interpreter's imports of SGLang
    (about 8 CPU-seconds a case)."""
    script = "\n".join([
        "import json, os, sys", "root = sys.argv[1]", prelude,
        "def run_case(args):", textwrap.indent(case_code, "    "), FORK_PER_CASE,
    ])
    cases_json = json.dumps([{"env": variables, "args": args} for variables, args in cases])
    run = subprocess.run([sys.executable, "-c", script, str(root), str(out), cases_json],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    statuses = json.loads(run.stdout.strip().splitlines()[-1])
    return [(status, (out / f"{index}.stdout").read_text(), (out / f"{index}.stderr").read_text())
            for index, status in enumerate(statuses)]


def _env_without_sglang_switches(patched_root: Path) -> dict:
    """This process's environment without SGLang's variables and RELAX_DEVICE, the patched copy first on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_") and k != "RELAX_DEVICE"}
    env["PYTHONPATH"] = os.pathsep.join([str(patched_root), str(REPO)])
    return env


# SGLANG_RELAX_FUSED_GDN_DECODE's cases: (switch: None leaves it unset, relax's glue module importable or blocked,
# the hook the patched qwen3_5 module then holds).
SWITCH_CASES = [
    (None, "importable", "HOOK None"),  # unset: off
    ("0", "importable", "HOOK None"),
    ("1", "importable", "HOOK relax.rollout.sglang_gdn_decode.qwen3_5_decode"),
    ("1", "blocked", "HOOK None"),
]

# What qwen3_5 imports, but neither qwen3_5 nor relax's glue module: each case's import of qwen3_5 runs its code
# afresh under the case's switch.
BEFORE_QWEN3_5 = textwrap.dedent(
    """
    import logging
    from relax.platform import get_platform

    get_platform("cpu").prepare_sglang()
    logging.basicConfig(level=logging.WARNING)
    from sglang.srt.models import qwen2_moe, qwen3_vl  # noqa: F401  (most of what qwen3_5 imports)

    assert "sglang.srt.models.qwen3_5" not in sys.modules and "relax.rollout.sglang_gdn_decode" not in sys.modules
    """
)
IMPORT_QWEN3_5 = textwrap.dedent(
    """
    (relax_glue,) = args
    if relax_glue == "blocked":
        sys.modules["relax.rollout.sglang_gdn_decode"] = None  # import raises ImportError: relax is not there
    from sglang.srt.models import qwen3_5

    assert qwen3_5.__file__.startswith(root), qwen3_5.__file__
    hook = qwen3_5._relax_gdn_decode
    print("HOOK", None if hook is None else f"{hook.__module__}.{hook.__name__}")
    """
)


@pytest.fixture(scope="module")
def switch_imports(patched_root, tmp_path_factory) -> list[tuple[int, str, str]]:
    """Per SWITCH_CASES entry: the exit status, stdout and stderr of its import of the patched qwen3_5 module."""
    cases = [({} if switch is None else {"SGLANG_RELAX_FUSED_GDN_DECODE": switch}, [relax_glue])
             for switch, relax_glue, _ in SWITCH_CASES]
    return _run_forked_cases(BEFORE_QWEN3_5, IMPORT_QWEN3_5, cases, patched_root,
                             tmp_path_factory.mktemp("switch_imports"), _env_without_sglang_switches(patched_root))


@pytest.mark.parametrize("case", range(len(SWITCH_CASES)), ids=["-".join(map(str, c)) for c in SWITCH_CASES])
def test_fused_gdn_decode_switch_is_off_by_default_and_falls_back_without_relax(switch_imports, case):
    _, relax_glue, expected = SWITCH_CASES[case]
    returncode, stdout, stderr = switch_imports[case]
    assert returncode == 0, stderr[-4000:]
    assert expected in stdout.splitlines(), stdout
    # without relax the model says so once, and SGLang's own decode path stays in place
    assert ("relax is not importable" in stderr) == (relax_glue == "blocked"), stderr[-3000:]


# SGLang's patched NPU top-k with relax's routing kernel in place of sgl_kernel_npu's; the switch is read per call.
BEFORE_NPU_TOPK = textwrap.dedent(
    """
    import types

    from relax.platform import get_platform

    get_platform("cpu").prepare_sglang()
    import torch

    import relax.kernels.sgl_kernel_npu as relax_npu_kernels
    from relax.kernels.sgl_kernel_npu import moe_routing
    from relax.kernels.moe_reference import route_topk

    # sgl_kernel_npu as relax's patches leave it: its relax/ package is relax's own source (the same bytes); the NPU's
    # vector-core count, the one thing the CPU lacks, is 2 programs here.
    calls = []
    real_fused_topk = moe_routing.fused_topk
    moe_routing.grid_size = lambda items, device, num_programs: min(items, 2)
    def counted(*args, **kwargs):
        calls.append(args[1:])
        return real_fused_topk(*args, **kwargs)
    moe_routing.fused_topk = counted
    sys.modules.update({"sgl_kernel_npu": types.ModuleType("sgl_kernel_npu"), "sgl_kernel_npu.relax": relax_npu_kernels,
                        "sgl_kernel_npu.relax.moe_routing": moe_routing})
    from sglang.srt.hardware_backend.npu.moe import topk as npu_topk
    from sglang.srt.layers.moe.topk import TopKConfig

    assert npu_topk.__file__.startswith(root), npu_topk.__file__
    # SGLang's grouped top-k is torch.compile'd: compiled here once for the forked cases, which each run it again
    grouped = TopKConfig(top_k=2, use_grouped_topk=True, topk_group=1, num_expert_group=2)
    npu_topk.fused_topk_npu(hidden_states=torch.zeros(5, 4), router_logits=torch.randn(5, 12), topk_config=grouped)
    assert calls == [], calls  # grouped routing never reaches relax's kernel (ROUTE_NPU_TOPK checks it per case)
    """
)
ROUTE_NPU_TOPK = textwrap.dedent(
    """
    logits = torch.randn(5, 12, generator=torch.Generator().manual_seed(0))
    for scoring_func, renormalize in (("softmax", True), ("sigmoid", False)):
        config = TopKConfig(top_k=3, renormalize=renormalize, scoring_func=scoring_func)
        try:
            out = npu_topk.fused_topk_npu(hidden_states=torch.zeros(5, 4), router_logits=logits, topk_config=config)
        except (AttributeError, RuntimeError) as error:  # SGLang's own path: torch_npu's ops, absent on the CPU
            print("NOT_SERVED", scoring_func, type(error).__name__)
            continue
        weights, ids = route_topk(logits, 3, scoring_func, renormalize)
        torch.testing.assert_close(out.topk_weights, weights)
        assert torch.equal(out.topk_ids.long(), ids)
        print("SERVED", scoring_func, renormalize, out.topk_ids.dtype)
    # grouped routing (BEFORE_NPU_TOPK's config) is never relax's: SGLang's torch-native grouped top-k serves it
    npu_topk.fused_topk_npu(hidden_states=torch.zeros(5, 4), router_logits=logits, topk_config=grouped)
    print("CALLS", calls)
    """
)
MOE_TOPK_CASES = [
    ("1", ["SERVED softmax True torch.int32", "SERVED sigmoid False torch.int32",
           "CALLS [(3, 'softmax', True), (3, 'sigmoid', False)]"]),
    (None, ["NOT_SERVED softmax AttributeError", "NOT_SERVED sigmoid AttributeError", "CALLS []"]),
]


@pytest.fixture(scope="module")
def moe_topk_routes(patched_root, tmp_path_factory) -> list[tuple[int, str, str]]:
    """Per MOE_TOPK_CASES entry: the exit status, stdout and stderr of ROUTE_NPU_TOPK under its switch."""
    cases = [({} if switch is None else {"SGLANG_RELAX_FUSED_MOE_TOPK": switch}, []) for switch, _ in MOE_TOPK_CASES]
    env = {**_env_without_sglang_switches(patched_root), "TRITON_INTERPRET": "1"}
    return _run_forked_cases(BEFORE_NPU_TOPK, ROUTE_NPU_TOPK, cases, patched_root,
                             tmp_path_factory.mktemp("moe_topk_routes"), env)


@pytest.mark.parametrize("case", range(len(MOE_TOPK_CASES)), ids=[str(switch) for switch, _ in MOE_TOPK_CASES])
def test_fused_moe_topk_switch_routes_plain_layers_through_relax_kernel(moe_topk_routes, case):
    """SGLang's patched NPU top-k with relax's routing kernel under TRITON_INTERPRET=1: switched on, plain routing
    gets the reference's weights and ids from it and grouped routing does not reach it; off, SGLang's own path
    (torch_npu's ops) runs."""
    _, expected = MOE_TOPK_CASES[case]
    returncode, stdout, stderr = moe_topk_routes[case]
    assert returncode == 0, stderr[-4000:]
    assert [line for line in stdout.splitlines() if line.split()[0] in ("SERVED", "NOT_SERVED", "CALLS")] \
        == expected, stdout
