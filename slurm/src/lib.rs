//! gem-slurm's logic, free of I/O: what Slurm's `scontrol` says a job holds
//! on this node, and the drop-in group that turns it into a guarantee.
//!
//! A job with `--gres=shard:K` on a GPU of N shards gets a group
//! `slurm-<job id>` with `MinUtil = K/N`, `MemoryLimit = K/N` of the GPU's
//! memory and the site's `MaxUtil`, open to the job's user only and, where
//! Slurm tracks jobs in cgroups, bound to the job's cgroup (so a process
//! `ssh`'d into the job is placed in it, and no other job can claim it).
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

use std::fmt::Write as _;

/// The shards a job holds on one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobShards {
    /// Shards allocated on the node.
    pub shards: u32,
    /// Indices of the GPUs they sit on (Slurm's `IDX`); empty when Slurm
    /// gives none.
    pub gpus: Vec<u32>,
}

/// `key=value` tokens of one line of `scontrol` output.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|t| t.strip_prefix(key)?.strip_prefix('='))
}

/// Splits a GRES list at the commas outside parentheses:
/// `gpu:1(IDX:0,2),shard:3(IDX:0)` → `gpu:1(IDX:0,2)`, `shard:3(IDX:0)`.
fn gres_items(list: &str) -> Vec<&str> {
    let (mut items, mut depth, mut start) = (Vec::new(), 0i32, 0);
    for (i, c) in list.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&list[start..]);
    items.into_iter().filter(|s| !s.is_empty()).collect()
}

/// One GRES item: its name, count and the indices in `(IDX:…)`, from
/// `shard:3(IDX:0)`, `shard:a100:3(IDX:0-1)` or `gpu:4(S:0-1)`.
fn gres_item(item: &str) -> Option<(&str, u32, Vec<u32>)> {
    let (head, detail) = match item.split_once('(') {
        Some((h, d)) => (h, d.trim_end_matches(')')),
        None => (item, ""),
    };
    let mut parts = head.split(':');
    let name = parts.next()?;
    let count = parts.next_back()?.parse().ok()?;
    let idx = detail
        .split(['(', ' '])
        .find_map(|d| d.strip_prefix("IDX:"))
        .map(parse_ranges)
        .unwrap_or_default();
    Some((name, count, idx))
}

/// `0-2,5` → 0, 1, 2, 5 (what does not parse is left out).
fn parse_ranges(text: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for part in text.split(',') {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.trim().parse::<u32>(), b.trim().parse::<u32>()) {
                    out.extend(a..=b.min(a.saturating_add(1023)));
                }
            }
            None => out.extend(part.trim().parse::<u32>()),
        }
    }
    out
}

/// The shards `scontrol show job -d ID` says the job holds on `node`.
/// Its per-node lines read `Nodes=n[1-2] CPU_IDs=0 Mem=0
/// GRES=shard:3(IDX:0)`; `expand` turns a host list (`n[1-2]`) into
/// names (`scontrol show hostnames`). `None`: no shards on the node.
pub fn job_shards(
    text: &str,
    node: &str,
    expand: impl Fn(&str) -> Vec<String>,
) -> Option<JobShards> {
    for line in text.lines() {
        let (Some(nodes), Some(gres)) = (field(line, "Nodes"), field(line, "GRES")) else {
            continue;
        };
        if nodes != node && !expand(nodes).iter().any(|n| n == node) {
            continue;
        }
        let (mut shards, mut gpus) = (0u32, Vec::new());
        for (name, count, idx) in gres_items(gres).into_iter().filter_map(gres_item) {
            if name == "shard" {
                shards = shards.saturating_add(count);
                gpus.extend(idx);
            }
        }
        gpus.sort_unstable();
        gpus.dedup();
        return (shards > 0).then_some(JobShards { shards, gpus });
    }
    None
}

