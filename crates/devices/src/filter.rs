//! Which devices the inventory keeps, in node-disk-manager's terms: path
//! prefixes to include or exclude, vendors to include or exclude, and the
//! OS disk.

use super::device::Device;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceFilter {
    /// Keep only devices whose `/dev` path starts with one of these (empty: all).
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
    /// node-disk-manager's default: no loop, ram, floppy, CD, md, dm, rbd or
    /// zfs volumes, no OS disk.
    pub fn node_disk_manager_defaults() -> Self {
        Self {
            exclude_paths: ["/dev/loop", "/dev/fd0", "/dev/sr0", "/dev/ram", "/dev/md", "/dev/dm-", "/dev/rbd", "/dev/zd"]
                .map(String::from)
                .to_vec(),
            exclude_os_disk: true,
            ..Self::default()
        }
    }

    pub fn admits(&self, d: &Device) -> bool {
        let path = d.path.to_string_lossy();
        let vendor = d.vendor.as_deref().unwrap_or("");
        let vendor_is = |v: &String| v.eq_ignore_ascii_case(vendor.trim());
        (self.include_paths.is_empty() || self.include_paths.iter().any(|p| path.starts_with(p.as_str())))
            && !self.exclude_paths.iter().any(|p| path.starts_with(p.as_str()))
            && (self.include_vendors.is_empty() || self.include_vendors.iter().any(vendor_is))
            && !self.exclude_vendors.iter().any(vendor_is)
            && !(self.exclude_os_disk && d.os_disk)
    }
}
