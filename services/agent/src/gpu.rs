//! Where a node's GPUs come from: NVML on a real machine, or fake GPUs with scripted faults for
//! tests, demos and machines without a driver. The agent sees only [`GpuSource`].

use std::time::Duration;

use ledger::event::GpuReading;

/// One GPU as discovered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuInfo {
    /// Index on the node (NVML's, in PCI bus order).
    pub index: u32,
    /// Vendor UUID (`GPU-…`), when known.
    pub uuid: Option<String>,
    /// Model as the vendor names it, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// Memory installed.
    pub memory_total_mib: u64,
}

/// Why GPUs could not be read.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// No usable NVIDIA driver: says what to do instead.
    #[error("{0}")]
    NoDriver(String),
    /// A reading failed.
    #[error("reading GPU {index}: {reason}")]
    Reading {
        /// Which GPU.
        index: u32,
        /// What NVML said.
        reason: String,
    },
}

/// A node's GPUs: what they are, and their readings now.
pub trait GpuSource: Send {
    /// What this source is, for logs (`NVML, driver 550.54` or `fake`).
    fn describe(&self) -> String;
    /// The GPUs, in index order.
    fn gpus(&self) -> &[GpuInfo];
    /// Readings of every GPU, `elapsed` after the agent started. `busy` holds the indices of the
    /// GPUs running workloads (fake GPUs report them as utilized).
    fn read(&mut self, elapsed: Duration, busy: &[u32]) -> Result<Vec<GpuReading>, GpuError>;
    /// Whether heartbeats should stop, `elapsed` after the agent started (a scripted fault).
    fn silent(&self, _elapsed: Duration) -> bool {
        false
    }
}

/// The scheduler's short model name for a vendor name: `NVIDIA H100 80GB HBM3` → `H100`.
pub fn short_model(name: &str) -> String {
    let name = name.trim();
    let rest = name
        .strip_prefix("NVIDIA ")
        .or_else(|| name.strip_prefix("Tesla "))
        .unwrap_or(name);
    let rest = rest.strip_prefix("Tesla ").unwrap_or(rest);
    rest.split_whitespace()
        .next()
        .unwrap_or("unknown")
        .to_owned()
}

// ---- fake ------------------------------------------------------------------------------------

/// A scripted fault of fake GPUs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// GPU `gpu` reports a fault from `after` on.
    Unhealthy {
        /// Which GPU.
        gpu: u32,
        /// When, after the agent started.
        after: Duration,
    },
    /// Heartbeats stop from `after` on.
    Silent {
        /// When, after the agent started.
        after: Duration,
    },
}

impl std::str::FromStr for Fault {
    type Err = String;

    /// `GPU@SECONDS` (that GPU goes unhealthy) or `silent@SECONDS` (heartbeats stop).
    fn from_str(s: &str) -> Result<Self, String> {
        let usage = || {
            format!(
                "fault {s:?}: write GPU@SECONDS (a GPU goes unhealthy, e.g. 1@30) or silent@SECONDS (heartbeats stop)"
            )
        };
        let (what, at) = s.split_once('@').ok_or_else(usage)?;
        let after = Duration::from_secs_f64(
            at.parse::<f64>()
                .ok()
                .filter(|a| a.is_finite() && *a >= 0.0)
                .ok_or_else(usage)?,
        );
        if what == "silent" {
            return Ok(Fault::Silent { after });
        }
        let gpu = what.parse().map_err(|_| usage())?;
        Ok(Fault::Unhealthy { gpu, after })
    }
}

/// Fake GPUs: idle ones read 0 % utilization, busy ones 90 %, and faults happen on schedule.
#[derive(Clone, Debug)]
pub struct FakeGpus {
    gpus: Vec<GpuInfo>,
    faults: Vec<Fault>,
}

impl FakeGpus {
    /// `count` fake GPUs of `model`, with `faults`. A fault naming a GPU the node lacks is an
    /// error.
    pub fn new(count: u32, model: &str, faults: Vec<Fault>) -> Result<Self, String> {
        if count == 0 {
            return Err("--fake-gpus must be at least 1".into());
        }
        for f in &faults {
            if let Fault::Unhealthy { gpu, .. } = f {
                if *gpu >= count {
                    return Err(format!(
                        "fault on GPU {gpu}, but there are only GPUs 0 to {}",
                        count - 1
                    ));
                }
            }
        }
        let gpus = (0..count)
            .map(|index| GpuInfo {
                index,
                uuid: None,
                name: model.to_owned(),
                memory_total_mib: 81_559,
            })
            .collect();
        Ok(FakeGpus { gpus, faults })
    }
}

