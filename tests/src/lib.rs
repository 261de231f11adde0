//! Harness for the tests that run several real binaries together: a
//! private simulated GPU machine per test ([`SimEnv`]: a directory with the
//! simulator installed as `libcuda.so.1`, its shared state and busy logs),
//! the workloads, and readers for what they print.
//!
//! Binaries are found in `GEMINI_BIN_DIR` when set, else in the cargo
//! target directory this test executable was built into
//! (`target/<profile>/`); `make test` builds them all first.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod accounts;
pub mod attack;
pub mod cpu;
mod scenario;
pub mod soak;

pub use accounts::{Account, ESCAPE_SLACK, ESCAPE_SLACK_NS};
pub use scenario::*;

pub use fakecuda_log::{Busy, busy, now_ns};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// Directory holding the workspace's binaries and libraries.
pub fn bin_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("GEMINI_BIN_DIR") {
        // Absolute: the simulator's library links and the programs'
        // working directories are elsewhere (a relative one made every
        // program fail to start, and the bench print NaN).
        return std::path::absolute(&d).unwrap_or_else(|_| PathBuf::from(d));
    }
    // target/<profile>/deps/<test-exe>, or target/<profile>/<binary>
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe.parent().expect("executable has a directory");
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir.parent().expect("target dir")
    } else {
        dir
    }
    .to_path_buf()
}

/// A binary of the workspace, checked to exist.
pub fn bin(name: &str) -> PathBuf {
    let p = bin_dir().join(name);
    assert!(
        p.exists(),
        "{} is missing: run `make test` (or `cargo build --workspace`) first",
        p.display()
    );
    p
}

/// Asserts that the shared library at `lib` (of any architecture) does
/// not name `libgcc_s.so.1`: the hook links its unwinder in (see its
/// build.rs), so that a process it is preloaded into loads one library
/// less.
pub fn assert_no_libgcc_s(lib: &Path) {
    assert_not_needed(lib, "libgcc_s");
}

/// Asserts that the shared library at `lib` (of any architecture) does
/// not name the shared C++ runtime: `libgemzmq.so` links it in
/// (`CXXSTDLIB_STATIC` in .cargo/config.toml), as loading
/// `libstdc++.so.6` took 0.9-1.4 ms of every hooked program's first CUDA
/// call.
pub fn assert_no_libstdcxx(lib: &Path) {
    assert_not_needed(lib, "libstdc++");
}

/// Asserts that `lib` needs shared libraries, none named like `name`.
fn assert_not_needed(lib: &Path, name: &str) {
    let out = Command::new("readelf").arg("-d").arg(lib).output().unwrap();
    assert!(
        out.status.success(),
        "readelf -d {}: {out:?}",
        lib.display()
    );
    let dynamic = String::from_utf8_lossy(&out.stdout);
    assert!(dynamic.contains("(NEEDED)"), "{dynamic}");
    assert!(
        !dynamic.contains(name),
        "{} needs {name}: {dynamic}",
        lib.display()
    );
}

/// The C workload, compiled once per test run against the simulator.
pub fn c_workload() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| compile_workload("workload.c", "CC", "cc", "gem-workload-c"))
        .clone()
}

/// The C++ workload (a program with a C++ runtime of its own, as
/// PyTorch has), compiled once per test run against the simulator.
pub fn cxx_workload() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| compile_workload("workload_cxx.cpp", "CXX", "c++", "gem-workload-cxx"))
        .clone()
}

/// `tests/workload/SRC` compiled by the compiler `$COMPILER_VAR` names
/// (`default` without it) against the simulator's `libcuda.so`, as `NAME`
/// beside the binaries.
fn compile_workload(src: &str, compiler_var: &str, default: &str, name: &str) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("workload")
        .join(src);
    let link = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(bin("libfakecuda.so"), link.path().join("libcuda.so")).unwrap();
    let out = bin_dir().join(format!("{name}.{}", std::process::id()));
    let compiler = std::env::var(compiler_var).unwrap_or_else(|_| default.into());
    let status = Command::new(&compiler)
        .args(["-O2", "-Wall", "-pthread", "-o"])
        .arg(&out)
        .arg(&src)
        .arg(format!("-L{}", link.path().display()))
        .arg("-lcuda")
        .status()
        .unwrap_or_else(|e| panic!("cannot run the compiler {compiler}: {e}"));
    assert!(status.success(), "compiling {} failed", src.display());
    let fixed = bin_dir().join(name);
    std::fs::rename(&out, &fixed).unwrap();
    fixed
}

