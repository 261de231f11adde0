//! `gem-slurm`: Slurm's prolog, epilog and task prolog for gemini.
//!
//! Slurm runs `Prolog=`, `Epilog=` and `TaskProlog=` programs without
//! arguments: with no subcommand, gem-slurm does what
//! `SLURM_SCRIPT_CONTEXT` says (`prolog_slurmd`, `epilog_slurmd`,
//! `prolog_task`), so the three lines of `slurm.conf` can all name it.

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};
use gemini_client::{self as client, ClientError};
use gemini_config::{Overrides, Settings, drop_in_dir, load_settings};
use gemini_protocol::{
    endpoint::{locate_ipc_dir, settings_path},
    env,
};
use gemini_slurm::{
    JobGroup, file_name, group_name, job_cgroups, job_shards, shards_per_gpu, task_exports,
    tracks_cgroups,
};
use std::path::{Path, PathBuf};
use std::process::{Command as Process, ExitCode};

#[derive(Parser, Debug)]
#[command(
    name = "gem-slurm",
    version,
    about = "Slurm glue for gemini: a job's GPU shards become a gemini group with a guaranteed share",
    long_about = "Slurm glue for gemini. The prolog turns a job's --gres=shard:K on a GPU of N shards into a group slurm-<job id> with MinUtil=K/N, MemoryLimit=K/N of the GPU's memory and [slurm] max_util of gemini.toml, open to the job's user and bound to its cgroup; the epilog removes it; the task prolog preloads the hook into every task of a job that has one.\n\nIn slurm.conf: Prolog=, Epilog= and TaskProlog= may all name gem-slurm itself: without a subcommand it does what SLURM_SCRIPT_CONTEXT says.",
    after_help = "Settings: [slurm] of gemini.toml (max_util, shards_per_gpu, gpu_memory, hook); see docs/slurm.md."
)]
struct Cli {
    /// gemini.toml (its config, ipc_dir and [slurm]) [default: /etc/gemini/gemini.toml when it exists]
    #[arg(long, global = true, env = env::SETTINGS, value_name = "FILE")]
    settings: Option<PathBuf>,

    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug, Clone, Copy, PartialEq, Eq)]
