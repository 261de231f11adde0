//! Contexts that go while the hook works with them: a context destroyed
//! beside another GPU's wait, contexts never used after they went,
//! captures begun beside the idle watcher, a launch with no current
//! context.

use super::*;

/// A token's end that waits for one GPU's work holds only that GPU's
/// contexts: a program destroying its context of GPU 1 meanwhile goes on
/// at once. (Before, one process-wide lock was held across every
/// synchronisation: the destruction waited the 3 s of GPU 0's kernel, as
/// did the other GPUs' token ends, the way NCCL's ranks wait for a peer.)
#[test]
fn a_context_goes_at_once_while_another_gpus_work_is_waited_for() {
    let g = Gemini::start(SimEnv::new(2, "8GiB"), "[a]\n");
    let mut w = Memwork::start_with(
        &g,
        "a",
        &["sync-beside", "--kernel-ms", "3000"],
        &[("GEMINI_IDLE_MS", "20")],
    );
    w.at("done");
    let ms = w.num("destroy_ms");
    assert!(
        ms < 1000,
        "cuCtxDestroy took {ms} ms beside a 3 s wait on GPU 0"
    );
    w.end();
}

/// After a primary context's last release, a reset, `cuCtxDestroy`
/// (PyTorch's and the CUDA runtime's teardown at exit) or
/// `cuGreenCtxDestroy` (whose context goes with the green context), the
/// hook never uses that context again: no synchronisation of it at a
/// token's end, no reuse of the timing events it made there. The
/// simulator fails and logs every call on a context that went; none is
/// logged. (Before, the idle watcher synchronised a released primary
/// context, and a token's end the context of a green context destroyed
/// after a token was taken in it.)
#[test]
fn contexts_that_went_are_never_used_again() {
    let g = Gemini::start(SimEnv::default(), "[a]\n");
    let mut w = Memwork::start(&g, "a", &["contexts"]);
    w.at("done");
    let pid = w.num("pid");
    w.end();
    let log = std::fs::read_to_string(g.sim.sim_dir().join("dead-context.log")).unwrap_or_default();
    let mine: Vec<&str> = log
        .lines()
        .filter(|l| l.split(' ').next() == Some(&pid.to_string()))
        .collect();
    assert!(
        mine.is_empty(),
        "calls on contexts that went:\n{}",
        mine.join("\n")
    );
}

/// A capture begun while the hook's idle watcher settles a token: the
/// watcher never synchronises inside it (the capture counts as open
/// before the driver's call, and the watcher checks and synchronises
/// under the same lock), so the driver invalidates none of 1000 captures
/// begun 0 to 10 ms after the process went idle. (The simulator
/// invalidates a global capture at another thread's context
/// synchronisation, as the driver does.)
#[test]
fn captures_begun_beside_the_idle_watcher_are_never_invalidated() {
    let g = Gemini::start(SimEnv::default(), "[a]\n");
    // Each begin takes 2 ms after the capture is open, which widens the
    // moment a watcher that counts captures only once the driver's call
    // returned synchronises inside one: the previous hook let the driver
    // invalidate 6 of 1000.
    let mut w = Memwork::start_with(
        &g,
        "a",
        &["capture-race", "--iterations", "1000"],
        &[("FAKECUDA_BEGIN_CAPTURE_US", "2000")],
    );
    w.at("done");
    assert_eq!(w.num("failed"), 0, "{:?}", w.said);
    assert_eq!(w.num("invalidated"), 0, "captures the driver invalidated");
    w.end();
}