/// A private simulated machine.
#[derive(Debug)]
pub struct SimEnv {
    dir: tempfile::TempDir,
    /// Devices (`FAKECUDA_DEVICES`).
    pub devices: u32,
    /// Memory per device (`FAKECUDA_MEM`).
    pub mem: String,
    /// Launch queue depth per process (`FAKECUDA_QUEUE_DEPTH`).
    pub queue_depth: u32,
    /// Device memory of a context (`FAKECUDA_CTX_MEM`) and of a module
    /// (`FAKECUDA_MODULE_MEM`): none unless a test asks (see
    /// [`SimEnv::driver_memory`]), so that tests count their own bytes.
    pub ctx_mem: String,
    pub module_mem: String,
    /// A driver that serves its versioned entry points (`_v2`, `_ptsz`,
    /// ...) only through `cuGetProcAddress` (`FAKECUDA_PROCADDR_ONLY`).
    pub procaddr_only: bool,
    /// The CUDA version the driver reports (`FAKECUDA_DRIVER_VERSION`;
    /// `None`: the simulator's default, 12.8). See [`SimEnv::r615`].
    pub driver_version: Option<i32>,
    /// Time slice of the devices in µs (`FAKECUDA_TIMESLICE_US`; 0: each
    /// device runs all work in launch order). See [`SimEnv::time_sliced`];
    /// `GEM_TEST_TIMESLICE_US` sets it for every test.
    pub timeslice_us: u32,
    /// How late a blocking wait returns after its work ended, µs
    /// (`FAKECUDA_WAKEUP_US`). See [`SimEnv::slow_wakeup`].
    pub wakeup_us: u32,
}

impl Default for SimEnv {
    fn default() -> Self {
        SimEnv::new(1, "16GiB")
    }
}

impl SimEnv {
    /// `devices` devices of `mem` each.
    pub fn new(devices: u32, mem: &str) -> SimEnv {
        let dir = tempfile::tempdir().unwrap();
        let lib = dir.path().join("lib");
        std::fs::create_dir(&lib).unwrap();
        for name in [
            "libcuda.so.1",
            "libcuda.so",
            "libnvidia-ml.so.1",
            "libnccl.so.2",
        ] {
            std::os::unix::fs::symlink(bin("libfakecuda.so"), lib.join(name)).unwrap();
        }
        SimEnv {
            dir,
            devices,
            mem: mem.into(),
            queue_depth: 128,
            ctx_mem: "0".into(),
            module_mem: "0".into(),
            procaddr_only: false,
            driver_version: None,
            timeslice_us: std::env::var("GEM_TEST_TIMESLICE_US")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
            wakeup_us: 0,
        }
    }

    /// The driver keeps memory of its own as a real one does: `ctx_mem`
    /// for each context, and each module its image.
    pub fn driver_memory(mut self, ctx_mem: &str) -> SimEnv {
        self.ctx_mem = ctx_mem.into();
        self.module_mem = "image".into();
        self
    }

    /// What the simulator says the processes of `group` (run through
    /// [`Gemini::hooked`]) hold now and held at most, per device.
    pub fn group_memory(&self, group: &str) -> fakecuda_log::groups::GroupMemory {
        fakecuda_log::groups::read(&self.sim_dir(), group).unwrap()
    }

    /// The temporary directory of this environment.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Where `libcuda.so.1` is.
    pub fn lib_dir(&self) -> PathBuf {
        self.dir.path().join("lib")
    }

    /// `FAKECUDA_DIR`.
    pub fn sim_dir(&self) -> PathBuf {
        self.dir.path().join("sim")
    }

