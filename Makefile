# gemini: `make` builds, `make test` runs the tests, `make demo` shows gemini
# at work on the driver simulator, `make bench` measures, `make install
# PREFIX=/usr/local` installs.

CARGO ?= cargo
PREFIX ?= /usr/local
# Where cargo puts what it builds: `target`, or wherever CARGO_TARGET_DIR
# (or a cargo config's build.target-dir) says; cargo itself is asked.
TARGET_DIR = $(or $(shell $(CARGO) metadata --format-version 1 --no-deps 2>/dev/null | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p'),target)
RELEASE_DIR = $(TARGET_DIR)/release

.PHONY: all setup build release sim-env test test-loom test-timesliced test-slurm test-prometheus test-hostile test-aarch64 demo bench chart test-gpu dist deb test-deb test-upgrade fuzz soak install uninstall lint fmt clean

# Seconds per fuzz target for `make fuzz`.
FUZZ_SECONDS ?= 30

all: build

# Installs the system packages a fresh machine lacks (or says the one
# command to run); every target that compiles starts with it.
setup:
	@scripts/setup.sh

build: setup
	$(CARGO) build --workspace

release: setup
	$(CARGO) build --workspace --release

test: setup
	$(CARGO) build --workspace --all-targets
	$(CARGO) test --workspace

# The loom model of the launch gate's admission protocol
# (hook/src/gate/admission.rs, docs/testing.md): its own build, with
# --cfg loom, in a target directory of its own.
test-loom: setup
	RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=$(TARGET_DIR)/loom $(CARGO) test -p gemini-hook --release --lib admission

# The integration tests on simulated GPUs that time-slice processes, as
# real ones do (docs/testing.md, "Time-sliced devices"): slower, and not
# yet part of make test.
test-timesliced: setup
	$(CARGO) build --workspace --all-targets
	GEM_TEST_TIMESLICE_US=2000 $(CARGO) test -p gemini-tests --test it

# gemini under a real Slurm on localhost (docs/slurm.md): installs
# Debian's slurmd, slurmctld, slurm-client and munge (as root), then runs
# the ignored test tests/tests/it/slurm.rs; it skips, saying why, without
# root or the packages.
test-slurm: setup
	@if [ "$$(id -u)" = 0 ] && ! command -v slurmd >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurmd slurmctld slurm-client munge >/dev/null; } || exit 1; fi
	$(CARGO) build --workspace --all-targets
	$(CARGO) test -p gemini-tests --test it -- slurm:: --ignored --nocapture

# A real Prometheus scraping gem-schd --metrics (docs/metrics.md):
# installs Debian's prometheus (as root), then runs the ignored test of
# tests/tests/it/metrics.rs; it skips, saying why, without the package.
test-prometheus: setup
	@if [ "$$(id -u)" = 0 ] && [ ! -x /usr/bin/prometheus ] && command -v apt-get >/dev/null 2>&1; then \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus >/dev/null; } || exit 1; fi
	@if command -v promtool >/dev/null 2>&1; then \
	  promtool check rules deploy/prometheus/gemini-alerts.yml && \
	  (cd deploy/prometheus && promtool test rules gemini-alerts.test.yml) || exit 1; \
	else echo "SKIPPED the alert rules' tests: no promtool (apt-get install prometheus)"; fi
	$(CARGO) build --workspace --all-targets
	$(CARGO) test -p gemini-tests --test it -- metrics:: --ignored --nocapture

# A hostile tenant (docs/security.md): as root, two victims and an
# attacker as real Unix users of the ipc_group; every attack refused, the
# victims' shares and memory kept, a table of it all (the ignored test of
# tests/tests/it/hostile.rs, which skips without root). Then gem-schd
# built with CXXFLAGS exported must still read its peers' credentials.
test-hostile: setup
	$(CARGO) build --workspace --all-targets
	$(CARGO) test -p gemini-tests --test it -- hostile:: --ignored --nocapture
	scripts/check-peercred.sh $(TARGET_DIR)/cxxflags

# The hook, the driver simulator and the workloads built for aarch64
# (Grace Hopper, GB200) and run under qemu-user beside the x86-64
# scheduler: the ignored tests of tests/tests/it/aarch64.rs. Installs
# Debian's aarch64 cross compilers and qemu-user-static (as root) and the
# Rust target; the tests skip, saying why, without them.
AARCH64 = aarch64-unknown-linux-gnu
AARCH64_ENV = CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc \
	CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc \
	CXX_aarch64_unknown_linux_gnu=aarch64-linux-gnu-g++ \
	AR_aarch64_unknown_linux_gnu=aarch64-linux-gnu-ar
