//! The admin listener: `GET /live` and `GET /ready`. Never limited, never forwarded, never
//! counted as in-flight work.

use std::convert::Infallible;
use std::sync::Arc;

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;

use crate::body::Body;
use crate::handle::{plain, readiness, without_body_for_head, Shared};
use crate::head_timeout::Busy;
use crate::problem::Problem;

/// hyper's service function for the admin listener.
pub(crate) async fn handle(
    shared: Arc<Shared>,
    busy: Busy,
    req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let get = matches!(*req.method(), Method::GET | Method::HEAD);
    let mut res = match (get, req.uri().path()) {
        // Live while the process serves: overload must never restart the container.
        (true, "/live") => plain(StatusCode::OK, "live\n"),
        (true, "/ready") => readiness(&shared.capacity),
        (false, "/live" | "/ready") => {
            let mut res = plain(StatusCode::METHOD_NOT_ALLOWED, "use GET\n");
            res.headers_mut().insert(
                http::header::ALLOW,
                http::HeaderValue::from_static("GET, HEAD"),
            );
            res
        }
        _ => Problem::not_found().into_response(&shared.problem_base),
    };
    if req.version() == http::Version::HTTP_2 && req.method() == Method::HEAD {
        without_body_for_head(&mut res);
    }
    res.body_mut().keep_busy(busy);
    Ok(res)
}
