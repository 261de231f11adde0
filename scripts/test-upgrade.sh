#!/usr/bin/env bash
# `make test-upgrade`: upgrading gemini under running jobs, on the driver
# simulator. It builds the previous release (scripts/releases.txt, tag
# vVERSION) and, with a hooked workload running in a group capped at
# MaxUtil 0.4 with 1 GiB allocated, checks at every step that the
# workload's kernels keep running gated (its group's share of the GPU is
# above 0 and at most 0.5: ungated it would take all of it; the share
# itself is printed), that its memory stays
# charged to its group, and that it ends without a failed CUDA call:
#
#   1. the previous release's hook and workload, under the previous
#      gem-schd; that gem-schd replaced by this one (an upgrade); this
#      one restarted gracefully (systemctl restart), then killed (-9)
#      and started;
#   2. this release's hook and workload under the previous gem-schd
#      (a hook newer than its scheduler speaks the scheduler's version),
#      which is then upgraded (the hook speaks its own version again);
#   3. as root with dpkg: the previous release's .deb installed, its hook
#      and workload running, this release's .deb installed over it and
#      gem-schd restarted, and a second workload started with the new
#      hook beside the first.
#
# Each restart prints how long the scheduler was away and how long the
# workload took to be back in its status.
#
#   scripts/test-upgrade.sh RELEASE_DIR WORK_DIR
set -euo pipefail
new=$(cd "${1:?usage: scripts/test-upgrade.sh RELEASE_DIR WORK_DIR}" && pwd)
mkdir -p "${2:?usage: scripts/test-upgrade.sh RELEASE_DIR WORK_DIR}"
work=$(cd "$2" && pwd)
cd "$(dirname "$0")/.."
root=$(pwd)
. scripts/deb-guard.sh
say() { echo "test-upgrade: $*"; }
fail() {
    echo "test-upgrade: FAIL: $*" >&2
    if [ -f "$work/sim/schd.log" ]; then
        echo "--- the last of gem-schd's log:" >&2
        tail -n 30 "$work/sim/schd.log" >&2
    fi
    exit 1
}

for f in gem-schd gem-workload libgemhook.so libgemzmq.so libfakecuda.so; do
    [ -e "$new/$f" ] || fail "$new/$f is missing: run make release first"
done

# The previous release: the newest in scripts/releases.txt older than ours.
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
older() { [ "$1" != "$2" ] && [ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | head -n 1)" = "$1" ]; }
prev_version=""
while read -r v c p; do
    if older "$v" "$version" && { [ -z "$prev_version" ] || older "$prev_version" "$v"; }; then
        prev_version=$v prev_commit=$c prev_protocol=$p
    fi
done < <(grep -v '^#' scripts/releases.txt)
[ -n "${prev_version:-}" ] || fail "scripts/releases.txt names no release older than $version"
if git rev-parse -q --verify "refs/tags/v$prev_version^{commit}" >/dev/null; then
    tagged=$(git rev-parse "v$prev_version^{commit}")
    [ "$tagged" = "$prev_commit" ] || fail "tag v$prev_version is $tagged, scripts/releases.txt says $prev_commit"
fi
if ! git cat-file -e "$prev_commit^{commit}" 2>/dev/null; then
    # A shallow clone (CI's, say): fetch that commit from where it came.
    say "commit $prev_commit (v$prev_version) is not in this clone; fetching it"
    git fetch --quiet --depth 1 origin "$prev_commit" 2>/dev/null ||
        git fetch --quiet --unshallow --tags origin 2>/dev/null || true
    git cat-file -e "$prev_commit^{commit}" 2>/dev/null ||
        fail "commit $prev_commit (v$prev_version) is not in this clone and could not be fetched (git fetch --unshallow --tags)"
fi

# Its build, kept between runs while the commit is the same. Its source
# lies outside this repository: cargo reads the .cargo/config.toml of
# every directory above the one it runs in, and this one's [env] (a
# table, forced) cannot be merged with the previous release's (a string).
prev=$work/prev
prev_rel=$prev/target/release
prev_src=${TMPDIR:-/tmp}/gemini-upgrade-$prev_commit
if [ ! -f "$prev_src/Cargo.toml" ]; then
    rm -rf "$prev_src"
    mkdir -p "$prev_src"
    git archive "$prev_commit" | tar -x -C "$prev_src"
fi
if [ "$(cat "$prev/commit" 2>/dev/null)" != "$prev_commit" ] || [ ! -x "$prev_rel/gem-schd" ]; then
    say "building gemini $prev_version ($prev_commit) from $prev_src into $prev"
    (cd "$prev_src" && CARGO_TARGET_DIR="$prev/target" cargo build --release --workspace --quiet) ||
        fail "the build of $prev_version failed"
    echo "$prev_commit" >"$prev/commit"
fi
[[ "$("$prev_rel/gem-schd" --version)" == *"$prev_version"* ]] || fail "$prev_rel/gem-schd is not $prev_version"

# One simulated GPU; the simulator (test equipment, not what is upgraded)
# is this build's.
sim=$work/sim
rm -rf "$sim"
mkdir -p "$sim/lib" "$sim/state" "$sim/ipc"
for n in libcuda.so.1 libcuda.so libnvidia-ml.so.1 libnccl.so.2; do
    ln -sf "$new/libfakecuda.so" "$sim/lib/$n"
done
export GEMINI_SETTINGS=/dev/null LD_LIBRARY_PATH=$sim/lib FAKECUDA_DIR=$sim/state
export FAKECUDA_DEVICES=1 FAKECUDA_MEM=16GiB GEMINI_IPC_DIR=$sim/ipc
unset GEMINI_GROUP_NAME GEMINI_CONNECT_TIMEOUT
conf=$sim/resource.conf
printf '[capped]\nMaxUtil=0.4\nMemoryLimit=4GiB\n' >"$conf"

schd=""
workloads=()
installed=""
cleanup() {
    for p in ${workloads[@]+"${workloads[@]}"} $schd; do kill -9 "$p" 2>/dev/null || true; done
    if [ -n "$installed" ]; then
        dpkg -P gemini >/dev/null 2>&1 || true
    fi
}
trap cleanup EXIT

now() { date +%s.%N; }
# Seconds since $1 (a `now`), to two decimals.
seconds_since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }
# Runs "$@" every 50 ms until it succeeds, for at most 10 s.
poll_until() {
    local _
    for _ in $(seq 200); do
        "$@" && return 0
        sleep 0.05
    done
    return 1
}
status_json() { "$new/gem-schd" status --json --ipc-dir "$GEMINI_IPC_DIR" 2>/dev/null; }
answers() { status_json >/dev/null; }

