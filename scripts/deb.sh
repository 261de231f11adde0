#!/usr/bin/env bash
# `make deb`: a Debian package of what `make release` built,
# gemini_VERSION_ARCH.deb, built with dpkg-deb from what `make install`
# puts in place under /usr:
#
#   /usr/bin/       gem-schd gem-holder gem-launch gem-slurm (stripped)
#   /usr/lib/       libgemhook.so (+ .so.1), the LD_PRELOAD hook, and libgemzmq.so
#                   (its ZeroMQ socket, loaded from beside it)
#   /usr/lib/systemd/system/  gem-schd.service, gem-holder.service
#   /usr/share/doc/gemini/    README.md, CHANGELOG.md, docs/, examples/
#   /usr/share/man/man1/      a page per tool, from its --help (help2man)
#   /usr/share/gemini/        prometheus/ (alert rules and their tests),
#                             grafana/ (the dashboard)
#   /etc/gemini/resource.conf the example, a conffile: an upgrade keeps
#                             the operator's edits, a removal keeps it,
#                             only a purge deletes it
#
# Its maintainer scripts follow what debhelper's dh_installsystemd
# writes: installed, gem-schd is enabled (also in an image built without
# systemd running, through deb-systemd-helper) and, where systemd runs,
# started; upgraded, restarted (and gem-holder, if it ran); removed,
# both are stopped and gem-schd's unit masked until a reinstall or purge.
#
#   scripts/deb.sh RELEASE_DIR OUT_DIR
set -euo pipefail
umask 022
release=${1:?usage: scripts/deb.sh RELEASE_DIR OUT_DIR}
out=${2:?usage: scripts/deb.sh RELEASE_DIR OUT_DIR}
cd "$(dirname "$0")/.."

for tool in dpkg-deb dpkg; do
    command -v "$tool" >/dev/null 2>&1 || { echo "deb: $tool is missing: make deb needs a Debian or Ubuntu machine (make dist makes a tarball anywhere)" >&2; exit 1; }
done

version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
arch=$(dpkg --print-architecture)
stage=$out/gemini_${version}_$arch
rm -rf "$stage"
mkdir -p "$stage"
make -s install DESTDIR="$(cd "$stage" && pwd)" PREFIX=/usr RELEASE_DIR="$release" >/dev/null

# A man page per tool, from its own --help and --version (help2man: the
# pages say what the tools say, and cannot drift from them).
if ! command -v help2man >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends help2man >/dev/null
    else
        echo "deb: help2man is missing (Debian: apt-get install help2man)" >&2; exit 1
    fi
fi
mkdir -p "$stage/usr/share/man/man1"
for b in gem-schd:"the gemini token scheduler: guaranteed shares of GPU time and memory caps per group" \
    gem-holder:"gemini's holder: keeps idle GPUs occupied and hands them back at once" \
    gem-launch:"run a program under gemini: group, GPUs, queue" \
    gem-slurm:"gemini under Slurm: prolog, epilog and task prolog"; do
    name=${b%%:*}
    help2man --no-info --no-discard-stderr --section 1 --name "${b#*:}" \
        "$stage/usr/bin/$name" | gzip -9n > "$stage/usr/share/man/man1/$name.1.gz"
done

