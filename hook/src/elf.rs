//! glibc's own `dlsym` and `dlvsym`, found in the dynamic symbol table of
//! the loaded `libc.so.6` (or `libdl.so.2`, where glibc before 2.34 keeps
//! them) rather than through `dlvsym`, which the hook interposes. Runs
//! inside the first `dlsym` or `dlvsym` call of the process: it allocates
//! nothing and takes no lock of ours (`dl_iterate_phdr` takes the loader's
//! own, recursive one).

use std::ffi::{CStr, c_int, c_void};

const PT_DYNAMIC: u32 = 2;
const DT_NULL: i64 = 0;
const DT_HASH: i64 = 4;
const DT_STRTAB: i64 = 5;
const DT_SYMTAB: i64 = 6;
const DT_GNU_HASH: i64 = 0x6fff_fef5;
const DT_VERSYM: i64 = 0x6fff_fff0;
/// `VERSYM_HIDDEN`: a version other than the symbol's default.
const VERSYM_HIDDEN: u16 = 0x8000;
/// `STT_FUNC`, `STT_GNU_IFUNC`: the symbol types of functions.
const STT_FUNC: u8 = 2;
const STT_GNU_IFUNC: u8 = 10;

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

/// One search over the loaded objects.
struct Search<'a> {
    name: &'a [u8],
    found: usize,
}

/// The address of glibc's function `name` in its default version (the
/// one a program linked today gets, `dlsym@@GLIBC_2.34` rather than the
/// older `dlsym@GLIBC_2.2.5`), or 0.
pub fn libc_function(name: &CStr) -> usize {
    let mut search = Search {
        name: name.to_bytes(),
        found: 0,
    };
    // SAFETY: the callback reads only what the loader hands it, for the
    // duration of the call; `search` outlives it.
    unsafe { libc::dl_iterate_phdr(Some(visit), (&raw mut search).cast()) };
    search.found
}

/// `dl_iterate_phdr`'s callback: looks in `libc.so.6` and `libdl.so.2`,
/// stops at the first that defines the name.
unsafe extern "C" fn visit(
    info: *mut libc::dl_phdr_info,
    _size: usize,
    data: *mut c_void,
) -> c_int {
    // SAFETY: the loader's description of one object, valid for the call;
    // `data` is the `Search` that `libc_function` passed.
    let (info, search) = unsafe { (&*info, &mut *data.cast::<Search>()) };
    if info.dlpi_name.is_null() {
        return 0;
    }
    // SAFETY: the loader's NUL-terminated path.
    let path = unsafe { CStr::from_ptr(info.dlpi_name) }.to_bytes();
    let file = path.rsplit(|&c| c == b'/').next().unwrap_or(path);
    if file != b"libc.so.6" && file != b"libdl.so.2" {
        return 0;
    }
    search.found = defined(info, search.name);
    i32::from(search.found != 0)
}

/// The address of the function `name` that the object defines in its
/// default version, or 0.
fn defined(info: &libc::dl_phdr_info, name: &[u8]) -> usize {
    let base = info.dlpi_addr;
    // SAFETY: `dlpi_phdr` holds `dlpi_phnum` program headers of a loaded
    // object.
    let phdrs = unsafe { std::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum as usize) };
    let Some(dynamic) = phdrs.iter().find(|p| p.p_type == PT_DYNAMIC) else {
        return 0;
    };
    // A pointer of the dynamic section: relocated by the loader, or not
    // (then relative to the object's base).
    let at = |v: u64| if v < base { base + v } else { v };
    let (mut symtab, mut strtab, mut hash, mut gnu_hash, mut versym) = (0, 0, 0, 0, 0);
    let mut d = (base + dynamic.p_vaddr) as *const Dyn;
    // SAFETY: the object's mapped dynamic section, ended by DT_NULL.
    unsafe {
        while (*d).tag != DT_NULL {
            match (*d).tag {
                DT_SYMTAB => symtab = at((*d).val),
                DT_STRTAB => strtab = at((*d).val),
                DT_HASH => hash = at((*d).val),
                DT_GNU_HASH => gnu_hash = at((*d).val),
                DT_VERSYM => versym = at((*d).val),
                _ => {}
            }
            d = d.add(1);
        }
    }
    if symtab == 0 || strtab == 0 {
        return 0;
    }
    // SAFETY: the hash tables of a loaded object, as the loader uses them.
    let count = unsafe {
        if hash != 0 {
            *(hash as *const u32).add(1) as usize
        } else if gnu_hash != 0 {
            gnu_symbols(gnu_hash)
        } else {
            return 0;
        }
    };
    for i in 0..count {
        // SAFETY: `count` symbols, as the hash table says.
        let sym = unsafe { &*(symtab as *const Sym).add(i) };
        let kind = sym.info & 0xf;
        if sym.shndx == 0 || sym.name == 0 || (kind != STT_FUNC && kind != STT_GNU_IFUNC) {
            continue;
        }
        // SAFETY: one version half-word per symbol, where the table exists.
        if versym != 0 && unsafe { *(versym as *const u16).add(i) } & VERSYM_HIDDEN != 0 {
            continue;
        }
        // SAFETY: a name in the object's string table.
        if unsafe { CStr::from_ptr((strtab + u64::from(sym.name)) as *const _) }.to_bytes() == name
        {
            // dlsym and dlvsym are plain functions in every glibc; an
            // indirect one would need its resolver called: not ours to do.
            return if kind == STT_FUNC {
                (base + sym.value) as usize
            } else {
                0
            };
        }
    }
    0
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glibc_s_default_dlsym_and_dlvsym_are_found_without_dlvsym() {
        for name in [c"dlsym", c"dlvsym", c"dlopen"] {
            let ours = libc_function(name);
            assert_ne!(ours, 0, "{name:?}");
            // The address a program linked today gets for the name.
            // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name (the
            // test binary does not interpose it).
            let linked = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) } as usize;
            assert_eq!(ours, linked, "{name:?}");
        }
        assert_eq!(libc_function(c"no_such_function_anywhere"), 0);
        // A data object is not a function.
        assert_eq!(libc_function(c"environ"), 0);
    }
}
