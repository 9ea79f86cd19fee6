//! mountinfo bytes → lines, owned mounts, a table, and a diff against an
//! empty table. Nothing may panic; every line is either a mount or an error.
#![no_main]

use libfuzzer_sys::fuzz_target;
use volring_mounts::{diff, mountinfo_lines, mountinfo_mounts, MountTable};

fuzz_target!(|data: &[u8]| {
    let lines = data.split(|&b| b == b'\n').filter(|l| !l.is_empty()).count();
    let mut seen = 0;
    // The owned mounts come in the order of the lines that parsed.
    let (mounts, _) = mountinfo_mounts(data);
    let mut owned = mounts.iter();
    for line in mountinfo_lines(data) {
        seen += 1;
        if let Ok(raw) = line {
            let m = owned.next().expect("an owned mount for every line that parsed");
            assert!(m.mount_point().len() <= raw.mount_point.len());
        }
    }
    assert!(owned.next().is_none(), "no owned mount without a line");
    assert_eq!(seen, lines);
    let (table, errors) = MountTable::from_mountinfo(data);
    assert!(table.len() + errors.len() <= lines);
    let _ = diff(&MountTable::default(), &table);
});
