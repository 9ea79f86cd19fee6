//! ListVolumes `starting_token`: whatever string a CO sends, the parser
//! answers without panicking, accepts only what volring issued (a token it
//! accepts is exactly the one `list_token` makes for the id it yields), and
//! every id's token parses back to the id. The checks live beside the parser
//! (`volring_csi::validate::fuzz_list_token`), which stays private to the
//! crate.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else { return };
    volring_csi::validate::fuzz_list_token(s);
});
