//! The kernel's octal escapes in mount tables (`\040` space, `\011` tab,
//! `\012` newline, `\134` backslash).

use std::borrow::Cow;

/// Undoes `\ooo` escapes. Borrows when there is nothing to undo, which is
/// nearly always. A backslash not followed by three octal digits is kept as
/// is: the kernel never writes one, and guessing would corrupt paths.
pub fn unescape(raw: &[u8]) -> Cow<'_, [u8]> {
    let Some(first) = memchr::memchr(b'\\', raw) else {
        return Cow::Borrowed(raw);
    };
    let mut out = Vec::with_capacity(raw.len());
    out.extend_from_slice(&raw[..first]);
    let mut i = first;
    while i < raw.len() {
        match raw.get(i + 1..i + 4) {
            Some(t) if raw[i] == b'\\' && is_octal_triplet(t) => {
                out.push((t[0] - b'0') * 64 + (t[1] - b'0') * 8 + (t[2] - b'0'));
                i += 4;
            }
            _ => {
                out.push(raw[i]);
                i += 1;
            }
        }
    }
    Cow::Owned(out)
}

fn is_octal_triplet(t: &[u8]) -> bool {
    t.len() == 3 && t[0] <= b'3' && t.iter().all(|c| (b'0'..=b'7').contains(c))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unescapes_the_four_kernel_escapes() {
        assert_eq!(&*unescape(br"/a\040b\011c\012d\134e"), b"/a b\tc\nd\\e");
    }

    #[test]
    fn borrows_when_clean_and_keeps_stray_backslashes() {
        assert!(matches!(unescape(b"/var/lib"), Cow::Borrowed(_)));
        assert_eq!(&*unescape(br"a\09"), br"a\09");
        assert_eq!(&*unescape(br"a\"), br"a\");
        assert_eq!(&*unescape(br"\0400"), b" 0");
        assert_eq!(&*unescape(br"\777"), br"\777");
    }
}
