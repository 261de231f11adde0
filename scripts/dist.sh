#!/usr/bin/env bash
# `make dist`: a relocatable tarball of what `make release` built,
# gemini-VERSION-ARCH-linux.tar.gz, that runs on any Linux machine of that
# architecture with glibc >= the build machine's (no Rust needed):
#
#   bin/        gem-schd gem-holder gem-launch gem-slurm (stripped)
#   lib/        libgemhook.so (+ .so.1), the LD_PRELOAD hook, and libgemzmq.so,
#               its ZeroMQ socket (loaded from beside it when it connects)
#   lib/gemini/ the shared libraries the binaries need beyond glibc
#               (glib, pcre2), found through an $ORIGIN rpath
#   share/gemini/  README, example resource.conf, systemd units, docs/, the GPU suite
#   test-gpu    runs the GPU suite with these binaries
#
#   scripts/dist.sh RELEASE_DIR OUT_DIR
set -euo pipefail
release=${1:?usage: scripts/dist.sh RELEASE_DIR OUT_DIR}
out=${2:?usage: scripts/dist.sh RELEASE_DIR OUT_DIR}
cd "$(dirname "$0")/.."

bins=(gem-schd gem-holder gem-launch gem-slurm)
for f in "${bins[@]}" libgemhook.so libgemzmq.so; do
    [ -f "$release/$f" ] || { echo "dist: $release/$f is missing; run \`make release\` first" >&2; exit 1; }
done
if ! command -v patchelf >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -q patchelf >/dev/null
    else
        echo "dist: patchelf is missing (Debian: apt-get install patchelf)" >&2; exit 1
    fi
fi

version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
arch=$(file -b "$release/gem-schd" | grep -q aarch64 && echo aarch64 || uname -m)
name=gemini-$version-$arch-linux
stage=$out/$name
rm -rf "$stage"
install -d "$stage/bin" "$stage/lib/gemini" "$stage/share/gemini/systemd" "$stage/share/gemini/docs" "$stage/share/gemini/gpu"
for b in "${bins[@]}"; do install -s -m 755 "$release/$b" "$stage/bin/"; done
install -s -m 755 "$release/libgemhook.so" "$release/libgemzmq.so" "$stage/lib/"
ln -sf libgemhook.so "$stage/lib/libgemhook.so.1"

# Libraries beyond the C runtime (glib and what it needs), next to
# the binaries that need them; the hook must need none (it is loaded into
# every program).
if ldd "$stage/lib/libgemhook.so" | grep -qE 'glib|pcre'; then echo "dist: the hook links glib" >&2; exit 1; fi
# Nor the C++ runtime: ZeroMQ, which needs it, is in libgemzmq.so, loaded
# at the first connection.
if ldd "$stage/lib/libgemhook.so" | grep -q 'libstdc++'; then echo "dist: the hook links libstdc++" >&2; exit 1; fi
# libgemzmq.so links it in (CXXSTDLIB_STATIC in .cargo/config.toml):
# loading the shared one took 0.9-1.4 ms of every hooked program.
if ldd "$stage/lib/libgemzmq.so" | grep -q 'libstdc++'; then echo "dist: libgemzmq.so links the shared libstdc++" >&2; exit 1; fi
# Nor libgcc_s: its unwinder is linked in (hook/build.rs), which saves every
# process it is preloaded into loading one more library.
hook_needed=$(readelf -d "$stage/lib/libgemhook.so")
if grep -q 'NEEDED.*libgcc_s' <<<"$hook_needed"; then echo "dist: the hook links libgcc_s (is GCC's libgcc_eh.a installed?)" >&2; exit 1; fi
for b in "${bins[@]}"; do
    libs=$(ldd "$stage/bin/$b" | awk '$3 ~ /^\// {print $3}' | grep -vE '/(libc|libm|libgcc_s|libstdc\+\+|libpthread|libdl|librt|ld-linux[^/]*)\.so' || true)
    [ -n "$libs" ] || continue
    for l in $libs; do cp -L "$l" "$stage/lib/gemini/"; done
    patchelf --set-rpath '$ORIGIN/../lib/gemini' "$stage/bin/$b"
done
for l in "$stage"/lib/gemini/*; do [ -e "$l" ] && patchelf --set-rpath '$ORIGIN' "$l"; done

cp dist/*.service "$stage/share/gemini/systemd/"
cp examples/resource.conf "$stage/share/gemini/"
cp README.md "$stage/share/gemini/"
cp docs/*.md docs/*.svg "$stage/share/gemini/docs/"
cp tests/gpu/*.py "$stage/share/gemini/gpu/"
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
cat >"$stage/test-gpu" <<SH
#!/bin/sh
# gemini's GPU suite with the binaries of this tarball (gemini $commit):
#   ./test-gpu [RESULTS.md]    (default: ./gpu-results.md)
here=\$(cd "\$(dirname "\$0")" && pwd)
[ \$# -gt 0 ] || set -- gpu-results.md
GEMINI_BIN_DIR="\$here/bin" GEMINI_HOOK="\$here/lib/libgemhook.so" GEMINI_COMMIT=\${GEMINI_COMMIT:-$commit} \\
  exec python3 "\$here/share/gemini/gpu/gpu_suite.py" "\$@"
SH
chmod 755 "$stage/test-gpu"
tar -C "$out" -czf "$out/$name.tar.gz" "$name"
echo "$out/$name.tar.gz"
