//! Problem bodies for the HTTP/1.1 request heads hyper refuses itself.
//!
//! A request line or header that does not parse, a head over [`MAX_HEAD_BYTES`] or with more
//! than [`MAX_HEADERS`] fields, and a request target too long for hyper are answered by hyper
//! before the gateway sees a request: `400`, `431` or `414` with an empty body, and the
//! connection closed. hyper offers no hook for that answer, so the connection's IO
//! ([`crate::head_timeout::Counted`]) swaps it, on its way out, for the same status with an
//! RFC 9457 problem body, like every other answer the gateway writes itself.
//!
//! hyper's automatic answer is recognised exactly: the whole write is its status line,
//! `connection: close`, `content-length: 0`, `date` and the blank line, in hyper's order.
//! No head the gateway writes can look like it (every response it writes carries
//! `x-request-id`, and a forwarded one never carries the upstream's `connection` header), but
//! a body can hold any bytes (review: an upstream's body reading exactly like it was
//! replaced). So only a write between messages is looked at: no response being made, every
//! byte of the responses before it written, not HTTP/2 (see `Counted::swap_for`). The check
//! costs a comparison of the first bytes of such a write.

use http::StatusCode;

use crate::problem::Problem;
use crate::server::{MAX_HEADERS, MAX_HEAD_BYTES};

/// What every write is compared with first: the start of an automatic answer's status line.
const START: &[u8] = b"HTTP/1.1 4";

/// The longest automatic answer (the 431's status line, the two fixed fields, a 29-byte date).
const LONGEST: usize = 160;

/// The problem answers to write in place of hyper's, made once per gateway.
#[derive(Debug)]
pub(crate) struct HeadErrors {
    answers: [Answer; 3],
}

#[derive(Debug)]
struct Answer {
    status: u16,
    /// hyper's answer up to its `date` field.
    hyper: Vec<u8>,
    /// Ours up to the `date` field, which is taken from hyper's.
    head: Vec<u8>,
    body: Vec<u8>,
}

impl Answer {
    fn new(problem: &Problem, problem_base: &str) -> Self {
        let status = problem.status;
        let line = format!(
            "HTTP/1.1 {} {}\r\nconnection: close\r\n",
            status.as_str(),
            status.canonical_reason().unwrap_or("")
        );
        let body = problem.to_json(problem_base);
        let head = format!(
            "{line}content-type: application/problem+json\r\ncache-control: no-store\r\ncontent-length: {}\r\n",
            body.len()
        );
        Answer {
            status: status.as_u16(),
            hyper: format!("{line}content-length: 0\r\n").into_bytes(),
            head: head.into_bytes(),
            body,
        }
    }
}

impl HeadErrors {
    pub(crate) fn new(problem_base: &str) -> Self {
        let bad =
            Problem::bad_request("The request line or a header field is malformed (RFC 9112).");
        let too_long = Problem::new(
            StatusCode::URI_TOO_LONG,
            "uri-too-long",
            "The request target is too long",
            "The request target is longer than the gateway accepts.",
        );
        let large = Problem::head_too_large(MAX_HEAD_BYTES, MAX_HEADERS);
        HeadErrors {
            answers: [bad, too_long, large].map(|p| Answer::new(&p, problem_base)),
        }
    }

    /// The answer to write instead of `buf`, and its status, if `buf` is exactly one of
    /// hyper's automatic answers to a request head it refused.
    pub(crate) fn replacement(&self, buf: &[u8]) -> Option<(u16, Vec<u8>)> {
        if buf.len() > LONGEST || !buf.starts_with(START) {
            return None;
        }
        self.answers.iter().find_map(|a| {
            let date = buf.strip_prefix(a.hyper.as_slice())?;
            let value = date.strip_prefix(b"date: ")?.strip_suffix(b"\r\n\r\n")?;
            let plain = !value.is_empty() && value.iter().all(|b| (b' '..=b'~').contains(b));
            plain.then(|| (a.status, [&a.head, date, &a.body].concat()))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DATE: &str = "date: Tue, 01 Dec 2026 03:46:47 GMT\r\n\r\n";

    fn errors() -> HeadErrors {
        HeadErrors::new("https://api.example.com/problems/")
    }

    /// hyper 1.x's automatic answers, byte for byte as it writes them.
    #[test]
    fn hyper_answers_get_problem_bodies_with_their_status_and_date() {
        for (status, reason, kind) in [
            ("400", "Bad Request", "bad-request"),
            ("414", "URI Too Long", "uri-too-long"),
            (
                "431",
                "Request Header Fields Too Large",
                "headers-too-large",
            ),
        ] {
            let hyper = format!(
                "HTTP/1.1 {status} {reason}\r\nconnection: close\r\ncontent-length: 0\r\n{DATE}"
            );
            let (code, ours) = errors().replacement(hyper.as_bytes()).expect("replaced");
            assert_eq!(code.to_string(), status);
            let ours = String::from_utf8(ours).unwrap();
            let (head, body) = ours.split_once("\r\n\r\n").unwrap();
            assert!(
                head.starts_with(&format!(
                    "HTTP/1.1 {status} {reason}\r\nconnection: close\r\n"
                )),
                "{head}"
            );
            assert!(head.contains("content-type: application/problem+json\r\n"));
            assert!(head.ends_with(DATE.trim_end()), "{head}");
            let json: serde_json::Value = serde_json::from_str(body).unwrap();
            assert_eq!(json["status"], status.parse::<u16>().unwrap());
            assert_eq!(
                json["type"],
                format!("https://api.example.com/problems/{kind}")
            );
            assert!(head.contains(&format!("content-length: {}\r\n", body.len())));
        }
    }

    /// Anything else passes as it is: the gateway's own answers and forwarded ones carry more
    /// fields, and other statuses are not hyper's.
    #[test]
    fn other_writes_pass_untouched() {
        let e = errors();
        for other in [
            format!("HTTP/1.1 400 Bad Request\r\nx-request-id: 1\r\nconnection: close\r\ncontent-length: 0\r\n{DATE}"),
            format!("HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 0\r\n{DATE}x"),
            format!("HTTP/1.1 404 Not Found\r\nconnection: close\r\ncontent-length: 0\r\n{DATE}"),
            "HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 0\r\ndate: \r\n\r\n".to_owned(),
            "HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n".to_owned(),
            String::new(),
        ] {
            assert_eq!(e.replacement(other.as_bytes()), None, "{other:?}");
        }
    }
}