    /// A command for `program` running on this machine's simulated GPUs.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new(program);
        // No /etc/gemini/gemini.toml of this machine's leaks into a test.
        c.env("GEMINI_SETTINGS", "/dev/null")
            .env("LD_LIBRARY_PATH", self.lib_dir())
            .env("FAKECUDA_DIR", self.sim_dir())
            .env("FAKECUDA_DEVICES", self.devices.to_string())
            .env("FAKECUDA_MEM", &self.mem)
            .env("FAKECUDA_QUEUE_DEPTH", self.queue_depth.to_string())
            .env("FAKECUDA_CTX_MEM", &self.ctx_mem)
            .env("FAKECUDA_MODULE_MEM", &self.module_mem);
        if self.procaddr_only {
            c.env("FAKECUDA_PROCADDR_ONLY", "1");
        }
        if let Some(v) = self.driver_version {
            c.env("FAKECUDA_DRIVER_VERSION", v.to_string());
        }
        if self.timeslice_us > 0 {
            c.env("FAKECUDA_TIMESLICE_US", self.timeslice_us.to_string());
        }
        if self.wakeup_us > 0 {
            c.env("FAKECUDA_WAKEUP_US", self.wakeup_us.to_string());
        }
        c
    }

    /// A host that wakes a blocked wait `us` µs after its work ended (a
    /// blocking-sync context, a loaded CPU).
    pub fn slow_wakeup(mut self, us: u32) -> SimEnv {
        self.wakeup_us = us;
        self
    }

    /// Devices that time-slice the work of different processes in 2 ms
    /// slices, as a real GPU does (an H200 measured about 2 ms).
    pub fn time_sliced(mut self) -> SimEnv {
        self.timeslice_us = 2000;
        self
    }

    /// The machine with an R615 driver (CUDA 13.5), which has per-cgroup
    /// memory limits (`nvmlDeviceSetMemoryLimits_v1`).
    pub fn r615(mut self) -> SimEnv {
        self.driver_version = Some(13050);
        self
    }

    /// The Rust workload (dlopen + cuGetProcAddress_v2).
    pub fn workload(&self) -> Command {
        self.command(bin("gem-workload"))
    }

    /// The C workload (linked against libcuda.so.1).
    pub fn c_workload(&self) -> Command {
        self.command(c_workload())
    }

    /// The C++ workload (linked against libcuda.so.1 and the shared C++
    /// runtime).
    pub fn cxx_workload(&self) -> Command {
        self.command(cxx_workload())
    }

    /// Busy figures of `device` over `[from, to)` ns.
    pub fn busy(&self, device: u32, from: u64, to: u64) -> Busy {
        let recs = fakecuda_log::read(&self.sim_dir(), device).unwrap();
        busy(&recs, from, to)
    }
}

/// For each burst a workload logged with `--bursts-file` (but the first,
/// which also connects to the scheduler: start-up, not preemption), how
/// long its first kernel waited on `device` after the burst began, in ns.
pub fn first_kernel_waits(sim: &SimEnv, device: u32, pid: u32, bursts_file: &Path) -> Vec<u64> {
    let recs = fakecuda_log::read(&sim.sim_dir(), device).unwrap();
    std::fs::read_to_string(bursts_file)
        .unwrap()
        .lines()
        .skip(1)
        .filter_map(|l| l.parse::<u64>().ok())
        .filter_map(|t| {
            recs.iter()
                .filter(|r| r.pid == pid && r.start >= t)
                .map(|r| r.start - t)
                .min()
        })
        .collect()
}

/// The `workload key=value ...` lines a workload printed, as maps.
pub fn reports(stdout: &[u8]) -> Vec<HashMap<String, String>> {
    String::from_utf8_lossy(stdout)
        .lines()
        .filter(|l| l.starts_with("workload "))
        .map(|l| {
            l.split_whitespace()
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        })
        .collect()
}

/// A numeric field of a report.
pub fn field(r: &HashMap<String, String>, key: &str) -> u64 {
    r.get(key)
        .unwrap_or_else(|| panic!("report lacks {key}: {r:?}"))
        .parse()
        .unwrap()
}

