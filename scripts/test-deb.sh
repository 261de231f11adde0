#!/usr/bin/env bash
# `make test-deb`: builds the Debian package (`make deb`) and checks it the
# way an operator uses it, with dpkg on this machine (as root; it skips,
# saying why, without root or dpkg):
#   - its control data (package, version, dependencies) and conffile;
#   - installed: the binaries run (--version), the hook and the units are
#     in place, /etc/gemini/resource.conf is the example;
#   - the operator edits resource.conf; an upgrade (the same package at a
#     higher version) keeps the edit and replaces the binaries;
#   - the installed gem-schd starts from the installed files and reads
#     the edited configuration;
#   - removed: the binaries go, resource.conf stays; purged: it goes.
#
#   scripts/test-deb.sh RELEASE_DIR OUT_DIR
set -euo pipefail
release=${1:?usage: scripts/test-deb.sh RELEASE_DIR OUT_DIR}
outdir=${2:?usage: scripts/test-deb.sh RELEASE_DIR OUT_DIR}
cd "$(dirname "$0")/.."
fail() { echo "test-deb: FAIL: $*" >&2; exit 1; }
if [ "$(id -u)" != 0 ] || ! command -v dpkg-deb >/dev/null 2>&1; then
    echo "test-deb: skipped: needs root and dpkg (it installs the package on this machine)"
    exit 0
fi
. scripts/deb-guard.sh
refuse_over_an_installation
deb=$(scripts/deb.sh "$release" "$outdir") || fail "make deb failed"
work=$(mktemp -d)
ipc=$(mktemp -d)
schd=""
cleanup() {
    [ -n "$schd" ] && kill "$schd" 2>/dev/null || true
    dpkg -P gemini >/dev/null 2>&1 || true
    rm -rf "$work" "$ipc"
}
trap cleanup EXIT

info=$(dpkg-deb -f "$deb")
grep -q '^Package: gemini$' <<<"$info" || fail "control: no Package: gemini"$'\n'"$info"
grep -q '^Depends: .*libglib' <<<"$info" || fail "control: glib missing from Depends"$'\n'"$info"
grep -q '^Depends: .*libc6 (>= 2\.[0-9]*)' <<<"$info" || fail "control: Depends lacks libc6's version"$'\n'"$info"
[ "$(dpkg-deb --ctrl-tarfile "$deb" | tar -xOf - ./conffiles)" = $'/etc/gemini/resource.conf\n/etc/gemini/gemini.toml' ] \
    || fail "resource.conf and gemini.toml are not the conffiles"
contents=$(dpkg-deb -c "$deb")
for f in ./usr/bin/gem-schd ./usr/bin/gem-holder ./usr/bin/gem-launch ./usr/bin/gem-slurm \
    ./usr/lib/libgemhook.so ./usr/lib/libgemzmq.so ./usr/lib/systemd/system/gem-schd.service \
    ./usr/lib/systemd/system/gem-holder.service ./usr/share/doc/gemini/README.md \
    ./usr/share/doc/gemini/copyright ./usr/share/doc/gemini/CHANGELOG.md \
    ./usr/share/gemini/prometheus/gemini-alerts.yml ./usr/share/gemini/prometheus/gemini-alerts.test.yml \
    ./usr/share/gemini/grafana/gemini-dashboard.json ./etc/gemini/resource.conf ./etc/gemini/gemini.toml \
    ./usr/share/doc/gemini/examples/gemini.toml ./usr/share/doc/gemini/examples/resource.conf \
    ./usr/share/man/man1/gem-schd.1.gz ./usr/share/man/man1/gem-holder.1.gz \
    ./usr/share/man/man1/gem-launch.1.gz ./usr/share/man/man1/gem-slurm.1.gz; do
    grep -q " $f\( \|$\)" <<<"$contents" || fail "$f is not in the package"
done
awk '{print $2}' <<<"$contents" | grep -qv '^root/root$' && fail "files not owned by root"
echo "test-deb: control data, conffile and contents ok"

dpkg -i "$deb" >/dev/null || fail "dpkg -i failed"
for b in gem-schd gem-holder gem-launch gem-slurm; do
    /usr/bin/$b --version | grep -q "^$b " || fail "/usr/bin/$b --version"