# Starts gem-schd from $1 (a directory of binaries) and waits until it
# answers; sets $schd to its pid and $up to how long that took (s).
start_schd() {
    local t0
    t0=$(now)
    "$1/gem-schd" --config "$conf" --ipc-dir "$GEMINI_IPC_DIR" >>"$sim/schd.log" 2>&1 </dev/null &
    schd=$!
    poll_until answers || fail "gem-schd from $1 did not come up"
    up=$(seconds_since "$t0")
}

# Stops gem-schd: `graceful` as systemd does (SIGTERM), or `kill -9`.
stop_schd() {
    if [ "$1" = graceful ]; then kill -TERM "$schd"; else kill -9 "$schd"; fi
    wait "$schd" 2>/dev/null || true
    schd=""
}

# Starts a workload: $1 the hook, $2 gem-workload, $3 seconds, $4 its
# output file. Sets $wl to its pid.
start_workload() {
    LD_PRELOAD=$1 GEMINI_GROUP_NAME=capped "$2" --mem 1GiB --kernel-us 1000 --seconds "$3" \
        >"$4" 2>"$4.err" </dev/null &
    wl=$!
    workloads+=("$wl")
}

# Checks the status against what the workloads must show. Arguments:
# what (for messages), then pid=BUILD for each workload (BUILD: the
# release its status row must show), and optionally capped=HI (the
# group's share of the GPU must be above 0, it ran, and at most HI: its
# cap of 0.40 held; how far below the cap it ran depends on the CPU a
# noisy machine leaves it, and is printed, not checked) and mem=BYTES (what the group must hold,
# exactly; without it, at least 1 GiB a workload). It leaves the group's
# memory in $memory.
check() {
    local what=$1
    shift
    status_json >"$sim/status.json" || fail "$what: no status"
    python3 - "$sim/status.json" "$what" "$@" <<'PYEOF' || fail "$what"
import json, sys
what, args = sys.argv[2], sys.argv[3:]
st = json.load(open(sys.argv[1]))
share = None
exact = None
want = {}
for a in args:
    k, v = a.split("=", 1)
    if k == "capped":
        share = float(v)
    elif k == "mem":
        exact = int(v)
    else:
        want[int(k)] = v
errors = []
clients = {c["pid"]: c for c in st["clients"]}
for pid, build in want.items():
    c = clients.get(pid)
    if c is None:
        errors.append(f"pid {pid} is not among the clients: {sorted(clients)}")
    elif c.get("build") != build:
        errors.append(f"pid {pid} shows release {c.get('build')!r}, expected {build!r}")
dev = st["devices"][0] if st["devices"] else {"groups": [], "busy": 0}
g = next((g for g in dev["groups"] if g["group"] == "capped"), None)
used = g["memory_used"] if g else 0
if exact is not None and used != exact:
    errors.append(f"group capped holds {used} bytes, expected {exact} (as before the restart)")
if exact is None and used < len(want) << 30:
    errors.append(f"group capped holds {used} bytes, expected at least {len(want)} GiB")
open(sys.argv[1] + ".memory", "w").write(str(used))
if share is not None:
    s = g["share"] if g else 0.0
    if not 0 < s <= share:
        errors.append(f"group capped's share {s:.3f} is not within (0, {share}] (busy {dev['busy']:.3f})")
line = f"{what}: share {g['share'] if g else 0:.3f}, busy {dev['busy']:.3f}, memory {used >> 20} MiB, clients " + ", ".join(
    f"{c['pid']} ({c.get('build') or '-'}, protocol {c.get('protocol')})" for c in st["clients"] if c["role"] == "Client")
print("test-upgrade: " + line)
if errors:
    print("\n".join(errors), file=sys.stderr)
    sys.exit(1)
PYEOF
    memory=$(cat "$sim/status.json.memory")
}

