# shellcheck shell=bash
# Sourced by scripts/run-*.sh: the one way they start `relax train`.
#   RELAX_PYTHON   interpreter relax is installed in (default: python3; .venv/bin/python in a checkout)
#   RELAX_DRY_RUN  1: append --dry-run, so relax validates every flag, prints the resolved relax, SGLang
#                  and Megatron settings, and exits without touching a device (tests run every script so)

relax_train() {
    local python="${RELAX_PYTHON:-python3}"
    if [[ "${RELAX_DRY_RUN:-0}" == "1" ]]; then
        exec "$python" -m relax.cli train "$@" --dry-run
    fi
    exec "$python" -m relax.cli train "$@"
}
