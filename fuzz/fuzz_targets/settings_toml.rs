//! Any text as gemini.toml: parsing and validation never panic, and valid
//! settings keep their invariants.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(raw) = gemini_config::parse_settings(text, "fuzz.toml")
        && let Ok(s) = raw.validate("fuzz.toml")
    {
        assert!(!s.min_quota.is_zero());
        assert!(s.min_quota <= s.base_quota && s.base_quota <= s.max_quota);
    }
});
