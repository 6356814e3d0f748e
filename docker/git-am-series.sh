#!/usr/bin/env bash
# Apply relax's patch set for one upstream to a git checkout of it, in order, with `git am`.
#   git-am-series.sh <upstream> <checkout> [patches-dir]
# <upstream> names a directory of patches/ (see patches/manifest.toml). An empty set is a no-op.
set -euo pipefail
upstream="$1"
checkout="$2"
patches_dir="${3:-/opt/relax/patches}"

shopt -s nullglob
series=("$patches_dir/$upstream"/*.patch)
if ((${#series[@]} == 0)); then
    echo "git-am-series: no patches for $upstream"
    exit 0
fi
git -C "$checkout" -c user.name="relax image build" -c user.email=build@relax.invalid am "${series[@]}"
echo "git-am-series: applied ${#series[@]} patch(es) to $upstream"
