#!/usr/bin/env bash
# make demo: the scheduler with examples/resource.conf, driven by simulated
# clients (one per group, both always wanting the GPU) for 10 seconds; prints
# `gem-schd status` and each group's achieved share next to its settings.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release}
SECS=${DEMO_SECONDS:-10}
work=$(mktemp -d)
trap 'kill "$schd" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"' EXIT
cp examples/resource.conf "$work/resource.conf"
"$BIN/gem-schd" --config "$work/resource.conf" --ipc-dir "$work/ipc" 2>"$work/schd.log" &
schd=$!
for _ in $(seq 100); do
    "$BIN/gem-schd" status --ipc-dir "$work/ipc" >/dev/null 2>&1 && break
    sleep 0.1
done
echo "== gem-schd running with examples/resource.conf; two saturating clients for ${SECS}s"
"$BIN/examples/demo_clients" "$work/ipc" "$SECS" train notebook
echo
echo "== gem-schd status"
"$BIN/gem-schd" status --ipc-dir "$work/ipc"
"$BIN/gem-schd" shutdown --ipc-dir "$work/ipc" >/dev/null
echo "== scheduler log"
cat "$work/schd.log"
