//! Text from sysfs and the udev database: uevent files, udev entries,
//! `maj:min`. Never panics.
#![no_main]

use libfuzzer_sys::fuzz_target;
use volring_devices::sysfs::{parse_devnum, parse_udev_db, parse_uevent_file};

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let _ = parse_uevent_file(&text);
    let _ = parse_udev_db(&text);
    let _ = parse_devnum(&text);
});
