#!/usr/bin/env bash
# `make deb`: a Debian package of what `make release` built,
# gemini_VERSION_ARCH.deb, built with dpkg-deb from what `make install`
# puts in place under /usr:
#
#   /usr/bin/       gem-schd gem-holder gem-launch gem-slurm (stripped)
#   /usr/lib/       libgemhook.so (+ .so.1), the LD_PRELOAD hook
#   /usr/lib/systemd/system/  gem-schd.service, gem-holder.service
#   /usr/share/doc/gemini/    README.md, docs/
#   /etc/gemini/resource.conf the example, a conffile: an upgrade keeps
#                             the operator's edits, a removal keeps it,
#                             only a purge deletes it
#
# Its maintainer scripts, where systemd runs: installed, gem-schd is
# enabled and started; upgraded, gem-schd (and gem-holder, if it ran) is
# restarted; removed, both are stopped and disabled. Without systemd (a
# container) they do nothing of that, and say so.
#
#   scripts/deb.sh RELEASE_DIR OUT_DIR
set -euo pipefail
release=${1:?usage: scripts/deb.sh RELEASE_DIR OUT_DIR}
out=${2:?usage: scripts/deb.sh RELEASE_DIR OUT_DIR}
cd "$(dirname "$0")/.."

for tool in dpkg-deb dpkg; do
    command -v "$tool" >/dev/null 2>&1 || { echo "deb: $tool is missing: make deb needs a Debian or Ubuntu machine (make dist makes a tarball anywhere)" >&2; exit 1; }
done

version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
arch=$(dpkg --print-architecture)
case "$(command -v file >/dev/null && file -b "$release/gem-schd")" in
    *aarch64*) arch=arm64 ;;
esac
stage=$out/gemini_${version}_$arch
rm -rf "$stage"
mkdir -p "$stage"
make -s install DESTDIR="$(cd "$stage" && pwd)" PREFIX=/usr RELEASE_DIR="$release" >/dev/null

# Depends: the packages that hold the shared libraries the binaries and
# the hook load (glib, pcre2, libstdc++, libc), as this machine names them.
libs=$(for f in "$stage"/usr/bin/* "$stage"/usr/lib/libgemhook.so; do
    ldd "$f" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}'
done | sort -u)
depends=$(for l in $libs; do
    dpkg -S "$l" 2>/dev/null || dpkg -S "$(readlink -f "$l")" 2>/dev/null || true
done | cut -d: -f1 | sort -u | paste -sd, | sed 's/,/, /g')
[ -n "$depends" ] || { echo "deb: could not tell which packages hold the binaries' libraries" >&2; exit 1; }

size=$(du -sk "$stage" | cut -f1)
mkdir -p "$stage/DEBIAN"
cat > "$stage/DEBIAN/control" <<EOF
Package: gemini
Version: $version
Architecture: $arch
Maintainer: gemini developers <gemini@localhost>
Installed-Size: $size
Depends: $depends
Section: admin
Priority: optional
Description: GPU sharing with guarantees for unmodified CUDA programs
 gemini gives each group of processes a guaranteed minimum and a maximum
 share of GPU time and a memory cap, enforced without changing the
 program: gem-schd (the scheduler), libgemhook.so (the LD_PRELOAD hook),
 gem-holder, gem-launch and gem-slurm. Groups are set in
 /etc/gemini/resource.conf.
EOF
echo /etc/gemini/resource.conf > "$stage/DEBIAN/conffiles"

cat > "$stage/DEBIAN/postinst" <<'EOF'
#!/bin/sh
# Installed: gem-schd enabled and started. Upgraded: the running services
# restarted with the new binaries (programs under the hook reconnect).
set -e
if [ "$1" = configure ]; then
    if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
        systemctl daemon-reload || true
        if [ -z "$2" ]; then
            systemctl enable gem-schd.service >/dev/null 2>&1 || true
            systemctl start gem-schd.service || true
        else
            systemctl try-restart gem-schd.service gem-holder.service || true
        fi
    else
        echo "gemini: systemd is not running; start the scheduler with: gem-schd --config /etc/gemini/resource.conf"
    fi
fi
exit 0
EOF
cat > "$stage/DEBIAN/prerm" <<'EOF'
#!/bin/sh
# Removed: the services stopped and disabled. Upgraded: left running; the
# new package's postinst restarts them.
set -e
if [ "$1" = remove ] && [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
    systemctl stop gem-holder.service gem-schd.service || true
    systemctl disable gem-holder.service gem-schd.service >/dev/null 2>&1 || true
fi
exit 0
EOF
cat > "$stage/DEBIAN/postrm" <<'EOF'
#!/bin/sh
# The configuration stays on removal (dpkg keeps the conffile); a purge
# deletes it with the directory if nothing else is left there.
set -e
if [ "$1" = purge ]; then
    rmdir /etc/gemini 2>/dev/null || true
fi
if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
    systemctl daemon-reload || true
fi
exit 0
EOF
chmod 755 "$stage/DEBIAN/postinst" "$stage/DEBIAN/prerm" "$stage/DEBIAN/postrm"

deb=$out/gemini_${version}_$arch.deb
dpkg-deb --root-owner-group --build "$stage" "$deb" >/dev/null
echo "$deb"
