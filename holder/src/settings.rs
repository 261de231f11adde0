//! The holder's settings, from flags (the meanings of the seeds' doma and
//! gpu-occupy options).

use serde::{Deserialize, Serialize};

/// How much memory to hold.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum HoldMem {
    /// A number of bytes.
    Bytes(u64),
    /// A fraction of the device's free memory when holding starts.
    FractionOfFree(f64),
}

impl HoldMem {
    /// `512MiB`, `2GB`, a number of bytes, or a percentage of free memory
    /// such as `50%`.
    pub fn parse(s: &str) -> Result<HoldMem, String> {
        let s = s.trim();
        if let Some(p) = s.strip_suffix('%') {
            return match p.trim().parse::<f64>() {
                Ok(v) if (0.0..=100.0).contains(&v) => Ok(HoldMem::FractionOfFree(v / 100.0)),
                _ => Err(format!("expected a percentage from 0% to 100%, got {s:?}")),
            };
        }
        gemini_protocol::units::parse_size(s)
            .map(HoldMem::Bytes)
            .map_err(|e| format!("{e}; or a percentage of free memory such as 50%"))
    }

    /// Bytes to hold on a device with `free` bytes free.
    pub fn bytes(&self, free: u64) -> u64 {
        match *self {
            HoldMem::Bytes(b) => b.min(free),
            HoldMem::FractionOfFree(f) => (free as f64 * f) as u64,
        }
    }
}

impl std::fmt::Display for HoldMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            HoldMem::Bytes(b) => f.write_str(&gemini_protocol::units::format_size(b)),
            HoldMem::FractionOfFree(x) => write!(f, "{}% of free", x * 100.0),
        }
    }
}

/// A flag's number: finite and within `lo..=hi` (a NaN or an overflow to
/// infinity would cross the control socket's JSON as `null`, which means
/// "keep the current value"). Clap names the flag before the message.
pub fn number_in(text: &str, lo: f64, hi: f64) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && (lo..=hi).contains(&v) => Ok(v),
        Ok(_) => Err(format!("expected a number from {lo} to {hi}")),
        Err(_) => Err("expected a number".into()),
    }
}

/// Longest wait before holding: a year (longer overflows the clock's
/// nanoseconds; stop the holder instead).
pub const MAX_WAIT_MINUTES: f64 = 525_600.0;

/// Everything that shapes the holder's behaviour.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    /// Devices to hold (physical indices); empty: all.
    pub devices: Vec<u32>,
    /// Idle time before holding, in minutes.
    pub wait_minutes: f64,
    /// Memory used by others under which a device counts idle, bytes.
    pub mem_threshold: u64,
    /// Memory to hold.
    pub hold_mem: HoldMem,
    /// Target utilisation of the device (real clients plus holder).
    pub hold_util: f64,
    /// Length of one holder kernel, milliseconds.
    pub max_kernel_ms: f64,
}

impl Settings {
    /// Checks ranges; the message says what was expected.
    pub fn validate(&self) -> Result<(), String> {
        for (i, d) in self.devices.iter().enumerate() {
            if self.devices[..i].contains(d) {
                return Err(format!("--devices lists device {d} twice"));
            }
        }
        if !(0.0..=1.0).contains(&self.hold_util) {
            return Err(format!(
                "--hold-util must be from 0 to 1, got {}",
                self.hold_util
            ));
        }
        if !(self.wait_minutes >= 0.0 && self.wait_minutes <= MAX_WAIT_MINUTES) {
            return Err(format!(
                "--wait-minutes must be from 0 to {MAX_WAIT_MINUTES}, got {}",
                self.wait_minutes
            ));
        }
        if !(0.05..=100.0).contains(&self.max_kernel_ms) {
            return Err(format!(
                "--max-kernel-ms must be from 0.05 to 100, got {}",
                self.max_kernel_ms
            ));
        }
        Ok(())
    }

    /// The wait period in nanoseconds.
    pub fn wait_ns(&self) -> u64 {
        (self.wait_minutes * 60e9) as u64
    }

    /// One kernel's length in nanoseconds.
    pub fn kernel_ns(&self) -> u64 {
        (self.max_kernel_ms * 1e6) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hold_mem_sizes_and_percentages() {
        assert_eq!(HoldMem::parse("50%"), Ok(HoldMem::FractionOfFree(0.5)));
        assert_eq!(HoldMem::parse("8GiB"), Ok(HoldMem::Bytes(8 << 30)));
        assert_eq!(HoldMem::parse("0.5GB"), Ok(HoldMem::Bytes(500_000_000)));
        assert!(HoldMem::parse("150%").is_err());
        assert!(HoldMem::parse("lots").is_err());
        assert_eq!(HoldMem::FractionOfFree(0.5).bytes(1000), 500);
        assert_eq!(HoldMem::Bytes(2000).bytes(1000), 1000);
    }

    #[test]
    fn flag_numbers_must_be_finite_and_in_range() {
        assert_eq!(number_in("0.25", 0.0, 1.0), Ok(0.25));
        for bad in ["NaN", "nan", "inf", "1e400", "-0.1", "1.5", "half"] {
            let e = number_in(bad, 0.0, 1.0).unwrap_err();
            assert!(e.starts_with("expected a number"), "{bad}: {e}");
        }
        assert!(number_in("1e400", 0.0, MAX_WAIT_MINUTES).is_err());
        assert_eq!(HoldMem::FractionOfFree(0.5).to_string(), "50% of free");
        assert_eq!(HoldMem::Bytes(8 << 30).to_string(), "8.0 GiB");
    }

    #[test]
    fn ranges_are_checked() {
        let ok = Settings {
            devices: vec![],
            wait_minutes: 10.0,
            mem_threshold: 500_000_000,
            hold_mem: HoldMem::FractionOfFree(0.5),
            hold_util: 0.5,
            max_kernel_ms: 1.0,
        };
        assert!(ok.validate().is_ok());
        assert!(
            Settings {
                hold_util: 1.5,
                ..ok.clone()
            }
            .validate()
            .unwrap_err()
            .contains("--hold-util")
        );
        assert!(
            Settings {
                wait_minutes: -1.0,
                ..ok.clone()
            }
            .validate()
            .is_err()
        );
        assert_eq!(
            Settings {
                devices: vec![0, 1, 0],
                ..ok.clone()
            }
            .validate(),
            Err("--devices lists device 0 twice".into())
        );
        assert!(
            Settings {
                hold_util: f64::NAN,
                ..ok.clone()
            }
            .validate()
            .is_err()
        );
        assert!(
            Settings {
                max_kernel_ms: 0.0,
                ..ok
            }
            .validate()
            .is_err()
        );
    }
}