test-aarch64: setup
	@if [ "$$(id -u)" = 0 ] && ! { command -v qemu-aarch64-static && command -v aarch64-linux-gnu-g++; } >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends gcc-aarch64-linux-gnu g++-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user-static >/dev/null; } || exit 1; fi
	@if [ ! -d "$$(rustc --print sysroot)/lib/rustlib/$(AARCH64)" ] && command -v rustup >/dev/null 2>&1; then \
	  rustup target add $(AARCH64) || exit 1; fi
	@if [ -d "$$(rustc --print sysroot)/lib/rustlib/$(AARCH64)" ] && command -v aarch64-linux-gnu-g++ >/dev/null 2>&1; then \
	  echo "$(AARCH64_ENV) $(CARGO) build --target $(AARCH64) -p gemini-hook -p gemini-zmqlink -p fakecuda -p gemini-workload"; \
	  $(AARCH64_ENV) $(CARGO) build --target $(AARCH64) -p gemini-hook -p gemini-zmqlink -p fakecuda -p gemini-workload || exit 1; \
	else echo "test-aarch64: no aarch64 build: it needs the Rust target $(AARCH64) (rustup target add $(AARCH64)) and aarch64-linux-gnu-g++ (Debian: apt-get install g++-aarch64-linux-gnu); the tests skip"; fi
	$(CARGO) build --workspace --all-targets
	GEMINI_AARCH64_DIR=$(TARGET_DIR)/$(AARCH64)/debug $(CARGO) test -p gemini-tests --test it -- aarch64:: --ignored --nocapture

# The environment that runs gemini on the driver simulator (no GPU):
# eval "$(make -s sim-env)" (see scripts/sim-env.sh).
sim-env: release
	@GEMINI_BIN_DIR=$(RELEASE_DIR) scripts/sim-env.sh

demo: release
	$(RELEASE_DIR)/gem-demo examples/resource.conf

bench: release
	$(RELEASE_DIR)/gem-bench --write docs/benchmarks.md

# docs/shares.svg, the README's chart, from a fresh 12 s run.
chart: release
	$(RELEASE_DIR)/gem-bench --chart docs/shares.svg

# Skips (exit 0) where there is no NVIDIA GPU; needs the release binaries
# (built here when cargo is available) and PyTorch.
test-gpu:
	@if ! nvidia-smi -L >/dev/null 2>&1; then echo "no NVIDIA GPU found, skipped"; exit 0; fi; \
	if command -v $(CARGO) >/dev/null 2>&1; then $(CARGO) build --workspace --release || exit 1; fi; \
	GEMINI_BIN_DIR=$(RELEASE_DIR) python3 tests/gpu/gpu_suite.py docs/gpu-results.md

# A relocatable tarball of the release build for machines without Rust
# (README.md, "From the release tarball"): target/dist/gemini-VERSION-ARCH-linux.tar.gz.
dist: release
	scripts/dist.sh $(RELEASE_DIR) $(TARGET_DIR)/dist

# A Debian package of the release build (scripts/deb.sh, dpkg-deb):
# binaries, hook, systemd units, docs, /etc/gemini/resource.conf as a
# conffile; target/deb/gemini_VERSION_ARCH.deb.
deb: release
	scripts/deb.sh $(RELEASE_DIR) $(TARGET_DIR)/deb

# Builds the package and installs, upgrades, runs, removes and purges it
# on this machine with dpkg (as root; skips, saying why, otherwise).
test-deb: release
	scripts/test-deb.sh $(RELEASE_DIR) $(TARGET_DIR)/deb

# Upgrading under running jobs (scripts/test-upgrade.sh): builds the
# previous release (scripts/releases.txt) and runs its hook and workload
# against this gem-schd, restarts gem-schd under load, runs this hook
# under the previous gem-schd, and (as root with dpkg) installs the
# previous .deb and then this one under a running workload.
test-upgrade: release
	scripts/test-upgrade.sh $(RELEASE_DIR) $(TARGET_DIR)/upgrade

