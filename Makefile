# gemini: `make` builds, `make test` runs the tests, `make demo` shows gemini
# at work on the driver simulator, `make bench` measures, `make install
# PREFIX=/usr/local` installs.

CARGO ?= cargo
PREFIX ?= /usr/local
RELEASE_DIR := target/release

.PHONY: all build release test demo bench install lint fmt clean

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
