//! `gem-procaddr FILE`: asks the driver (`libcuda.so.1`, through its
//! `cuGetProcAddress_v2`, found with `dlsym` as the CUDA runtime finds
//! it) for every entry point a `cudart-lookups` file lists, and prints a
//! line per request: `symbol version flags result status found owner`,
//! where owner is `hook` for a function of `libgemhook.so`, `driver` for
//! any other, `-` for none. Run with and without the hook, the two
//! outputs tell whether the hook changed what a runtime gets.

use anyhow::{Context as _, bail};
use std::ffi::{CStr, CString, c_char, c_void};

type GetProc = unsafe extern "C" fn(*const c_char, *mut *mut c_void, i32, u64, *mut i32) -> i32;

/// Which library `f` is in.
fn owner(f: *mut c_void) -> &'static str {
    if f.is_null() {
        return "-";
    }
    // SAFETY: dladdr only reads the loader's tables; `info` is a local.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::dladdr(f, &mut info) } == 0 || info.dli_fname.is_null() {
        return "driver";
    }
    // SAFETY: dladdr filled a NUL-terminated path.
    let path = unsafe { CStr::from_ptr(info.dli_fname) }.to_string_lossy();
    if path.contains("gemhook") {
        "hook"
    } else {
        "driver"
    }
}

fn main() -> anyhow::Result<()> {
    let Some(file) = std::env::args().nth(1) else {
        bail!("usage: gem-procaddr FILE (a cudart-lookups .tsv)");
    };
    let text = std::fs::read_to_string(&file).with_context(|| file.clone())?;
    // SAFETY: the driver library's initialisers are its own.
    let lib = unsafe { libloading::Library::new("libcuda.so.1") }.context("dlopen libcuda.so.1")?;
    // SAFETY: cuGetProcAddress_v2's C signature.
    let get = *unsafe { lib.get::<GetProc>(b"cuGetProcAddress_v2\0") }?;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let mut f = line.split('\t');
        let (Some(symbol), Some(version), Some(flags)) = (f.next(), f.next(), f.next()) else {
            bail!("{file}: not `symbol version flags`: {line:?}");
        };
        let version: i32 = version
            .parse()
            .with_context(|| format!("{file}: {line:?}"))?;
        let flags: u64 = flags.parse().with_context(|| format!("{file}: {line:?}"))?;
        let name = CString::new(symbol)?;
        let (mut p, mut status) = (std::ptr::null_mut(), -1);
        // SAFETY: a NUL-terminated name and out-pointers to locals.
        let r = unsafe { get(name.as_ptr(), &mut p, version, flags, &mut status) };
        println!(
            "{symbol}\t{version}\t{flags}\t{r}\t{status}\t{}\t{}",
            !p.is_null(),
            owner(p)
        );
    }
    Ok(())
}