impl GpuSource for FakeGpus {
    fn describe(&self) -> String {
        format!("{} fake {}", self.gpus.len(), self.gpus[0].name)
    }

    fn gpus(&self) -> &[GpuInfo] {
        &self.gpus
    }

    fn read(&mut self, elapsed: Duration, busy: &[u32]) -> Result<Vec<GpuReading>, GpuError> {
        Ok(self
            .gpus
            .iter()
            .map(|g| {
                let working = busy.contains(&g.index);
                let faulty = self.faults.iter().any(|f| {
                    matches!(f, Fault::Unhealthy { gpu, after } if *gpu == g.index && elapsed >= *after)
                });
                GpuReading {
                    gpu: g.index,
                    uuid: g.uuid.clone(),
                    utilization_pct: if working { 90 } else { 0 },
                    memory_used_mib: if working { 40_000 } else { 0 },
                    memory_total_mib: g.memory_total_mib,
                    temperature_c: if working { 70 } else { 35 },
                    power_w: if working { 600 } else { 70 },
                    ecc_errors_uncorrected: 0,
                    fault: faulty.then(|| "fake fault (scripted)".to_owned()),
                }
            })
            .collect())
    }

    fn silent(&self, elapsed: Duration) -> bool {
        self.faults
            .iter()
            .any(|f| matches!(f, Fault::Silent { after } if elapsed >= *after))
    }
}

// ---- NVML ------------------------------------------------------------------------------------

/// The machine's NVIDIA GPUs through NVML.
pub struct Nvml {
    nvml: nvml_wrapper::Nvml,
    driver: String,
    gpus: Vec<GpuInfo>,
}

impl Nvml {
    /// Loads NVML and discovers every GPU. Without a driver, the error says how to run with
    /// fake GPUs instead.
    pub fn open() -> Result<Self, GpuError> {
        use nvml_wrapper::error::NvmlError;
        let hint = "or run with --fake-gpus N to use fake GPUs";
        let nvml = nvml_wrapper::Nvml::init().map_err(|e| {
            GpuError::NoDriver(match e {
                NvmlError::LibloadingError(_) | NvmlError::LibraryNotFound => format!(
                    "no NVIDIA driver on this machine (libnvidia-ml.so could not be loaded): install the driver, {hint}"
                ),
                NvmlError::DriverNotLoaded => {
                    format!("the NVIDIA driver is installed but not loaded: load it (nvidia-smi should list the GPUs), {hint}")
                }
                NvmlError::NoPermission => format!(
                    "no permission to talk to the NVIDIA driver: run as a user that may, {hint}"
                ),
                other => format!("NVML failed to start ({other}): check the driver with nvidia-smi, {hint}"),
            })
        })?;
        let driver = nvml
            .sys_driver_version()
            .unwrap_or_else(|_| "unknown".into());
        let count = nvml.device_count().map_err(|e| GpuError::Reading {
            index: 0,
            reason: e.to_string(),
        })?;
        if count == 0 {
            return Err(GpuError::NoDriver(format!(
                "the NVIDIA driver {driver} sees no GPUs on this machine; {hint}"
            )));
        }
        let mut gpus = Vec::with_capacity(count as usize);
        for index in 0..count {
            let reading = |e: NvmlError| GpuError::Reading {
                index,
                reason: e.to_string(),
            };
            let d = nvml.device_by_index(index).map_err(reading)?;
            gpus.push(GpuInfo {
                index,
                uuid: d.uuid().ok(),
                name: d.name().map_err(reading)?,
                memory_total_mib: d.memory_info().map_or(0, |m| m.total >> 20),
            });
        }
        Ok(Nvml { nvml, driver, gpus })
    }
}

impl GpuSource for Nvml {
    fn describe(&self) -> String {
        format!("NVML, driver {}", self.driver)
    }