/// Shards per GPU of a node, from `scontrol show node`'s `Gres=gpu:4,shard:40`
/// (the shards spread evenly over the GPUs, Slurm's default). `None`
/// when the node lists no GPUs or no shards.
pub fn shards_per_gpu(node_text: &str) -> Option<u32> {
    let gres = node_text.lines().find_map(|l| field(l, "Gres"))?;
    let (mut gpus, mut shards) = (0u32, 0u32);
    for (name, count, _) in gres_items(gres).into_iter().filter_map(gres_item) {
        match name {
            "gpu" => gpus = gpus.saturating_add(count),
            "shard" => shards = shards.saturating_add(count),
            _ => {}
        }
    }
    (gpus > 0 && shards > 0)
        .then(|| shards / gpus)
        .filter(|&n| n > 0)
}

/// Whether `slurm.conf` tracks job processes in cgroups
/// (`ProctrackType=proctrack/cgroup`).
pub fn tracks_cgroups(slurm_conf: &str) -> bool {
    slurm_conf.lines().any(|l| {
        let l = l.split('#').next().unwrap_or("").trim();
        l.split_once('=').is_some_and(|(k, v)| {
            k.trim().eq_ignore_ascii_case("ProctrackType") && v.trim() == "proctrack/cgroup"
        })
    })
}

/// The cgroups Slurm puts a job's processes in: cgroup v1 (`/slurm` or,
/// built for several slurmd per host, `/slurm_<node>`, then
/// `uid_<uid>/job_<id>`) and cgroup v2 (`slurmstepd.scope/job_<id>`
/// under `system.slice`). A path that does not exist matches nothing.
pub fn job_cgroups(job: u64, uid: u32, node: &str) -> Vec<String> {
    vec![
        format!("/slurm/uid_{uid}/job_{job}"),
        format!("/slurm_{node}/uid_{uid}/job_{job}"),
        format!("/system.slice/slurmstepd.scope/job_{job}"),
    ]
}

/// The group of a job.
pub fn group_name(job: u64) -> String {
    format!("slurm-{job}")
}

/// The drop-in file of a job, in the drop-in directory.
pub fn file_name(job: u64) -> String {
    format!("slurm-job-{job}.conf")
}

/// What one job's group is given.
#[derive(Debug, Clone, PartialEq)]
pub struct JobGroup {
    /// Slurm's job id.
    pub job: u64,
    /// The job's user.
    pub user: String,
    /// The node.
    pub node: String,
    /// Its shards here.
    pub shards: JobShards,
    /// Shards of one GPU.
    pub per_gpu: u32,
    /// Bytes of one GPU's memory.
    pub gpu_memory: u64,
    /// The site's MaxUtil for jobs.
    pub max_util: f64,
    /// Cgroups bound to the group (empty: membership by name and user).
    pub cgroups: Vec<String>,
}

impl JobGroup {
    /// The guaranteed share of each of its GPUs: its shards over the
    /// shards of the GPUs they sit on (spread evenly when on several).
    pub fn min_util(&self) -> f64 {
        let gpus = self.shards.gpus.len().max(1) as f64;
        (f64::from(self.shards.shards) / (f64::from(self.per_gpu) * gpus)).min(1.0)
    }

    /// Its memory on each GPU: the same share of the GPU's memory.
    pub fn memory_limit(&self) -> u64 {
        (self.gpu_memory as f64 * self.min_util()) as u64
    }

