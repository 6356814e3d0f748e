#!/usr/bin/env bash
# Load CANN's environment (toolkit, and the ATB library of NNAL where the image has it), then run the command.
set -eo pipefail
# shellcheck disable=SC1091
source /usr/local/Ascend/ascend-toolkit/set_env.sh
if [[ -f /usr/local/Ascend/nnal/atb/set_env.sh ]]; then
    # shellcheck disable=SC1091
    source /usr/local/Ascend/nnal/atb/set_env.sh
fi
exec "$@"