enum Command {
    /// Write the job's group (from SLURM_JOB_ID) and have the scheduler load it
    Prolog,
    /// Remove the job's group and have the scheduler forget it
    Epilog,
    /// Print the `export` lines that put a task of a job with a group under the hook
    TaskProlog,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let command = match cli.command.or_else(from_context) {
        Some(c) => c,
        None => {
            eprintln!(
                "gem-slurm: no subcommand, and SLURM_SCRIPT_CONTEXT is not prolog_slurmd, epilog_slurmd or prolog_task; run `gem-slurm prolog|epilog|task-prolog` (see --help)"
            );
            return ExitCode::from(2);
        }
    };
    let result = settings(cli.settings.as_deref()).and_then(|(s, ipc)| match command {
        Command::Prolog => prolog(&s, &ipc),
        Command::Epilog => epilog(&s, &ipc),
        Command::TaskProlog => task_prolog(&s, &ipc),
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gem-slurm: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The subcommand Slurm's `SLURM_SCRIPT_CONTEXT` asks for.
fn from_context() -> Option<Command> {
    match std::env::var("SLURM_SCRIPT_CONTEXT").ok()?.as_str() {
        "prolog_slurmd" => Some(Command::Prolog),
        "epilog_slurmd" => Some(Command::Epilog),
        "prolog_task" => Some(Command::TaskProlog),
        _ => None,
    }
}

fn settings(named: Option<&Path>) -> anyhow::Result<(Settings, PathBuf)> {
    let file = settings_path(named.map(Path::as_os_str));
    let ipc = locate_ipc_dir(None, file.as_deref())?;
    let s = load_settings(file.as_deref(), Overrides::default())?;
    Ok((s, ipc))
}

fn var(name: &str) -> anyhow::Result<String> {
    std::env::var(name).with_context(|| {
        format!("{name} is not set: gem-slurm runs as Slurm's prolog, epilog or task prolog")
    })
}

fn job_id() -> anyhow::Result<u64> {
    let id = var("SLURM_JOB_ID")?;
    id.trim()
        .parse()
        .with_context(|| format!("SLURM_JOB_ID: expected a job number, got {id:?}"))
}

fn node_name() -> String {
    std::env::var("SLURMD_NODENAME")
        .ok()
        .filter(|n| !n.is_empty())
        .or_else(|| kernel_hostname().map(|h| h.split('.').next().unwrap_or(&h).to_string()))
        .unwrap_or_else(|| "localhost".into())
}

fn kernel_hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
}

/// `scontrol`: Slurm runs prologs with no search path set.
fn scontrol() -> PathBuf {
    let on_path = std::env::var_os("PATH").is_some_and(|p| !p.is_empty());
    if !on_path {
        for dir in ["/usr/bin", "/usr/local/bin", "/opt/slurm/bin", "/usr/sbin"] {
            let p = Path::new(dir).join("scontrol");
            if p.exists() {
                return p;
            }
        }
    }
    PathBuf::from("scontrol")
}

fn run_scontrol(args: &[&str]) -> anyhow::Result<String> {
    let bin = scontrol();
    let out = Process::new(&bin)
        .args(args)
        .output()
        .with_context(|| format!("cannot run {}", bin.display()))?;
    if !out.status.success() {
        bail!(
            "`scontrol {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn prolog(s: &Settings, ipc: &Path) -> anyhow::Result<()> {
    let job = job_id()?;
    let node = node_name();
    let text = run_scontrol(&["show", "job", "-d", &job.to_string()])?;
    let expand = |list: &str| {
        run_scontrol(&["show", "hostnames", list])
            .map(|t| t.lines().map(str::to_string).collect())
            .unwrap_or_default()
    };
    let Some(shards) = job_shards(&text, &node, expand) else {
        println!("gem-slurm: job {job} holds no GPU shards on {node}: no gemini group");
        return Ok(());
    };
    let per_gpu = match s.slurm.shards_per_gpu {
        Some(n) => n,
        None => shards_per_gpu(&run_scontrol(&["show", "node", &node])?).with_context(|| {
            format!("node {node} lists no gpu and shard counts (Gres=): set [slurm] shards_per_gpu in gemini.toml")
        })?,
    };
    let gpu = shards.gpus.first().copied().unwrap_or(0);
    let gpu_memory = match s.slurm.gpu_memory {
        Some(b) => b,
        None => nvml_memory(gpu).with_context(|| {
            format!("the memory of GPU {gpu} is unknown: set [slurm] gpu_memory in gemini.toml")
        })?,
    };
    let uid: u32 = var("SLURM_JOB_UID")?
        .parse()
        .context("SLURM_JOB_UID: expected a number")?;
    let slurm_conf = std::env::var("SLURM_CONF").unwrap_or_else(|_| "/etc/slurm/slurm.conf".into());
    let cgroups = match std::fs::read_to_string(&slurm_conf) {
        Ok(t) if tracks_cgroups(&t) => job_cgroups(job, uid, &node),
        _ => Vec::new(),
    };
    let group = JobGroup {
        job,
        user: var("SLURM_JOB_USER")?,
        node,
        shards,
        per_gpu,
        gpu_memory,
        max_util: s.slurm.max_util,
        cgroups,
    };
    let dir = drop_in_dir(&s.config);
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let path = dir.join(file_name(job));
    // Written aside and renamed: the scheduler's watcher never reads half
    // a file (it reads only *.conf).
    let tmp = dir.join(format!(".{}.tmp", file_name(job)));
    std::fs::write(&tmp, group.render())
        .and_then(|()| std::fs::rename(&tmp, &path))
        .with_context(|| format!("cannot write {}", path.display()))?;
    match reload(ipc) {
        Ok(()) => {}
        Err(Reload::Unreachable(e)) => {
            eprintln!(
                "gem-slurm: {e}; the scheduler reads {} when it starts",
                path.display()
            );
        }
        Err(Reload::Refused(e)) => {
            // A file the scheduler refuses would hold back every later
            // change: take it out again, and fail the job's start.
            let _ = std::fs::remove_file(&path);
            bail!("the scheduler refused group {}: {e}", group_name(job));
        }
    }
    println!(
        "gem-slurm: job {job}: group {} (MinUtil {:.3}, MemoryLimit {}) in {}",
        group_name(job),
        group.min_util(),
        gemini_config::format_size(group.memory_limit()),
        path.display()
    );
    Ok(())
}

fn epilog(s: &Settings, ipc: &Path) -> anyhow::Result<()> {
    let job = job_id()?;
    let path = drop_in_dir(&s.config).join(file_name(job));
    match std::fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("cannot remove {}", path.display())),
    }
    // The job's processes are gone; its group goes now rather than at the
    // watcher's next look. A failure here must not drain the node: the
    // file is gone, and the scheduler forgets the group when it reloads.
    match reload(ipc) {
        Ok(()) | Err(Reload::Unreachable(_)) => {}
        Err(Reload::Refused(e)) => eprintln!("gem-slurm: the scheduler did not reload: {e}"),
    }
    Ok(())
}

fn task_prolog(s: &Settings, ipc: &Path) -> anyhow::Result<()> {
    let job = job_id()?;
    if !drop_in_dir(&s.config).join(file_name(job)).exists() {
        return Ok(());
    }
    let preload = std::env::var("LD_PRELOAD").ok();
    print!(
        "{}",
        task_exports(
            job,
            &s.slurm.hook.display().to_string(),
            preload.as_deref(),
            &ipc.display().to_string()
        )
    );
    Ok(())
}

enum Reload {
    Unreachable(String),
    Refused(String),
}

/// Asks the scheduler to re-read its configuration now.
fn reload(ipc: &Path) -> Result<(), Reload> {
    match client::reload(ipc) {
        Ok(answer) => answer.map_err(Reload::Refused),
        Err(e @ (ClientError::Connect { .. } | ClientError::Timeout(_))) => {
            Err(Reload::Unreachable(e.to_string()))
        }
        Err(other) => Err(Reload::Refused(other.to_string())),
    }
}

/// Total memory of GPU `index` from NVML (`libnvidia-ml.so.1`).
fn nvml_memory(index: u32) -> anyhow::Result<u64> {
    let nvml = nvml_wrapper::Nvml::builder()
        .lib_path(std::ffi::OsStr::new("libnvidia-ml.so.1"))
        .init()
        .context("NVML (libnvidia-ml.so.1) cannot be loaded")?;
    let total = nvml
        .device_by_index(index)
        .and_then(|d| d.memory_info())
        .with_context(|| format!("NVML has no memory figure for GPU {index}"))?
        .total;
    if total == 0 {
        bail!("NVML reports 0 bytes for GPU {index}");
    }
    Ok(total)
}
