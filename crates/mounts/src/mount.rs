//! One mount, owned: what the table stores and what events carry.

use std::fmt;
use std::path::Path;

use serde::ser::SerializeStruct;
use serde::{Serialize, Serializer};

/// A mount's id. From `statmount` it is the kernel's unique 64-bit id (never
/// reused); from mountinfo it is the old, reusable 32-bit id. A table holds
/// ids of one kind only.
pub(crate) type MountId = u64;

/// A device number, `major:minor`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct DevNum {
    pub major: u32,
    pub minor: u32,
}

impl fmt::Display for DevNum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.major, self.minor)
    }
}

/// Parses `major:minor`, what [`Display`](fmt::Display) writes and a sysfs
/// `dev` file holds (without its newline): one parser for every crate that
/// reads device numbers from text.
impl std::str::FromStr for DevNum {
    type Err = super::Error;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || super::Error::DevNum(s.to_string());
        let (major, minor) = s.split_once(':').ok_or_else(bad)?;
        Ok(DevNum { major: major.parse().map_err(|_| bad())?, minor: minor.parse().map_err(|_| bad())? })
    }
}

impl Serialize for DevNum {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Mount propagation, as mountinfo's optional fields state it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default, Serialize)]
pub struct Propagation {
    /// `shared:N`: peer group this mount belongs to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shared: Option<u64>,
    /// `master:N`: the peer group this mount receives propagation from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub master: Option<u64>,
    /// `propagate_from:N`: nearest dominant peer group visible here.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) propagate_from: Option<u64>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub(crate) unbindable: bool,
}

/// The optional fields as mountinfo writes them (`shared:1 master:2`).
impl fmt::Display for Propagation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut sep = "";
        let mut tag = |f: &mut fmt::Formatter<'_>, t: fmt::Arguments<'_>| {
            let r = write!(f, "{sep}{t}");
            sep = " ";
            r
        };
        if let Some(n) = self.shared {
            tag(f, format_args!("shared:{n}"))?;
        }
        if let Some(n) = self.master {
            tag(f, format_args!("master:{n}"))?;
        }
        if let Some(n) = self.propagate_from {
            tag(f, format_args!("propagate_from:{n}"))?;
        }
        if self.unbindable {
            tag(f, format_args!("unbindable"))?;
        }
        Ok(())
    }
}

/// The text fields of a mount, in storage order.
#[derive(Clone, Copy)]
pub(crate) enum Field {
    Root = 0,
    MountPoint = 1,
    Options = 2,
    FsType = 3,
    Source = 4,
    SuperOptions = 5,
}

/// One mount. Its six text fields live in one allocation (one per mount, not
/// six), unescaped, as raw bytes: Linux paths need not be UTF-8.
#[derive(Clone, PartialEq, Eq)]
pub struct Mount {
    pub id: MountId,
    pub parent: MountId,
    /// The mountinfo id when known (statmount reports both kinds).
    pub info_id: Option<u32>,
    pub dev: DevNum,
    pub propagation: Propagation,
    text: Box<[u8]>,
    ends: [u32; 6],
}

/// Builds a [`Mount`] field by field, in [`Field`] order.
pub(crate) struct MountBuilder {
    text: Vec<u8>,
    ends: [u32; 6],
    next: usize,
}

impl MountBuilder {
    pub(crate) fn with_capacity(n: usize) -> Self {
        Self { text: Vec::with_capacity(n), ends: [0; 6], next: 0 }
    }

    pub(crate) fn push(&mut self, field: Field, bytes: &[u8]) {
        debug_assert_eq!(field as usize, self.next, "fields in order");
        self.text.extend_from_slice(bytes);
        self.ends[self.next] = self.text.len() as u32;
        self.next += 1;
    }

    /// Appends to the field pushed last.
    pub(crate) fn extend_last(&mut self, bytes: &[u8]) {
        self.text.extend_from_slice(bytes);
        self.ends[self.next - 1] = self.text.len() as u32;
    }

    pub(crate) fn finish(self, id: MountId, parent: MountId, info_id: Option<u32>, dev: DevNum, propagation: Propagation) -> Mount {
        debug_assert_eq!(self.next, 6);
        Mount { id, parent, info_id, dev, propagation, text: self.text.into_boxed_slice(), ends: self.ends }
    }
}

