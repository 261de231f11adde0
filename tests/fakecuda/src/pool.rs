//! Stream-ordered memory pools (`cuMemAllocAsync`, `cuMemFreeAsync`,
//! `cuMemPool*`), as the driver does it:
//! - each device has a default pool, and a current pool (the default one
//!   until `cuDeviceSetMemPool`) that `cuMemAllocAsync` allocates from;
//! - a pool *reserves* device memory and hands it out; freed memory goes
//!   back to the pool, not to the device;
//! - at a synchronisation (stream, event, context, a blocking copy) the
//!   pool gives back to the device what it reserves beyond its release
//!   threshold (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`, default 0) and beyond
//!   what is in use; `cuMemPoolTrimTo` does so at once;
//! - `CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`/`_HIGH` and
//!   `CU_MEMPOOL_ATTR_USED_MEM_CURRENT`/`_HIGH` say how much.
//!
//! Simplification: a pool counts bytes, not fragments (any freed bytes
//! can serve any allocation).

/// `CUmemPool_attribute`.
pub const ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES: i32 = 1;
pub const ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: i32 = 3;
pub const ATTR_RELEASE_THRESHOLD: i32 = 4;
pub const ATTR_RESERVED_MEM_CURRENT: i32 = 5;
pub const ATTR_RESERVED_MEM_HIGH: i32 = 6;
pub const ATTR_USED_MEM_CURRENT: i32 = 7;
pub const ATTR_USED_MEM_HIGH: i32 = 8;

/// A memory pool of one device.
#[derive(Debug, Default, Clone)]
pub struct Pool {
    pub device: usize,
    /// A pool of host memory (`CU_MEM_LOCATION_TYPE_HOST*`): it takes no
    /// device memory.
    pub host: bool,
    pub threshold: u64,
    pub reserved: u64,
    pub reserved_high: u64,
    pub used: u64,
    pub used_high: u64,
}

impl Pool {
    pub fn new(device: usize) -> Pool {
        Pool {
            device,
            ..Pool::default()
        }
    }

    /// How much more the pool must reserve from the device to hand out
    /// `bytes`.
    pub fn growth_for(&self, bytes: u64) -> u64 {
        (self.used + bytes).saturating_sub(self.reserved)
    }

    /// Hands out `bytes`, of which `grown` were just reserved.
    pub fn hand_out(&mut self, bytes: u64, grown: u64) {
        self.reserved += grown;
        self.used += bytes;
        self.reserved_high = self.reserved_high.max(self.reserved);
        self.used_high = self.used_high.max(self.used);
    }

    /// `bytes` come back to the pool.
    pub fn take_back(&mut self, bytes: u64) {
        self.used = self.used.saturating_sub(bytes);
    }

    /// Keeps at most `keep` (and what is in use); returns what goes back
    /// to the device.
    pub fn trim(&mut self, keep: u64) -> u64 {
        let keep = keep.max(self.used);
        let excess = self.reserved.saturating_sub(keep);
        self.reserved -= excess;
        excess
    }

    /// At a synchronisation: what exceeds the release threshold goes back.
    pub fn at_sync(&mut self) -> u64 {
        self.trim(self.threshold)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_keeps_what_its_threshold_allows() {
        let mut p = Pool::new(0);
        assert_eq!(p.growth_for(100), 100);
        p.hand_out(100, 100);
        p.take_back(100);
        assert_eq!(p.growth_for(60), 0, "freed bytes are reused");
        p.hand_out(60, 0);
        assert_eq!((p.reserved, p.used), (100, 60));
        assert_eq!(p.at_sync(), 40, "threshold 0: down to what is in use");
        p.threshold = u64::MAX;
        p.take_back(60);
        assert_eq!(p.at_sync(), 0, "an unbounded threshold keeps it all");
        assert_eq!(p.trim(10), 50);
        assert_eq!(
            (p.reserved, p.used, p.reserved_high, p.used_high),
            (10, 0, 100, 100)
        );
    }
}