done
grep -q "ExecStart=/usr/bin/gem-schd" /usr/lib/systemd/system/gem-schd.service || fail "the unit does not run /usr/bin/gem-schd"
# The socket in a directory only root can make, for every part alike.
grep -q "^RuntimeDirectory=gemini$" /usr/lib/systemd/system/gem-schd.service || fail "the unit makes no /run/gemini"
grep -q "^StateDirectory=gemini$" /usr/lib/systemd/system/gem-schd.service || fail "the unit makes no /var/lib/gemini"
grep -q '^accounting = "/var/lib/gemini/accounting.jsonl"$' /etc/gemini/gemini.toml \
    || fail "the installed settings do not keep the accounting log in /var/lib/gemini"
where=$(GEMINI_SETTINGS=/etc/gemini/gemini.toml /usr/bin/gem-schd status 2>&1 || true)
grep -q "/run/gemini/ipc" <<<"$where" || fail "the installed settings do not put the socket in /run/gemini/ipc: $where"
cmp -s /etc/gemini/resource.conf examples/resource.conf || fail "/etc/gemini/resource.conf is not the example"
# Enabled at installation, systemd running or not (as debhelper does it).
wants=/etc/systemd/system/multi-user.target.wants/gem-schd.service
if command -v deb-systemd-helper >/dev/null 2>&1; then
    [ -L "$wants" ] || fail "gem-schd.service is not enabled after installation"
fi
# The man pages say what --help says: gem-schd's lists its subcommands.
man_schd=$(zcat /usr/share/man/man1/gem-schd.1.gz)
grep -q '^\.TH GEM-SCHD "1"' <<<"$man_schd" && grep -q 'report' <<<"$man_schd" \
    || fail "gem-schd.1 is not a man page of gem-schd's --help: $(head -5 <<<"$man_schd")"
echo "test-deb: installed ok"

# The operator's edit, then an upgrade: the same files at a higher version.
printf '\n[test-deb-edit]\nMaxUtil=0.5\n' >> /etc/gemini/resource.conf
dpkg-deb -R "$deb" "$work/pkg"
version=$(dpkg-deb -f "$deb" Version)
sed -i "s/^Version: .*/Version: $version+upgrade1/" "$work/pkg/DEBIAN/control"
dpkg-deb --root-owner-group -b "$work/pkg" "$work/next.deb" >/dev/null
dpkg -i --force-confold "$work/next.deb" >/dev/null || fail "the upgrade failed"
[ "$(dpkg-query -W -f='${Version}' gemini)" = "$version+upgrade1" ] || fail "not upgraded"
grep -q '^\[test-deb-edit\]$' /etc/gemini/resource.conf || fail "the upgrade lost the operator's edit of resource.conf"
echo "test-deb: upgraded, the edit kept"

# The installed scheduler runs from the installed files and reads it.
GEMINI_SETTINGS=/dev/null /usr/bin/gem-schd --ipc-dir "$ipc" --config /etc/gemini/resource.conf >"$work/schd.log" 2>&1 &
schd=$!
for _ in $(seq 50); do
    out=$(GEMINI_SETTINGS=/dev/null /usr/bin/gem-schd --ipc-dir "$ipc" status 2>/dev/null) && break
    sleep 0.1
done
grep -q 'test-deb-edit' <<<"${out:-}" || fail "the installed gem-schd does not show the edited group: ${out:-}"$'\n'"$(cat "$work/schd.log")"
kill "$schd" 2>/dev/null || true
wait "$schd" 2>/dev/null || true
schd=""
echo "test-deb: the installed gem-schd runs with the edited resource.conf"
# It kept its accounting log, which the report reads once it stopped.
report=$(GEMINI_SETTINGS=/dev/null /usr/bin/gem-schd --ipc-dir "$ipc" report --since 1h 2>&1) \
    || fail "gem-schd report: $report"
grep -q "no GPU time recorded in this period" <<<"$report" || fail "gem-schd report: $report"
grep -q '"event":"stop"' "$ipc/accounting.jsonl" || fail "no stop in the accounting log: $(cat "$ipc/accounting.jsonl")"
echo "test-deb: the installed gem-schd kept an accounting log gem-schd report reads"

dpkg -r gemini >/dev/null || fail "dpkg -r failed"
[ ! -e /usr/bin/gem-schd ] && [ ! -e /usr/lib/libgemhook.so ] || fail "binaries left after removal"
grep -q '^\[test-deb-edit\]$' /etc/gemini/resource.conf || fail "removal lost resource.conf"
dpkg -P gemini >/dev/null || fail "dpkg -P failed"
[ ! -e /etc/gemini/resource.conf ] || fail "purge left resource.conf"
[ ! -L "$wants" ] || fail "purge left gem-schd.service enabled"
echo "test-deb: removal keeps the configuration, purge deletes it; all ok"