/// Writes `resource.conf` in `dir` aside and renames it into place, as an
/// editor saves it (the scheduler never reads half a file).
fn write_conf_in(dir: &Path, text: &str) {
    let tmp = dir.join("resource.conf.tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, dir.join("resource.conf")).unwrap();
}

/// A simulated machine with `gem-schd` running on a private IPC directory:
/// the one harness of the integration tests, the scheduler's own among
/// them.
#[derive(Debug)]
pub struct Gemini {
    /// The simulated GPUs.
    pub sim: SimEnv,
    schd: Option<std::process::Child>,
    flags: Vec<String>,
}

impl Gemini {
    /// Starts the scheduler with `conf` as resource.conf.
    pub fn start(sim: SimEnv, conf: &str) -> Gemini {
        Gemini::start_with(sim, conf, &[])
    }

    /// Starts the scheduler with `conf` and extra command-line flags.
    pub fn start_with(sim: SimEnv, conf: &str, flags: &[&str]) -> Gemini {
        write_conf_in(sim.path(), conf);
        Gemini::start_prepared(sim, flags)
    }

    /// A scheduler with `conf` on a machine of one simulated GPU: the
    /// daemon's own tests.
    pub fn daemon(conf: &str) -> Gemini {
        Gemini::start(SimEnv::default(), conf)
    }

    /// Starts the scheduler on `sim`, whose directory already holds its
    /// `resource.conf` (and whatever else the test put there).
    pub fn start_prepared(sim: SimEnv, flags: &[&str]) -> Gemini {
        let mut g = Gemini {
            sim,
            schd: None,
            flags: flags.iter().map(|s| s.to_string()).collect(),
        };
        g.start_scheduler();
        g
    }

    /// The `gem-schd` command on `sim`'s `resource.conf` and IPC directory,
    /// logging to `schd.log` there, with `flags`.
    fn scheduler_command(sim: &SimEnv, flags: &[String]) -> Command {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(sim.path().join("schd.log"))
            .unwrap();
        let mut cmd = sim.command(bin("gem-schd"));
        cmd.arg("--config")
            .arg(sim.path().join("resource.conf"))
            .arg("--ipc-dir")
            .arg(sim.path().join("ipc"))
            .args(if flags.iter().any(|f| f == "--log-level") {
                &[][..]
            } else {
                &["--log-level", "debug"][..]
            })
            .args(flags)
            .env_remove("GEMINI_IPC_DIR")
            .stderr(log)
            .stdout(std::process::Stdio::null());
        cmd
    }

    /// Spawns a `gem-schd` on `sim`'s directory without waiting for it (one
    /// that is expected to refuse to start, say).
    pub fn spawn_in(sim: &SimEnv, flags: &[&str]) -> std::process::Child {
        let flags: Vec<String> = flags.iter().map(|s| s.to_string()).collect();
        Gemini::scheduler_command(sim, &flags).spawn().unwrap()
    }

    /// The machine's directory (`resource.conf`, `ipc`, `schd.log`).
    pub fn dir(&self) -> &Path {
        self.sim.path()
    }

    /// A new connection to the scheduler.
    pub fn client(&self) -> gemini_scheduler::client::Client {
        gemini_scheduler::client::Client::connect(&self.ipc()).unwrap()
    }

    /// Whether the scheduler process still runs.
    pub fn alive(&mut self) -> bool {
        self.schd
            .as_mut()
            .is_some_and(|c| c.try_wait().unwrap().is_none())
    }

    /// `resource.conf`.
    pub fn conf(&self) -> PathBuf {
        self.sim.path().join("resource.conf")
    }

    /// The IPC directory.
    pub fn ipc(&self) -> PathBuf {
        self.sim.path().join("ipc")
    }

    /// Replaces resource.conf (the scheduler reloads it).
    pub fn write_conf(&self, text: &str) {
        write_conf_in(self.sim.path(), text);
    }

    /// The scheduler's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.sim.path().join("schd.log")).unwrap_or_default()
    }

    /// Starts (or restarts) the scheduler and waits until it answers.
    pub fn start_scheduler(&mut self) {
        self.start_scheduler_with(true);
    }

    /// Starts (or restarts) the scheduler, with the simulated machine's
    /// NVML (which names the GPUs by UUID) or without any, as on a machine
    /// where `libnvidia-ml.so.1` cannot be loaded.
    pub fn start_scheduler_with(&mut self, nvml: bool) {
        let mut cmd = Gemini::scheduler_command(&self.sim, &self.flags);
        if !nvml {
            cmd.env_remove("LD_LIBRARY_PATH");
        }
        let child = cmd.spawn().unwrap();
        self.schd = Some(child);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while std::time::Instant::now() < deadline {
            if self.try_status().is_some() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        panic!("gem-schd did not come up:\n{}", self.log());
    }

    /// The scheduler's process id, while it runs.
    pub fn scheduler_pid(&self) -> Option<u32> {
        self.schd.as_ref().map(std::process::Child::id)
    }

    /// Waits for the scheduler to exit (after a signal or a shutdown).
    pub fn wait_scheduler(&mut self) -> std::process::ExitStatus {
        let mut c = self.schd.take().expect("the scheduler was started");
        c.wait().unwrap()
    }

    /// Stops the scheduler with `gem-schd shutdown`, as an operator or an
    /// upgrade does, and waits for it to exit.
    pub fn shutdown_scheduler(&mut self) {
        let out = self
            .sim
            .command(bin("gem-schd"))
            .args(["shutdown", "--ipc-dir"])
            .arg(self.ipc())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "gem-schd shutdown: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        self.wait_scheduler();
    }

    /// Kills the scheduler with SIGKILL (no clean-up, as a crash).
    pub fn kill_scheduler(&mut self) {
        if let Some(mut c) = self.schd.take() {
            c.kill().unwrap();
            c.wait().unwrap();
        }
    }

    /// The scheduler's status, or `None` if it did not answer within
    /// 300 ms (a loop with a deadline of its own uses this: a host that
    /// stalls the machine for a moment does not fail it).
    pub fn try_status(&self) -> Option<gemini_protocol::StatusReport> {
        let mut c = gemini_scheduler::client::Client::connect(&self.ipc()).ok()?;
        match c
            .request(
                &gemini_protocol::Request::Status,
                std::time::Duration::from_millis(300),
            )
            .ok()?
        {
            gemini_protocol::Reply::Status(s) => Some(*s),
            _ => None,
        }
    }

    /// The scheduler's status.
    pub fn status(&self) -> gemini_protocol::StatusReport {
        self.try_status().unwrap_or_else(|| {
            panic!(
                "the scheduler does not answer status; its log:\n{}",
                self.log()
            )
        })
    }

    /// Polls status until `pred` holds, for `secs` at most; whether it did.
    pub fn try_status_until(
        &self,
        secs: f64,
        pred: impl Fn(&gemini_protocol::StatusReport) -> bool,
    ) -> bool {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs_f64(secs);
        while std::time::Instant::now() < deadline {
            if self.try_status().is_some_and(|s| pred(&s)) {
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        false
    }

    /// Polls status until `pred` holds, failing after `secs`; the status
    /// that satisfied it.
    pub fn wait_status(
        &self,
        secs: f64,
        what: &str,
        pred: impl Fn(&gemini_protocol::StatusReport) -> bool,
    ) -> gemini_protocol::StatusReport {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs_f64(secs);
        loop {
            if let Some(s) = self.try_status().filter(|s| pred(s)) {
                return s;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "timed out waiting for {what}: {:#?}\nlog:\n{}",
                self.try_status(),
                self.log()
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// `gem-holder` with its arguments, on this machine's simulated GPUs
    /// and scheduler.
    pub fn holder(&self, args: &[&str]) -> Command {
        let mut c = self.sim.command(bin("gem-holder"));
        c.env("GEMINI_IPC_DIR", self.ipc()).args(args);
        c
    }

    /// Asks the running holder for its status (JSON).
    pub fn holder_status(&self) -> Option<String> {
        let out = self.holder(&["status", "--json"]).output().ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Polls the holder's status (JSON) until `pred` holds, failing after
    /// 10 s with what it last said.
    pub fn wait_holder(&self, what: &str, pred: impl Fn(&str) -> bool) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            if self.holder_status().is_some_and(|s| pred(&s)) {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "holder never {what}: {:?}",
                self.holder_status()
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    /// Runs `cmd` under the hook as a process of `group`.
    pub fn hooked(&self, mut cmd: Command, group: &str) -> Command {
        cmd.env("LD_PRELOAD", bin("libgemhook.so"))
            .env("GEMINI_GROUP_NAME", group)
            .env("FAKECUDA_TAG", group)
            .env("GEMINI_IPC_DIR", self.ipc());
        cmd
    }

    /// A hooked `gem-workload` of `group` that arrives in bursts: 20 ms of
    /// 0.5 ms kernels every 150 ms, for `seconds`, writing when each burst
    /// began to `bursts_file` (for [`first_kernel_waits`]). Each burst finds
    /// a device a holder has taken back in between.
    pub fn bursty_client(&self, group: &str, seconds: &str, bursts_file: &Path) -> Command {
        let mut c = self.hooked(self.sim.workload(), group);
        c.args([
            "--seconds",
            seconds,
            "--kernel-us",
            "500",
            "--burst-ms",
            "20",
            "--gap-ms",
            "130",
        ])
        .arg("--bursts-file")
        .arg(bursts_file);
        c
    }
}

/// The cgroup of this process (and of the processes the tests start), as
/// the scheduler reads it: the unified (v2) hierarchy's path, else the
/// first hierarchy's.
pub fn own_cgroup() -> String {
    let text = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let path = |l: &str| l.splitn(3, ':').nth(2).unwrap_or("/").to_string();
    text.lines()
        .find(|l| l.starts_with("0::"))
        .map(path)
        .or_else(|| text.lines().next().map(path))
        .unwrap_or_else(|| "/".into())
}

/// Runs `c` to its end and fails the test, with the command and its
/// stderr, unless it succeeded.
pub fn run_ok(mut c: Command) -> Output {
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{c:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}
