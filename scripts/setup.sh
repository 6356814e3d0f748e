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
"${pip[@]}" install --quiet --no-compile -e ".[cpu,test]"
"${pip[@]}" install --quiet --no-compile --no-deps "sglang==$("$venv/bin/python" relax/pins.py sglang)"
# The bytecode pip would write one file after another, on every core at once (77 s -> 63 s on 2 cores); a few
# files some packages ship are not Python 3 and fail to compile, as they do under pip's own compile step.
site_packages="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$venv/bin/python" -m compileall -q -j 0 "$site_packages" >/dev/null || true
echo "$want" > "$stamp"
echo "relax environment ready in $venv"
