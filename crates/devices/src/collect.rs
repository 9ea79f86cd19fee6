//! The ways to read every tracked device's counters, side by side so the
//! collector (and the bench) can time them against each other.
//!
//! Measured on the development machine (2 cores, 6.18;
//! `cargo bench --bench device_stats`): a sysfs `stat` read costs the same
//! kernfs work through the ring as through `pread`, plus the ring's own
//! per-request overhead, so the io_uring batch (one syscall, registered or
//! not, with DEFER_TASKRUN) is 1.5–3× slower than a `pread` loop.
//! `/proc/diskstats` formats all devices in one read and wins at 1,000
//! devices, but it restarts its walk of the device list every page of
//! output, so at 4,096 it is level with `pread`; and `pread` wins whenever
//! only a few of many devices are tracked. So the
//! collector times the candidates on the live system and uses the fastest.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::stats::{parse_diskstats, IoCounters};
use volring_mounts::DevNum;
use volring_ring::BackendChoice;
use volring_ring::{BatchRead, BatchReader, ReadBatch};

/// How counters are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum StatMethod {
    /// Time the others on this system and use the fastest.
    Auto,
    /// One read of `/proc/diskstats` through the ring.
    Diskstats,
    /// One io_uring batch of reads of the kept-open sysfs `stat` files.
    Ring,
    /// A `pread` per kept-open sysfs `stat` file.
    Pread,
    /// open/read/close per `stat` file (what a naive agent does).
    OpenRead,
}

impl StatMethod {
    /// The name `--stats-method` takes and a snapshot reports.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            StatMethod::Auto => "auto",
            StatMethod::Diskstats => "diskstats",
            StatMethod::Ring => "ring",
            StatMethod::Pread => "pread",
            StatMethod::OpenRead => "open-read",
        }
    }

    /// The candidates `Auto` chooses among.
    pub(crate) const MEASURED: [StatMethod; 3] = [StatMethod::Diskstats, StatMethod::Ring, StatMethod::Pread];
}

/// The method's name, as `--stats-method` takes it (`open-read`).
impl std::fmt::Display for StatMethod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.as_str())
    }
}

/// The counters of one read, per tracked device, in tracking order.
pub(crate) type Sample = Vec<(DevNum, Arc<str>, Result<IoCounters, String>)>;

/// Open files and buffers for all methods over one set of devices, with a
/// ring of its own for the batched reads: for reading outside a ring thread
/// (the bench, tests). The collector keeps the files only (`StatFiles`)
/// and reads through its ring thread's reactor, so that thread has one ring.
pub struct StatSource {
    files: StatFiles,
    reader: BatchReader,
}

impl StatSource {
    pub fn new(devices: impl IntoIterator<Item = (DevNum, Arc<str>)>, io: BackendChoice) -> io::Result<Self> {
        let files = StatFiles::new(devices)?;
        let depth = (files.len() as u32).clamp(8, 4096);
        Ok(Self { files, reader: BatchReader::new(io, depth)? })
    }

    /// Reads every tracked device's counters with `method` (`Auto` reads
    /// with diskstats).
    pub fn read(&mut self, method: StatMethod) -> io::Result<Sample> {
        self.files.read(method, &mut self.reader)
    }
}

/// The tracked devices' open files and buffers; the batched reads go
/// through whatever ring the caller has.
pub(crate) struct StatFiles {
    devices: Vec<(DevNum, Arc<str>)>,
    /// Each device's `/sys/class/block/<name>/stat`, kept open; `None` if
    /// it could not be opened.
    files: Vec<Option<File>>,
    bufs: Vec<Vec<u8>>,
    index: HashMap<DevNum, usize>,
    diskstats: File,
    diskstats_buf: Vec<u8>,
}

/// First size of the `/proc/diskstats` buffer; doubled while a read fills it.
const DISKSTATS_START: usize = 64 << 10;
/// Largest `/proc/diskstats` accepted (about 400,000 devices).
const MAX_DISKSTATS: usize = 64 << 20;
/// A sysfs `stat` line is 17 counters of up to 20 digits.
const STAT_LINE: usize = 512;

