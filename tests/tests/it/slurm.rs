//! gemini under a real Slurm (`make test-slurm`): slurmctld and slurmd on
//! localhost, a GPU of 10 shards whose "device" is the driver simulator,
//! and `gem-slurm` as the prolog, epilog and task prolog. Needs root and
//! Debian's `slurmd`, `slurmctld`, `slurm-client` and `munge` (the make
//! target installs them); skipped, saying why, where they are missing.

use gemini_tests::cpu::CpuTimes;
use gemini_tests::{Gemini, SimEnv, bin, field, now_ns, reports};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const SEC: u64 = 1_000_000_000;

fn found(program: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Why this machine cannot run Slurm, if it cannot.
fn cannot_run() -> Option<String> {
    // SAFETY: geteuid cannot fail and touches no memory.
    if unsafe { libc::geteuid() } != 0 {
        return Some("slurmd must run as root".into());
    }
    let missing: Vec<&str> = [
        "slurmctld",
        "slurmd",
        "sbatch",
        "squeue",
        "scontrol",
        "munged",
    ]
    .into_iter()
    .filter(|p| !found(p))
    .collect();
    (!missing.is_empty()).then(|| {
        format!(
            "{} not installed (apt-get install slurmd slurmctld slurm-client munge)",
            missing.join(", ")
        )
    })
}

/// Writes an executable shell script.
fn write_script(path: &Path, text: impl AsRef<[u8]>) {
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// munged, started if no daemon answers yet.
fn ensure_munge() {
    let works = || {
        Command::new("sh")
            .args(["-c", "munge -n | unmunge"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if works() {
        return;
    }
    // -R: a munged once run as root leaves its log file root's, and
    // munged refuses to start on it.
    let script = "mkdir -p /run/munge /var/log/munge /var/lib/munge && \
        chown -R munge:munge /run/munge /var/log/munge /var/lib/munge && \
        { [ -s /etc/munge/munge.key ] || { mungekey --create 2>/dev/null || \
          dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null; }; } && \
        chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key && \
        { runuser -u munge -- munged --force || su -s /bin/sh munge -c 'munged --force'; }";
    let st = Command::new("sh").args(["-c", script]).status().unwrap();
    assert!(st.success(), "munged did not start");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !works() {
        assert!(Instant::now() < deadline, "munge does not answer");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// slurmctld and slurmd on localhost, stopped on drop.
struct Slurm {
    dir: PathBuf,
    conf: PathBuf,
    daemons: Vec<Child>,
}

impl Slurm {
    fn start(dir: &Path, settings: &Path, sim: &SimEnv, cgroups: bool) -> Option<Slurm> {
        for d in ["state", "spool", "log"] {
            std::fs::create_dir_all(dir.join(d)).unwrap();
        }
        let fake_gpu = dir.join("fakegpu0");
        std::fs::write(&fake_gpu, "").unwrap();
        // gem-slurm as Slurm runs it: no arguments, no search path, the
        // environment slurmd gives; the wrapper adds only where the
        // simulator (for NVML) and this test's gemini.toml are.
        let glue = dir.join("gem-slurm.sh");
        write_script(
            &glue,
            format!(
                "#!/bin/sh\nexport LD_LIBRARY_PATH={} FAKECUDA_DIR={} FAKECUDA_DEVICES=1 FAKECUDA_MEM={}\nexec {} --settings {}\n",
                sim.lib_dir().display(),
                sim.sim_dir().display(),
                sim.mem,
                bin("gem-slurm").display(),
                settings.display()
            ),
        );
        let port = 20_000 + (std::process::id() % 20_000) as u16;
        let d = dir.display();
        let conf = dir.join("slurm.conf");
        std::fs::write(
            &conf,
            format!(
                "ClusterName=gemtest\nSlurmctldHost=localhost\nSlurmUser=root\nSlurmdUser=root\n\
                 AuthType=auth/munge\nStateSaveLocation={d}/state\nSlurmdSpoolDir={d}/spool\n\
                 SlurmctldPidFile={d}/slurmctld.pid\nSlurmdPidFile={d}/slurmd.pid\n\
                 SlurmctldPort={port}\nSlurmdPort={}\n\
                 ProctrackType=proctrack/{}\nTaskPlugin=task/none\n\
                 SchedulerType=sched/backfill\nSelectType=select/cons_tres\nSelectTypeParameters=CR_Core\n\
                 GresTypes=gpu,shard\nPrologFlags=Alloc\n\
                 Prolog={g}\nEpilog={g}\nTaskProlog={g}\n\
                 ReturnToService=2\nMpiDefault=none\n\
                 SlurmctldLogFile={d}/log/slurmctld.log\nSlurmdLogFile={d}/log/slurmd.log\n\
                 NodeName=localhost CPUs=2 RealMemory=500 Gres=gpu:1,shard:10 State=UNKNOWN\n\
                 PartitionName=main Nodes=localhost Default=YES MaxTime=5 State=UP\n",
                port + 1,
                if cgroups { "cgroup" } else { "linuxproc" },
                g = glue.display(),
            ),
        )
        .unwrap();
        std::fs::write(
            dir.join("gres.conf"),
            format!(
                "NodeName=localhost Name=gpu File={f}\nNodeName=localhost Name=shard Count=10 File={f}\n",
                f = fake_gpu.display()
            ),
        )
        .unwrap();
        std::fs::write(
            dir.join("cgroup.conf"),
            "CgroupPlugin=autodetect\nConstrainDevices=no\n",
        )
        .unwrap();
        let mut s = Slurm {
            dir: dir.to_path_buf(),
            conf,
            daemons: Vec::new(),
        };
        for daemon in ["slurmctld", "slurmd"] {
            let child = Command::new(daemon)
                .arg("-D")
                .env("SLURM_CONF", &s.conf)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            s.daemons.push(child);
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let out = s.cmd("sinfo").args(["-h", "-o", "%T"]).output().unwrap();
            if String::from_utf8_lossy(&out.stdout).trim() == "idle" {
                return Some(s);
            }
            if Instant::now() > deadline
                || s.daemons
                    .iter_mut()
                    .any(|c| c.try_wait().unwrap().is_some())
            {
                eprintln!(
                    "slurm did not come up (proctrack/{}): {}",
                    if cgroups { "cgroup" } else { "linuxproc" },
                    std::fs::read_to_string(dir.join("log/slurmd.log")).unwrap_or_default()
                );
                return None;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn cmd(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("SLURM_CONF", &self.conf);
        c
    }

    /// Submits `script` with `--gres=shard:K`; its job id.
    fn submit(&self, shards: u32, script: &str, env: &[(&str, &str)]) -> u64 {
        let mut c = self.cmd("sbatch");
        c.arg("--parsable")
            .arg(format!("--gres=shard:{shards}"))
            .arg("-o")
            .arg(self.dir.join("job-%j.out"))
            .arg("--wrap")
            .arg(script);
        for (k, v) in env {
            c.env(k, v);
        }
        let out = c.output().unwrap();
        assert!(
            out.status.success(),
            "sbatch: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
    }

    fn output(&self, job: u64) -> String {
        std::fs::read_to_string(self.dir.join(format!("job-{job}.out"))).unwrap_or_default()
    }

    fn wait_done(&self, jobs: &[u64]) {
        let ids: Vec<String> = jobs.iter().map(u64::to_string).collect();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let out = self
                .cmd("squeue")
                .args(["-h", "-j", &ids.join(",")])
                .output()
                .unwrap();
            if String::from_utf8_lossy(&out.stdout).trim().is_empty() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "jobs {ids:?} still queued or running"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        for c in &mut self.daemons {
            let _ = c.kill();
            let _ = c.wait();
        }
        // slurmd leaves its job step daemons behind when killed.
        let _ = Command::new("pkill")
            .args(["-f", &format!("slurmstepd.*{}", self.dir.display())])
            .status();
    }
}

/// Two jobs of 3 and 7 shards of 10 share the device 0.3 / 0.7, each in
/// the group its prolog wrote, under the hook its task prolog preloaded;
/// a process of one claiming the other's group is refused; the epilog
/// removes both groups.
#[test]
#[ignore = "needs root and Slurm: run `make test-slurm`"]
fn slurm_shards_become_guaranteed_shares() {
    if let Some(why) = cannot_run() {
        eprintln!("SKIPPED slurm_shards_become_guaranteed_shares: {why}");
        return;
    }
    ensure_munge();
    // An R615 driver: gem-schd has it enforce each job's memory limit on
    // the job's cgroup too.
    let g = Gemini::start(SimEnv::default().r615(), "");
    let dir = g.sim.path().join("slurm");
    std::fs::create_dir_all(&dir).unwrap();
    let settings = g.sim.path().join("gemini.toml");
    std::fs::write(
        &settings,
        format!(
            "config = \"{}\"\nipc_dir = \"{}\"\n[slurm]\nhook = \"{}\"\n",
            g.conf().display(),
            g.ipc().display(),
            bin("libgemhook.so").display()
        ),
    )
    .unwrap();
    let (slurm, cgroups) = match Slurm::start(&dir, &settings, &g.sim, true) {
        Some(s) => (s, true),
        None => (
            Slurm::start(&dir, &settings, &g.sim, false).expect("slurm with proctrack/linuxproc"),
            false,
        ),
    };
    let lib = g.sim.lib_dir();
    let sim_dir = g.sim.sim_dir();
    // What the jobs inherit: the simulator, not gemini (the task prolog
    // must bring the hook, the group and the socket).
    let env = [
        ("LD_LIBRARY_PATH", lib.to_str().unwrap()),
        ("FAKECUDA_DIR", sim_dir.to_str().unwrap()),
        ("FAKECUDA_DEVICES", "1"),
        ("FAKECUDA_MEM", g.sim.mem.as_str()),
        ("FAKECUDA_CTX_MEM", g.sim.ctx_mem.as_str()),
        ("FAKECUDA_MODULE_MEM", g.sim.module_mem.as_str()),
        ("FAKECUDA_DRIVER_VERSION", "13050"),
        ("GEMINI_SETTINGS", "/dev/null"),
        ("LD_PRELOAD", ""),
        ("GEMINI_GROUP_NAME", ""),
        ("GEMINI_IPC_DIR", ""),
    ];
    let workload = bin("gem-workload");
    let w = workload.display();
    let seven = slurm.submit(7, &format!("{w} --seconds 6 --kernel-us 1000"), &env);
    // A step that escapes the hook (LD_PRELOAD unset) is held to the
    // job's limit by the driver.
    let memwork = bin("gem-memwork");
    let claim = if cgroups {
        format!(
            "GEMINI_GROUP_NAME=slurm-{seven} {w} --seconds 0.2 --kernel-us 1000; echo claim exit $?; \
             env -u LD_PRELOAD {} context --chunk 1GiB </dev/null; ",
            memwork.display()
        )
    } else {
        String::new()
    };
    let three = slurm.submit(3, &format!("{claim}{w} --seconds 6 --kernel-us 1000"), &env);
    g.wait_status(20.0, "both jobs' workloads connected", |s| {
        s.groups
            .iter()
            .filter(|x| x.name.starts_with("slurm-"))
            .count()
            == 2
            && s.clients.len() == 2
    });
    let st = g.status();
    let group = |name: String| {
        st.groups
            .iter()
            .find(|x| x.name == name)
            .unwrap_or_else(|| panic!("no group {name}: {st:?}"))
            .clone()
    };
    let (g7, g3) = (
        group(format!("slurm-{seven}")),
        group(format!("slurm-{three}")),
    );
    assert!((g7.min_util - 0.7).abs() < 1e-9 && (g3.min_util - 0.3).abs() < 1e-9);
    assert_eq!(
        g3.memory_limit,
        (16u64 << 30) * 3 / 10,
        "3/10 of the GPU's memory, from NVML"
    );
    std::thread::sleep(Duration::from_secs(1));
    let cpu = CpuTimes::now();
    let t0 = now_ns();
    std::thread::sleep(Duration::from_secs(3));
    let busy = g.sim.busy(0, t0, t0 + 3 * SEC);
    let counts = cpu.counts("two Slurm jobs of 3 and 7 shards");
    slurm.wait_done(&[seven, three]);
    let (o7, o3) = (slurm.output(seven), slurm.output(three));
    let pid = |out: &str| {
        let r = reports(out.as_bytes());
        let last = r
            .last()
            .unwrap_or_else(|| panic!("no workload report in {out}"));
        assert_eq!(field(last, "alloc_error"), 0, "{out}");
        field(last, "pid") as u32
    };
    let (s7, s3) = (busy.share(pid(&o7)), busy.share(pid(&o3)));
    assert!(
        s7 > 0.1 && s3 > 0.05,
        "both jobs ran under the hook: {s7:.3} {s3:.3}\n{o7}\n{o3}"
    );
    if counts {
        assert!(
            (s7 - 0.7).abs() <= 0.06 && (s3 - 0.3).abs() <= 0.06,
            "shards 7 and 3 of 10: got {s7:.3} and {s3:.3}"
        );
    }
    if cgroups {
        assert!(
            o3.contains(&format!("may not join group \"slurm-{seven}\""))
                && o3.contains("claim exit 1"),
            "a process of job {three} claimed job {seven}'s group: {o3}"
        );
        // 3/10 of 16 GiB: the fifth GiB is refused, by the driver alone.
        assert!(
            o3.contains("memwork allocated=4294967296 error=2"),
            "a step without the hook was not held to the job's limit by the driver: {o3}"
        );
        assert!(
            g3.driver_memory.iter().any(|m| m.limit == g3.memory_limit),
            "the driver's limit is in the status: {g3:?}"
        );
    } else {
        eprintln!(
            "slurmd could not track jobs in cgroups here: the claim of another job's group was not tried"
        );
    }
    g.wait_status(10.0, "the epilog removed both groups", |s| {
        !s.groups.iter().any(|x| x.name.starts_with("slurm-"))
    });
    let left: Vec<_> = std::fs::read_dir(gemini_config::drop_in_dir(&g.conf()))
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "drop-in files left behind: {left:?}");
}

/// `gem-slurm` against a stand-in `scontrol` (no Slurm needed): a job
/// whose group the scheduler refuses (MinUtil over 1 with the main file's
/// group) has its file taken out again and the prolog fails, saying why;
/// a job that fits is loaded at once and removed by the epilog; a job on
/// the node's other GPU is counted against that GPU only (`Devices=`);
/// without a scheduler the file stays for it to read when it starts.
#[test]
fn the_prolog_takes_a_refused_group_out_and_fails() {
    let g = Gemini::start(SimEnv::default(), "[other]\nMinUtil=0.5\n");
    let stub = g.sim.path().join("stub");
    std::fs::create_dir_all(&stub).unwrap();
    let scontrol = stub.join("scontrol");
    write_script(
        &scontrol,
        "#!/bin/sh\ncase \"$2\" in\n  job) echo \"JobId=$4\"; echo \"     Nodes=localhost CPU_IDs=0 Mem=0 GRES=shard:$SHARDS(IDX:${IDX:-0})\";;\n  node) echo 'NodeName=localhost'; echo '   Gres=gpu:2,shard:20';;\nesac\n",
    );
    let settings = g.sim.path().join("gemini.toml");
    std::fs::write(
        &settings,
        format!(
            "config = \"{}\"\nipc_dir = \"{}\"\n[slurm]\ngpu_memory = \"10GiB\"\n",
            g.conf().display(),
            g.ipc().display()
        ),
    )
    .unwrap();
    let path = format!(
        "{}:{}",
        stub.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let glue_on = |what: &str, job: &str, shards: &str, gpu: &str| {
        Command::new(bin("gem-slurm"))
            .arg("--settings")
            .arg(&settings)
            .arg(what)
            .env("PATH", &path)
            .env("SHARDS", shards)
            .env("IDX", gpu)
            .env("SLURM_JOB_ID", job)
            .env("SLURM_JOB_UID", "0")
            .env("SLURM_JOB_USER", "root")
            .env("SLURMD_NODENAME", "localhost")
            .env("SLURM_CONF", "/nonexistent/slurm.conf")
            .output()
            .unwrap()
    };
    let glue = |what: &str, job: &str, shards: &str| glue_on(what, job, shards, "0");
    let dropins = gemini_config::drop_in_dir(&g.conf());
    // 0.5 + 0.7 > 1: refused, taken out, the prolog fails.
    let out = glue("prolog", "41", "7");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("the scheduler refused group slurm-41") && err.contains("MinUtil"),
        "{err}"
    );
    assert!(
        !dropins.join("slurm-job-41.conf").exists(),
        "refused file left"
    );
    // 0.5 + 0.3 fits: in force at once, with 3/10 of the 10 GiB.
    let out = glue("prolog", "42", "3");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let st = g.status();
    let grp = st
        .groups
        .iter()
        .find(|x| x.name == "slurm-42")
        .expect("slurm-42 loaded");
    assert!((grp.min_util - 0.3).abs() < 1e-9);
    assert_eq!(grp.memory_limit, (10u64 << 30) * 3 / 10);
    // 5 more shards fit on the node's other GPU (0.5 + 0.5 there), though
    // the node's groups add up to 1.3: MinUtil counts per GPU.
    let out = glue_on("prolog", "44", "5", "1");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(dropins.join("slurm-job-44.conf")).unwrap();
    assert!(text.contains("\nDevices=1\n"), "{text}");
    assert!(g.status().groups.iter().any(|x| x.name == "slurm-44"));
    // Not on GPU 0 (0.5 + 0.3 + 0.5).
    let out = glue_on("prolog", "45", "5", "0");
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("on GPU 0 adds up to 1.300"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(glue_on("epilog", "44", "5", "1").status.success());
    // The task prolog of that job puts it under the hook.
    let out = glue("task-prolog", "42", "3");
    let exports = String::from_utf8_lossy(&out.stdout);
    assert!(
        exports.contains("export GEMINI_GROUP_NAME=slurm-42\n"),
        "{exports}"
    );
    assert!(exports.contains("export LD_PRELOAD="), "{exports}");
    assert!(
        glue("task-prolog", "41", "7").stdout.is_empty(),
        "no group, no exports"
    );
    // The epilog removes it, at once.
    assert!(glue("epilog", "42", "3").status.success());
    assert!(!g.status().groups.iter().any(|x| x.name == "slurm-42"));
    // No scheduler: the file stays, and the prolog does not fail the job.
    let mut g = g;
    g.kill_scheduler();
    let out = glue("prolog", "43", "3");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(dropins.join("slurm-job-43.conf").exists());
    assert!(String::from_utf8_lossy(&out.stderr).contains("reads"));
}
