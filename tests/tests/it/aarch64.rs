//! The hook on aarch64 (Grace Hopper, GB200): `libgemhook.so`, the driver
//! simulator and the workloads built for `aarch64-unknown-linux-gnu`, run
//! under qemu-user beside the x86-64 scheduler (the socket, the peer
//! credentials and `/proc` are the host kernel's). `make test-aarch64`
//! builds them and runs these tests (ignored otherwise); without the
//! cross build or qemu they skip, saying why.
//!
//! What they prove is that the hook is reached the way the CUDA runtime
//! reaches the driver there: `dlsym(libcuda, "cuGetProcAddress_v2")`,
//! which only the hook's own `dlsym` can answer. (Before, it was built for
//! x86-64 only, and an aarch64 program ran ungated and uncapped.)

use gemini_tests::cpu::CpuTimes;
use gemini_tests::{Gemini, SimEnv, field, now_ns, reports};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

const SEC: u64 = 1_000_000_000;

/// The aarch64 build (`GEMINI_AARCH64_DIR`, set by `make test-aarch64`)
/// and qemu, or why they cannot be had.
fn aarch64() -> Result<(PathBuf, PathBuf), String> {
    let dir = std::env::var_os("GEMINI_AARCH64_DIR")
        .map(PathBuf::from)
        .ok_or("GEMINI_AARCH64_DIR is not set (run `make test-aarch64`)")?;
    for f in [
        "libgemhook.so",
        "libgemzmq.so",
        "libfakecuda.so",
        "gem-workload",
        "gem-memwork",
        "gem-procaddr",
    ] {
        if !dir.join(f).exists() {
            return Err(format!(
                "{} is missing (run `make test-aarch64`)",
                dir.join(f).display()
            ));
        }
    }
    let qemu = ["qemu-aarch64-static", "qemu-aarch64"]
        .iter()
        .find_map(|q| {
            std::env::var_os("PATH")?
                .to_str()?
                .split(':')
                .map(|d| Path::new(d).join(q))
                .find(|p| p.exists())
        })
        .ok_or("no qemu-aarch64-static (Debian: apt-get install qemu-user-static)")?;
    if !Path::new(SYSROOT)
        .join("lib/ld-linux-aarch64.so.1")
        .exists()
    {
        return Err(format!(
            "no aarch64 C library in {SYSROOT} (Debian: apt-get install libc6-arm64-cross)"
        ));
    }
    Ok((dir, qemu))
}

/// Debian's aarch64 cross libraries (`libc6-arm64-cross`,
/// `libstdc++6-arm64-cross`), the guest's root for its loader.
const SYSROOT: &str = "/usr/aarch64-linux-gnu";

/// An aarch64 machine beside `g`'s: its simulated driver (the same
/// `FAKECUDA_DIR`, so one device and one busy log) and `program` of the
/// aarch64 build, run by qemu; with the aarch64 hook for `group`.
struct Arm {
    dir: PathBuf,
    qemu: PathBuf,
    lib: PathBuf,
}

impl Arm {
    fn new(g: &Gemini) -> Option<Arm> {
        let (dir, qemu) = match aarch64() {
            Ok(x) => x,
            Err(why) => {
                eprintln!("SKIPPED: {why}");
                return None;
            }
        };
        let lib = g.dir().join("lib-aarch64");
        std::fs::create_dir_all(&lib).unwrap();
        for name in ["libcuda.so.1", "libcuda.so", "libnvidia-ml.so.1"] {
            let _ = std::os::unix::fs::symlink(dir.join("libfakecuda.so"), lib.join(name));
        }
        Some(Arm { dir, qemu, lib })
    }

    /// `program` of the aarch64 build under qemu, on `g`'s machine, with
    /// the hook for `group` (`None`: without it).
    fn command(&self, g: &Gemini, program: &str, group: Option<&str>) -> Command {
        let mut c = match group {
            Some(group) => g.hooked(g.sim.command(&self.qemu), group),
            None => g.sim.command(&self.qemu),
        };
        // The x86-64 paths the harness set are replaced inside the guest.
        c.env_remove("LD_PRELOAD")
            .arg("-L")
            .arg(SYSROOT)
            .arg("-E")
            .arg(format!("LD_LIBRARY_PATH={}", self.lib.display()));
        if group.is_some() {
            c.arg("-E").arg(format!(
                "LD_PRELOAD={}",
                self.dir.join("libgemhook.so").display()
            ));
        }
        c.arg(self.dir.join(program));
        c
    }
}

