//! `x-request-id`: kept when the caller sent a sane one, made up otherwise, passed upstream
//! and echoed on the response.

use std::sync::atomic::{AtomicU64, Ordering};

use http::{HeaderMap, HeaderName, HeaderValue};

/// The header name.
pub(crate) static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Ids longer than this from a caller are replaced.
const MAX_LEN: usize = 128;

/// Makes unique ids: a random per-process prefix and a counter. No lock, no syscall.
#[derive(Debug)]
pub(crate) struct RequestIds {
    prefix: u64,
    next: AtomicU64,
}

impl RequestIds {
    pub(crate) fn new() -> Self {
        Self {
            prefix: rand::random(),
            next: AtomicU64::new(0),
        }
    }

    /// The caller's id if it is printable and short, else a new one (and the header is set).
    pub(crate) fn ensure(&self, headers: &mut HeaderMap) -> HeaderValue {
        if let Some(v) = headers.get(&X_REQUEST_ID) {
            let ok = !v.is_empty()
                && v.len() <= MAX_LEN
                && v.as_bytes().iter().all(|b| b.is_ascii_graphic());
            if ok {
                return v.clone();
            }
        }
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let id = HeaderValue::from_str(&format!("{:016x}{n:016x}", self.prefix))
            .expect("hex is a valid header value");
        headers.insert(X_REQUEST_ID.clone(), id.clone());
        id
    }
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

    #[test]
    fn made_up_ids_are_unique() {
        let ids = RequestIds::new();
        let a = ids.ensure(&mut HeaderMap::new());
        let b = ids.ensure(&mut HeaderMap::new());
        assert_ne!(a, b);
    }
}
