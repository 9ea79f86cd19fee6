//! `/proc/<pid>/mountinfo` parser: zero-copy over the bytes read.
//!
//! Line format (proc(5)):
//! `36 35 98:0 /mnt1 /mnt/parent rw,noatime master:1 - ext3 /dev/root rw,errors=continue`
//! — id, parent id, major:minor, root, mount point, per-mount options, zero or
//! more optional fields, a lone `-`, fs type, source, superblock options.
//! A malformed line yields an error naming it; the lines after it still parse.

use super::escape::unescape;
use super::mount::{DevNum, Field, Mount, MountBuilder, Propagation};

/// One line, borrowed from the input. Text fields are still escaped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawMount<'a> {
    pub id: u32,
    pub parent: u32,
    pub dev: DevNum,
    pub root: &'a [u8],
    pub mount_point: &'a [u8],
    pub options: &'a [u8],
    pub propagation: Propagation,
    pub fs_type: &'a [u8],
    pub source: &'a [u8],
    pub super_options: &'a [u8],
}

/// What is wrong with a line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum LineFault {
    #[error("missing field `{0}`")]
    Missing(&'static str),
    #[error("field `{0}` is not a number")]
    BadNumber(&'static str),
    #[error("device is not major:minor")]
    BadDevice,
    #[error("no `-` separator after the optional fields")]
    NoSeparator,
    #[error("optional field `{0}` has no valid number")]
    BadOptional(&'static str),
    #[error("unexpected text after the superblock options")]
    Trailing,
}

/// A malformed line, named by its number (1-based) and an excerpt.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("mountinfo line {line}: {fault}: {excerpt:?}")]
pub struct LineError {
    pub line: usize,
    pub(crate) fault: LineFault,
    /// At most 120 bytes of the line, lossily decoded.
    pub(crate) excerpt: String,
}

impl LineError {
    fn new(line: usize, text: &[u8], fault: LineFault) -> Self {
        let cut = &text[..text.len().min(120)];
        Self { line, fault, excerpt: String::from_utf8_lossy(cut).into_owned() }
    }
}

/// Splits fields on single spaces, as the kernel writes them.
struct Fields<'a> {
    rest: &'a [u8],
    done: bool,
}

impl<'a> Fields<'a> {
    fn next_field(&mut self, name: &'static str) -> Result<&'a [u8], LineFault> {
        if self.done {
            return Err(LineFault::Missing(name));
        }
        match memchr::memchr(b' ', self.rest) {
            Some(i) => {
                let f = &self.rest[..i];
                self.rest = &self.rest[i + 1..];
                Ok(f)
            }
            None => {
                self.done = true;
                Ok(self.rest)
            }
        }
    }
}

fn number(field: &[u8], name: &'static str) -> Result<u64, LineFault> {
    if field.is_empty() || field.len() > 20 {
        return Err(LineFault::BadNumber(name));
    }
    let mut v: u64 = 0;
    for &b in field {
        if !b.is_ascii_digit() {
            return Err(LineFault::BadNumber(name));
        }
        v = v.checked_mul(10).and_then(|v| v.checked_add((b - b'0') as u64)).ok_or(LineFault::BadNumber(name))?;
    }
    Ok(v)
}

fn number32(field: &[u8], name: &'static str) -> Result<u32, LineFault> {
    u32::try_from(number(field, name)?).map_err(|_| LineFault::BadNumber(name))
}

fn device(field: &[u8]) -> Result<DevNum, LineFault> {
    let colon = field.iter().position(|&b| b == b':').ok_or(LineFault::BadDevice)?;
    let major = number32(&field[..colon], "major").map_err(|_| LineFault::BadDevice)?;
    let minor = number32(&field[colon + 1..], "minor").map_err(|_| LineFault::BadDevice)?;
    Ok(DevNum { major, minor })
}

/// Reads one optional field into `p`. Unknown tags are ignored, as proc(5)
/// asks of parsers, so newer kernels do not break older agents.
fn optional(tag: &[u8], p: &mut Propagation) -> Result<(), LineFault> {
    if tag == b"unbindable" {
        p.unbindable = true;
        return Ok(());
    }
    let Some(colon) = tag.iter().position(|&b| b == b':') else {
        return Ok(());
    };
    let (name, value) = (&tag[..colon], &tag[colon + 1..]);
    let slot = match name {
        b"shared" => (&mut p.shared, "shared"),
        b"master" => (&mut p.master, "master"),
        b"propagate_from" => (&mut p.propagate_from, "propagate_from"),
        _ => return Ok(()),
    };
    *slot.0 = Some(number(value, slot.1).map_err(|_| LineFault::BadOptional(slot.1))?);
    Ok(())
}

/// Parses one line (without its newline).
pub(crate) fn parse_line(line: &[u8]) -> Result<RawMount<'_>, LineFault> {
    let mut f = Fields { rest: line, done: false };
    let id = number32(f.next_field("mount id")?, "mount id")?;
    let parent = number32(f.next_field("parent id")?, "parent id")?;
    let dev = device(f.next_field("major:minor")?)?;
    let root = f.next_field("root")?;
    let mount_point = f.next_field("mount point")?;
    let options = f.next_field("options")?;
    let mut propagation = Propagation::default();
    loop {
        let tag = f.next_field("separator").map_err(|_| LineFault::NoSeparator)?;
        if tag == b"-" {
            break;
        }
        if f.done {
            return Err(LineFault::NoSeparator);
        }
        optional(tag, &mut propagation)?;
    }
    let fs_type = f.next_field("fs type")?;
    let source = f.next_field("source")?;
    let super_options = f.next_field("super options")?;
    if !f.done {
        return Err(LineFault::Trailing);
    }
    if root.is_empty() || mount_point.is_empty() || fs_type.is_empty() {
        return Err(LineFault::Missing(if root.is_empty() {
            "root"
        } else if mount_point.is_empty() {
            "mount point"
        } else {
            "fs type"
        }));
    }
    Ok(RawMount { id, parent, dev, root, mount_point, options, propagation, fs_type, source, super_options })
}

/// Iterates the lines of a mountinfo buffer; blank lines are skipped.
pub fn mountinfo_lines(buf: &[u8]) -> impl Iterator<Item = Result<RawMount<'_>, LineError>> + '_ {
    lines(buf).enumerate().filter(|(_, l)| !l.is_empty()).map(|(i, l)| parse_line(l).map_err(|fault| LineError::new(i + 1, l, fault)))
}

/// Every line as an owned [`Mount`], and the malformed lines beside them.
///
/// Counts the lines first (one SIMD pass) so the output is allocated once:
/// growing it by doubling re-maps and faults in fresh pages at every step,
/// which at 20,000 lines cost more than the parsing itself.
pub fn mountinfo_mounts(buf: &[u8]) -> (Vec<Mount>, Vec<LineError>) {
    let mut out = Vec::with_capacity(line_count(buf));
    let mut errors = Vec::new();
    for line in mountinfo_lines(buf) {
        match line {
            Ok(raw) => out.push(raw.to_mount()),
            Err(e) => errors.push(e),
        }
    }
    (out, errors)
}

/// Upper bound on the number of lines in `buf`.
pub(crate) fn line_count(buf: &[u8]) -> usize {
    memchr::memchr_iter(b'\n', buf).count() + 1
}

/// The lines of `buf`, the last one with or without its newline.
fn lines(buf: &[u8]) -> impl Iterator<Item = &[u8]> + '_ {
    let mut rest = Some(buf);
    std::iter::from_fn(move || {
        let r = rest?;
        match memchr::memchr(b'\n', r) {
            Some(i) => {
                rest = Some(&r[i + 1..]);
                Some(&r[..i])
            }
            None => {
                rest = None;
                Some(r)
            }
        }
    })
}