/// Runs `c` (standard error captured), which must succeed.
fn succeeded(c: &mut Command) -> Output {
    let out = c.stderr(Stdio::piped()).output().unwrap();
    assert!(
        out.status.success(),
        "{c:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The CUDA runtime's start-up lookups (13.5.37) from an aarch64 program:
/// through the hook's `dlsym` it gets the hook's `cuGetProcAddress_v2`,
/// which answers with the hook's wrappers where it gates or charges, and
/// the driver's answers (results, statuses) unchanged.
#[test]
#[ignore = "needs the aarch64 build and qemu: run `make test-aarch64`"]
fn an_aarch64_runtimes_lookups_reach_the_hook() {
    let g = Gemini::start(SimEnv::default().r615(), "[a]\n");
    let Some(arm) = Arm::new(&g) else { return };
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/cudart-lookups/13.5.37.tsv");
    let run = |group: Option<&str>| {
        String::from_utf8(succeeded(arm.command(&g, "gem-procaddr", group).arg(&file)).stdout)
            .unwrap()
    };
    let (plain, hooked) = (run(None), run(Some("a")));
    assert!(plain.lines().count() > 400, "{plain}");
    crate::procaddr::same_answers("13.5.37 on aarch64", &plain, &hooked);
    for name in [
        "cuLaunchKernel\t",
        "cuMemAlloc\t",
        "cuCtxSynchronize\t13000",
    ] {
        assert!(
            hooked
                .lines()
                .any(|l| l.starts_with(name) && l.ends_with("\thook")),
            "{name}: not the hook's wrapper:\n{hooked}"
        );
    }
}

/// The aarch64 hook links its unwinder in too (no `libgcc_s.so.1`, which
/// every process it was preloaded into paid to load), its ZeroMQ socket
/// its C++ runtime (no `libstdc++.so.6`), and a panic still
/// unwinds through its frames to its entry points' `catch_unwind`.
#[test]
#[ignore = "needs the aarch64 build and qemu: run `make test-aarch64`"]
fn the_aarch64_hook_unwinds_without_libgcc_s() {
    let g = Gemini::start(SimEnv::default(), "[a]\n");
    let Some(arm) = Arm::new(&g) else { return };
    gemini_tests::assert_no_libgcc_s(&arm.dir.join("libgemhook.so"));
    gemini_tests::assert_no_libstdcxx(&arm.dir.join("libgemzmq.so"));
    succeeded(
        arm.command(&g, "gem-workload", Some("a"))
            .arg("--hook-unwinds"),
    );
}

/// An aarch64 program capped at `MaxUtil` 0.3 gets at most that share of
/// the device, and one under `MemoryLimit` 256 MiB is refused past it.
#[test]
#[ignore = "needs the aarch64 build and qemu: run `make test-aarch64`"]
fn an_aarch64_program_is_gated_and_capped() {
    let g = Gemini::start(
        SimEnv::new(1, "1GiB"),
        "[a]\nMaxUtil=0.3\nMemoryLimit=256MiB\n",
    );
    let Some(arm) = Arm::new(&g) else { return };
    let cpu = CpuTimes::now();
    let t0 = now_ns();
    let out = succeeded(arm.command(&g, "gem-workload", Some("a")).args([
        "--seconds",
        "4",
        "--kernel-us",
        "1000",
        "--iter-kernels",
        "10",
    ]));
    let pid = field(&reports(&out.stdout)[0], "pid") as u32;
    let share = g.sim.busy(0, t0 + 2 * SEC, t0 + 4 * SEC).share(pid);
    // Over the cap fails always (a starved program only gets less); under
    // it, only where the host left the CPU (qemu is slow enough).
    assert!(
        share <= 0.35,
        "MaxUtil 0.3 on aarch64: the workload took {share:.3} of the device"
    );
    if cpu.counts("the aarch64 workload's share under MaxUtil 0.3") {
        assert!(
            share > 0.05,
            "MaxUtil 0.3 on aarch64: the workload took only {share:.3} of the device"
        );
    }
    let out = succeeded(
        arm.command(&g, "gem-memwork", Some("a"))
            .args(["context", "--chunk", "64MiB"])
            .stdin(Stdio::null()),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("memwork allocated=268435456 error=2"),
        "MemoryLimit 256 MiB on aarch64: {text}"
    );
}
