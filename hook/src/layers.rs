//! The hook's modules stay in the layers `lib.rs` lists: a module uses
//! only modules of lower layers. The list is read from `lib.rs`'s own
//! documentation, each module's uses from its source (every
//! `crate::name` outside comments; a module's folder counts as the
//! module).

use std::collections::BTreeMap;
use std::path::Path;

/// Module name -> layer, from the numbered list in `lib.rs`'s `//!` lines.
fn layers(lib: &str) -> BTreeMap<String, u32> {
    let mut out = BTreeMap::new();
    let mut layer = 0;
    for line in lib.lines().filter_map(|l| l.strip_prefix("//!")) {
        let t = line.trim_start();
        if let Some((n, _)) = t.split_once(". ")
            && let Ok(n) = n.parse::<u32>()
        {
            layer = n;
        }
        if layer == 0 {
            continue;
        }
        if t.starts_with("Environment:") {
            break;
        }
        for part in line.split("[`").skip(1) {
            if let Some((name, _)) = part.split_once("`]") {
                out.entry(name.to_string()).or_insert(layer);
            }
        }
    }
    out
}

/// The modules `source` uses: `crate::name` outside `//` comments.
fn uses(source: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in source.lines() {
        let code = line.split("//").next().unwrap_or("");
        for part in code.split("crate::").skip(1) {
            let name: String = part
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                out.push(name);
            }
        }
    }
    out
}

#[test]
fn every_module_uses_only_lower_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let lib = std::fs::read_to_string(src.join("lib.rs")).unwrap();
    let layer = layers(&lib);
    let mut wrong = Vec::new();
    let declared = lib
        .lines()
        .filter(|l| l.ends_with(';'))
        .filter_map(|l| l.strip_prefix("mod "));
    for decl in declared {
        let module = decl.trim_end_matches(';').trim();
        if module == "layers" {
            continue;
        }
        let Some(&mine) = layer.get(module) else {
            wrong.push(format!("{module} is in no layer of lib.rs's list"));
            continue;
        };
        let mut files = vec![src.join(format!("{module}.rs"))];
        if let Ok(dir) = std::fs::read_dir(src.join(module)) {
            files.extend(dir.filter_map(Result::ok).map(|e| e.path()));
        }
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap();
            for used in uses(&text) {
                match layer.get(&used) {
                    Some(&theirs) if theirs < mine || used == module => {}
                    Some(&theirs) => wrong.push(format!(
                        "{} (layer {mine}) uses {used} (layer {theirs})",
                        file.display()
                    )),
                    None => wrong.push(format!("{} uses {used}, in no layer", file.display())),
                }
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn the_layer_list_and_the_uses_are_read_as_written() {
    let lib = "//! 1. [`a`], [`b`] (x);\n//!    [`c`];\n//! 2. [`d`]\n//! Environment: [`e`]\n";
    let l = layers(lib);
    assert_eq!(l.get("a"), Some(&1));
    assert_eq!(l.get("c"), Some(&1));
    assert_eq!(l.get("d"), Some(&2));
    assert_eq!(l.get("e"), None);
    assert_eq!(
        uses("use crate::a::{x};\nlet y = crate::b::f(); // crate::c\n"),
        ["a", "b"]
    );
}
