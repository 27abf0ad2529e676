#!/usr/bin/env bash
# Build the GPU host's bundle for this project (the shared recipe's bundle.sh beside the
# checkout, plus the extras the GPU scripts use: msgpack for Serve's gRPC path, py-spy for
# PROFILE_S) and cut it into parts small enough for one `run` call each: with the checkout, a
# part must stay under the 64 MiB a call carries, and the recipe's 58 MB parts did not.
# usage: bench/gpu_bundle.sh [RECIPE_DIR]   (default: ../shared/gpu beside the checkout)
# Then ship .gpu-carry/c0 .. cN, one `run` per part (`mkdir -p ~/dl && cp .gpu-carry/cK/* ~/dl/`),
# the last one going on with `bench/gpu_host.sh unpack ...`.
set -euo pipefail
repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
recipe=${1:-$repo/../shared/gpu}
PART_MB=${PART_MB:-47}
"$recipe/bundle.sh" msgpack==1.2.4 py-spy==0.4.3
cd "$repo/.gpu-carry"
whole=$(mktemp)
cat c*/part.* > "$whole"
rm -rf c*
split -b "${PART_MB}M" -d -a 1 "$whole" part.
rm -f "$whole"
n=0
for f in part.*; do mkdir -p "c$n"; mv "$f" "c$n/"; n=$((n + 1)); done
echo "bundle in $n parts of at most ${PART_MB} MB: .gpu-carry/c0 .. c$((n - 1))"
