//! Which GPU is which: the scheduler's index of each CUDA ordinal, found
//! once by the GPU's UUID (a MIG instance's, by the GPU it is part of). A device cgroup (Slurm's `ConstrainDevices`),
//! `CUDA_VISIBLE_DEVICES` and a container (whose NVML numbers its GPUs
//! from 0 too) renumber the ordinals away from the machine's indices.

use crate::log::debug;
use crate::state::State;
use crate::{driver, nvml_lib};
use gemini_protocol::{Reply, Request};

impl State {
    /// The scheduler's device index for the driver's ordinal `dev`: the
    /// machine's own index of the GPU, which a device cgroup (Slurm's
    /// `ConstrainDevices`: a job's only GPU is ordinal 0 whichever it is),
    /// `CUDA_VISIBLE_DEVICES` and a container (whose NVML, too, numbers
    /// its GPUs from 0) renumber away from the ordinal. Found once, by each
    /// GPU's UUID: the scheduler's NVML index, else this process's NVML
    /// index, else the numeric `CUDA_VISIBLE_DEVICES` entry, else the
    /// ordinal.
    pub fn physical(&self, dev: u32) -> u32 {
        self.gpus(Some(dev))
            .get(dev as usize)
            .map_or_else(|| self.settings.fallback_physical(dev), |g| g.1)
    }

    /// The scheduler's device index of the process's GPU whose UUID text
    /// is `uuid` (`None`: not one of its CUDA devices).
    pub fn physical_of_uuid(&self, uuid: &str) -> Option<u32> {
        self.gpus(None).iter().find(|g| g.0 == uuid).map(|g| g.1)
    }

    /// The UUID text of ordinal `dev` (`GPU-…`), once the map is known.
    pub fn uuid_of(&self, dev: u32) -> Option<&str> {
        self.gpus(Some(dev))
            .get(dev as usize)
            .map(|g| g.0.as_str())
            .filter(|u| !u.is_empty())
    }

    /// The map, found once the driver answers: asked before `cuInit`
    /// (vLLM asks NVML for memory before it initialises CUDA), the driver
    /// has no devices yet, and a map kept from then would be empty for
    /// the process's life. `about`: the ordinal the caller asks about.
    fn gpus(&self, about: Option<u32>) -> &[(String, u32)] {
        if let Some(map) = self.gpus.get() {
            return map;
        }
        match self.find_gpus(about) {
            Some(map) => self.gpus.get_or_init(|| map),
            None => &[],
        }
    }

    /// `None` while the driver does not answer (not initialised yet).
    /// The first map is asked at start-up, where the memory view of GPU
    /// `about` is asked next (the size of a context about to be made on
    /// it, or the free memory a program reads): that is sent with it, of
    /// the index this process would give the GPU (see below), which is
    /// the scheduler's unless a container renumbers its GPUs; and both
    /// behind the hello where there was none yet. One wait then serves
    /// what took three.
    fn find_gpus(&self, about: Option<u32>) -> Option<Vec<(String, u32)>> {
        let count = driver::device_count()?;
        let uuids: Vec<Option<[u8; 16]>> = (0..count).map(driver::device_uuid).collect();
        // A MIG instance is known (to the scheduler, and here) by its GPU.
        let texts: Vec<String> = uuids
            .iter()
            .map(|u| {
                u.as_ref()
                    .map(|u| nvml_lib::gpu_of_uuid(u).unwrap_or_else(|| nvml_lib::uuid_text(u)))
                    .unwrap_or_default()
            })
            .collect();
        let ours = |ordinal: usize| {
            uuids[ordinal]
                .and_then(|u| nvml_lib::index_of_uuid(&u))
                .unwrap_or_else(|| self.settings.fallback_physical(ordinal as u32))
        };
        let asked = Request::Gpus {
            uuids: texts.clone(),
        };
        let mut ahead = vec![asked.clone()];
        if let Some(dev) = about.filter(|&d| i64::from(d) < i64::from(count)) {
            ahead.push(Request::MemoryInfo {
                device: ours(dev as usize),
            });
        }
        self.send_ahead(&ahead);
        let theirs = match self.call(&asked, 0) {
            Ok(Reply::Gpus { devices }) if devices.len() == uuids.len() => devices,
            _ => vec![None; uuids.len()],
        };
        let mut map = Vec::with_capacity(texts.len());
        for (ordinal, (text, theirs)) in texts.into_iter().zip(theirs).enumerate() {
            let index = theirs.unwrap_or_else(|| ours(ordinal));
            map.push((text, index));
        }
        debug!("GPUs by ordinal, as the scheduler numbers them: {map:?}");
        Some(map)
    }
}
