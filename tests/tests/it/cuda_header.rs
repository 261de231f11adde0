//! Keeping up with CUDA: the hook's one table (`hook/src/table.rs`) checked
//! against `cuda.h` and `cudaTypedefs.h` of each pinned CUDA release,
//! 12.8.90, 13.0.96 and 13.5.37 (`scripts/cuda-headers.sh` fetches them):
//! - every entry names a real versioned entry point (`PFN_<base>_v<since>`,
//!   `_ptsz`/`_ptds` for the per-thread ones) whose parameters agree with
//!   the entry's, in number and in how they are passed (a 32-bit value, a
//!   64-bit value or pointer);
//! - every launch, device allocation, free, memory query and
//!   synchronisation of the header, in its newest version and per-thread
//!   variant, is in the table, as a line of that kind.

use regex::Regex;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;

/// How a parameter is passed on x86-64: in a 32-bit or a 64-bit integer
/// register (pointers and handles are 64-bit), or a float register.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    W32,
    W64,
    F32,
}

/// Entry points of the header the hook deliberately leaves alone, and why.
const NOT_HOOKED: &[(&str, &str)] = &[
    ("cuLaunchHostFunc", "runs a host function: no device time"),
    ("cuMemAllocHost", "host memory: never counted"),
    ("cuMemFreeHost", "host memory: never counted"),
];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .into()
}

/// The pinned CUDA releases whose headers are checked.
const RELEASES: [&str; 3] = ["12.8.90", "13.0.96", "13.5.37"];

/// The headers' directories, one per release, fetched once; `None` where
/// they cannot be had. `GEMINI_CUDA_INCLUDE` names one directory to check
/// instead.
fn headers() -> Option<Vec<(String, PathBuf)>> {
    if let Some(d) = std::env::var_os("GEMINI_CUDA_INCLUDE") {
        return Some(vec![("GEMINI_CUDA_INCLUDE".into(), d.into())]);
    }
    RELEASES
        .iter()
        .map(|v| {
            let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("cuda-headers-{v}"));
            let ok = Command::new(repo().join("scripts/cuda-headers.sh"))
                .arg(&dir)
                .arg(v)
                .status()
                .is_ok_and(|s| s.success());
            ok.then(|| (v.to_string(), dir))
        })
        .collect()
}

/// A C type's class, through `cuda.h`'s typedefs.
struct Types {
    aliases: HashMap<String, String>,
    pointers: BTreeSet<String>,
    enums: BTreeSet<String>,
}

impl Types {
    fn parse(cuda_h: &str) -> Types {
        let pointer = Regex::new(r"typedef\s+struct\s+\w+\s*\*\s*(\w+)\s*;").unwrap();
        let enumeration = Regex::new(r"(?s)typedef\s+enum\s+\w*\s*\{[^}]*\}\s*(\w+)\s*;").unwrap();
        let alias = Regex::new(
            r"typedef\s+((?:unsigned\s+)?(?:long\s+long|int|short|char|\w+))\s+(\w+)\s*;",
        )
        .unwrap();
        Types {
            pointers: pointer
                .captures_iter(cuda_h)
                .map(|c| c[1].to_string())
                .collect(),
            enums: enumeration
                .captures_iter(cuda_h)
                .map(|c| c[1].to_string())
                .collect(),
            // The first definition wins: where a header defines a type for
            // 64-bit platforms and else another, the 64-bit one is first.
            aliases: alias
                .captures_iter(cuda_h)
                .fold(HashMap::new(), |mut m, c| {
                    m.entry(c[2].to_string())
                        .or_insert_with(|| c[1].to_string());
                    m
                }),
        }
    }

    /// The class of a parameter declaration (`const CUstream hStream`).
    fn param(&self, decl: &str) -> Result<Class, String> {
        if decl.contains('*') {
            return Ok(Class::W64);
        }
        let words: Vec<&str> = decl.split_whitespace().filter(|w| *w != "const").collect();
        // The last word is the parameter's name.
        let ty = words[..words.len().saturating_sub(1)].join(" ");
        self.class(&ty)
            .ok_or_else(|| format!("unknown C type `{ty}` in `{decl}`"))
    }

