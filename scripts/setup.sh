#!/usr/bin/env bash
# Create (or refresh) the virtual environment with relax and the CPU stack: torch (CPU build), sglang
# without its CUDA-pinned dependencies, megatron-core, ray[default], transformers. Needs only Python 3.11.
# Idempotent: when relax/pins.py and setup.py are unchanged since the last success it returns at once.
#   RELAX_VENV  where the environment lives (default: .venv in the repository)
#   PYTHON      the interpreter that creates it (default: python3.11)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv="${RELAX_VENV:-.venv}"
python="${PYTHON:-python3.11}"

stamp="$venv/.relax-setup-stamp"
want="$(cat relax/pins.py setup.py | sha256sum | cut -d' ' -f1)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    exit 0
fi

[[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install --quiet --upgrade pip
# relax itself (editable) with the CPU stack and test tools, then sglang on its own without its deps.
"${pip[@]}" install --quiet -e ".[cpu,test]"
"${pip[@]}" install --quiet --no-deps "sglang==$("$venv/bin/python" relax/pins.py sglang)"
echo "$want" > "$stamp"
echo "relax environment ready in $venv"