impl RawMount<'_> {
    /// The owned form, unescaped, keyed by the mountinfo id.
    pub(crate) fn to_mount(self) -> Mount {
        let len = self.root.len()
            + self.mount_point.len()
            + self.options.len()
            + self.fs_type.len()
            + self.source.len()
            + self.super_options.len();
        let mut b = MountBuilder::with_capacity(len);
        b.push(Field::Root, &unescape(self.root));
        b.push(Field::MountPoint, &unescape(self.mount_point));
        b.push(Field::Options, self.options);
        b.push(Field::FsType, &unescape(self.fs_type));
        b.push(Field::Source, &unescape(self.source));
        b.push(Field::SuperOptions, &unescape(self.super_options));
        b.finish(self.id as u64, self.parent as u64, Some(self.id), self.dev, self.propagation)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &[u8] = b"22 1 0:21 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
36 35 98:0 /mnt1 /mnt/parent rw,noatime master:1 - ext3 /dev/root rw,errors=continue
101 36 7:3 / /var/lib/kubelet/pods/a\\040b/vol ro,relatime shared:40 master:12 propagate_from:3 unbindable - ext4 /dev/loop3 ro
102 36 0:55 / /tmp/x rw - fuse.sshfs user@host:/a\\134b rw,user_id=0
";

    #[test]
    fn parses_every_field() {
        let all: Vec<_> = mountinfo_lines(SAMPLE).collect::<Result<_, _>>().unwrap();
        assert_eq!(all.len(), 4);
        let m = &all[1];
        assert_eq!((m.id, m.parent, m.dev), (36, 35, DevNum { major: 98, minor: 0 }));
        assert_eq!(m.root, b"/mnt1");
        assert_eq!(m.options, b"rw,noatime");
        assert_eq!(m.propagation, Propagation { master: Some(1), ..Default::default() });
        assert_eq!((m.fs_type, m.source, m.super_options), (&b"ext3"[..], &b"/dev/root"[..], &b"rw,errors=continue"[..]));
        let k = all[2].to_mount();
        assert_eq!(k.mount_point(), b"/var/lib/kubelet/pods/a b/vol");
        assert_eq!(k.options().split(|&b| b == b',').next(), Some(&b"ro"[..]), "mounted read-only");
        assert_eq!(k.propagation, Propagation { shared: Some(40), master: Some(12), propagate_from: Some(3), unbindable: true });
        assert_eq!(k.propagation.to_string(), "shared:40 master:12 propagate_from:3 unbindable");
        let f = all[3].to_mount();
        assert_eq!(f.fs_type(), b"fuse.sshfs");
        assert_eq!(f.source(), b"user@host:/a\\b");
    }

    #[test]
    fn malformed_lines_are_named_and_the_rest_parses() {
        let buf = b"22 1 0:21 / /sys rw - sysfs sysfs rw\nnot a line\n23 1 0:22 / /proc rw shared:x - proc proc rw\n24 1 0:23 / /dev rw - devtmpfs udev rw\n25 1 0:24 / /run rw shared:1\n";
        let res: Vec<_> = mountinfo_lines(buf).collect();
        assert_eq!(res.len(), 5);
        assert!(res[0].is_ok() && res[3].is_ok());
        let e = res[1].as_ref().unwrap_err();
        assert_eq!((e.line, e.fault), (2, LineFault::BadNumber("mount id")));
        assert_eq!(res[2].as_ref().unwrap_err().fault, LineFault::BadOptional("shared"));
        assert_eq!(res[4].as_ref().unwrap_err().fault, LineFault::NoSeparator);
        assert!(e.to_string().contains("line 2"));
    }

    #[test]
    fn rejects_each_kind_of_damage() {
        let cases: &[(&[u8], LineFault)] = &[
            (b"", LineFault::BadNumber("mount id")),
            (b"1", LineFault::Missing("parent id")),
            (b"1 2 3 / / rw - t s o", LineFault::BadDevice),
            (b"1 2 3:x / / rw - t s o", LineFault::BadDevice),
            (b"1 2 3:4 / / rw - t s", LineFault::Missing("super options")),
            (b"1 2 3:4 / / rw - t s o extra", LineFault::Trailing),
            (b"99999999999 2 3:4 / / rw - t s o", LineFault::BadNumber("mount id")),
            (b"1 2 3:4  / rw - t s o", LineFault::Missing("root")),
            (b"1 2 3:4 / / rw master:99999999999999999999999 - t s o", LineFault::BadOptional("master")),
        ];
        for (line, fault) in cases {
            assert_eq!(parse_line(line), Err(*fault), "{:?}", String::from_utf8_lossy(line));
        }
    }

    #[test]
    fn unknown_optional_tags_are_ignored() {
        let m = parse_line(b"1 2 3:4 / /x rw future:5 shared:2 - t s o").unwrap();
        assert_eq!(m.propagation.shared, Some(2));
    }
}
