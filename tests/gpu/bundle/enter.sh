# shellcheck shell=bash
# Sourced on the lent GPU machine from the repository root, after build.sh's .gpu-bundle/ was carried there:
# unpacks the bundle (once per machine) and sets the variables the verified path needs. Verification only.
#   source tests/gpu/bundle/enter.sh && python3 -m pytest -q tests/gpu/test_colocated_step_gpu.py
RELAX_GPU_SITE=/tmp/relax-gpu-site
mkdir -p "$RELAX_GPU_SITE"
for archive in .gpu-bundle/*.tar.xz; do  # build.sh writes site.tar.xz; later additions sit beside it
    marker="$RELAX_GPU_SITE/.unpacked-$(basename "$archive")"
    [ -f "$marker" ] && continue
    xz -T0 -dc "$archive" | tar -C "$RELAX_GPU_SITE" -xf - && touch "$marker" \
        || { echo "enter.sh: could not unpack $archive" >&2; return 1; }
done
# relax's patch sets on the unpacked SGLang and megatron-core, as a user's `relax patches apply` does (needs git).
if [ ! -f "$RELAX_GPU_SITE/.patched" ]; then
    PYTHONPATH="$RELAX_GPU_SITE:$PWD" python3 -m relax.cli patches apply sglang megatron-core \
        && touch "$RELAX_GPU_SITE/.patched" || { echo "enter.sh: relax patches apply failed" >&2; return 1; }
fi
# The stand-ins first (they replace sgl_kernel and cutlass), then the bundle, then this repository.
export PYTHONPATH="$PWD/tests/gpu/bundle/standin:$RELAX_GPU_SITE:$PWD"
# NVLink multicast stays off on the lent machines (a program that uses it can take the host's GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# One GPU: its tests one after another, not in pytest.ini's lanes.
export PYTEST_ADDOPTS="-n 0"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
# The stand-in is not the sglang-kernel version SGLang checks for.
export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
# SGLang's Rust radix tree is dropped from the bundle (and the wheel's build links libtorch 2.14.1, which misreads
# dtypes under the device's torch 2.11): its Python tree core instead.
export SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python
# SGLang's fused ops in torch rather than its JIT kernels, which nvcc would compile on first use (7-11 s each).
export SGLANG_FORCE_FUSED_OP_BACKEND=torch