    fn gpus(&self) -> &[GpuInfo] {
        &self.gpus
    }

    fn read(&mut self, _elapsed: Duration, _busy: &[u32]) -> Result<Vec<GpuReading>, GpuError> {
        use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError, TemperatureSensor};
        let mut out = Vec::with_capacity(self.gpus.len());
        for g in &self.gpus {
            let d = self
                .nvml
                .device_by_index(g.index)
                .map_err(|e| GpuError::Reading {
                    index: g.index,
                    reason: e.to_string(),
                })?;
            // Each reading is optional: a GPU without ECC, or a field the driver does not
            // support, reads as 0 rather than failing the heartbeat.
            let memory = d.memory_info().ok();
            let fault = match d.are_pages_pending_retired() {
                Ok(true) => Some("pages pending retirement: reset the GPU".to_owned()),
                _ => None,
            };
            out.push(GpuReading {
                gpu: g.index,
                uuid: g.uuid.clone(),
                utilization_pct: d.utilization_rates().map_or(0, |u| u.gpu.min(100) as u8),
                memory_used_mib: memory.as_ref().map_or(0, |m| m.used >> 20),
                memory_total_mib: memory
                    .as_ref()
                    .map_or(g.memory_total_mib, |m| m.total >> 20),
                temperature_c: d.temperature(TemperatureSensor::Gpu).unwrap_or(0),
                power_w: d.power_usage().map_or(0, |mw| mw / 1000),
                ecc_errors_uncorrected: d
                    .total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
                    .unwrap_or(0),
                fault,
            });
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vendor_names_shorten_to_the_schedulers_model_names() {
        assert_eq!(short_model("NVIDIA H100 80GB HBM3"), "H100");
        assert_eq!(short_model("NVIDIA H200"), "H200");
        assert_eq!(short_model("Tesla V100-SXM2-16GB"), "V100-SXM2-16GB");
        assert_eq!(short_model("NVIDIA A100-SXM4-80GB"), "A100-SXM4-80GB");
        assert_eq!(short_model("H100"), "H100");
    }

    #[test]
    fn faults_parse_and_bad_ones_say_how_to_write_them() {
        assert_eq!(
            "1@30".parse::<Fault>().unwrap(),
            Fault::Unhealthy {
                gpu: 1,
                after: Duration::from_secs(30)
            }
        );
        assert_eq!(
            "silent@2.5".parse::<Fault>().unwrap(),
            Fault::Silent {
                after: Duration::from_millis(2500)
            }
        );
        for bad in ["1", "x@3", "1@-2", "silent@soon"] {
            let e = bad.parse::<Fault>().unwrap_err();
            assert!(e.contains("GPU@SECONDS"), "{bad}: {e}");
        }
        let e = FakeGpus::new(2, "H100", vec!["5@1".parse().unwrap()]).unwrap_err();
        assert!(e.contains("only GPUs 0 to 1"), "{e}");
    }

    #[test]
    fn fake_gpus_follow_their_script() {
        let mut g = FakeGpus::new(
            2,
            "H100",
            vec!["1@10".parse().unwrap(), "silent@20".parse().unwrap()],
        )
        .unwrap();
        let early = g.read(Duration::from_secs(1), &[0]).unwrap();
        assert_eq!(early.len(), 2);
        assert_eq!(
            (early[0].utilization_pct, early[1].utilization_pct),
            (90, 0)
        );
        assert!(early.iter().all(|r| r.fault.is_none()));
        assert!(!g.silent(Duration::from_secs(1)));
        let late = g.read(Duration::from_secs(10), &[]).unwrap();
        assert!(late[0].fault.is_none() && late[1].fault.is_some());
        assert!(g.silent(Duration::from_secs(20)));
    }

    #[test]
    fn nvml_without_a_driver_says_what_to_do() {
        // On a machine with a driver this discovers real GPUs; without one (CI) it must fail
        // with the one actionable line, not a panic.
        match Nvml::open() {
            Ok(nvml) => assert!(!nvml.gpus().is_empty()),
            Err(e) => {
                let line = e.to_string();
                assert!(line.contains("--fake-gpus"), "{line}");
                assert!(!line.contains('\n'), "{line}");
            }
        }
    }
}