    /// The drop-in file's text.
    pub fn render(&self) -> String {
        let min = self.min_util();
        let gpus = if self.shards.gpus.is_empty() {
            String::from("its GPU")
        } else {
            let list: Vec<String> = self.shards.gpus.iter().map(u32::to_string).collect();
            format!("GPU {}", list.join(", "))
        };
        let mut s = String::new();
        let _ = writeln!(
            s,
            "# Slurm job {} of {} on {}: {} of the {} shards of {gpus}.",
            self.job, self.user, self.node, self.shards.shards, self.per_gpu
        );
        let _ = writeln!(
            s,
            "# Written by `gem-slurm prolog`, removed by `gem-slurm epilog`."
        );
        if self.cgroups.is_empty() {
            let _ = writeln!(
                s,
                "# Slurm does not track jobs in cgroups here (ProctrackType): membership is by name and user."
            );
        }
        let _ = writeln!(s, "[{}]", group_name(self.job));
        let _ = writeln!(s, "MinUtil={}", share(min));
        let _ = writeln!(s, "MaxUtil={}", share(self.max_util.max(min)));
        let _ = writeln!(s, "MemoryLimit={}", self.memory_limit());
        let _ = writeln!(s, "AllowedUsers={}", self.user);
        if !self.shards.gpus.is_empty() {
            // Slurm's GPU indices (gres IDX) follow the device files
            // (/dev/nvidiaN), as NVML's do: the job's guarantee and memory
            // are on those GPUs, and its MinUtil counts against theirs only.
            let list: Vec<String> = self.shards.gpus.iter().map(u32::to_string).collect();
            let _ = writeln!(s, "Devices={}", list.join(","));
        }
        if !self.cgroups.is_empty() {
            let _ = writeln!(s, "Cgroups={}", self.cgroups.join(";"));
        }
        s
    }
}

/// A share with as many decimals as it needs (at most 6): `0.3`, `0.125`.
fn share(x: f64) -> String {
    let t = format!("{x:.6}");
    let t = t.trim_end_matches('0').trim_end_matches('.');
    if t.is_empty() { "0".into() } else { t.into() }
}