impl StatFiles {
    pub(crate) fn new(devices: impl IntoIterator<Item = (DevNum, Arc<str>)>) -> io::Result<Self> {
        let mut tracked = Vec::new();
        let mut files = Vec::new();
        let mut index = HashMap::new();
        for (dev, name) in devices {
            if index.contains_key(&dev) {
                continue;
            }
            index.insert(dev, tracked.len());
            files.push(File::open(format!("/sys/class/block/{name}/stat")).ok());
            tracked.push((dev, name));
        }
        let bufs = vec![vec![0; STAT_LINE]; tracked.len()];
        Ok(Self {
            devices: tracked,
            files,
            bufs,
            index,
            diskstats: File::open("/proc/diskstats")?,
            diskstats_buf: vec![0; DISKSTATS_START],
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.devices.len()
    }

    pub(crate) fn devices(&self) -> impl Iterator<Item = (DevNum, &Arc<str>)> {
        self.devices.iter().map(|(d, n)| (*d, n))
    }

    /// Reads every tracked device's counters with `method` (`Auto` reads
    /// with diskstats), batched reads through `io`.
    pub(crate) fn read(&mut self, method: StatMethod, io: &mut dyn ReadBatch) -> io::Result<Sample> {
        match method {
            StatMethod::Auto | StatMethod::Diskstats => self.read_diskstats(io),
            StatMethod::Ring => self.read_ring(io),
            StatMethod::Pread => Ok(self.read_pread()),
            StatMethod::OpenRead => Ok(self.read_open()),
        }
    }

    /// Times each of `methods` `rounds` times; the median of each, fastest first.
    pub(crate) fn calibrate(&mut self, methods: &[StatMethod], rounds: usize, io: &mut dyn ReadBatch) -> Vec<(StatMethod, Duration)> {
        let mut out: Vec<(StatMethod, Duration)> = methods
            .iter()
            .filter_map(|&m| {
                let mut times = Vec::with_capacity(rounds);
                for _ in 0..rounds.max(1) {
                    let t = Instant::now();
                    self.read(m, io).ok()?;
                    times.push(t.elapsed());
                }
                times.sort();
                Some((m, times[times.len() / 2]))
            })
            .collect();
        out.sort_by_key(|&(_, d)| d);
        out
    }

    fn read_diskstats(&mut self, io: &mut dyn ReadBatch) -> io::Result<Sample> {
        let len = loop {
            if self.diskstats_buf.is_empty() {
                // A read abandoned at a deadline kept its buffer (the ring
                // frees it when the kernel lets go): start a new one, or
                // doubling an empty buffer would never end.
                self.diskstats_buf = vec![0; DISKSTATS_START];
            }
            let mut reads = [BatchRead::new(self.diskstats.as_fd(), 0, std::mem::take(&mut self.diskstats_buf))];
            io.read_batch(&mut reads, Duration::from_secs(5))?;
            let [r] = reads;
            self.diskstats_buf = r.buf;
            let n = r.result?;
            // A full buffer may have cut the text: read again with more room.
            if n < self.diskstats_buf.len() || self.diskstats_buf.len() >= MAX_DISKSTATS {
                break n;
            }
            let grown = self.diskstats_buf.len() * 2;
            self.diskstats_buf.resize(grown, 0);
        };
        let mut found: Vec<Option<IoCounters>> = vec![None; self.devices.len()];
        for (_, line) in parse_diskstats(&self.diskstats_buf[..len]) {
            if let Ok(l) = line {
                if let Some(&i) = self.index.get(&l.dev) {
                    found[i] = Some(l.counters);
                }
            }
        }
        Ok(self
            .devices
            .iter()
            .zip(found)
            .map(|((dev, name), c)| (*dev, name.clone(), c.ok_or_else(|| "not in /proc/diskstats".to_string())))
            .collect())
    }

    fn read_ring(&mut self, io: &mut dyn ReadBatch) -> io::Result<Sample> {
        let mut reads = Vec::with_capacity(self.devices.len());
        let mut owners = Vec::with_capacity(self.devices.len());
        for (i, (f, buf)) in self.files.iter().zip(self.bufs.iter_mut()).enumerate() {
            if let Some(f) = f {
                reads.push(BatchRead::new(f.as_fd(), 0, std::mem::take(buf)));
                owners.push(i);
            }
        }
        io.read_batch(&mut reads, Duration::from_secs(5))?;
        let mut results: Vec<Option<Result<IoCounters, String>>> = vec![None; self.devices.len()];
        for (r, &i) in reads.into_iter().zip(&owners) {
            results[i] = Some(match r.result {
                Ok(n) => IoCounters::parse(&r.buf[..n]).map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            });
            // A read abandoned at the deadline kept its buffer (the ring frees
            // it when the kernel lets go): start a new one.
            self.bufs[i] = if r.buf.is_empty() { vec![0; STAT_LINE] } else { r.buf };
        }
        Ok(self.finish(results))
    }

    fn read_pread(&mut self) -> Sample {
        let results = self
            .files
            .iter()
            .zip(self.bufs.iter_mut())
            .map(|(f, buf)| {
                let f = f.as_ref()?;
                Some(match rustix::io::pread(f, &mut *buf, 0) {
                    Ok(n) => IoCounters::parse(&buf[..n]).map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                })
            })
            .collect();
        self.finish(results)
    }

    fn read_open(&mut self) -> Sample {
        self.devices
            .iter()
            .map(|(dev, name)| {
                let c = std::fs::read(format!("/sys/class/block/{name}/stat"))
                    .map_err(|e| e.to_string())
                    .and_then(|b| IoCounters::parse(&b).map_err(|e| e.to_string()));
                (*dev, name.clone(), c)
            })
            .collect()
    }

    fn finish(&self, results: Vec<Option<Result<IoCounters, String>>>) -> Sample {
        self.devices
            .iter()
            .zip(results)
            .map(|((dev, name), r)| (*dev, name.clone(), r.unwrap_or_else(|| Err("stat file could not be opened".into()))))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_diskstats_buffer_lost_to_an_abandoned_read_is_replaced() {
        let (tx, rx) = std::sync::mpsc::channel();
        // On its own thread (the ring is single-issuer), bounded by the wait below.
        std::thread::spawn(move || {
            let mut source = StatSource::new(Vec::new(), BackendChoice::Auto).unwrap();
            // What an abandoned read leaves behind: the buffer is in the ring.
            source.files.diskstats_buf = Vec::new();
            let r = source.read(StatMethod::Diskstats).map(|s| s.len());
            let _ = tx.send((r.map_err(|e| e.to_string()), source.files.diskstats_buf.len()));
        });
        let (r, len) = rx.recv_timeout(Duration::from_secs(30)).expect("the read ends");
        assert_eq!(r, Ok(0));
        assert!(len >= DISKSTATS_START);
    }
}
