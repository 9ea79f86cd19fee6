//! ListVolumes `starting_token`: whatever string a CO sends, the parser
//! answers without panicking, accepts only what volring issued (a token it
//! accepts is exactly the one `list_token` makes for the id it yields), and
//! every id's token parses back to the id.
#![no_main]

use libfuzzer_sys::fuzz_target;
use volring_csi::validate;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else { return };
    if let Ok(id) = validate::parse_list_token(s) {
        assert!(validate::volume_id(&id).is_ok(), "{s:?} -> {id:?}");
        assert_eq!(validate::list_token(&id), s, "tokens are canonical");
    }
    if validate::volume_id(s).is_ok() {
        let t = validate::list_token(s);
        assert!(t.len() <= validate::MAX_TOKEN_LEN);
        assert_eq!(validate::parse_list_token(&t).ok().as_deref(), Some(s));
    }
});
