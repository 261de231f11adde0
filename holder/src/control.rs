//! The holder's own control socket, `ipc://$GEMINI_IPC_DIR/holder.sock`:
//! `gem-holder status|stop|start|restart|shutdown` talk to a running
//! `gem-holder run` over it (JSON messages, REQ/REP).

use crate::settings::{HoldMem, Settings};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// File name of the socket in the IPC directory.
pub const SOCKET: &str = "holder.sock";

/// Settings to change on restart; `None` keeps the current value.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Patch {
    /// Devices.
    pub devices: Option<Vec<u32>>,
    /// Wait period, minutes.
    pub wait_minutes: Option<f64>,
    /// Idle threshold, bytes.
    pub mem_threshold: Option<u64>,
    /// Memory to hold.
    pub hold_mem: Option<HoldMem>,
    /// Target utilisation.
    pub hold_util: Option<f64>,
    /// Kernel length, ms.
    pub max_kernel_ms: Option<f64>,
}

impl Patch {
    /// `base` with this patch applied.
    pub fn apply(&self, base: &Settings) -> Settings {
        Settings {
            devices: self.devices.clone().unwrap_or_else(|| base.devices.clone()),
            wait_minutes: self.wait_minutes.unwrap_or(base.wait_minutes),
            mem_threshold: self.mem_threshold.unwrap_or(base.mem_threshold),
            hold_mem: self.hold_mem.unwrap_or(base.hold_mem),
            hold_util: self.hold_util.unwrap_or(base.hold_util),
            max_kernel_ms: self.max_kernel_ms.unwrap_or(base.max_kernel_ms),
        }
    }
}

/// A command to the running holder.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Command {
    /// Report state.
    Status,
    /// Release everything and stop holding (the process stays).
    Stop,
    /// Hold again (after the wait period).
    Start,
    /// Release everything, apply the patch, hold again.
    Restart(Patch),
    /// Release everything and exit.
    Shutdown,
}

/// One device's state.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeviceStatus {
    /// Physical index.
    pub device: u32,
    /// `waiting`, `holding` or `stopped`.
    pub state: String,
    /// Bytes held.
    pub held_bytes: u64,
    /// Share of time the holder's kernels aim to fill.
    pub duty: f64,
    /// Last utilisation read from NVML.
    pub utilisation: Option<f64>,
    /// Memory used by others, bytes.
    pub others_used: u64,
    /// Seconds since real clients last used the device (or its memory
    /// was above the threshold).
    pub idle_seconds: f64,
}

/// The running holder's state.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Status {
    /// Settings in force.
    pub settings: Settings,
    /// Stopped by `gem-holder stop`.
    pub stopped: bool,
    /// Whether the scheduler answers.
    pub scheduler: bool,
    /// Per device.
    pub devices: Vec<DeviceStatus>,
}

/// The answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Answer {
    /// State.
    Status(Status),
    /// Done, with a sentence for the user.
    Ok(String),
    /// Refused.
    Err(String),
}

/// The control endpoint in `ipc_dir`.
pub fn endpoint(ipc_dir: &Path) -> String {
    format!("ipc://{}", ipc_dir.join(SOCKET).display())
}

/// Whether a holder answers in `ipc_dir` (quickly: no socket file, no
/// holder).
pub fn running(ipc_dir: &Path) -> bool {
    ipc_dir.join(SOCKET).exists() && send_within(ipc_dir, &Command::Status, 500).is_ok()
}

/// Sends `cmd` to the running holder.
pub fn send(ipc_dir: &Path, cmd: &Command) -> anyhow::Result<Answer> {
    send_within(ipc_dir, cmd, 5000)
}

/// No holder answers in the IPC directory (exit status 3).
#[derive(Debug)]
pub struct NoHolder(pub String);

impl std::fmt::Display for NoHolder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "no gem-holder answers at {} (start one with `gem-holder run`)",
            self.0
        )
    }
}

impl std::error::Error for NoHolder {}

fn send_within(ipc_dir: &Path, cmd: &Command, timeout_ms: i64) -> anyhow::Result<Answer> {
    // No socket: no holder, said at once rather than after the timeout.
    if !ipc_dir.join(SOCKET).exists() {
        return Err(NoHolder(endpoint(ipc_dir)).into());
    }
    let ctx = zmq::Context::new();
    let s = ctx.socket(zmq::REQ)?;
    s.set_linger(0)?;
    s.connect(&endpoint(ipc_dir))?;
    s.send(serde_json::to_vec(cmd)?, 0)?;
    if s.poll(zmq::POLLIN, timeout_ms)? == 0 {
        return Err(NoHolder(endpoint(ipc_dir)).into());
    }
    Ok(serde_json::from_slice(&s.recv_bytes(0)?)?)
}
