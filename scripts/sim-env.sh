#!/usr/bin/env bash
# Prints the environment that runs gemini on the driver simulator, with no
# GPU: the simulator installed as libcuda.so.1, libnvidia-ml.so.1 and
# libnccl.so.2 in a directory of its own, its state, an IPC directory, and
# the built binaries on PATH. Use it as
#
#   eval "$(scripts/sim-env.sh)"        # or: eval "$(make -s sim-env)"
#
# GEMINI_BIN_DIR (default target/release, what `make release` builds),
# GEMINI_SIM_DIR (default $TMPDIR/gemini-sim-UID), FAKECUDA_DEVICES
# (default 2) and FAKECUDA_MEM (default 16GiB) change what it sets up.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${GEMINI_BIN_DIR:-$root/target/release}
if [ ! -f "$bin/libfakecuda.so" ] || [ ! -x "$bin/gem-schd" ]; then
  # Said through the eval, on stderr, and failing there.
  echo "echo 'sim-env: no simulator build in $bin: run make release first' >&2; false"
  exit 1
fi
dir=${GEMINI_SIM_DIR:-${TMPDIR:-/tmp}/gemini-sim-$(id -u)}
mkdir -p "$dir/lib" "$dir/state" "$dir/ipc"
for name in libcuda.so.1 libcuda.so libnvidia-ml.so.1 libnccl.so.2; do
  ln -sf "$bin/libfakecuda.so" "$dir/lib/$name"
done
q() { printf '%q' "$1"; }
cat <<ENV
export PATH=$(q "$bin"):"\$PATH"
export LD_LIBRARY_PATH=$(q "$dir/lib")\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
export FAKECUDA_DIR=$(q "$dir/state") FAKECUDA_DEVICES=${FAKECUDA_DEVICES:-2} FAKECUDA_MEM=${FAKECUDA_MEM:-16GiB}
export GEMINI_IPC_DIR=$(q "$dir/ipc") GEMINI_SETTINGS=/dev/null
echo "gemini: the driver simulator in $(q "$dir") ($bin on PATH)" >&2
ENV
