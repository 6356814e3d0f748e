#!/bin/bash
# Builds the GPU verification bundle: .gpu-bundle/site.tar.xz, carried to the lent H200 (device tool, `carry`)
# and unpacked there by tests/gpu/bundle/enter.sh. Verification only: users install relax's CUDA stack with
# `pip install .[cuda]` (the real sglang-kernel, flashinfer, ...), see docs/gpu-verification.md.
#
# What it holds (cp312 wheels for the device's Python 3.12; the device image already has torch 2.11, triton,
# numpy, safetensors, tokenizers, aiohttp, grpcio, ...): SGLang and the light packages its engine imports, Ray
# without its libraries (data, train, tune, serve, rllib, llm, the dashboard's web client, jars), megatron-core and
# torch_memory_saver. Compiled parts nothing on this path loads are dropped to fit the device's 64 MiB carry:
# SGLang's Rust extensions (the gRPC/HTTP servers, the Rust radix tree; enter.sh selects SGLang's Python tree) and
# its diffusion package. The stand-ins (tests/gpu/bundle/standin) travel with the repository, not in the bundle.
#
#   bash tests/gpu/bundle/build.sh            # downloads into ~/.cache/relax-gpu-wheels, writes .gpu-bundle/
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
PIN() { python3 "$ROOT/relax/pins.py" "$1"; }
WHEELS=${RELAX_GPU_WHEELS:-$HOME/.cache/relax-gpu-wheels}
OUT_DIR=$ROOT/.gpu-bundle
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT

PACKAGES=(
  "sglang==$(PIN sglang)" "transformers==$(PIN transformers)" "ray==$(PIN ray)" "megatron-core==$(PIN megatron_core)"
  "torch-memory-saver==$(PIN torch_memory_saver)"
  apache-tvm-ffi==0.1.11 xgrammar==0.2.7 compressed-tensors==0.18.0 openai==2.8.0 jiter==0.19.0 distro==1.9.0
  sniffio==1.3.1 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0 fastapi==0.165.0 starlette==1.10.0 opentelemetry-api==1.45.2 uvicorn==0.54.0
  python-multipart==0.0.34 orjson==3.13.0 pybase64==1.5.1 msgspec==0.23.0 pyzmq==27.3.0 setproctitle==1.3.8
  partial-json-parser==0.2.1.1.post7 interegular==0.3.3 gguf==0.19.0 loguru==0.7.3 zstandard==0.25.0 dill==0.4.1
  ipython==9.18.1 ipython-pygments-lexers==1.1.1 jedi==0.20.1 parso==0.8.7 matplotlib-inline==0.2.2 pexpect==4.9.0
  ptyprocess==0.7.0 prompt-toolkit==3.0.53 wcwidth==0.9.4 stack-data==0.6.3 asttokens==3.0.2 executing==2.3.0
  pure-eval==0.2.4 traitlets==5.16.1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
  rpds-py==2026.9.1 pytest-xdist==3.8.0 execnet==2.1.2
)
PLATFORMS=()
for tag in manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux_2_35; do
  PLATFORMS+=(--platform "${tag}_x86_64")
done
mkdir -p "$WHEELS"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 "${PLATFORMS[@]}" -d "$WHEELS" "${PACKAGES[@]}"

# A wheel's file name spells the project name with underscores, in any case (PEP 427).
for package in "${PACKAGES[@]}"; do
  name=$(echo "${package%%==*}" | tr - _); version=${package#*==}
  wheel=$(find "$WHEELS" -maxdepth 1 -iname "${name}-${version}-*.whl" | head -1)
  [ -n "$wheel" ] || { echo "no wheel for $package in $WHEELS" >&2; exit 1; }
  unzip -q -o "$wheel" -d "$STAGE"  # keeps the executable bits (Ray's raylet and gcs_server)
done

# Not loaded on the verified path (see the header); each is a large compiled or data-heavy part.
rm -rf "$STAGE"/sglang/multimodal_gen "$STAGE"/sglang/srt/rust_extensions/*.so "$STAGE"/sglang/srt/mem_cache/rust_tree_core/*.so
rm -rf "$STAGE"/ray/{data,train,tune,serve,rllib,llm,jars,air} "$STAGE"/ray/dashboard/client
find "$STAGE" -name __pycache__ -prune -exec rm -rf {} +

mkdir -p "$OUT_DIR"
tar -C "$STAGE" -cf - . | xz -9 -T0 > "$OUT_DIR/site.tar.xz"
echo "$OUT_DIR/site.tar.xz: $(du -m "$OUT_DIR/site.tar.xz" | cut -f1) MiB"