# Depends: the packages that hold the shared libraries the binaries and
# the hook load (glib, pcre2, libc), as this machine names them,
# and libc6 at least as new as the newest glibc symbol version they use.
libs=""
for f in "$stage"/usr/bin/* "$stage"/usr/lib/libgemhook.so "$stage"/usr/lib/libgemzmq.so; do
    linked=$(ldd "$f") || { echo "deb: ldd $f failed: $linked" >&2; exit 1; }
    libs+=$(awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}' <<<"$linked")$'\n'
done
packages=""
for l in $(sort -u <<<"$libs"); do
    owner=$(dpkg -S "$l" 2>/dev/null || dpkg -S "$(readlink -f "$l")" 2>/dev/null || true)
    owner=$(grep -v '^diversion by' <<<"$owner" | head -1 | cut -d: -f1)
    [ -n "$owner" ] || { echo "deb: no package holds $l, which the binaries load: install it from a package, or use make dist" >&2; exit 1; }
    packages+="$owner"$'\n'
done
glibc=$(for f in "$stage"/usr/bin/* "$stage"/usr/lib/libgemhook.so "$stage"/usr/lib/libgemzmq.so; do objdump -T "$f"; done |
    grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -1)
depends=$(sort -u <<<"$packages" | grep -v '^$' | sed "s/^libc6\$/libc6 (>= $glibc)/" | paste -sd, | sed 's/,/, /g')

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
# The daemon's settings: the IPC directory in /run/gemini, which systemd
# makes for root before gem-schd starts (RuntimeDirectory= in the unit),
# so that no user can make it first (under /tmp anyone can).
cat > "$stage/etc/gemini/gemini.toml" <<'EOF'
# gemini's settings (docs/configuration.md), read by gem-schd, the tools
# and the hook. Edit and restart gem-schd.

# Where the scheduler's socket is: a directory only root can make.
ipc_dir = "/run/gemini/ipc"

# Let the members of this Unix group run programs under gemini
# (docs/security.md); as installed, only root can.
# ipc_group = "gpu"

# A user (not root) holds at most this many GPUs reserved at once
# (default: half the machine's), for at most this long.
# reserve_max_gpus = 4
# reserve_max_duration = "1d"

# The accounting log `gem-schd report` reads (in the unit's
# StateDirectory): kept across upgrades and reboots.
accounting = "/var/lib/gemini/accounting.jsonl"

# Every setting, with its default: /usr/share/doc/gemini/examples/gemini.toml
EOF
printf '/etc/gemini/resource.conf\n/etc/gemini/gemini.toml\n' > "$stage/DEBIAN/conffiles"
cat > "$stage/usr/share/doc/gemini/copyright" <<'EOF'
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: gemini

Files: *
Copyright: the gemini developers
License: Apache-2.0
 On Debian systems, the full text of the Apache License 2.0 is in
 /usr/share/common-licenses/Apache-2.0.
EOF

cat > "$stage/DEBIAN/postinst" <<'EOF'
#!/bin/sh
# As dh_installsystemd writes it. Installed: gem-schd enabled and
# started. Upgraded (or installed again after a removal): restarted with
# the new binaries; gem-holder restarted if it ran. Programs under the
# hook register again with the new scheduler.
set -e
if [ "$1" = configure ] && [ -z "$2" ]; then
    echo "gemini: as installed, only root can run programs under gemini. To let users in, set"
    echo "gemini:   ipc_group = \"GROUP\"   (a Unix group of those users)"
    echo "gemini: in /etc/gemini/gemini.toml and restart gem-schd; restrict groups with AllowedUsers="
    echo "gemini: or AllowedGroups= in /etc/gemini/resource.conf (/usr/share/doc/gemini/docs/security.md)"
fi
if [ "$1" = configure ] && [ -n "$2" ] && dpkg --compare-versions "$2" lt 0.2.0; then
    echo "gemini: the scheduler's socket moves from /tmp/gemini/ipc to /run/gemini/ipc (ipc_dir in"
    echo "gemini: /etc/gemini/gemini.toml): programs started before this upgrade look in the old place"
    echo "gemini: and wait there; restart them, or set ipc_dir = \"/tmp/gemini/ipc\" to keep it"
fi
if [ "$1" = configure ] || [ "$1" = abort-upgrade ] || [ "$1" = abort-deconfigure ] || [ "$1" = abort-remove ]; then
    if command -v deb-systemd-helper >/dev/null 2>&1; then
        deb-systemd-helper unmask gem-schd.service >/dev/null || true
        # was-enabled is true for a first installation: it is enabled.
        if deb-systemd-helper --quiet was-enabled gem-schd.service; then
            deb-systemd-helper enable gem-schd.service >/dev/null || true
        else
            deb-systemd-helper update-state gem-schd.service >/dev/null || true
        fi
    elif [ -d /run/systemd/system ] && [ -z "$2" ]; then
        systemctl enable gem-schd.service >/dev/null 2>&1 || true
    fi
    if [ -d /run/systemd/system ]; then
        systemctl --system daemon-reload >/dev/null || true
        if [ -n "$2" ]; then action=restart; else action=start; fi
        systemctl $action gem-schd.service || true
        systemctl try-restart gem-holder.service || true
    elif [ -n "$2" ]; then
        echo "gemini: systemd is not running; restart gem-schd yourself (gem-schd shutdown, then start it again): programs started from now on load the new hook"
    else
        echo "gemini: systemd is not running; start the scheduler with: gem-schd --config /etc/gemini/resource.conf"
    fi
fi
exit 0
EOF
cat > "$stage/DEBIAN/prerm" <<'EOF'
#!/bin/sh
# Removed: the services stopped (programs under the hook then wait for a
# scheduler; drain them first). Upgraded: left running; the new
# package's postinst restarts them.
set -e
if [ "$1" = remove ] && [ -d /run/systemd/system ]; then
    systemctl stop gem-holder.service gem-schd.service || true
fi
exit 0
EOF
cat > "$stage/DEBIAN/postrm" <<'EOF'
#!/bin/sh
# Removed: gem-schd's unit masked until the package comes back (dpkg keeps
# the conffile). Purged: its enablement forgotten; dpkg deletes the
# conffile and /etc/gemini if nothing else is left there.
set -e
if [ "$1" = remove ] && command -v deb-systemd-helper >/dev/null 2>&1; then
    deb-systemd-helper mask gem-schd.service >/dev/null || true
fi
if [ "$1" = purge ] && command -v deb-systemd-helper >/dev/null 2>&1; then
    deb-systemd-helper purge gem-schd.service >/dev/null || true
    deb-systemd-helper unmask gem-schd.service >/dev/null || true
fi
if [ -d /run/systemd/system ]; then
    systemctl --system daemon-reload >/dev/null || true
fi
exit 0
EOF
chmod 755 "$stage/DEBIAN/postinst" "$stage/DEBIAN/prerm" "$stage/DEBIAN/postrm"

deb=$out/gemini_${version}_$arch.deb
dpkg-deb --root-owner-group --build "$stage" "$deb" >/dev/null
echo "$deb"