/// The `export` lines of the task prolog for a job with a group: the hook
/// preloaded (before what the task already preloads), the group and the
/// scheduler's IPC directory.
pub fn task_exports(job: u64, hook: &str, preload: Option<&str>, ipc_dir: &str) -> String {
    let preload = match preload.map(str::trim).filter(|p| !p.is_empty()) {
        Some(p) if p.split([':', ' ']).any(|x| x == hook) => p.to_string(),
        Some(p) => format!("{hook}:{p}"),
        None => hook.to_string(),
    };
    format!(
        "export LD_PRELOAD={preload}\nexport GEMINI_GROUP_NAME={}\nexport GEMINI_IPC_DIR={ipc_dir}\n",
        group_name(job)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const JOB: &str = "JobId=3 JobName=wrap
   UserId=alice(1000) GroupId=alice(1000) MCS_label=N/A
   JOB_GRES=shard:3
     Nodes=localhost CPU_IDs=0 Mem=0 GRES=shard:3(IDX:0)
   MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0
   TresPerNode=gres:shard:3
";

    fn no_expand(_: &str) -> Vec<String> {
        Vec::new()
    }

    #[test]
    fn shards_of_a_job_on_its_node() {
        assert_eq!(
            job_shards(JOB, "localhost", no_expand),
            Some(JobShards {
                shards: 3,
                gpus: vec![0]
            })
        );
        assert_eq!(job_shards(JOB, "other", no_expand), None);
    }

    #[test]
    fn shards_on_a_node_of_a_host_list_with_gpus_and_types() {
        let text = "   Nodes=gpu[01-02] CPU_IDs=0-3 Mem=0 GRES=gpu:a100:1(IDX:2),shard:a100:4(IDX:0-1,3)\n";
        let expand = |list: &str| {
            assert_eq!(list, "gpu[01-02]");
            vec!["gpu01".to_string(), "gpu02".to_string()]
        };
        assert_eq!(
            job_shards(text, "gpu02", expand),
            Some(JobShards {
                shards: 4,
                gpus: vec![0, 1, 3]
            })
        );
    }

    #[test]
    fn a_job_without_shards_has_none() {
        let text = "     Nodes=localhost CPU_IDs=1 Mem=0 GRES=\n     Nodes=n2 CPU_IDs=1 Mem=0 GRES=gpu:1(IDX:0)\n";
        assert_eq!(job_shards(text, "localhost", no_expand), None);
        assert_eq!(job_shards(text, "n2", no_expand), None);
    }

    #[test]
    fn shards_per_gpu_from_the_node() {
        let node = "NodeName=localhost Arch=x86_64 CoresPerSocket=2\n   Gres=gpu:1,shard:10\n   NodeAddr=localhost";
        assert_eq!(shards_per_gpu(node), Some(10));
        assert_eq!(
            shards_per_gpu("   Gres=gpu:a100:4(S:0-1),shard:a100:40(S:0-1)\n"),
            Some(10)
        );
        assert_eq!(shards_per_gpu("   Gres=shard:10\n"), None);
        assert_eq!(shards_per_gpu("   Gres=(null)\n"), None);
    }

    #[test]
    fn cgroup_tracking_is_read_from_slurm_conf() {
        assert!(tracks_cgroups(
            "ClusterName=x\nproctracktype = proctrack/cgroup # jobs\n"
        ));
        assert!(!tracks_cgroups("ProctrackType=proctrack/linuxproc\n"));
        assert!(!tracks_cgroups("#ProctrackType=proctrack/cgroup\n"));
    }

    #[test]
    fn a_job_of_3_shards_in_10_gets_0_3_and_its_memory() {
        let g = JobGroup {
            job: 42,
            user: "root".into(),
            node: "n1".into(),
            shards: JobShards {
                shards: 3,
                gpus: vec![0],
            },
            per_gpu: 10,
            gpu_memory: 80 << 30,
            max_util: 1.0,
            cgroups: job_cgroups(42, 1000, "n1"),
        };
        let text = g.render();
        let (cfg, warnings) =
            gemini_config::parse_resource(&text, std::path::Path::new("slurm-job-42.conf"))
                .unwrap();
        assert!(warnings.is_empty(), "{warnings:?}");
        let grp = cfg.group("slurm-42").unwrap();
        assert!((grp.min_util - 0.3).abs() < 1e-9, "{text}");
        assert_eq!(grp.max_util, 1.0);
        assert_eq!(grp.memory_limit, (80u64 << 30) * 3 / 10);
        assert_eq!(grp.devices, Some(vec![0]), "{text}");
        assert_eq!(
            grp.allowed_users.as_deref(),
            Some(&["root".to_string()][..])
        );
        assert!(
            grp.cgroup_match("/slurm/uid_1000/job_42/step_batch")
                .is_some()
        );
        assert!(grp.cgroup_match("/slurm/uid_1000/job_420/step_0").is_none());
    }

    #[test]
    fn max_util_is_never_below_the_minimum() {
        let g = JobGroup {
            job: 7,
            user: "bob".into(),
            node: "n1".into(),
            shards: JobShards {
                shards: 7,
                gpus: vec![],
            },
            per_gpu: 10,
            gpu_memory: 1000,
            max_util: 0.5,
            cgroups: Vec::new(),
        };
        let text = g.render();
        assert!(text.contains("MinUtil=0.7\nMaxUtil=0.7\n"), "{text}");
        assert!(!text.contains("Cgroups="), "{text}");
        assert!(!text.contains("Devices="), "GPUs not known: {text}");
    }

    #[test]
    fn the_task_prolog_puts_the_hook_first_once() {
        let e = task_exports(
            5,
            "/l/libgemhook.so",
            Some("/x/libfoo.so"),
            "/tmp/gemini/ipc",
        );
        assert!(
            e.contains("export LD_PRELOAD=/l/libgemhook.so:/x/libfoo.so\n"),
            "{e}"
        );
        assert!(e.contains("export GEMINI_GROUP_NAME=slurm-5\n"), "{e}");
        let again = task_exports(5, "/l/libgemhook.so", Some("/l/libgemhook.so"), "/i");
        assert!(
            again.contains("export LD_PRELOAD=/l/libgemhook.so\n"),
            "{again}"
        );
    }
}
