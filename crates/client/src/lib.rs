//! Client helpers for APIs behind sluice: Retry-After, RateLimit fields, problem bodies, a retry policy.
