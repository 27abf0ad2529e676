#!/usr/bin/env bash
# Run one command on the lent GPU host: free what an earlier command left behind (Ray, vLLM
# engine cores holding the GPU, HAProxy holding ports 8000/8404/9101 after a command was cut off
# by its time limit), set the environment of the host recipe (the bundle unpacked in ~/site),
# then run "$@".
# usage: bench/gpu_host.sh [unpack] COMMAND [ARGS...]
#   unpack: first assemble the bundle parts copied to ~/dl into ~/site (the last shipping call)
set -uo pipefail
export PYTHONPATH=~/site:$PWD PATH=~/site/bin:$PATH PYTHONUNBUFFERED=1
if [ "${1:-}" = unpack ]; then
  shift
  mkdir -p ~/site && cat ~/dl/part.* | xz -d -T8 | tar x -C ~/site || exit 1
  echo "bundle unpacked"
fi
ray stop --force > /dev/null 2>&1
pids=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)
[ -n "$pids" ] && kill -9 $pids 2>/dev/null
pkill -9 -f haproxy 2>/dev/null
sleep 1
if [ $# -gt 0 ]; then exec "$@"; fi
