//! A load-balancer model with the two rules the seed names: Envoy's outlier detection
//! (eject after 5 consecutive 5xx) and a Kubernetes-style readiness probe (200 to 399 is up).

use http::StatusCode;

/// Counts consecutive 5xx answers the way Envoy's default outlier detection does.
#[derive(Default)]
pub(crate) struct Balancer {
    consecutive_5xx: u32,
    ejected: bool,
}

impl Balancer {
    pub(crate) const EJECT_AFTER: u32 = 5;

    pub(crate) fn observe(&mut self, status: StatusCode) {
        if status.is_server_error() {
            self.consecutive_5xx += 1;
            self.ejected |= self.consecutive_5xx >= Self::EJECT_AFTER;
        } else {
            self.consecutive_5xx = 0;
        }
    }

    /// "balancer: 5 consecutive 5xx, ejected true; probes 503 503 503, ready false"
    pub(crate) fn verdict(&self, probes: &[StatusCode]) -> String {
        let ready = probes.iter().all(|s| (200..400).contains(&s.as_u16()));
        let probes: Vec<String> = probes.iter().map(|s| s.as_u16().to_string()).collect();
        format!(
            "balancer: {} consecutive 5xx, ejected {}; probes {}, ready {ready}",
            self.consecutive_5xx,
            self.ejected,
            probes.join(" ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn five_consecutive_5xx_eject_and_429s_do_not() {
        let mut b = Balancer::default();
        for _ in 0..10 {
            b.observe(StatusCode::TOO_MANY_REQUESTS);
        }
        assert!(!b.ejected);
        for _ in 0..4 {
            b.observe(StatusCode::SERVICE_UNAVAILABLE);
        }
        assert!(!b.ejected);
        b.observe(StatusCode::SERVICE_UNAVAILABLE);
        assert!(b.ejected);
        assert!(b
            .verdict(&[StatusCode::SERVICE_UNAVAILABLE])
            .ends_with("probes 503, ready false"));
    }
}