# Whether every pid given is among the clients.
clients_back() {
    status_json | python3 -c '
import json, sys
st = json.load(sys.stdin)
# A stand-in holding the memory of a process until it says hello is not it.
pids = {c["pid"] for c in st["clients"] if c["role"] == "Client" and c.get("build") != "(restored)"}
sys.exit(0 if all(int(p) in pids for p in sys.argv[1:]) else 1)' "$@" 2>/dev/null
}

# Waits until every pid given is among the clients again after a restart;
# sets $back to how long that took (s) from $1, when the scheduler went
# away.
back_after() {
    local since=$1
    shift
    poll_until clients_back "$@" || fail "the workload(s) $* did not come back within 10 s of the restart"
    back=$(seconds_since "$since")
}

# Waits for a workload to end and checks it ran without a failed call,
# launched kernels, and kept to its cap over its whole run.
finish() {
    local pid=$1 out=$2 what=$3
    wait "$pid" || fail "$what: the workload failed: $(cat "$out.err")"
    local left=() p
    for p in ${workloads[@]+"${workloads[@]}"}; do [ "$p" = "$pid" ] || left+=("$p"); done
    workloads=(${left[@]+"${left[@]}"})
    python3 - "$out" "$what" <<'PYEOF' || fail "$what: $(cat "$out")"
import re, sys
line = open(sys.argv[1]).read()
kv = dict(re.findall(r"(\w+)=(\S+)", line))
kernels, us, secs = int(kv["kernels"]), int(kv["kernel_us"]), float(kv["seconds"])
share = kernels * us / 1e6 / secs
print(f"test-upgrade: {sys.argv[2]}: {kernels} kernels in {secs:.1f} s, {share:.3f} of the GPU")
if kv["alloc_error"] != "0" or int(kv["allocated"]) < 1 << 30:
    sys.exit(f"allocation: {kv['allocated']} bytes, error {kv['alloc_error']}")
if kernels == 0 or share > 0.45:
    sys.exit(f"ran {kernels} kernels, {share:.3f} of the GPU over its run, capped at 0.4")
PYEOF
}

# A restart under load: stops gem-schd ($1: graceful or kill -9), starts
# the one in $2, checks the workloads ($4…: pid=BUILD) come back with
# their memory and hold their share. $3 is what to call the step. Where
# the scheduler stopped is of this release ($RESTORES), the workloads are
# stopped (SIGSTOP) across the restart, so they say nothing to the new
# scheduler until it has answered a status: their memory must be counted
# all the same, exactly as before, from what the old one saved.
restart() {
    local how=$1 bin=$2 label=$3
    shift 3
    local t0 pids=() before
    for a in "$@"; do pids+=("${a%%=*}"); done
    check "$label, before"
    before=$memory
    if [ "${RESTORES:-}" = 1 ]; then
        kill -STOP "${pids[@]}"
    fi
    t0=$(now)
    stop_schd "$how"
    start_schd "$bin"
    if [ "${RESTORES:-}" = 1 ]; then
        check "$label, first status, workloads stopped" "mem=$before"
        kill -CONT "${pids[@]}"
    fi
    back_after "$t0" "${pids[@]}"
    say "$label: gem-schd answered after ${up} s, the workload was back after ${back} s"
    sleep 5
    check "$label, 5 s on" "$@" capped=0.5 "mem=$before"
}

