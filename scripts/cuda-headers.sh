#!/usr/bin/env bash
# Fetches cuda.h and cudaTypedefs.h of a pinned CUDA release (from NVIDIA's
# CUDA runtime wheel on PyPI, checked against its sha256) into DIR, for the
# check that the hook's table matches the driver API.
#
#   scripts/cuda-headers.sh DIR [VERSION]
#
# VERSION: 12.8.90 (default), 13.0.96 or 13.5.37.
set -euo pipefail

out=${1:?usage: scripts/cuda-headers.sh DIR [12.8.90|13.0.96|13.5.37]}
VERSION=${2:-12.8.90}
# version → wheel, its sha256, where the headers are inside it.
case "$VERSION" in
    12.8.90)
        PACKAGE=nvidia-cuda-runtime-cu12
        SHA256=adade8dcbd0edf427b7204d480d6066d33902cab2a4707dcfc48a2d0fd44ab90
        INCLUDE=nvidia/cuda_runtime/include ;;
    13.0.96)
        PACKAGE=nvidia-cuda-runtime
        SHA256=7f82250d7782aa23b6cfe765ecc7db554bd3c2870c43f3d1821f1d18aebf0548
        INCLUDE=nvidia/cu13/include ;;
    13.5.37)
        PACKAGE=nvidia-cuda-runtime
        SHA256=df2b79a8852f10d1fef8c848489c49eebb5754051bf870202a862831412b179d
        INCLUDE=nvidia/cu13/include ;;
    *)
        echo "cuda-headers: no pinned release $VERSION (known: 12.8.90, 13.0.96, 13.5.37)" >&2
        exit 2 ;;
esac

if [ -f "$out/cuda.h" ] && [ -f "$out/cudaTypedefs.h" ] && [ "$(cat "$out/VERSION" 2>/dev/null)" = "$VERSION" ]; then
    exit 0
fi
command -v python3 >/dev/null 2>&1 || { echo "cuda-headers: python3 is needed (scripts/setup.sh installs it)" >&2; exit 1; }
python3 -m pip --version >/dev/null 2>&1 || { echo "cuda-headers: pip is needed (Debian: apt-get install python3-pip)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --only-binary=:all: \
    --platform manylinux2014_x86_64 --python-version 3.11 \
    "$PACKAGE==$VERSION" -d "$tmp" >&2
whl=$(ls "$tmp"/*.whl)
echo "$SHA256  $whl" | sha256sum -c --quiet - >&2
mkdir -p "$out"
python3 - "$whl" "$out" "$INCLUDE" <<'PY'
import sys, zipfile
whl, out, include = sys.argv[1], sys.argv[2], sys.argv[3]
with zipfile.ZipFile(whl) as z:
    for name in ("cuda.h", "cudaTypedefs.h"):
        with open(f"{out}/{name}", "wb") as f:
            f.write(z.read(f"{include}/{name}"))
PY
echo "$VERSION" > "$out/VERSION"