    fn class(&self, ty: &str) -> Option<Class> {
        match ty {
            "int" | "unsigned int" | "unsigned" | "CUresult" => return Some(Class::W32),
            "unsigned long long" | "long long" | "size_t" | "cuuint64_t" => {
                return Some(Class::W64);
            }
            "float" => return Some(Class::F32),
            _ => {}
        }
        if self.pointers.contains(ty) {
            return Some(Class::W64);
        }
        if self.enums.contains(ty) {
            return Some(Class::W32);
        }
        let target = self.aliases.get(ty)?;
        (target != ty).then(|| self.class(target)).flatten()
    }
}

/// `PFN_<base>_v<version>[_ptsz|_ptds]` → parameter declarations.
type Pfns = BTreeMap<(String, u32, String), Vec<String>>;

fn parse_pfns(typedefs_h: &str) -> Pfns {
    let re = Regex::new(
        r"(?s)typedef\s+CUresult\s*\(\s*CUDAAPI\s*\*\s*PFN_(cu\w+?)_v(\d+)(_ptsz|_ptds)?\s*\)\s*\(([^;]*?)\)\s*;",
    )
    .unwrap();
    re.captures_iter(typedefs_h)
        .map(|c| {
            let params: Vec<String> = c[4]
                .split(',')
                .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" "))
                .filter(|p| !p.is_empty() && p != "void")
                .collect();
            (
                (
                    c[1].to_string(),
                    c[2].parse().unwrap(),
                    c.get(3).map_or("", |m| m.as_str()).to_string(),
                ),
                params,
            )
        })
        .collect()
}

/// A line of the hook's table.
#[derive(Debug)]
struct Entry {
    symbol: String,
    base: String,
    since: u32,
    per_thread: bool,
    /// `Launch`, `Alloc`, `Free`, `Query`, …
    kind: String,
    args: Vec<Class>,
}

fn rust_class(ty: &str) -> Class {
    let ty = ty.trim();
    if ty.starts_with('*') || ty == "Ptr" {
        return Class::W64;
    }
    match ty {
        "u32" | "i32" => Class::W32,
        "f32" => Class::F32,
        "usize" | "u64" | "i64" | "CUdeviceptr" => Class::W64,
        other => panic!("table argument type `{other}` has no class here"),
    }
}

fn parse_table(table_rs: &str) -> Vec<Entry> {
    let re = Regex::new(
        r#"(?m)^\s*(cu\w+)\s*\["(\w+)",\s*(\d+),\s*(true|false),\s*(\w+)\]\s*\(([^)]*)\)\s*=>"#,
    )
    .unwrap();
    re.captures_iter(table_rs)
        .map(|c| Entry {
            symbol: c[1].to_string(),
            base: c[2].to_string(),
            since: c[3].parse().unwrap(),
            per_thread: &c[4] == "true",
            kind: c[5].to_string(),
            args: c[6]
                .split(',')
                .filter(|a| !a.trim().is_empty())
                .map(|a| rust_class(a.split_once(':').unwrap().1))
                .collect(),
        })
        .collect()
}

/// The kind of line the hook must have for a base name of the header
/// (`None`: it need not hook it): launches, device allocations, frees and
/// memory queries.
fn must_hook(base: &str) -> Option<&'static str> {
    if NOT_HOOKED.iter().any(|(name, _)| *name == base) {
        return None;
    }
    [
        ("Launch", r"^cu(Launch\w*|GraphLaunch)$"),
        (
            "Alloc",
            r"^cu(MemAlloc\w*|MemCreate|(Mipmapped)?Array(3D)?Create)$",
        ),
        (
            "Free",
            r"^cu(MemFree\w*|MemRelease|(Mipmapped)?ArrayDestroy)$",
        ),
        ("Query", r"^cu(MemGetInfo|DeviceTotalMem)$"),
        ("Sync", r"^cu(Ctx|Stream|Event)Synchronize$"),
    ]
    .into_iter()
    .find(|(_, re)| Regex::new(re).unwrap().is_match(base))
    .map(|(kind, _)| kind)
}

