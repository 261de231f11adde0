//! Which multi-GPU job a process is a rank of, as its launcher declares
//! it. A job's ranks run collectives that wait for each other, so the
//! scheduler gives them their GPUs in the same windows (turns); a process
//! with no such evidence is never put into turns, however its work
//! waits (independent programs of one group lose the gaps between their
//! kernels to turns). The evidence:
//! - `gem-launch --job NAME` (`GEMINI_JOB`);
//! - torchrun's `TORCHELASTIC_RUN_ID` with a `WORLD_SIZE` over 1, and its
//!   rendezvous endpoint (`MASTER_ADDR`, `MASTER_PORT`): a torchrun with
//!   static rendezvous sets the run id `none` for every job;
//! - a Slurm step of more than one task (`SLURM_JOB_ID`, `SLURM_STEP_ID`,
//!   `SLURM_STEP_NUM_TASKS` or `SLURM_NTASKS`);
//! - an Open MPI or MPICH launch of more than one rank
//!   (`OMPI_COMM_WORLD_SIZE`, `PMI_SIZE`), named by its PMIx namespace
//!   (`PMIX_NAMESPACE`), its Open MPI job id, or else by the launcher
//!   process that started the node's ranks (`parent`);
//! - an NCCL communicator the process creates (the hook reports it with
//!   `Request::Job` when it sees one made).
//!
//! The name is the job's identity on the machine: ranks with the same
//! name are one job.

/// The job `var` (an environment lookup) declares; `parent` is the
/// parent process id (the launcher of an MPI rank). `None`: no evidence.
pub fn declared(var: impl Fn(&str) -> Option<String>, parent: u32) -> Option<String> {
    let get = |k: &str| {
        var(k)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
    };
    let many = |k: &str| {
        get(k)
            .and_then(|v| v.parse::<u64>().ok())
            .is_some_and(|n| n > 1)
    };
    if let Some(name) = get(crate::env::JOB) {
        return Some(format!("gemini:{name}"));
    }
    if let Some(run) = get("TORCHELASTIC_RUN_ID")
        && many("WORLD_SIZE")
    {
        return Some(match (get("MASTER_ADDR"), get("MASTER_PORT")) {
            (Some(addr), Some(port)) => format!("torchrun:{run}@{addr}:{port}"),
            _ => format!("torchrun:{run}"),
        });
    }
    if let (Some(job), Some(step)) = (get("SLURM_JOB_ID"), get("SLURM_STEP_ID"))
        && (many("SLURM_STEP_NUM_TASKS") || many("SLURM_NTASKS"))
    {
        return Some(format!("slurm:{job}.{step}"));
    }
    if many("OMPI_COMM_WORLD_SIZE") || many("PMI_SIZE") {
        let name = get("PMIX_NAMESPACE")
            .or_else(|| get("OMPI_MCA_ess_base_jobid"))
            .or_else(|| get("OMPI_MCA_orte_ess_jobid"))
            .unwrap_or_else(|| format!("launcher-{parent}"));
        return Some(format!("mpi:{name}"));
    }
    None
}

/// The job of the NCCL communicator whose unique id is `id` (the bytes
/// every rank is given to create it): one name for all its ranks.
pub fn of_nccl(id: &[u8]) -> String {
    // FNV-1a: stable across builds, enough to tell communicators apart.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in id {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("nccl:{h:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn job(vars: &[(&str, &str)]) -> Option<String> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        declared(|k| m.get(k).cloned(), 77)
    }

    #[test]
    fn each_launcher_names_its_job() {
        assert_eq!(job(&[]), None);
        assert_eq!(job(&[("GEMINI_JOB", "llama")]), Some("gemini:llama".into()));
        assert_eq!(
            job(&[
                ("TORCHELASTIC_RUN_ID", "r1"),
                ("WORLD_SIZE", "4"),
                ("RANK", "2")
            ]),
            Some("torchrun:r1".into())
        );
        // Two torchruns with static rendezvous (run id `none`) on one
        // host are two jobs: their rendezvous ports differ.
        let static_rdzv = |port: &str| {
            job(&[
                ("TORCHELASTIC_RUN_ID", "none"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", port),
            ])
        };
        assert_eq!(
            static_rdzv("29500"),
            Some("torchrun:none@127.0.0.1:29500".into())
        );
        assert_ne!(static_rdzv("29500"), static_rdzv("29501"));
        assert_eq!(
            job(&[
                ("SLURM_JOB_ID", "812"),
                ("SLURM_STEP_ID", "0"),
                ("SLURM_STEP_NUM_TASKS", "8")
            ]),
            Some("slurm:812.0".into())
        );
        assert_eq!(
            job(&[
                ("OMPI_COMM_WORLD_SIZE", "2"),
                ("PMIX_NAMESPACE", "prterun-h-9@1")
            ]),
            Some("mpi:prterun-h-9@1".into())
        );
        assert_eq!(
            job(&[("PMI_SIZE", "2"), ("PMI_RANK", "1")]),
            Some("mpi:launcher-77".into())
        );
        // The launcher's own name wins over what it runs under.
        assert_eq!(
            job(&[
                ("GEMINI_JOB", "x"),
                ("SLURM_JOB_ID", "1"),
                ("SLURM_STEP_ID", "0"),
                ("SLURM_NTASKS", "2")
            ]),
            Some("gemini:x".into())
        );
    }

    /// One process is no job: a one-rank torchrun, a one-task Slurm step
    /// (every `srun` of a batch script), an MPI run of one rank.
    #[test]
    fn a_single_rank_is_no_job() {
        assert_eq!(
            job(&[("TORCHELASTIC_RUN_ID", "r1"), ("WORLD_SIZE", "1")]),
            None
        );
        assert_eq!(job(&[("TORCHELASTIC_RUN_ID", "r1")]), None);
        assert_eq!(
            job(&[
                ("SLURM_JOB_ID", "812"),
                ("SLURM_STEP_ID", "0"),
                ("SLURM_NTASKS", "1")
            ]),
            None
        );
        assert_eq!(job(&[("SLURM_JOB_ID", "812"), ("SLURM_NTASKS", "4")]), None);
        assert_eq!(job(&[("OMPI_COMM_WORLD_SIZE", "1")]), None);
        assert_eq!(job(&[("GEMINI_JOB", "  ")]), None);
    }

    #[test]
    fn an_nccl_communicator_names_one_job() {
        let a = of_nccl(&[1u8; 128]);
        assert_eq!(a, of_nccl(&[1u8; 128]));
        assert_ne!(a, of_nccl(&[2u8; 128]));
        assert!(a.starts_with("nccl:"));
    }
}
