# Sourced by the tests that install gemini's package with dpkg
# (scripts/test-deb.sh, scripts/test-upgrade.sh), which define `fail`.
# Never over an installation of the operator's: these tests edit, remove
# and purge what they installed.
refuse_over_an_installation() {
    if dpkg -s gemini >/dev/null 2>&1; then
        fail "a gemini package is installed already; this test would remove it (dpkg -P gemini first)"
    fi
    local f
    for f in /etc/gemini/resource.conf /usr/bin/gem-schd /usr/lib/libgemhook.so; do
        [ ! -e "$f" ] || fail "$f exists (make install?); this test would take it over and delete it"
    done
}
