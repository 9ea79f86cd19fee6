//! Text from sysfs and the udev database: uevent files, udev entries,
//! `maj:min`. Never panics.
#![no_main]

use libfuzzer_sys::fuzz_target;
use volring_devices::fuzz_sysfs_text;

fuzz_target!(|data: &[u8]| {
    fuzz_sysfs_text(&String::from_utf8_lossy(data));
});
