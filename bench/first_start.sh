#!/usr/bin/env bash
# How long a new user waits: a fresh clone of this checkout, an empty home folder (no pip cache,
# no kernel cache), `make serve`, until the first /v1/completions answers. Each line of make's
# output is printed with the seconds since the start (docs/quickstart.md's table).
#   bench/first_start.sh [WORK_DIR] [PORT]
set -u
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-/tmp/tierserve-first-start}
port=${2:-8123}
rm -rf "$work"; mkdir -p "$work/home"
git clone -q "$repo" "$work/clone" && cd "$work/clone" || exit 1
start=$(date +%s.%N)
since() { echo "$(date +%s.%N) - $start" | bc; }
( HOME="$work/home" make serve PORT="$port" 2>&1 | while IFS= read -r line; do
    printf '%7.1f %s\n' "$(since)" "$line"; done ) &
body='{"model":"smollm2-135m","prompt":"The capital of France is","max_tokens":8,"temperature":0}'
until curl -sf -m 60 "localhost:$port/v1/completions" -H 'content-type: application/json' \
    -d "$body"; do
  sleep 0.5
done
echo
echo "first answer after $(since) s"
pkill -f "tierserve serve --host 127.0.0.1 --port $port"
wait
