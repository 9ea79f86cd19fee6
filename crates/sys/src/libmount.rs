//! util-linux libmount, linked only for the parser bench (`--features libmount-peer`).

use std::ffi::CString;
use std::io;
use std::os::raw::{c_char, c_int, c_void};

#[link(name = "mount")]
extern "C" {
    fn mnt_new_table() -> *mut c_void;
    fn mnt_unref_table(tb: *mut c_void);
    fn mnt_table_parse_file(tb: *mut c_void, filename: *const c_char) -> c_int;
    fn mnt_table_get_nents(tb: *mut c_void) -> c_int;
}

/// A parsed libmount table; freed on drop, so a bench can time parsing and
/// teardown separately, as it does for volring's tables.
pub struct Table(*mut c_void);

impl Table {
    /// Parses a mountinfo-format file.
    pub fn parse_file(path: &std::path::Path) -> io::Result<Self> {
        let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(io::Error::other)?;
        // SAFETY: mnt_new_table has no preconditions; it returns NULL on ENOMEM.
        let tb = unsafe { mnt_new_table() };
        if tb.is_null() {
            return Err(io::Error::from(io::ErrorKind::OutOfMemory));
        }
        let table = Table(tb);
        // SAFETY: `tb` is a live table, `c` a NUL-terminated path alive for the call.
        let rc = unsafe { mnt_table_parse_file(tb, c.as_ptr()) };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(-rc));
        }
        Ok(table)
    }

    /// Number of entries.
    pub fn entries(&self) -> usize {
        // SAFETY: self.0 is a live table until drop.
        unsafe { mnt_table_get_nents(self.0) }.max(0) as usize
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        // SAFETY: drops the only reference; self.0 is not used afterwards.
        unsafe { mnt_unref_table(self.0) };
    }
}

/// Makes glibc consolidate and return freed memory now, so the frees of one
/// timed run are not paid for by the next run's first large allocation.
pub fn settle_heap() {
    // SAFETY: malloc_trim only walks glibc's own heap state; no pointer of
    // ours is involved.
    unsafe { libc::malloc_trim(0) };
}
