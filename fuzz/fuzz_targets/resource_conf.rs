//! Any text as resource.conf: parsing never panics, and a file that
//! parses satisfies every validation rule.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok((cfg, _)) = gemini_config::parse_resource(text, "fuzz.conf".as_ref()) {
        let mut sum = 0.0;
        for g in cfg.groups.values() {
            assert!((0.0..=1.0).contains(&g.min_util) && (0.0..=1.0).contains(&g.max_util));
            assert!(g.min_util <= g.max_util);
            sum += g.min_util;
        }
        assert!(sum <= 1.0 + 1e-6);
    }
});
