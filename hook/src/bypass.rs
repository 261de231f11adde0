//! Lookups that cannot reach the hook, said once rather than left to run
//! ungated unnoticed. The hook answers `dlsym` and the driver's
//! `cuGetProcAddress`; it does not interpose `dlvsym` (glibc's `dlsym` is
//! found through it), so a library that finds the driver's entry points
//! with `dlvsym` would call them directly. No CUDA library we know of
//! does; a loaded object that imports `dlvsym` is named once, at the first
//! token request after it was loaded. (A library loaded with
//! `RTLD_DEEPBIND` is named by the hook's `dlopen`.)

use crate::log::error;
use std::ffi::{CStr, c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// `dlpi_adds` when the loaded objects were last looked through.
static SEEN_ADDS: AtomicU64 = AtomicU64::new(0);
/// Whether a `dlvsym` importer was named already.
static TOLD: AtomicBool = AtomicBool::new(false);

const PT_DYNAMIC: u32 = 2;
const DT_NULL: i64 = 0;
const DT_HASH: i64 = 4;
const DT_STRTAB: i64 = 5;
const DT_SYMTAB: i64 = 6;
const DT_GNU_HASH: i64 = 0x6fff_fef5;

/// `Elf64_Dyn`.
#[repr(C)]
struct Dyn {
    tag: i64,
    val: u64,
}

/// `Elf64_Sym`.
#[repr(C)]
struct Sym {
    name: u32,
    info: u8,
    other: u8,
    shndx: u16,
    value: u64,
    size: u64,
}

/// One walk over the loaded objects.
struct Walk {
    /// No object visited yet.
    first: bool,
    /// The first object that imports `dlvsym`.
    found: Option<String>,
}

/// Looks through the loaded objects if any was loaded since the last
/// look, and names the first that imports `dlvsym` (once per process).
/// Cheap when nothing new was loaded: one callback of `dl_iterate_phdr`.
pub fn check() {
    if TOLD.load(Ordering::Relaxed) {
        return;
    }
    let mut walk = Walk {
        first: true,
        found: None,
    };
    // SAFETY: the callback reads only what the loader hands it, for the
    // duration of the call; `walk` outlives it.
    unsafe { libc::dl_iterate_phdr(Some(visit), (&raw mut walk).cast()) };
    if let Some(name) = walk.found
        && !TOLD.swap(true, Ordering::Relaxed)
    {
        error!(
            "{name} looks symbols up with dlvsym, which gemini does not interpose: \
             CUDA entry points found that way bypass the hook (not gated, not capped)"
        );
    }
}

/// `dl_iterate_phdr`'s callback: stops at the first object when nothing
/// was loaded since the last walk; else notes in the [`Walk`] the first
/// object that imports `dlvsym`.
unsafe extern "C" fn visit(
    info: *mut libc::dl_phdr_info,
    _size: usize,
    data: *mut c_void,
) -> c_int {
    // SAFETY: the loader's description of one object, valid for the call;
    // `data` is the `Walk` that `check` passed.
    let (info, walk) = unsafe { (&*info, &mut *data.cast::<Walk>()) };
    if walk.first {
        walk.first = false;
        let adds = info.dlpi_adds;
        if SEEN_ADDS.swap(adds, Ordering::Relaxed) == adds {
            return 1;
        }
    }
    if walk.found.is_some() || !imports_dlvsym(info) {
        return 0;
    }
    let name = if info.dlpi_name.is_null() {
        String::new()
    } else {
        // SAFETY: the loader's NUL-terminated path.
        unsafe { CStr::from_ptr(info.dlpi_name) }
            .to_string_lossy()
            .into_owned()
    };
    // The hook itself imports dlvsym, to find glibc's dlsym.
    if !name.contains("gemhook") {
        walk.found = Some(if name.is_empty() {
            std::env::current_exe()
                .map(|p| p.display().to_string())
                .unwrap_or_else(|_| "the program".into())
        } else {
            name
        });
    }
    0
}

/// Whether the object's dynamic symbol table has `dlvsym` undefined.
fn imports_dlvsym(info: &libc::dl_phdr_info) -> bool {
    let base = info.dlpi_addr;
    // SAFETY: `dlpi_phdr` holds `dlpi_phnum` program headers of a loaded
    // object.
    let phdrs = unsafe { std::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum as usize) };
    let Some(dynamic) = phdrs.iter().find(|p| p.p_type == PT_DYNAMIC) else {
        return false;
    };
    // A pointer of the dynamic section: relocated by the loader, or not
    // (then relative to the object's base).
    let at = |v: u64| if v < base { base + v } else { v };
    let (mut symtab, mut strtab, mut hash, mut gnu_hash) = (0, 0, 0, 0);
    let mut d = (base + dynamic.p_vaddr) as *const Dyn;
    // SAFETY: the object's mapped dynamic section, ended by DT_NULL.
    unsafe {
        while (*d).tag != DT_NULL {
            match (*d).tag {
                DT_SYMTAB => symtab = at((*d).val),
                DT_STRTAB => strtab = at((*d).val),
                DT_HASH => hash = at((*d).val),
                DT_GNU_HASH => gnu_hash = at((*d).val),
                _ => {}
            }
            d = d.add(1);
        }
    }
    if symtab == 0 || strtab == 0 {
        return false;
    }
    // SAFETY: the hash tables of a loaded object, as the loader uses them.
    let count = unsafe {
        if hash != 0 {
            *(hash as *const u32).add(1) as usize
        } else if gnu_hash != 0 {
            gnu_symbols(gnu_hash)
        } else {
            return false;
        }
    };
    (0..count).any(|i| {
        // SAFETY: `count` symbols, as the hash table says.
        let sym = unsafe { &*(symtab as *const Sym).add(i) };
        // SAFETY: a name in the object's string table.
        sym.shndx == 0
            && sym.name != 0
            && unsafe { CStr::from_ptr((strtab + u64::from(sym.name)) as *const _) }.to_bytes()
                == b"dlvsym"
    })
}

/// The number of dynamic symbols a `DT_GNU_HASH` table covers: past the
/// last chain of the highest bucket.
///
/// # Safety
/// `table` is the address of a loaded object's `DT_GNU_HASH` table.
unsafe fn gnu_symbols(table: u64) -> usize {
    let h = table as *const u32;
    // SAFETY: the header: nbuckets, symoffset, bloom words, bloom shift.
    let (nbuckets, symoffset, bloom) =
        unsafe { (*h as usize, *h.add(1) as usize, *h.add(2) as usize) };
    // SAFETY: 64-bit bloom words follow the 16-byte header, then buckets.
    let buckets = unsafe { (h.add(4) as *const u64).add(bloom) as *const u32 };
    // SAFETY: the chains follow the `nbuckets` buckets.
    let chains = unsafe { buckets.add(nbuckets) };
    // SAFETY: `nbuckets` buckets.
    let last = (0..nbuckets)
        .map(|i| unsafe { *buckets.add(i) } as usize)
        .max()
        .unwrap_or(0);
    if last < symoffset {
        return symoffset;
    }
    let mut i = last;
    // SAFETY: a chain ends with a word whose low bit is set.
    while unsafe { *chains.add(i - symoffset) } & 1 == 0 {
        i += 1;
    }
    i + 1
}
