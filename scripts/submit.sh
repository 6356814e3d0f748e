#!/usr/bin/env bash
# Submit a run to a Ray cluster as a job whose driver and actors get this shell's worker environment:
#   export HCCL_CONNECT_TIMEOUT=1200 SGLANG_...=...       # forwarded as they are (see relax submit --help)
#   scripts/submit.sh --address http://HEAD:8265 [--env NAME[=VALUE]] [--working-dir .] -- bash scripts/run-X.sh
# Waits for the job, streams its logs, and exits with the job's status.
#   RELAX_PYTHON  the interpreter relax is installed in (default: python3)
set -euo pipefail
exec "${RELAX_PYTHON:-python3}" -m relax.cli submit "$@"
