# gemini: `make` builds, `make test` runs the tests, `make demo` shows the
# scheduler at work, `make install PREFIX=/usr/local` installs.

CARGO ?= cargo
PREFIX ?= /usr/local
RELEASE_DIR := target/release

.PHONY: all build release test demo install lint fmt clean

all: build

build:
	$(CARGO) build --workspace

release:
	$(CARGO) build --workspace --release --bins --examples

test:
	$(CARGO) build --workspace --all-targets
	$(CARGO) test --workspace

demo: release
	BIN=$(RELEASE_DIR) scripts/demo.sh

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all

install: release
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/lib/systemd/system $(DESTDIR)/etc/gemini
	install -m 755 $(RELEASE_DIR)/gem-schd $(DESTDIR)$(PREFIX)/bin/
	sed 's|@PREFIX@|$(PREFIX)|g' dist/gem-schd.service > $(DESTDIR)$(PREFIX)/lib/systemd/system/gem-schd.service
	test -e $(DESTDIR)/etc/gemini/resource.conf || install -m 644 examples/resource.conf $(DESTDIR)/etc/gemini/resource.conf

clean:
	$(CARGO) clean
