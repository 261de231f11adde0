//! Links the unwinder statically where the C toolchain has it.
//!
//! Rust's standard library names `libgcc_s.so.1` for its unwinder (the
//! hook catches a panic at every entry point, see `table.rs`, and so
//! unwinds). Loading that library cost every process the hook is
//! preloaded into 0.07-0.1 ms, most of what the hook added to a `/bin/true`
//! (0.12-0.15 ms). The same unwinder is in GCC's `libgcc_eh.a`: named
//! before the standard library's `-lgcc_s`, it defines the `_Unwind_*`
//! symbols first, `--as-needed` leaves `libgcc_s` out, and the library's
//! cdylib version script keeps them private. A toolchain without it (not
//! GCC) links as before.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    // GNU targets only: musl's std brings its own unwinder.
    if std::env::var("CARGO_CFG_TARGET_ENV").as_deref() != Ok("gnu") {
        return;
    }
    let Some(dir) = libgcc_eh_dir() else {
        println!("cargo:warning=libgcc_eh.a not found: libgemhook.so needs libgcc_s.so.1");
        return;
    };
    println!("cargo:rustc-link-search=native={}", dir.display());
    println!("cargo:rustc-link-lib=static=gcc_eh");
    // The hook's own references to the functions it exports (the tables
    // it hands out for `cuGetProcAddress` and `dlsym`) bound when linked:
    // 120 fewer symbol lookups at every load. A preloaded library comes
    // first in the lookup order anyway, so they bound to it before.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-Bsymbolic-functions");
}

/// The directory of the target's `libgcc_eh.a`, as the target's C compiler
/// (the one the `cc` crate picks: `CC_<target>`, `TARGET_CC`, `CC`, or the
/// default; it tells cargo to build again when those change) finds it.
fn libgcc_eh_dir() -> Option<PathBuf> {
    let compiler = cc::Build::new().try_get_compiler().ok()?;
    let out = Command::new(compiler.path())
        .arg("-print-file-name=libgcc_eh.a")
        .output()
        .ok()?;
    let path = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    // Not found, GCC prints the name alone.
    if !out.status.success() || !path.is_absolute() || !path.is_file() {
        return None;
    }
    path.parent().map(PathBuf::from)
}
