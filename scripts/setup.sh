#!/usr/bin/env bash
# Makes sure this machine can build and test gemini, installing what is
# missing. `make demo`, `make test` and `.ci/run` all start here.
#
#   scripts/setup.sh           install what is missing (apt; as root, or
#                              through sudo when it needs no password)
#   scripts/setup.sh --check   only say what is missing (exit 1 if anything)
#
# Without root or password-less sudo it prints the one command to run and
# stops. The Rust toolchain is never installed here: it prints how to.
set -euo pipefail

check_only=0
case "${1:-}" in
    --check) check_only=1 ;;
    "") ;;
    -h | --help)
        sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    *)
        echo "setup: unknown argument '$1' (expected --check or nothing)" >&2
        exit 2
        ;;
esac

# Oldest Rust that builds the workspace (Cargo.toml's rust-version).
RUST_MIN=1.88

say() { echo "setup: $*" >&2; }

# Debian packages that are missing.
need=()
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
if ! command -v pkg-config >/dev/null 2>&1 || ! pkg-config --exists glib-2.0 2>/dev/null; then
    need+=(libglib2.0-dev)
fi
command -v cc >/dev/null 2>&1 || need+=(gcc)
command -v c++ >/dev/null 2>&1 || need+=(g++)
command -v make >/dev/null 2>&1 || need+=(make)
command -v python3 >/dev/null 2>&1 || need+=(python3)
# Wanted, not required: pip fetches the pinned CUDA headers the table
# check reads and installs cuda-python for the third-party client test in
# a venv of its own; tmux is the terminal `gem-schd top` is tested in;
# without them those three tests say NOT CHECKED.
want=()
python3 -m pip --version >/dev/null 2>&1 || want+=(python3-pip)
python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || want+=(python3-venv)
command -v tmux >/dev/null 2>&1 || want+=(tmux)

# The Rust toolchain: rustup's, not apt's (Debian's is often too old).
rust_problem=""
if ! command -v cargo >/dev/null 2>&1; then
    rust_problem="cargo not found"
else
    ver=$(rustc --version 2>/dev/null | sed -n 's/^rustc \([0-9]*\.[0-9]*\).*/\1/p')
    if [ -z "$ver" ]; then
        rust_problem="rustc not found or not working"
    elif [ "$(printf '%s\n%s\n' "$RUST_MIN" "$ver" | sort -V | head -n1)" != "$RUST_MIN" ]; then
        rust_problem="rustc $ver is older than $RUST_MIN"
    fi
fi

# Where apt can install them, the wanted packages come along; elsewhere
# they are only named.
can_install=0
if command -v apt-get >/dev/null 2>&1; then
    if [ "$(id -u)" -eq 0 ] || { command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; }; then
        can_install=1
    fi
fi
if [ ${#want[@]} -gt 0 ]; then
    if [ "$can_install" -eq 1 ] && [ "$check_only" -eq 0 ]; then
        need+=("${want[@]}")
    else
        say "optional, for three tests that otherwise say NOT CHECKED: ${want[*]}"
    fi
fi

if [ ${#need[@]} -gt 0 ]; then
    cmd="apt-get install -y ${need[*]}"
    if [ "$check_only" -eq 1 ]; then
        say "missing: ${need[*]} (install with: sudo $cmd)"
    elif ! command -v apt-get >/dev/null 2>&1; then
        say "missing: ${need[*]} (Debian package names). This is not a Debian or"
        say "Ubuntu machine: install their equivalents (glib 2 with its headers,"
        say "pkg-config, a C and C++ compiler with its static C++ runtime, libstdc++.a:"
        say "libstdc++-static on Fedora and RHEL; make, python3), then run this again."
        exit 1
    else
        sudo=""
        if [ "$(id -u)" -ne 0 ]; then
            if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
                sudo="sudo"
            else
                say "missing: ${need[*]}"
                say "run this one command, then run make again:"
                echo "    sudo apt-get update && sudo $cmd" >&2
                exit 1
            fi
        fi
        say "installing ${need[*]}"
        export DEBIAN_FRONTEND=noninteractive
        $sudo apt-get update -qq
        $sudo apt-get install -y -qq "${need[@]}"
    fi
fi

if [ -n "$rust_problem" ]; then
    say "$rust_problem: gemini needs Rust $RUST_MIN or newer. Install it with:"
    echo "    curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y && . \"\$HOME/.cargo/env\"" >&2
    exit 1
fi

# `make lint` (run by CI) needs rustfmt and clippy: rustup adds them.
for tool in rustfmt clippy; do
    sub=$([ "$tool" = rustfmt ] && echo fmt || echo clippy)
    if ! cargo "$sub" --version >/dev/null 2>&1; then
        if [ "$check_only" -eq 0 ] && command -v rustup >/dev/null 2>&1; then
            say "installing the $tool component"
            rustup component add "$tool" >/dev/null
        else
            say "missing: $tool (install with: rustup component add $tool); only \`make lint\` needs it"
        fi
    fi
done

if [ "$check_only" -eq 1 ] && [ ${#need[@]} -gt 0 ]; then
    exit 1
fi