#[test]
fn the_hook_table_matches_the_pinned_cuda_headers() {
    let Some(dirs) = headers() else {
        eprintln!(
            "NOT CHECKED: the pinned CUDA headers could not be fetched (offline?); \
             set GEMINI_CUDA_INCLUDE to a directory with cuda.h and cudaTypedefs.h"
        );
        return;
    };
    let table = std::fs::read_to_string(repo().join("hook/src/table.rs")).unwrap();
    let entries = parse_table(&table);
    assert!(entries.len() > 40, "parsed {} table entries", entries.len());
    let mut problems = Vec::new();
    // Each entry must be in some release's header (a newer release keeps
    // every older entry point, but an entry may be newer than the oldest).
    let mut unknown: BTreeSet<String> = entries.iter().map(|e| e.symbol.clone()).collect();
    for (release, dir) in &dirs {
        let (found, wrong) = check_release(dir, &entries);
        unknown.retain(|s| !found.contains(s));
        problems.extend(wrong.into_iter().map(|p| format!("CUDA {release}: {p}")));
    }
    for symbol in unknown {
        problems.push(format!(
            "{symbol}: no PFN typedef of its version in any pinned release's cudaTypedefs.h"
        ));
    }
    assert!(
        problems.is_empty(),
        "the hook's table disagrees with CUDA's headers:\n{}",
        problems.join("\n")
    );
}

/// The table's entries checked against one release's headers in `dir`:
/// the symbols of the entries the header types, and what disagrees.
fn check_release(dir: &Path, entries: &[Entry]) -> (BTreeSet<String>, Vec<String>) {
    let cuda_h = std::fs::read_to_string(dir.join("cuda.h")).unwrap();
    let typedefs = std::fs::read_to_string(dir.join("cudaTypedefs.h")).unwrap();
    let types = Types::parse(&cuda_h);
    let pfns = parse_pfns(&typedefs);
    assert!(pfns.len() > 500, "parsed {} PFN typedefs", pfns.len());

    let mut problems = Vec::new();
    let mut found_symbols = BTreeSet::new();
    for e in entries {
        let variants: &[&str] = if e.per_thread {
            &["_ptsz", "_ptds"]
        } else {
            &[""]
        };
        let found = variants
            .iter()
            .find_map(|v| pfns.get(&(e.base.clone(), e.since, v.to_string())));
        let Some(params) = found else {
            continue;
        };
        found_symbols.insert(e.symbol.clone());
        let want: Result<Vec<Class>, String> = params.iter().map(|p| types.param(p)).collect();
        match want {
            Err(why) => problems.push(format!("{}: {why}", e.symbol)),
            Ok(want) if want != e.args => problems.push(format!(
                "{}: the table passes {:?}, the header declares ({}) = {want:?}",
                e.symbol,
                e.args,
                params.join(", ")
            )),
            Ok(_) => {}
        }
    }
    // Completeness: the newest version of each variant of every launch,
    // allocation, free and memory query, as a line of its kind.
    let mut newest: BTreeMap<(String, String), u32> = BTreeMap::new();
    for (base, version, variant) in pfns.keys() {
        if must_hook(base).is_some() {
            let v = newest.entry((base.clone(), variant.clone())).or_default();
            *v = (*v).max(*version);
        }
    }
    for ((base, variant), version) in &newest {
        let kind = must_hook(base).unwrap_or_default();
        let line = entries
            .iter()
            .find(|e| &e.base == base && e.since == *version && e.per_thread != variant.is_empty());
        match line {
            None => problems.push(format!(
                "PFN_{base}_v{version}{variant} (kind {kind}) is not in the hook's table"
            )),
            Some(e) if e.kind != kind => problems.push(format!(
                "{}: kind {} in the table, but the header's {base} is a {kind}",
                e.symbol, e.kind
            )),
            Some(_) => {}
        }
    }
    assert!(newest.len() >= 20, "{newest:?}");
    (found_symbols, problems)
}

