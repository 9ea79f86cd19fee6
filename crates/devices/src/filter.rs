//! Which devices the inventory keeps, in node-disk-manager's terms: path
//! prefixes to include or exclude, vendors to include or exclude, and the
//! OS disk.

use super::device::Device;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceFilter {
    /// Keep only devices whose `/dev` path starts with one of these (empty:
    /// all); a prefix never ends inside a number, so `/dev/loop1` is loop1
    /// (and its partitions), not loop10.
    pub include_paths: Vec<String>,
    /// Drop devices whose `/dev` path starts with one of these.
    pub exclude_paths: Vec<String>,
    /// Keep only these vendors (empty: all); compared case-insensitively.
    pub include_vendors: Vec<String>,
    pub exclude_vendors: Vec<String>,
    /// Drop the device behind `/` and what it sits on.
    pub exclude_os_disk: bool,
    /// Keep zero-size devices (unattached loop devices, empty card readers),
    /// which lsblk and node-disk-manager leave out.
    pub include_empty: bool,
}

impl DeviceFilter {
    pub(crate) fn admits(&self, d: &Device) -> bool {
        let path = d.path.to_string_lossy();
        let vendor = d.vendor.as_deref().unwrap_or("");
        let vendor_is = |v: &String| v.eq_ignore_ascii_case(vendor.trim());
        (self.include_paths.is_empty() || self.include_paths.iter().any(|p| under(&path, p)))
            && !self.exclude_paths.iter().any(|p| under(&path, p))
            && (self.include_vendors.is_empty() || self.include_vendors.iter().any(vendor_is))
            && !self.exclude_vendors.iter().any(vendor_is)
            && !(self.exclude_os_disk && d.os_disk)
    }
}

/// Whether `path` starts with `prefix` without cutting a number in two:
/// `/dev/loop` takes every loop device, `/dev/loop1` takes loop1 and
/// loop1p1 but not loop10, `/dev/sda` takes sda1.
fn under(path: &str, prefix: &str) -> bool {
    let Some(rest) = path.strip_prefix(prefix) else { return false };
    let splits_number = prefix.ends_with(|c: char| c.is_ascii_digit()) && rest.starts_with(|c: char| c.is_ascii_digit());
    !splits_number
}

#[cfg(test)]
mod tests {
    use super::under;

    /// Before: `--include /dev/loop7` kept loop70 too.
    #[test]
    fn a_prefix_does_not_split_a_number() {
        assert!(under("/dev/loop7", "/dev/loop7"));
        assert!(under("/dev/loop7p1", "/dev/loop7"));
        assert!(!under("/dev/loop70", "/dev/loop7"));
        assert!(under("/dev/loop70", "/dev/loop"));
        assert!(under("/dev/sda1", "/dev/sda"));
        assert!(under("/dev/nvme0n1p2", "/dev/nvme0n1"));
        assert!(!under("/dev/nvme0n10", "/dev/nvme0n1"));
        assert!(under("/dev/dm-3", "/dev/dm-"));
        assert!(!under("/dev/vda", "/dev/loop"));
    }
}