/// A `CUkernel` (`cuLibraryGetKernel`) launched on an explicit stream from
/// a thread with no current context runs in the stream's context, as
/// cuda.h allows: it is gated on that stream's GPU. A group whose
/// `Devices` is GPU 1 gets its launches on GPU 0 refused
/// (`CUDA_ERROR_NOT_PERMITTED`) and those on GPU 1 through a token.
/// (Before, such launches passed ungated: no context, no token.)
#[test]
fn a_kernel_launched_with_no_current_context_is_gated_on_its_streams_gpu() {
    let g = Gemini::start(SimEnv::new(2, "16GiB"), "[a]\nDevices=1\n");
    let mut w = Memwork::start(&g, "a", &["kernel-no-context", "--device", "0"]);
    w.at("launched");
    assert_eq!(
        w.num("launch_error"),
        800,
        "GPU 0: CUDA_ERROR_NOT_PERMITTED"
    );
    w.end();
    let t0 = gemini_tests::now_ns();
    let mut w = Memwork::start(&g, "a", &["kernel-no-context", "--device", "1"]);
    w.at("launched");
    assert_eq!(w.num("launch_error"), 0, "GPU 1");
    let busy = g.sim.busy(1, t0, gemini_tests::now_ns());
    assert!(busy.device_share() > 0.0, "the kernels ran on GPU 1");
    assert!(
        g.status()
            .devices
            .iter()
            .any(|d| d.device == 1 && d.groups.iter().any(|r| r.group == "a")),
        "group a took a token on GPU 1: {:?}",
        g.status().devices
    );
    w.end();
}

/// A `CUkernel` launched onto a stream of GPU 1 from a thread whose
/// current context is GPU 0's runs on GPU 1, in the stream's context: it
/// is gated and charged there, not on the current context's GPU. A group
/// whose `Devices` is GPU 1 launches through a token of GPU 1; the other
/// way round (current on GPU 1, stream on GPU 0) it is refused. (Before,
/// the launch was gated on the current context's GPU: refused, and where
/// allowed, charged to the wrong GPU.)
#[test]
fn a_kernel_launched_onto_another_gpus_stream_is_gated_on_the_streams_gpu() {
    let g = Gemini::start(SimEnv::new(2, "16GiB"), "[a]\nDevices=1\n");
    let t0 = gemini_tests::now_ns();
    let mut w = Memwork::start(
        &g,
        "a",
        &["kernel-no-context", "--device", "1", "--current", "0"],
    );
    w.at("launched");
    assert_eq!(w.num("launch_error"), 0, "stream on GPU 1, current GPU 0");
    let busy = g.sim.busy(1, t0, gemini_tests::now_ns());
    assert!(busy.device_share() > 0.0, "the kernels ran on GPU 1");
    let devices = g.status().devices;
    assert!(
        devices
            .iter()
            .any(|d| d.device == 1 && d.groups.iter().any(|r| r.group == "a")),
        "group a took a token on GPU 1: {devices:?}"
    );
    w.end();
    let mut w = Memwork::start(
        &g,
        "a",
        &["kernel-no-context", "--device", "0", "--current", "1"],
    );
    w.at("launched");
    assert_eq!(
        w.num("launch_error"),
        800,
        "stream on GPU 0, current GPU 1: CUDA_ERROR_NOT_PERMITTED"
    );
    w.end();
}

/// A `CUkernel` launched from a thread with no current context onto a
/// stream of a green context's context, which the hook never saw made
/// (`cuCtxFromGreenCtx`): gated on that context's GPU, which the hook
/// asks of the driver. A group whose `Devices` is GPU 1 gets its
/// launches on GPU 0 refused. (Before, such launches passed ungated.)
#[test]
fn a_kernel_launched_onto_a_green_contexts_stream_is_gated() {
    let g = Gemini::start(SimEnv::new(2, "16GiB"), "[a]\nDevices=1\n");
    // From a thread with no context, and from one whose current context
    // is GPU 1's (the simulator's driver is 12.8 by default, which answers
    // a request for `cuCtxGetDevice_v2` with `cuCtxGetDevice`, the
    // current context's GPU).
    for current in [None, Some("1")] {
        let mut args = vec!["kernel-no-context", "--device", "0", "--green"];
        args.extend(current.iter().flat_map(|c| ["--current", c]));
        let mut w = Memwork::start(&g, "a", &args);
        w.at("launched");
        assert_eq!(
            w.num("launch_error"),
            800,
            "a green context of GPU 0, current {current:?}: CUDA_ERROR_NOT_PERMITTED"
        );
        w.end();
    }
}