/// The simulator's `cuGetProcAddress` tables (kept apart from the hook's,
/// so that a mistake in one is not copied into the other) name versions
/// the header has: every versioned variant is a `PFN_<base>_v<version>`,
/// and every function is introduced at the first version the header
/// types it with. (The simulator introduced `cuLaunchKernelEx` at 11080;
/// the header, and the hook, at 11060.)
#[test]
fn the_simulators_versions_match_the_pinned_cuda_headers() {
    let Some(dirs) = headers() else {
        eprintln!("NOT CHECKED: the pinned CUDA headers could not be fetched (offline?)");
        return;
    };
    // The newest release types every version the older ones do.
    let (_, dir) = dirs.last().unwrap();
    let typedefs = std::fs::read_to_string(dir.join("cudaTypedefs.h")).unwrap();
    let pfns = parse_pfns(&typedefs);
    let first = |base: &str| {
        pfns.keys()
            .filter(|(b, _, _)| b == base)
            .map(|(_, v, _)| *v)
            .min()
    };
    let src = std::fs::read_to_string(repo().join("tests/fakecuda/src/procaddr.rs")).unwrap();
    let section = |name: &str| {
        let from = src.find(&format!("pub const {name}")).unwrap();
        let len = src[from..].find("];").unwrap();
        src[from..from + len].to_string()
    };
    let versioned: Vec<(String, u32, String)> =
        Regex::new(r#"\(\s*"(cu\w+)",\s*(\d+),\s*"(cu\w+)",?\s*\)"#)
            .unwrap()
            .captures_iter(&section("VERSIONED"))
            .map(|c| (c[1].to_string(), c[2].parse().unwrap(), c[3].to_string()))
            .collect();
    let introduced: Vec<(String, u32)> = Regex::new(r#"\(\s*"(cu\w+)",\s*(\d+)\s*\)"#)
        .unwrap()
        .captures_iter(&section("INTRODUCED"))
        .map(|c| (c[1].to_string(), c[2].parse().unwrap()))
        .collect();
    assert!(versioned.len() > 30, "parsed {versioned:?}");
    assert!(introduced.len() > 20, "parsed {introduced:?}");
    let mut problems = Vec::new();
    for (base, version, symbol) in &versioned {
        let typed = pfns.contains_key(&(base.clone(), *version, String::new()));
        // CUDA 12's cuda.h defines cuGraphInstantiate as
        // cuGraphInstantiateWithFlags: the variant is another function.
        let renamed = !symbol.starts_with(&format!("{base}_v")) && first(symbol).is_some();
        if !typed && !renamed {
            problems.push(format!(
                "{base} at {version} ({symbol}): no PFN_{base}_v{version}"
            ));
        }
    }
    for (name, version) in &introduced {
        match first(name) {
            Some(v) if v == *version => {}
            Some(v) => problems.push(format!(
                "{name} is introduced at {version} in the simulator, at {v} in the header"
            )),
            None => problems.push(format!("{name}: no PFN_{name}_v… in the header")),
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
}

#[test]
fn the_parsers_read_what_they_claim() {
    let types = Types::parse(
        "typedef struct CUstream_st *CUstream;\n\
         typedef unsigned long long CUdeviceptr_v2;\ntypedef CUdeviceptr_v2 CUdeviceptr;\n\
         typedef enum CUmode_enum {\n A = 0,\n B = 1\n} CUmode;\ntypedef int CUdevice_v1;\n",
    );
    assert_eq!(types.param("CUstream hStream"), Ok(Class::W64));
    assert_eq!(types.param("CUdeviceptr dptr"), Ok(Class::W64));
    assert_eq!(types.param("CUmode mode"), Ok(Class::W32));
    assert_eq!(types.param("CUdevice_v1 dev"), Ok(Class::W32));
    assert_eq!(types.param("const void *p"), Ok(Class::W64));
    assert!(types.param("CUnknown x").is_err());
    let pfns = parse_pfns(
        "typedef CUresult (CUDAAPI *PFN_cuLaunchKernel_v7000_ptsz)(CUfunction f,\n unsigned int x);\n\
         typedef CUresult (CUDAAPI *PFN_cuCtxSynchronize_v2000)(void);",
    );
    assert_eq!(
        pfns[&("cuLaunchKernel".into(), 7000, "_ptsz".into())],
        ["CUfunction f", "unsigned int x"]
    );
    assert!(pfns[&("cuCtxSynchronize".into(), 2000, String::new())].is_empty());
    let entries = parse_table(
        "    cuMemAlloc_v2 [\"cuMemAlloc\", 3020, false, Alloc] (dptr: *mut CUdeviceptr, bytes: usize) => |call| x;",
    );
    assert_eq!(entries[0].symbol, "cuMemAlloc_v2");
    assert_eq!(entries[0].kind, "Alloc");
    assert_eq!(entries[0].args, [Class::W64, Class::W64]);
    assert_eq!(must_hook("cuLaunchKernelEx"), Some("Launch"));
    assert_eq!(must_hook("cuArray3DCreate"), Some("Alloc"));
    assert_eq!(must_hook("cuMemFreeAsync"), Some("Free"));
    assert_eq!(must_hook("cuMemGetInfo"), Some("Query"));
    assert_eq!(must_hook("cuLaunchHostFunc"), None);
    assert_eq!(must_hook("cuMemAllocHost"), None);
    assert_eq!(must_hook("cuMemFreeHost"), None);
    assert_eq!(must_hook("cuCtxSynchronize"), Some("Sync"));
    assert_eq!(must_hook("cuCtxSetCurrent"), None);
}
