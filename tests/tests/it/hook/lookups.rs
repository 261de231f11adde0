//! How programs find the driver: `RTLD_DEEPBIND`, `dlvsym`.

use super::*;

/// A library that loads the driver with `RTLD_DEEPBIND` binds its own
/// dependencies first, so its calls may bypass the hook: the hook says so
/// once, naming it, instead of letting it run ungated unnoticed.
#[test]
fn a_driver_loaded_with_rtld_deepbind_is_said_once() {
    let g = Gemini::start(SimEnv::default(), "[a]\n");
    let c = rust(
        &g,
        "a",
        &["--deepbind", "--seconds", "0.2", "--kernel-us", "1000"],
    );
    let out = finish(spawn(c));
    let log = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        log.matches("libcuda.so.1 is loaded with RTLD_DEEPBIND")
            .count(),
        1,
        "{log}"
    );
    let plain = finish(spawn(rust(
        &g,
        "a",
        &["--seconds", "0.2", "--kernel-us", "1000"],
    )));
    assert!(!String::from_utf8_lossy(&plain.stderr).contains("RTLD_DEEPBIND"));
}

/// A library that finds glibc's functions with `dlvsym`, as the CUDA
/// runtime does at 8 sites, gets glibc's answers under the hook (which
/// interposes `dlvsym`), for a `dlopen(NULL)` handle and for
/// `RTLD_NEXT`, and the hook says nothing about it. (The hook of 86b1a80
/// named every such library as one that bypasses it: a false alarm on
/// every PyTorch process.)
#[test]
fn glibc_functions_found_with_dlvsym_are_glibc_s_and_draw_no_warning() {
    let dir = tempfile::tempdir().unwrap();
    let src = format!(
        "#define _GNU_SOURCE\n#include <dlfcn.h>\n#include <stdio.h>\n#include <stdlib.h>\n{RUNTIME_DLVSYMS}\n\
         __attribute__((constructor)) static void check(void) {{\n\
           void *self = dlopen(NULL, RTLD_NOW);\n\
           for (unsigned i = 0; i < sizeof names / sizeof names[0]; i++) {{\n\
             void *v = dlvsym(self, names[i][0], names[i][1]);\n\
             void *n = dlvsym(RTLD_NEXT, names[i][0], names[i][1]);\n\
             void *d = dlsym(RTLD_DEFAULT, names[i][0]);\n\
             if (!v || v != d || n != d) {{ fprintf(stderr, \"vlookup: %s %p %p %p\\n\", names[i][0], v, n, d); abort(); }}\n\
           }}\n\
           fprintf(stderr, \"vlookup: all found\\n\");\n\
         }}\n"
    );
    let lib = cc(
        dir.path(),
        "libvlookup.so",
        &src,
        &["-shared", "-fPIC", "-ldl"],
    );
    let g = Gemini::start(SimEnv::default(), "[a]\n");
    let mut c = rust(
        &g,
        "a",
        &[
            "--seconds",
            "0.3",
            "--kernel-us",
            "1000",
            "--iter-kernels",
            "5",
        ],
    );
    c.arg("--load-lib").arg(&lib);
    let out = finish(spawn(c));
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains("vlookup: all found"), "{log}");
    let others: Vec<&str> = log.lines().filter(|l| !l.starts_with("vlookup:")).collect();
    assert!(others.is_empty(), "the hook said something: {others:?}");
}

/// `dlvsym` of a driver name answers as glibc does, with the hook's gated
/// function where glibc finds one: glibc's `dlvsym` does not match an
/// unversioned symbol of an object with version tables (the driver's
/// exports, and the simulator's), so `dlvsym(libcuda, "cuLaunchKernel",
/// …)` is null with and without the hook; a versioned `cuLaunchKernel`
/// (a driver shim's) is the hook's under it, as `dlsym` would give.
#[test]
fn a_driver_name_found_with_dlvsym_is_the_hook_s_where_glibc_finds_one() {
    let dir = tempfile::tempdir().unwrap();
    let map = dir.path().join("shim.map");
    std::fs::write(&map, "CUDA_SHIM_1 { global: cuLaunchKernel; local: *; };\n").unwrap();
    let shim = cc(
        dir.path(),
        "libcudashim.so",
        "int cuLaunchKernel(void) { return 999; }\n",
        &[
            "-shared",
            "-fPIC",
            &format!("-Wl,--version-script={}", map.display()),
        ],
    );
    let prog = cc(
        dir.path(),
        "vprobe",
        &format!(
            "#define _GNU_SOURCE\n#include <dlfcn.h>\n#include <stdio.h>\n#include <string.h>\n\
             static const char *in(void *f) {{ Dl_info i; if (!f) return \"null\";\n\
               if (!dladdr(f, &i) || !i.dli_fname) return \"?\"; const char *s = strrchr(i.dli_fname, '/'); return s ? s + 1 : i.dli_fname; }}\n\
             int main(void) {{\n\
               void *shim = dlopen(\"{}\", RTLD_NOW), *drv = dlopen(\"libcuda.so.1\", RTLD_NOW);\n\
               if (!shim || !drv) {{ fprintf(stderr, \"%s\\n\", dlerror()); return 1; }}\n\
               printf(\"shim %s\\n\", in(dlvsym(shim, \"cuLaunchKernel\", \"CUDA_SHIM_1\")));\n\
               printf(\"driver %s\\n\", in(dlvsym(drv, \"cuLaunchKernel\", \"GLIBC_2.2.5\")));\n\
               printf(\"unknown %s\\n\", in(dlvsym(shim, \"cuLaunchKernel\", \"CUDA_SHIM_2\")));\n\
               printf(\"default %s\\n\", in(dlsym(RTLD_DEFAULT, \"cuLaunchKernel\")));\n\
               return 0; }}\n",
            shim.display()
        ),
        &["-ldl"],
    );
    let g = Gemini::start(SimEnv::default(), "[a]\n");
    let run = |hooked: bool| {
        let c = g.sim.command(&prog);
        let c = if hooked { g.hooked(c, "a") } else { c };
        String::from_utf8_lossy(&finish(spawn(c)).stdout).into_owned()
    };
    assert_eq!(
        run(false),
        "shim libcudashim.so\ndriver null\nunknown null\ndefault null\n"
    );
    assert_eq!(
        run(true),
        "shim libgemhook.so\ndriver null\nunknown null\ndefault libgemhook.so\n"
    );
}
