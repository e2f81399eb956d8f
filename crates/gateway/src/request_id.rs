//! `x-request-id`: kept when the caller sent a sane one, made up otherwise, passed upstream
//! and echoed on the response.

use std::sync::atomic::{AtomicU64, Ordering};

use http::header::Entry;
use http::{HeaderMap, HeaderName, HeaderValue};

/// The header name.
pub(crate) static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Ids longer than this from a caller are replaced.
const MAX_LEN: usize = 128;

/// Makes unique ids: a random per-process prefix and a counter, 32 hex digits. No lock, no
/// syscall, no formatting machinery (`format!` was 5% of a forwarded request's instructions).
#[derive(Debug)]
pub(crate) struct RequestIds {
    /// The prefix's 16 hex digits, written once.
    prefix: [u8; 16],
    next: AtomicU64,
}

impl RequestIds {
    pub(crate) fn new() -> Self {
        Self {
            prefix: hex(rand::random()),
            next: AtomicU64::new(0),
        }
    }

    /// The caller's id if it sent one, printable and short, else a new one (and the header is
    /// set). An id sent twice is replaced: the upstream would read one and the log the other.
    pub(crate) fn ensure(&self, headers: &mut HeaderMap) -> HeaderValue {
        let entry = match headers.entry(&X_REQUEST_ID) {
            Entry::Occupied(mut e) => {
                let v = e.get();
                let ok = !v.is_empty()
                    && v.len() <= MAX_LEN
                    && v.as_bytes().iter().all(|b| b.is_ascii_graphic())
                    && e.iter().nth(1).is_none();
                if ok {
                    return v.clone();
                }
                let id = self.make();
                e.insert(id.clone());
                return id;
            }
            Entry::Vacant(e) => e,
        };
        let id = self.make();
        entry.insert(id.clone());
        id
    }

    fn make(&self) -> HeaderValue {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let mut id = [0u8; 32];
        id[..16].copy_from_slice(&self.prefix);
        id[16..].copy_from_slice(&hex(n));
        HeaderValue::from_bytes(&id).expect("hex is a valid header value")
    }
}

/// `n` as 16 lower-case hex digits.
pub(crate) fn hex(n: u64) -> [u8; 16] {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = [0u8; 16];
    for (i, d) in out.iter_mut().enumerate() {
        *d = DIGITS[(n >> (60 - 4 * i)) as usize & 0xf];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_a_sane_id_and_replaces_a_bad_one() {
        let ids = RequestIds::new();
        let mut h = HeaderMap::new();
        h.insert(&X_REQUEST_ID, HeaderValue::from_static("abc-123"));
        assert_eq!(ids.ensure(&mut h), "abc-123");
        h.insert(&X_REQUEST_ID, HeaderValue::from_static("has space"));
        let made = ids.ensure(&mut h);
        assert_eq!(made.len(), 32);
        assert_eq!(h[&X_REQUEST_ID], made);
    }

    /// Sent twice, the upstream would read one id and the log the other: a new one replaces
    /// both (review).
    #[test]
    fn an_id_sent_twice_is_replaced_by_one() {
        let ids = RequestIds::new();
        let mut h = HeaderMap::new();
        h.append(&X_REQUEST_ID, HeaderValue::from_static("first"));
        h.append(&X_REQUEST_ID, HeaderValue::from_static("second"));
        let made = ids.ensure(&mut h);
        assert_eq!(made.len(), 32);
        assert_eq!(h.get_all(&X_REQUEST_ID).iter().collect::<Vec<_>>(), [made]);
    }

    #[test]
    fn hex_is_sixteen_lower_case_digits() {
        assert_eq!(&hex(0), b"0000000000000000");
        assert_eq!(&hex(0x0123_4567_89ab_cdef), b"0123456789abcdef");
        assert_eq!(&hex(u64::MAX), b"ffffffffffffffff");
        assert_eq!(hex(48879), *format!("{:016x}", 48879).as_bytes());
    }

    #[test]
    fn made_up_ids_are_unique() {
        let ids = RequestIds::new();
        let a = ids.ensure(&mut HeaderMap::new());
        let b = ids.ensure(&mut HeaderMap::new());
        assert_ne!(a, b);
        let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
        assert_eq!(a[..16], b[..16], "one prefix per process");
        let count = |id: &str| u64::from_str_radix(&id[16..], 16).unwrap();
        assert_eq!(count(b), count(a) + 1);
    }
}
