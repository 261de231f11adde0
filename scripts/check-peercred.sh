#!/usr/bin/env bash
# gem-schd built with CXXFLAGS exported, as CI systems and distribution
# builders do, still reads its peers' credentials (SO_PEERCRED): the
# bundled libzmq's defines in .cargo/config.toml are forced, and gem-schd
# refuses to start without peer credentials. Builds the scheduler alone
# into TARGET (libzmq included, about two minutes on two cores) and
# checks that it starts and answers.
set -euo pipefail
target=${1:?usage: check-peercred.sh TARGET_DIR}
cd "$(dirname "$0")/.."
echo "check-peercred: building gem-schd with CXXFLAGS=-O2 exported into $target"
CXXFLAGS=-O2 CARGO_TARGET_DIR="$target" cargo build -q -p gemini-scheduler --bin gem-schd
dir=$(mktemp -d)
trap 'kill "$pid" 2>/dev/null || true; rm -rf "$dir"' EXIT
printf '[a]\n' >"$dir/resource.conf"
GEMINI_SETTINGS=/dev/null "$target/debug/gem-schd" --config "$dir/resource.conf" \
  --ipc-dir "$dir/ipc" --log-level warn 2>"$dir/log" &
pid=$!
for _ in $(seq 100); do
  if GEMINI_SETTINGS=/dev/null "$target/debug/gem-schd" status --ipc-dir "$dir/ipc" >/dev/null 2>&1; then
    echo "check-peercred: passed (gem-schd built with CXXFLAGS=-O2 reads its peers' credentials)"
    exit 0
  fi
  if ! kill -0 "$pid" 2>/dev/null; then break; fi
  sleep 0.1
done
echo "check-peercred: FAILED: gem-schd built with CXXFLAGS=-O2 did not start:" >&2
cat "$dir/log" >&2
exit 1
