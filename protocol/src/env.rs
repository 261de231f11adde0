//! Every environment variable any gemini part reads, in one place. Each
//! part reads the environment once, at start-up, into its own settings.

/// Name of the group a client process belongs to (required by the hook).
pub const GROUP_NAME: &str = "GEMINI_GROUP_NAME";
/// Directory holding the scheduler's `ipc://` socket.
pub const IPC_DIR: &str = "GEMINI_IPC_DIR";
/// Enables the hook's diagnostics on stderr when set (`1`, `debug`, `trace`).
pub const LOG: &str = "GEMINI_LOG";
/// Path of `resource.conf` for the scheduler (flag `--config` wins).
pub const CONFIG: &str = "GEMINI_CONFIG";
/// Path of `gemini.toml` (flag `--settings` wins); every part reads its
/// `ipc_dir`. Default: `/etc/gemini/gemini.toml` when it exists.
pub const SETTINGS: &str = "GEMINI_SETTINGS";
/// How long a client waits for an absent scheduler before giving up.
pub const CONNECT_TIMEOUT: &str = "GEMINI_CONNECT_TIMEOUT";
/// How long the hook holds a token with nothing queued before giving it
/// back (a bare number is milliseconds; default 5).
pub const IDLE_MS: &str = "GEMINI_IDLE_MS";
/// Benchmarks only: microseconds the hook sleeps before each token
/// request, so that `gem-bench --only rtt` can measure what a slower token
/// round trip would cost. Unset (or 0) in use.
pub const BENCH_TOKEN_DELAY_US: &str = "GEMINI_BENCH_TOKEN_DELAY_US";
/// Tests only: microseconds the hook sleeps after reading a token's
/// grant, before taking it (a thread descheduled there on a loaded host);
/// `N:US`: after every Nth. Unset (or 0) in use.
pub const TEST_TAKE_DELAY_US: &str = "GEMINI_TEST_TAKE_DELAY_US";
/// `0` turns off asking for a token ahead of a process's predicted return
/// from a quiet gap (the hook's default: on).
pub const ASK_AHEAD: &str = "GEMINI_ASK_AHEAD";
/// Path of `libgemhook.so` for `gem-launch` (flag `--hook` wins).
pub const HOOK: &str = "GEMINI_HOOK";
/// The multi-GPU job a process is a rank of (`gem-launch --job NAME`):
/// its ranks take their GPUs in turns together (see [`crate::job`]).
pub const JOB: &str = "GEMINI_JOB";
