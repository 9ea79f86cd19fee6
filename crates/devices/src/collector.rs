//! The stat collector: a ring thread that samples counters on a timer and
//! publishes each [`StatSnapshot`] whole, so any number of readers (CSI
//! volume stats, `/metrics`, the CR updater) take the latest without a lock.

use std::collections::HashMap;
use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;

use super::collect::{StatFiles, StatMethod};
use super::stats::{DeviceStat, IoCounters, IoRates, StatSnapshot};
use volring_mounts::DevNum;
use volring_ring::ReadBatch;
use volring_ring::{BackendChoice, Completion, Driver, Flow, Reactor, ReactorOp, RingStats, RingThread};

#[derive(Debug, Clone)]
pub struct CollectorConfig {
    pub interval: Duration,
    pub method: StatMethod,
    pub io: BackendChoice,
    /// With `Auto`: re-time the methods after this many samples (the device
    /// count also triggers it when it changes by a quarter).
    pub recalibrate_after: u64,
}

impl Default for CollectorConfig {
    fn default() -> Self {
        Self { interval: Duration::from_secs(1), method: StatMethod::Auto, io: BackendChoice::Auto, recalibrate_after: 600 }
    }
}

/// Read side of the collector: cheap to clone, never blocks.
#[derive(Debug, Clone, Default)]
pub struct StatsReader(Arc<ArcSwap<StatSnapshot>>);

impl StatsReader {
    pub fn latest(&self) -> Arc<StatSnapshot> {
        self.0.load_full()
    }
}

pub(crate) enum CollectorCommand {
    /// Track exactly these devices from now on.
    Track(Vec<(DevNum, Arc<str>)>),
}

/// The running collector.
pub struct StatCollector {
    ring: RingThread<CollectorDriver>,
}

impl StatCollector {
    /// Starts sampling `devices`; returns once the first sample is
    /// published, with the read side (clone it for each reader), as the
    /// watchers hand out their queues at start.
    pub fn start(cfg: CollectorConfig, devices: Vec<(DevNum, Arc<str>)>) -> io::Result<(Self, StatsReader)> {
        let reader = StatsReader::default();
        let out = reader.clone();
        let io = cfg.io;
        let make = move || {
            let source = StatFiles::new(devices)?;
            Ok(CollectorDriver {
                cfg,
                source,
                out,
                chosen: None,
                calibrated_len: 0,
                samples: 0,
                since_calibration: 0,
                prev: HashMap::new(),
                epoch: Instant::now(),
                calibration: Vec::new(),
            })
        };
        let ring = RingThread::spawn_with("volring-stats", make, io, 64)?;
        Ok((Self { ring }, reader))
    }

    pub fn ring_stats(&self) -> &Arc<RingStats> {
        self.ring.stats()
    }

    /// Changes the tracked set; `false` when the command queue is full.
    pub fn track(&self, devices: Vec<(DevNum, Arc<str>)>) -> bool {
        self.ring.send(CollectorCommand::Track(devices)).is_ok()
    }

    pub fn stop(self) -> io::Result<()> {
        self.ring.stop().map(|_| ())
    }
}

struct CollectorDriver {
    cfg: CollectorConfig,
    /// Read through the ring thread's reactor: the thread's one ring does
    /// the timer, the mailbox and the batched reads.
    source: StatFiles,
    out: StatsReader,
    /// The method in use (with `Auto`, after calibration).
    chosen: Option<StatMethod>,
    calibrated_len: usize,
    samples: u64,
    since_calibration: u64,
    prev: HashMap<DevNum, (IoCounters, Duration)>,
    epoch: Instant,
    calibration: Vec<(StatMethod, Duration)>,
}

const TICK: u64 = 1;

impl CollectorDriver {
    fn method(&mut self, ring: &mut dyn ReadBatch) -> StatMethod {
        if self.cfg.method != StatMethod::Auto {
            return self.cfg.method;
        }
        let len = self.source.len();
        let drifted = len.abs_diff(self.calibrated_len) * 4 > self.calibrated_len.max(1);
        if self.chosen.is_none() || drifted || self.since_calibration >= self.cfg.recalibrate_after {
            self.calibration = self.source.calibrate(&StatMethod::MEASURED, 3, ring);
            self.chosen = self.calibration.first().map(|&(m, _)| m);
            self.calibrated_len = len;
            self.since_calibration = 0;
            tracing::debug!(devices = len, calibration = ?self.calibration, "stat collector timed its methods");
        }
        self.chosen.unwrap_or(StatMethod::Diskstats)
    }

    fn sample(&mut self, ring: &mut dyn ReadBatch) {
        let method = self.method(ring);
        let started = Instant::now();
        let taken_at = self.epoch.elapsed();
        let unix_time = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        let sample = match self.source.read(method, ring) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, method = method.as_str(), "stat collection failed");
                return;
            }
        };
        let cost = started.elapsed();
        let mut devices = Vec::with_capacity(sample.len());
        let mut errors = Vec::new();
        for (dev, name, r) in sample {
            match r {
                Ok(counters) => {
                    let rates = self.prev.get(&dev).map(|(c, at)| IoRates::between(c, &counters, taken_at.saturating_sub(*at)));
                    self.prev.insert(dev, (counters, taken_at));
                    devices.push(DeviceStat { dev, name, counters, rates });
                }
                Err(e) => errors.push((name, e)),
            }
        }
        devices.sort_by_key(|d| d.dev);
        self.samples += 1;
        self.since_calibration += 1;
        let calibration = self.calibration.iter().map(|&(m, d)| (m.as_str(), d.as_secs_f64() * 1000.0)).collect();
        self.out.0.store(Arc::new(StatSnapshot {
            devices,
            taken_at,
            unix_time,
            cost,
            method: method.as_str(),
            generation: self.samples,
            errors,
            calibration,
        }));
    }
}

impl Driver for CollectorDriver {
    type Command = CollectorCommand;

    fn start(&mut self, ring: &mut Reactor) -> io::Result<()> {
        self.sample(ring);
        ring.submit(TICK, ReactorOp::Timeout(self.cfg.interval))
    }

    fn on_command(&mut self, cmd: CollectorCommand, ring: &mut Reactor) -> Flow {
        match cmd {
            CollectorCommand::Track(devices) => match StatFiles::new(devices) {
                Ok(s) => {
                    self.source = s;
                    let keep: std::collections::HashSet<DevNum> = self.source.devices().map(|(d, _)| d).collect();
                    self.prev.retain(|d, _| keep.contains(d));
                    self.sample(ring);
                }
                Err(e) => tracing::warn!(error = %e, "stat collector could not track the new device set"),
            },
        }
        Flow::Continue
    }

    fn on_completion(&mut self, c: Completion, ring: &mut Reactor) -> Flow {
        if c.token == TICK {
            self.sample(ring);
            if let Err(e) = ring.submit(TICK, ReactorOp::Timeout(self.cfg.interval)) {
                tracing::error!(error = %e, "stat collector cannot re-arm its timer; stopping");
                return Flow::Stop;
            }
        }
        Flow::Continue
    }
}
