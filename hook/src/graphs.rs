//! What a graph launch costs on the device.
//!
//! A graph runs whole, often for many milliseconds (a captured training
//! step, a decode step). Counted as one ordinary launch it would look like
//! a few microseconds of work, and a lent token would admit it and be
//! overrun by all of it. So each launch outside a capture is bracketed
//! with two timing events on its stream; once the second has completed,
//! their elapsed time updates the cost of that executable graph, which
//! predicts its next launches (see `gate::admit_graph`).
//!
//! Nothing here synchronises or waits: completed timings are collected
//! with `cuEventQuery` at the next graph launch. While a capture is open
//! nothing is recorded or queried (legacy-stream work or a query could
//! break a global-mode capture).

use crate::capture;
use crate::cuda::CUDA_SUCCESS;
use crate::driver::{self, CUresult};
use crate::state::lock;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

/// Timings not yet collected, at most (older ones are dropped: a program
/// that launches graphs without ever letting them finish is not waited
/// for).
const MAX_PENDING: usize = 64;
/// Spare event pairs kept for reuse, at most.
const MAX_SPARE: usize = 16;

/// A launch being timed.
#[derive(Debug, Clone, Copy)]
struct Timing {
    exec: usize,
    ctx: usize,
    start: usize,
    end: usize,
}

#[derive(Debug, Default)]
struct Graphs {
    /// Smoothed device time per launch of each executable graph (ns).
    cost: HashMap<usize, u64>,
    pending: Vec<Timing>,
    /// Event pairs `(ctx, start, end)` free for reuse.
    spare: Vec<(usize, usize, usize)>,
}

static GRAPHS: Mutex<Option<Graphs>> = Mutex::new(None);

fn with<T>(f: impl FnOnce(&mut Graphs) -> T) -> T {
    let mut g = lock(&GRAPHS);
    f(g.get_or_insert_with(Graphs::default))
}

/// The predicted device time of a launch of `exec` (ns), once one has
/// been timed.
pub fn cost(exec: *mut c_void) -> Option<u64> {
    with(|g| g.cost.get(&(exec as usize)).copied())
}

/// Launches `exec` on `stream` with `launch` (the real call), timing it
/// with events when no capture is open; returns `launch`'s result.
pub fn launch(
    exec: *mut c_void,
    stream: *mut c_void,
    per_thread: bool,
    launch: impl FnOnce() -> CUresult,
) -> CUresult {
    if capture::any_open() {
        return launch();
    }
    let Some(ctx) = current_context() else {
        return launch();
    };
    let pair = with(|g| {
        collect(g);
        take_pair(g, ctx)
    });
    let Some((start, end)) = pair else {
        return launch();
    };
    let recorded = driver::event_record(start, stream, per_thread) == 0;
    let r = launch();
    let timing = Timing {
        exec: exec as usize,
        ctx,
        start,
        end,
    };
    if recorded && r == CUDA_SUCCESS && driver::event_record(end, stream, per_thread) == 0 {
        with(|g| {
            if g.pending.len() >= MAX_PENDING {
                let old = g.pending.remove(0);
                destroy(old.start, old.end);
            }
            g.pending.push(timing);
        });
    } else {
        with(|g| give_back(g, timing));
    }
    r
}

/// The calling thread's current context, if any.
fn current_context() -> Option<usize> {
    let mut ctx: *mut c_void = std::ptr::null_mut();
    // SAFETY: out-pointer to a local.
    let r = unsafe { driver::ctx_get_current(&mut ctx) };
    (r == CUDA_SUCCESS && !ctx.is_null()).then_some(ctx as usize)
}

/// A pair of timing events of `ctx`: a spare one, or two new ones.
fn take_pair(g: &mut Graphs, ctx: usize) -> Option<(usize, usize)> {
    if let Some(i) = g.spare.iter().position(|&(c, ..)| c == ctx) {
        let (_, a, b) = g.spare.swap_remove(i);
        return Some((a, b));
    }
    let a = driver::event_create()?;
    match driver::event_create() {
        Some(b) => Some((a, b)),
        None => {
            destroy(a, 0);
            None
        }
    }
}

fn give_back(g: &mut Graphs, t: Timing) {
    if g.spare.len() < MAX_SPARE {
        g.spare.push((t.ctx, t.start, t.end));
    } else {
        destroy(t.start, t.end);
    }
}

fn destroy(a: usize, b: usize) {
    for e in [a, b] {
        if e != 0 {
            driver::event_destroy(e);
        }
    }
}

/// Turns the timings whose launch has finished into costs.
fn collect(g: &mut Graphs) {
    let mut i = 0;
    while i < g.pending.len() {
        let t = g.pending[i];
        match driver::event_elapsed_ns(t.start, t.end) {
            Ok(ns) => {
                let c = g.cost.entry(t.exec).or_insert_with(|| {
                    crate::log::debug!("graph {:#x}: {} us on the device", t.exec, ns / 1000);
                    ns
                });
                // Follows a change within a few launches (a graph updated
                // with cuGraphExecUpdate) without jumping on one outlier.
                *c = (*c * 3 + ns) / 4;
                g.pending.swap_remove(i);
                give_back(g, t);
            }
            Err(crate::cuda::CUDA_ERROR_NOT_READY) => i += 1,
            Err(_) => {
                // Not measurable (a context destroyed, events of a
                // stream reset): forget it.
                g.pending.swap_remove(i);
                destroy(t.start, t.end);
            }
        }
    }
}

/// A graph executable was destroyed: its handle may be reused.
pub fn forget(exec: *mut c_void) {
    with(|g| {
        g.cost.remove(&(exec as usize));
    });
}

/// A context was destroyed, and its events with it.
pub fn context_gone(ctx: *mut c_void) {
    let ctx = ctx as usize;
    with(|g| {
        g.pending.retain(|t| t.ctx != ctx);
        g.spare.retain(|&(c, ..)| c != ctx);
    });
}
