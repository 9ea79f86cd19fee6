//! Active swap areas, from `/proc/swaps`: what makes `volring devices`
//! print `[SWAP]` (a signature alone only says mkswap once ran there).
//!
//! The file is a header line, then one line per area: the path, its type
//! (`partition` or `file`), size, used, priority. The kernel escapes space,
//! tab, newline and backslash in the path as `\ooo` octal, as in mountinfo
//! (the mounts crate's `unescape` undoes both).

use std::collections::BTreeSet;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};

use volring_mounts::{unescape, DevNum};

/// One line of `/proc/swaps`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SwapArea {
    pub(crate) path: PathBuf,
    /// A block device (`partition`, whatever the device is) rather than a
    /// swap file.
    pub(crate) is_device: bool,
}

/// Parses `/proc/swaps`. Pure; lines that do not have a path and a type
/// (the header among them) are skipped.
pub(crate) fn parse_proc_swaps(text: &[u8]) -> Vec<SwapArea> {
    text.split(|&b| b == b'\n')
        .skip(1)
        .filter_map(|line| {
            let mut fields = line.split(|b| b.is_ascii_whitespace()).filter(|f| !f.is_empty());
            let path = fields.next()?;
            let kind = fields.next()?;
            Some(SwapArea {
                path: PathBuf::from(std::ffi::OsString::from_vec(unescape(path).into_owned())),
                is_device: kind == b"partition",
            })
        })
        .collect()
}

/// The fuzz entry (fuzz/fuzz_targets/proc_swaps.rs): parses `/proc/swaps`
/// text as [`active_swap_devices`] does and hands back each area's path, in
/// order, so the parser and its area type stay private to this crate.
pub fn fuzz_proc_swaps(text: &[u8]) -> Vec<PathBuf> {
    parse_proc_swaps(text).into_iter().map(|a| a.path).collect()
}

/// The device numbers of the block devices in use as swap now. Reads
/// `proc_swaps` (world-readable) and stats each device path; an area whose
/// path no longer resolves is left out.
pub fn active_swap_devices(proc_swaps: &Path) -> std::io::Result<BTreeSet<DevNum>> {
    use std::os::unix::fs::MetadataExt;
    let text = std::fs::read(proc_swaps)?;
    Ok(parse_proc_swaps(&text)
        .into_iter()
        .filter(|a| a.is_device)
        .filter_map(|a| std::fs::metadata(&a.path).ok())
        .map(|m| {
            let rdev = m.rdev();
            DevNum { major: rustix::fs::major(rdev), minor: rustix::fs::minor(rdev) }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn areas_with_escaped_paths() {
        let text = b"Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n\
            /dev/zram0                              partition\t8388604\t\t0\t\t100\n\
            /var/my\\040swap\\134file                 file\t\t1048572\t\t0\t\t-2\n\
            /odd\\9\\400x partition 1 0 -3\n\
            junk\n";
        let a = parse_proc_swaps(text);
        assert_eq!(a.len(), 3);
        assert_eq!(a[0], SwapArea { path: "/dev/zram0".into(), is_device: true });
        assert_eq!(a[1], SwapArea { path: "/var/my swap\\file".into(), is_device: false });
        assert_eq!(a[2].path, PathBuf::from("/odd\\9\\400x"));
        assert!(parse_proc_swaps(b"Filename Type Size Used Priority\n").is_empty());
        assert!(parse_proc_swaps(b"").is_empty());
    }
}