# Coverage-guided fuzzing (cargo fuzz, libFuzzer) of the protocol decoder
# and the two config parsers, from the committed corpus in fuzz/corpus.
# cargo-fuzz needs nightly features; RUSTC_BOOTSTRAP=1 allows them on the
# stable toolchain.
fuzz: setup
	command -v cargo-fuzz >/dev/null 2>&1 || $(CARGO) install cargo-fuzz
	$(CARGO) run -q -p gemini-protocol --example fuzz_seeds -- fuzz/corpus/protocol_decode
	cd fuzz && for t in protocol_decode resource_conf settings_toml; do \
		RUSTC_BOOTSTRAP=1 $(CARGO) fuzz run -O $$t corpus/$$t -- -max_total_time=$(FUZZ_SECONDS) -max_len=4096 || exit 1; \
	done

# Long fault and load runs: 2 minutes of random SIGKILLs (and a scheduler
# crash), then 60 s of 256 concurrent clients.
soak: release
	$(RELEASE_DIR)/gem-soak

lint: setup
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all

# Installs what `make release` built: run that first as yourself, so that
# `sudo make install` runs no cargo as root. Binaries are stripped (the
# hook is loaded into every program's exec: 21 MB with debug info).
BINS = gem-schd gem-holder gem-launch gem-slurm
UNITS = gem-schd gem-holder
install:
	@for f in $(BINS) libgemhook.so libgemzmq.so; do test -f $(RELEASE_DIR)/$$f || { \
	  echo "make install: $(RELEASE_DIR)/$$f is missing; run \`make release\` first (as yourself, not root)" >&2; exit 1; }; done
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/lib $(DESTDIR)$(PREFIX)/lib/systemd/system $(DESTDIR)$(PREFIX)/share/doc/gemini $(DESTDIR)/etc/gemini
	install -s -m 755 $(addprefix $(RELEASE_DIR)/,$(BINS)) $(DESTDIR)$(PREFIX)/bin/
	install -s -m 755 $(RELEASE_DIR)/libgemhook.so $(RELEASE_DIR)/libgemzmq.so $(DESTDIR)$(PREFIX)/lib/
	ln -sf libgemhook.so $(DESTDIR)$(PREFIX)/lib/libgemhook.so.1
	for u in $(UNITS); do sed 's|@PREFIX@|$(PREFIX)|g' dist/$$u.service > $(DESTDIR)$(PREFIX)/lib/systemd/system/$$u.service; done
	install -m 644 README.md $(DESTDIR)$(PREFIX)/share/doc/gemini/README.md
	install -d $(DESTDIR)$(PREFIX)/share/doc/gemini/docs
	install -m 644 docs/*.md docs/*.svg $(DESTDIR)$(PREFIX)/share/doc/gemini/docs/
	install -m 644 CHANGELOG.md $(DESTDIR)$(PREFIX)/share/doc/gemini/CHANGELOG.md
	install -d $(DESTDIR)$(PREFIX)/share/doc/gemini/examples
	install -m 644 examples/gemini.toml examples/resource.conf $(DESTDIR)$(PREFIX)/share/doc/gemini/examples/
	install -d $(DESTDIR)$(PREFIX)/share/gemini/prometheus $(DESTDIR)$(PREFIX)/share/gemini/grafana
	install -m 644 deploy/prometheus/gemini-alerts.yml deploy/prometheus/gemini-alerts.test.yml $(DESTDIR)$(PREFIX)/share/gemini/prometheus/
	install -m 644 deploy/grafana/gemini-dashboard.json $(DESTDIR)$(PREFIX)/share/gemini/grafana/
	test -e $(DESTDIR)/etc/gemini/resource.conf || install -m 644 examples/resource.conf $(DESTDIR)/etc/gemini/resource.conf

# Removes what `make install` put in place, but not /etc/gemini (the
# site's configuration).
uninstall:
	rm -f $(addprefix $(DESTDIR)$(PREFIX)/bin/,$(BINS))
	rm -f $(DESTDIR)$(PREFIX)/lib/libgemhook.so $(DESTDIR)$(PREFIX)/lib/libgemhook.so.1 $(DESTDIR)$(PREFIX)/lib/libgemzmq.so
	rm -f $(foreach u,$(UNITS),$(DESTDIR)$(PREFIX)/lib/systemd/system/$(u).service)
	rm -rf $(DESTDIR)$(PREFIX)/share/doc/gemini $(DESTDIR)$(PREFIX)/share/gemini

clean:
	$(CARGO) clean