say "1. gemini $prev_version's hook and workload; its gem-schd upgraded to $version, then restarted"
start_schd "$prev_rel"
start_workload "$prev_rel/libgemhook.so" "$prev_rel/gem-workload" 30 "$sim/old.out"
old=$wl
sleep 5
check "under gem-schd $prev_version" "$old=$prev_version" capped=0.5
restart graceful "$new" "upgraded to $version" "$old=$prev_version"
RESTORES=1 restart graceful "$new" "restarted" "$old=$prev_version"
# The memory state is written every second.
sleep 1.5
RESTORES=1 restart kill "$new" "killed and started" "$old=$prev_version"
finish "$old" "$sim/old.out" "$prev_version workload"
stop_schd graceful

say "2. gemini $version's hook and workload under gem-schd $prev_version"
start_schd "$prev_rel"
start_workload "$new/libgemhook.so" "$new/gem-workload" 16 "$sim/new.out"
sleep 5
# A scheduler of protocol $prev_protocol lists every client as of its own
# release: this one speaks it.
check "under gem-schd $prev_version" "$wl=$prev_version" capped=0.5
# That scheduler upgraded: the hook speaks its own version again.
restart graceful "$new" "upgraded to $version under it" "$wl=$version"
python3 - "$sim/status.json" "$wl" <<'PYEOF' || fail "the $version hook still speaks protocol $prev_protocol to gem-schd $version"
import json, sys
st = json.load(open(sys.argv[1]))
c = next(c for c in st["clients"] if c["pid"] == int(sys.argv[2]))
sys.exit(0 if c["protocol"] == st["protocol"] else 1)
PYEOF
finish "$wl" "$sim/new.out" "$version workload under $prev_version, then $version"
stop_schd graceful

say "3. the .deb of $prev_version, then of $version, installed under a running workload"
if [ "$(id -u)" != 0 ] || ! command -v dpkg-deb >/dev/null 2>&1; then
    say "3. skipped: needs root and dpkg (it installs the packages on this machine)"
    say "passed (1 and 2)"
    exit 0
fi
refuse_over_an_installation
old_deb=$(cd "$prev_src" && CARGO_TARGET_DIR="$prev/target" scripts/deb.sh "$prev_rel" "$prev/deb") ||
    fail "the .deb of $prev_version could not be built"
new_deb=$(scripts/deb.sh "$new" "$work/deb") || fail "the .deb of $version could not be built"
systemd_runs() { [ -d /run/systemd/system ]; }
# gem-schd as its package starts it where systemd runs; this test runs
# its own from the installed files, on the simulator.
stop_service() { if systemd_runs; then systemctl stop gem-schd gem-holder 2>/dev/null || true; fi; }
installed=1
dpkg -i "$old_deb" >"$work/dpkg.log" 2>&1 || fail "dpkg -i $old_deb: $(cat "$work/dpkg.log")"
stop_service
[[ "$(/usr/bin/gem-schd --version)" == *"$prev_version"* ]] || fail "the installed gem-schd is not $prev_version"
start_schd /usr/bin
start_workload /usr/lib/libgemhook.so "$prev_rel/gem-workload" 24 "$sim/deb-old.out"
old=$wl
sleep 5
check "installed $prev_version" "$old=$prev_version" capped=0.5
dpkg -i "$new_deb" >"$work/dpkg.log" 2>&1 || fail "dpkg -i $new_deb over $prev_version: $(cat "$work/dpkg.log")"
stop_service
[[ "$(/usr/bin/gem-schd --version)" == *"$version"* ]] || fail "the installed gem-schd is not $version after the upgrade"
restart graceful /usr/bin "package upgraded to $version" "$old=$prev_version"
start_workload /usr/lib/libgemhook.so "$new/gem-workload" 8 "$sim/deb-new.out"
sleep 5
check "a $version workload beside the $prev_version one" "$old=$prev_version" "$wl=$version" capped=0.5
finish "$wl" "$sim/deb-new.out" "$version workload, installed hook"
finish "$old" "$sim/deb-old.out" "$prev_version workload across the package upgrade"
stop_schd graceful
dpkg -P gemini >/dev/null 2>&1 || fail "dpkg -P gemini failed"
installed=""
say "passed"
