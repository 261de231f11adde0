#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]
//! Configuration of gemini: `resource.conf` (the groups, XDG Desktop Entry
//! syntax read with glib's `KeyFile`) and `gemini.toml` (the daemon's own
//! settings). Each is read into a raw form first and then validated into
//! typed settings; every error names the file, the line (or group) and what
//! was expected. `load` functions open files; `parse_*` functions work on
//! strings, and that is what the unit tests feed.

pub mod resource;
pub mod settings;

pub use resource::{
    ConfigError, ConfigErrors, GroupConfig, Latency, ResourceConfig, Warning, diff, drop_in_dir,
    load_resource, load_resource_as, parse_resource,
};

pub use gemini_protocol::units::{format_size, parse_size};
pub use settings::{
    DEFAULT_HOOK, Overrides, RawSettings, RawSlurm, Settings, SettingsError, SlurmSettings,
    load_settings, parse_log_level, parse_metrics, parse_settings,
};
