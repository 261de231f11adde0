# gemini: `make` builds, `make test` runs the tests, `make demo` shows gemini
# at work on the driver simulator, `make bench` measures, `make install
# PREFIX=/usr/local` installs.

CARGO ?= cargo
PREFIX ?= /usr/local
RELEASE_DIR := target/release

.PHONY: all build release test demo bench test-gpu install lint fmt clean

all: build

build:
	$(CARGO) build --workspace

release:
	$(CARGO) build --workspace --release

test:
	$(CARGO) build --workspace --all-targets
	$(CARGO) test --workspace

demo: release
	$(RELEASE_DIR)/gem-demo examples/resource.conf

bench: release
	$(RELEASE_DIR)/gem-bench --write docs/benchmarks.md

# Skips (exit 0) where there is no NVIDIA GPU; needs the release binaries
# (built here when cargo is available) and PyTorch.
test-gpu:
	@if ! nvidia-smi -L >/dev/null 2>&1; then echo "no NVIDIA GPU found, skipped"; exit 0; fi; \
	if command -v $(CARGO) >/dev/null 2>&1; then $(CARGO) build --workspace --release || exit 1; fi; \
	GEMINI_BIN_DIR=$(RELEASE_DIR) python3 tests/gpu/gpu_suite.py docs/gpu-results.md

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all

install: release
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/lib $(DESTDIR)$(PREFIX)/lib/systemd/system $(DESTDIR)/etc/gemini
	install -m 755 $(RELEASE_DIR)/gem-schd $(RELEASE_DIR)/gem-holder $(RELEASE_DIR)/gem-launch $(DESTDIR)$(PREFIX)/bin/
	install -m 755 $(RELEASE_DIR)/libgemhook.so $(DESTDIR)$(PREFIX)/lib/
	ln -sf libgemhook.so $(DESTDIR)$(PREFIX)/lib/libgemhook.so.1
	for u in gem-schd gem-holder; do sed 's|@PREFIX@|$(PREFIX)|g' dist/$$u.service > $(DESTDIR)$(PREFIX)/lib/systemd/system/$$u.service; done
	test -e $(DESTDIR)/etc/gemini/resource.conf || install -m 644 examples/resource.conf $(DESTDIR)/etc/gemini/resource.conf

clean:
	$(CARGO) clean
