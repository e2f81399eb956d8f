//! Protocol switches (`Connection: upgrade`, e.g. WebSocket): once the upstream answers `101`,
//! the client's and the upstream's connections are spliced together, byte for byte, until
//! either side closes.
//!
//! The request was decided like any other (its quota charged once, at the handshake); the
//! tunnel then holds the request's in-flight slot and concurrency slots for as long as it is
//! open, since it keeps using the gateway and the upstream.

use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;

use crate::capacity::InFlight;
use crate::quota::Held;

/// Splices the two sides once both have switched; `hold` is released when the tunnel ends.
pub(crate) async fn splice(client: OnUpgrade, upstream: OnUpgrade, hold: (InFlight, Held)) {
    let (client, upstream) = match tokio::try_join!(client, upstream) {
        Ok(both) => both,
        Err(e) => {
            tracing::debug!(error = %e, "a protocol switch did not complete");
            return;
        }
    };
    let (mut client, mut upstream) = (TokioIo::new(client), TokioIo::new(upstream));
    match tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
        Ok((up, down)) => tracing::debug!(up, down, "tunnel closed"),
        Err(e) => tracing::debug!(error = %e, "tunnel ended with an error"),
    }
    drop(hold);
}