impl Mount {
    fn field(&self, f: Field) -> &[u8] {
        let i = f as usize;
        let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
        &self.text[start..self.ends[i] as usize]
    }

    /// The path inside the filesystem that is mounted (`/` unless a bind of a subtree).
    pub fn root(&self) -> &[u8] {
        self.field(Field::Root)
    }
    /// Where it is mounted, relative to the process's root.
    pub fn mount_point(&self) -> &[u8] {
        self.field(Field::MountPoint)
    }
    pub fn mount_point_path(&self) -> &Path {
        use std::os::unix::ffi::OsStrExt;
        Path::new(std::ffi::OsStr::from_bytes(self.mount_point()))
    }
    /// Per-mount options (`rw,nosuid,relatime`).
    pub fn options(&self) -> &[u8] {
        self.field(Field::Options)
    }
    /// Filesystem type, with `.subtype` when there is one (`fuse.sshfs`).
    pub fn fs_type(&self) -> &[u8] {
        self.field(Field::FsType)
    }
    /// Mount source (`/dev/loop0`, `tmpfs`, `none`).
    pub fn source(&self) -> &[u8] {
        self.field(Field::Source)
    }
    /// Superblock options (`rw,size=1024k`).
    pub fn super_options(&self) -> &[u8] {
        self.field(Field::SuperOptions)
    }
}

impl fmt::Debug for Mount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let l = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        f.debug_struct("Mount")
            .field("id", &self.id)
            .field("parent", &self.parent)
            .field("dev", &format_args!("{}", self.dev))
            .field("root", &l(self.root()))
            .field("mount_point", &l(self.mount_point()))
            .field("options", &l(self.options()))
            .field("propagation", &self.propagation)
            .field("fs_type", &l(self.fs_type()))
            .field("source", &l(self.source()))
            .field("super_options", &l(self.super_options()))
            .finish()
    }
}

impl Serialize for Mount {
    /// Text fields go out as strings, lossily where they are not UTF-8.
    /// Valid UTF-8 (nearly every path) is borrowed, not copied: an event's
    /// JSON line used to cost six allocations here.
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let l = String::from_utf8_lossy;
        let mut st = s.serialize_struct("Mount", 11)?;
        st.serialize_field("id", &self.id)?;
        st.serialize_field("parent", &self.parent)?;
        st.serialize_field("info_id", &self.info_id)?;
        st.serialize_field("maj:min", &self.dev)?;
        st.serialize_field("target", &l(self.mount_point()))?;
        st.serialize_field("source", &l(self.source()))?;
        st.serialize_field("fstype", &l(self.fs_type()))?;
        st.serialize_field("options", &l(self.options()))?;
        st.serialize_field("super_options", &l(self.super_options()))?;
        st.serialize_field("root", &l(self.root()))?;
        st.serialize_field("propagation", &self.propagation)?;
        st.end()
    }
}

#[cfg(test)]
mod tests {
    use super::DevNum;
    use crate::MountTable;

    /// A device number reads back what it displays; anything else is refused.
    #[test]
    fn a_devnum_parses_what_it_displays() {
        let d = DevNum { major: 259, minor: 7 };
        assert_eq!(d.to_string().parse::<DevNum>().unwrap(), d);
        for bad in ["7", "a:b", "7:", ":3", "7:3\n", "-1:0", "7:3:1"] {
            assert!(bad.parse::<DevNum>().is_err(), "{bad:?}");
        }
    }

    /// The JSON shape `volring mounts --json/--watch` prints; bytes that are
    /// not UTF-8 come out as U+FFFD.
    #[test]
    fn serialises_every_field() {
        let (t, _) =
            MountTable::from_mountinfo(b"36 35 7:3 /sub /mnt/a\\040b\xff ro,relatime shared:4 master:2 - ext4 /dev/loop3 ro,stripe=16\n");
        let json = serde_json::to_string(&**t.get(36).unwrap()).unwrap();
        let want = format!(
            r#"{{"id":36,"parent":35,"info_id":36,"maj:min":"7:3","target":"/mnt/a b{}","source":"/dev/loop3","fstype":"ext4","options":"ro,relatime","super_options":"ro,stripe=16","root":"/sub","propagation":{{"shared":4,"master":2}}}}"#,
            char::REPLACEMENT_CHARACTER
        );
        assert_eq!(json, want);
    }
}
