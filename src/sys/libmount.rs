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

/// Parses a mountinfo-format file into a libmount table and returns how many
/// entries it holds.
pub fn parse_table_file(path: &std::path::Path) -> io::Result<usize> {
    let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(io::Error::other)?;
    // SAFETY: mnt_new_table has no preconditions; it returns NULL on ENOMEM.
    let tb = unsafe { mnt_new_table() };
    if tb.is_null() {
        return Err(io::Error::from(io::ErrorKind::OutOfMemory));
    }
    // SAFETY: `tb` is a live table, `c` a NUL-terminated path alive for the call.
    let rc = unsafe { mnt_table_parse_file(tb, c.as_ptr()) };
    // SAFETY: `tb` is live until the unref below.
    let n = unsafe { mnt_table_get_nents(tb) };
    // SAFETY: drops the only reference we hold; `tb` is not used afterwards.
    unsafe { mnt_unref_table(tb) };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(-rc));
    }
    Ok(n.max(0) as usize)
}
