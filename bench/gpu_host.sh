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
# A stack cut off by a time limit runs on in its own session: its driver, Ray's processes, the
# engine core and HAProxy all go (`ray stop` alone left one answering on port 8000).
pkill -9 -f "serve_app.cli (run|vllm)" 2>/dev/null
pkill -9 -f "ray::|raylet|gcs_server|EngineCore|VLLM::" 2>/dev/null
pids=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)
[ -n "$pids" ] && kill -9 $pids 2>/dev/null
pkill -9 -f haproxy 2>/dev/null
command -v fuser > /dev/null && fuser -k -9 8000/tcp 8100/tcp 8404/tcp 9101/tcp > /dev/null 2>&1
sleep 1
if [ $# -gt 0 ]; then exec "$@"; fi
