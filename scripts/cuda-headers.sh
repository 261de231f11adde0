#!/usr/bin/env bash
# Fetches cuda.h and cudaTypedefs.h of a pinned CUDA release (from NVIDIA's
# nvidia-cuda-runtime-cu12 wheel on PyPI, checked against its sha256) into
# DIR, for the check that the hook's table matches the driver API.
#
#   scripts/cuda-headers.sh DIR
set -euo pipefail

VERSION=12.8.90
SHA256=adade8dcbd0edf427b7204d480d6066d33902cab2a4707dcfc48a2d0fd44ab90
out=${1:?usage: scripts/cuda-headers.sh DIR}

if [ -f "$out/cuda.h" ] && [ -f "$out/cudaTypedefs.h" ] && [ "$(cat "$out/VERSION" 2>/dev/null)" = "$VERSION" ]; then
    exit 0
fi
command -v python3 >/dev/null 2>&1 || { echo "cuda-headers: python3 is needed (scripts/setup.sh installs it)" >&2; exit 1; }
python3 -m pip --version >/dev/null 2>&1 || { echo "cuda-headers: pip is needed (Debian: apt-get install python3-pip)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --only-binary=:all: \
    --platform manylinux2014_x86_64 --python-version 3.11 \
    "nvidia-cuda-runtime-cu12==$VERSION" -d "$tmp" >&2
whl=$(ls "$tmp"/*.whl)
echo "$SHA256  $whl" | sha256sum -c --quiet - >&2
mkdir -p "$out"
python3 - "$whl" "$out" <<'PY'
import sys, zipfile
whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    for name in ("cuda.h", "cudaTypedefs.h"):
        with open(f"{out}/{name}", "wb") as f:
            f.write(z.read(f"nvidia/cuda_runtime/include/{name}"))
PY
echo "$VERSION" > "$out/VERSION"
