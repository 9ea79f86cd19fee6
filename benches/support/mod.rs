//! Shared by the benches: kubelet-like mountinfo text and mount scaffolding.

#![allow(dead_code)]

use std::fmt::Write;
use std::path::{Path, PathBuf};

/// xorshift64*: deterministic, so every run parses the same bytes.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn hex(&mut self, n: usize) -> String {
        let mut s = String::with_capacity(n);
        while s.len() < n {
            let _ = write!(s, "{:016x}", self.next());
        }
        s.truncate(n);
        s
    }
    fn uuid(&mut self) -> String {
        let h = self.hex(32);
        format!("{}-{}-{}-{}-{}", &h[..8], &h[8..12], &h[12..16], &h[16..20], &h[20..])
    }
}

/// `n` mountinfo lines shaped like a dense Kubernetes node's: projected
/// service-account tmpfs, CSI block volumes (ext4 on rbd), containerd
/// overlay rootfs with long lowerdir chains, and sandbox shm.
pub fn kubelet_mountinfo(n: usize) -> Vec<u8> {
    let mut rng = Rng::new(0x5eed + n as u64);
    let mut s = String::with_capacity(n * 260);
    s.push_str("22 1 0:21 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw\n");
    s.push_str("26 1 253:1 / / rw,relatime shared:1 - ext4 /dev/mapper/vg0-root rw,errors=remount-ro\n");
    s.push_str("30 26 253:2 / /var/lib/kubelet rw,relatime shared:9 - xfs /dev/mapper/vg0-kubelet rw,attr2,inode64,logbufs=8,logbsize=32k,noquota\n");
    let mut id = 100u32;
    while id - 100 < n.saturating_sub(3) as u32 {
        let pod = rng.uuid();
        let group = 100 + id / 2;
        match rng.next() % 4 {
            0 => {
                let _ = writeln!(
                    s,
                    "{id} 30 0:{} / /var/lib/kubelet/pods/{pod}/volumes/kubernetes.io~projected/kube-api-access-{} rw,relatime shared:{group} - tmpfs tmpfs rw,size=4194304k,inode64",
                    1000 + id,
                    rng.hex(5)
                );
            }
            1 => {
                let _ = writeln!(
                    s,
                    "{id} 30 252:{} / /var/lib/kubelet/pods/{pod}/volumes/kubernetes.io~csi/pvc-{}/mount rw,relatime shared:{group} - ext4 /dev/rbd{} rw,stripe=16",
                    id % 4096,
                    rng.uuid(),
                    id % 4096
                );
            }
            2 => {
                let snaps: Vec<String> = (0..6)
                    .map(|_| format!("/var/lib/containerd/io.containerd.snapshotter.v1.overlayfs/snapshots/{}/fs", rng.next() % 90000))
                    .collect();
                let _ = writeln!(
                    s,
                    "{id} 26 0:{} / /run/containerd/io.containerd.runtime.v2.task/k8s.io/{}/rootfs rw,relatime shared:{group} - overlay overlay rw,lowerdir={},upperdir=/var/lib/containerd/io.containerd.snapshotter.v1.overlayfs/snapshots/{}/fs,workdir=/var/lib/containerd/io.containerd.snapshotter.v1.overlayfs/snapshots/{}/work",
                    2000 + id,
                    rng.hex(64),
                    snaps.join(":"),
                    rng.next() % 90000,
                    rng.next() % 90000
                );
            }
            _ => {
                let _ = writeln!(
                    s,
                    "{id} 26 0:{} / /run/containerd/io.containerd.grpc.v1.cri/sandboxes/{}/shm rw,nosuid,nodev,noexec,relatime shared:{group} - tmpfs shm rw,size=65536k,inode64",
                    3000 + id,
                    rng.hex(64)
                );
            }
        }
        id += 1;
    }
    s.into_bytes()
}

/// A scratch tree of mounts for benches, in the process's private namespace
/// (the bench enters one first). Everything is lazily unmounted on drop.
pub struct MountFarm {
    pub root: PathBuf,
    pub count: usize,
}

impl MountFarm {
    pub fn new() -> Self {
        let root = std::env::temp_dir().join(format!("volring-bench-{}", std::process::id()));
        std::fs::create_dir_all(&root).expect("bench dir");
        // One tmpfs holds all the mount points, so the host disk sees nothing.
        rustix::mount::mount("tmpfs", &root, "tmpfs", rustix::mount::MountFlags::empty(), None).expect("bench tmpfs");
        std::fs::create_dir(root.join("src")).expect("src");
        Self { root, count: 0 }
    }

    /// Grows the farm to `n` mounts: kubelet-like, half tmpfs, half binds.
    pub fn grow_to(&mut self, n: usize) {
        while self.count < n {
            let p = self.root.join(format!("m{}", self.count));
            std::fs::create_dir(&p).expect("mkdir");
            if self.count.is_multiple_of(2) {
                rustix::mount::mount("tmpfs", &p, "tmpfs", rustix::mount::MountFlags::empty(), Some(c"size=64k")).expect("tmpfs");
            } else {
                rustix::mount::mount_bind(self.root.join("src"), &p).expect("bind");
            }
            self.count += 1;
        }
    }

    pub fn dir(&self, name: &str) -> PathBuf {
        let p = self.root.join(name);
        std::fs::create_dir_all(&p).expect("mkdir");
        p
    }

    pub fn root(&self) -> &Path {
        &self.root
    }
}

impl Drop for MountFarm {
    fn drop(&mut self) {
        let _ = rustix::mount::unmount(&self.root, rustix::mount::UnmountFlags::DETACH);
        let _ = std::fs::remove_dir(&self.root);
    }
}

/// Percentile of a sorted slice.
pub fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

/// CPU time and context switches of every thread of `pid`.
pub fn thread_usage(pid: u32) -> (std::time::Duration, u64) {
    let (mut ns, mut switches) = (0u64, 0u64);
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten() {
        if let Ok(s) = std::fs::read_to_string(t.path().join("schedstat")) {
            ns += s.split_whitespace().next().and_then(|v| v.parse().ok()).unwrap_or(0);
        }
        if let Ok(s) = std::fs::read_to_string(t.path().join("status")) {
            switches += s
                .lines()
                .filter(|l| l.contains("ctxt_switches"))
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .sum::<u64>();
        }
    }
    (std::time::Duration::from_nanos(ns), switches)
}
