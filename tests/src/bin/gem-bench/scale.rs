//! `--only scale`: the token path as programs and GPUs grow. 8, 64 and
//! 256 clients (one connection each, as a hooked process has), spread
//! over 1, 4 and 8 simulated GPUs, each asking for its GPU's token,
//! reporting 1 µs of work and giving it back, as fast as it is granted,
//! for 2 s. Per shape: the round trip of a grant (the client's time from
//! its request to the grant, less the time the request waited in gem-schd
//! for the token, which the grant says: `held_us`), the grants served per
//! second, and gem-schd's CPU per grant.

use super::startup::cpu_s;
use super::{Table, client_in, percentile, ran_1us};
use gemini_protocol::{Reply, Request};
use gemini_tests::{Gemini, SimEnv};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

const CLIENTS: [usize; 3] = [8, 64, 256];
const GPUS: [u32; 3] = [1, 4, 8];
const SECONDS: f64 = 2.0;

/// What one shape measured: round trips (µs), grants per second and
/// gem-schd's CPU per grant (µs).
struct Scaled {
    rtt: Vec<f64>,
    grants_per_s: f64,
    cpu_per_grant_us: f64,
}

fn run(clients: usize, gpus: u32) -> Scaled {
    let g = Gemini::start_with(
        SimEnv::new(gpus, "16GiB"),
        "[a]\n",
        &["--log-level", "warn"],
    );
    let schd = g.scheduler_pid().expect("gem-schd runs");
    let ctx = zmq::Context::new();
    let start = Arc::new(Barrier::new(clients + 1));
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..clients)
        .map(|i| {
            let mut c = client_in(&ctx, &g, "a");
            let (start, stop) = (start.clone(), stop.clone());
            let device = i as u32 % gpus;
            std::thread::spawn(move || {
                let mut rtt = Vec::new();
                start.wait();
                while !stop.load(Ordering::Relaxed) {
                    let asked = Instant::now();
                    let acquire = Request::AcquireToken {
                        device,
                        ran: ran_1us(),
                        in_flight: false,
                        burst_us: 0,
                        rtt_us: 100,
                        launch_us: 0,
                    };
                    let r = c.request(&acquire, Duration::from_secs(30));
                    let Ok(Reply::Token { held_us, .. }) = r else {
                        panic!("{r:?}");
                    };
                    let took = asked.elapsed().as_secs_f64() * 1e6;
                    if !stop.load(Ordering::Relaxed) {
                        rtt.push((took - held_us as f64).max(0.0));
                    }
                    let release = Request::ReleaseToken {
                        device,
                        ran: ran_1us(),
                        in_flight: false,
                    };
                    let _ = c.request(&release, Duration::from_secs(30));
                }
                rtt
            })
        })
        .collect();
    start.wait();
    let (cpu0, t0) = (cpu_s(schd), Instant::now());
    std::thread::sleep(Duration::from_secs_f64(SECONDS));
    stop.store(true, Ordering::Relaxed);
    let (cpu1, elapsed) = (cpu_s(schd), t0.elapsed().as_secs_f64());
    let rtt: Vec<f64> = workers
        .into_iter()
        .flat_map(|w| w.join().expect("a client"))
        .collect();
    let grants = rtt.len() as f64;
    Scaled {
        grants_per_s: grants / elapsed,
        cpu_per_grant_us: (cpu1 - cpu0) * 1e6 / grants.max(1.0),
        rtt,
    }
}

pub(crate) fn scale(t: &mut Table) {
    for clients in CLIENTS {
        for gpus in GPUS {
            let mut s = run(clients, gpus);
            t.row(
                format!(
                    "token path at scale: {clients} clients on {gpus} GPU(s), each asking again at once (2 s): round trip median / p99, grants/s, gem-schd CPU per grant"
                ),
                format!(
                    "{:.0} / {:.0} µs, {:.0} grants/s, {:.0} µs",
                    percentile(&mut s.rtt, 0.5),
                    percentile(&mut s.rtt, 0.99),
                    s.grants_per_s,
                    s.cpu_per_grant_us
                ),
                "",
            );
        }
    }
}
