//! mountinfo bytes → lines, owned mounts, a table, and a diff against an
//! empty table. Nothing may panic; every line is either a mount or an error.
#![no_main]

use libfuzzer_sys::fuzz_target;
use volring_mounts::{diff, mountinfo_lines, MountTable};

fuzz_target!(|data: &[u8]| {
    let lines = data.split(|&b| b == b'\n').filter(|l| !l.is_empty()).count();
    let mut seen = 0;
    for line in mountinfo_lines(data) {
        seen += 1;
        if let Ok(raw) = line {
            let m = raw.to_mount();
            assert!(m.mount_point().len() <= raw.mount_point.len());
        }
    }
    assert_eq!(seen, lines);
    let (table, errors) = MountTable::from_mountinfo(data);
    assert!(table.len() + errors.len() <= lines);
    let _ = diff(&MountTable::default(), &table);
});
