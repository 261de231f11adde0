//! Graph memory nodes, as the driver does it (CUDA driver API, "Graph
//! Management": `cuGraphAddMemAllocNode`, `cuGraphAddMemFreeNode`,
//! `cuDeviceGraphMemTrim`, `cuDeviceGetGraphMemAttribute`; and
//! `cuMemAllocAsync`/`cuMemFreeAsync` on a capturing stream, which add
//! those nodes to the capture's graph):
//! - an allocation node gets its address when it is created, fixed for
//!   the graph's life; no memory is taken until the graph runs;
//! - a launch takes the memory of its allocation nodes from the device's
//!   graph allocator, which reserves more device memory only when what it
//!   holds free does not cover them (and fails the launch with
//!   `CUDA_ERROR_OUT_OF_MEMORY` when the device cannot give it);
//! - memory freed in the graph goes back to the graph allocator, not to
//!   the device; an allocation the graph does not free stays in use after
//!   the launch until `cuMemFree`/`cuMemFreeAsync` frees it, and launching
//!   the graph again before that fails with `CUDA_ERROR_INVALID_VALUE`,
//!   unless it was instantiated with
//!   `CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH`;
//! - the graph allocator keeps what it reserved (a synchronisation does
//!   not trim it) until `cuDeviceGraphMemTrim` gives back what no graph
//!   uses; `CU_GRAPH_MEM_ATTR_*` say how much it reserves and how much is
//!   used.
//!
//! Simplifications: memory freed in the graph is counted as used for the
//! whole launch (at once, then given back); a free node may only free an
//! allocation of its own graph (`CUDA_ERROR_NOT_SUPPORTED` otherwise); the
//! reserve is counted in bytes, not fragments, and per process.

/// `CUgraphMem_attribute`.
pub const ATTR_USED_MEM_CURRENT: i32 = 0;
pub const ATTR_USED_MEM_HIGH: i32 = 1;
pub const ATTR_RESERVED_MEM_CURRENT: i32 = 2;
pub const ATTR_RESERVED_MEM_HIGH: i32 = 3;

/// `CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH`.
pub const AUTO_FREE_ON_LAUNCH: u64 = 1;

/// Layout of `CUDA_MEM_ALLOC_NODE_PARAMS` (CUDA 11.4 and later, x86-64):
/// `CUmemPoolProps poolProps` (88 bytes: `allocType`, `handleTypes`,
/// `location.type`, `location.id`, …), `accessDescs`, `accessDescCount`,
/// `bytesize`, `dptr` (out).
pub const PARAMS_HANDLE_TYPES: usize = 4;
pub const PARAMS_LOCATION_TYPE: usize = 8;
pub const PARAMS_LOCATION_ID: usize = 12;
pub const PARAMS_BYTESIZE: usize = 104;
pub const PARAMS_DPTR: usize = 112;
/// `CU_MEM_LOCATION_TYPE_DEVICE`.
pub const LOCATION_DEVICE: u32 = 1;

/// An allocation node of a graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AllocNode {
    /// Its address, fixed for the graph's life.
    pub dptr: u64,
    pub device: usize,
    pub bytes: u64,
    /// A free node of the same graph frees it.
    pub freed_in_graph: bool,
}

/// Marks the allocation at `dptr` among `allocs` freed in its graph:
/// `CUDA_ERROR_INVALID_VALUE` (as a result code) when it is already, and
/// `None` when it is not one of them.
pub fn free_in_graph(allocs: &mut [AllocNode], dptr: u64) -> Option<Result<(), ()>> {
    let a = allocs.iter_mut().find(|a| a.dptr == dptr)?;
    if a.freed_in_graph {
        return Some(Err(()));
    }
    a.freed_in_graph = true;
    Some(Ok(()))
}

/// Bytes a launch of `allocs` needs from the graph allocator of `device`.
pub fn launch_bytes(allocs: &[AllocNode], device: usize) -> u64 {
    allocs
        .iter()
        .filter(|a| a.device == device)
        .map(|a| a.bytes)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::Pool;

    fn node(dptr: u64, device: usize, bytes: u64) -> AllocNode {
        AllocNode {
            dptr,
            device,
            bytes,
            freed_in_graph: false,
        }
    }

    #[test]
    fn a_launch_needs_its_allocations_and_the_allocator_keeps_them() {
        let mut allocs = vec![node(1, 0, 100), node(2, 0, 50), node(3, 1, 7)];
        assert_eq!(free_in_graph(&mut allocs, 2), Some(Ok(())));
        assert_eq!(free_in_graph(&mut allocs, 2), Some(Err(())), "freed twice");
        assert_eq!(free_in_graph(&mut allocs, 9), None);
        assert_eq!(launch_bytes(&allocs, 0), 150);
        assert_eq!(launch_bytes(&allocs, 1), 7);
        // The graph allocator is a pool that only trims when asked.
        let mut g = Pool::new(0);
        let grow = g.growth_for(150);
        g.hand_out(150, grow);
        g.take_back(50);
        assert_eq!((g.reserved, g.used, g.used_high), (150, 100, 150));
        g.take_back(100);
        assert_eq!(g.growth_for(150), 0, "a second launch reuses the reserve");
        assert_eq!(g.trim(0), 150);
    }
}
