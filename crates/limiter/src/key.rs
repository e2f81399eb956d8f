//! Fixed-size keys: a 128-bit keyed hash of a caller's identity parts.
//!
//! The raw identity (an address, an API key) is never stored. The hash is keyed by a secret
//! seed, so a caller cannot choose identities that collide in the table.

use std::hash::Hasher as _;

use siphasher::sip128::{Hasher128 as _, SipHasher13};

/// The 128-bit identity of a caller within a limit. Never zero (zero marks a free table slot).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Key(pub(crate) [u64; 2]);

impl Key {
    /// The key as 16 bytes (little-endian words), e.g. to name it in a shared store.
    pub fn to_bytes(self) -> [u8; 16] {
        let mut out = [0u8; 16];
        out[..8].copy_from_slice(&self.0[0].to_le_bytes());
        out[8..].copy_from_slice(&self.0[1].to_le_bytes());
        out
    }

    /// A key from 16 bytes produced by [`Key::to_bytes`]; `None` for the all-zero value.
    pub fn from_bytes(bytes: [u8; 16]) -> Option<Key> {
        let lo = u64::from_le_bytes(bytes[..8].try_into().ok()?);
        let hi = u64::from_le_bytes(bytes[8..].try_into().ok()?);
        (lo != 0 || hi != 0).then_some(Key([lo, hi]))
    }
}

/// Turns identity parts into [`Key`]s with SipHash-1-3-128 under a secret seed.
#[derive(Clone)]
pub struct KeyHasher {
    seed: SipHasher13,
}

impl std::fmt::Debug for KeyHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The seed is a secret: never print it.
        f.write_str("KeyHasher { .. }")
    }
}

impl KeyHasher {
    /// A hasher with a seed drawn from the operating system's generator, fresh per process.
    pub fn new_random() -> Self {
        let (k0, k1): (u64, u64) = rand::random();
        KeyHasher {
            seed: SipHasher13::new_with_keys(k0, k1),
        }
    }

    /// A hasher whose seed is derived from `secret`, so every instance sharing the secret (e.g.
    /// gateways sharing a store) derives the same key for the same identity.
    pub fn with_secret(secret: &[u8]) -> Self {
        let mut derive = SipHasher13::new_with_keys(0x736c_7569_6365_2d6b, 0x6579_2d73_6565_6431);
        derive.write(b"sluice key seed v1");
        derive.write_u64(secret.len() as u64);
        derive.write(secret);
        let h = derive.finish128();
        KeyHasher {
            seed: SipHasher13::new_with_keys(h.h1, h.h2),
        }
    }

    /// The key of an identity made of `parts`. Each part is framed by its length, so
    /// `["ab", "c"]` and `["a", "bc"]` give different keys.
    pub fn key(&self, parts: &[&[u8]]) -> Key {
        let mut h = self.seed;
        h.write_u64(parts.len() as u64);
        for part in parts {
            h.write_u64(part.len() as u64);
            h.write(part);
        }
        let out = h.finish128();
        // Zero marks a free slot; a 2^-128 event, mapped away rather than ignored.
        Key([out.h1 | u64::from(out.h1 == 0 && out.h2 == 0), out.h2])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_secret_gives_the_same_key_on_every_instance() {
        let a = KeyHasher::with_secret(b"shared");
        let b = KeyHasher::with_secret(b"shared");
        assert_eq!(a.key(&[b"10.0.0.1"]), b.key(&[b"10.0.0.1"]));
        let other = KeyHasher::with_secret(b"other");
        assert_ne!(a.key(&[b"10.0.0.1"]), other.key(&[b"10.0.0.1"]));
    }

    #[test]
    fn random_seeds_differ_between_hashers() {
        let a = KeyHasher::new_random();
        let b = KeyHasher::new_random();
        assert_ne!(a.key(&[b"x"]), b.key(&[b"x"]));
    }

    #[test]
    fn parts_are_framed_unambiguously() {
        let h = KeyHasher::with_secret(b"s");
        assert_ne!(h.key(&[b"ab", b"c"]), h.key(&[b"a", b"bc"]));
        assert_ne!(h.key(&[b"abc"]), h.key(&[b"abc", b""]));
        assert_ne!(h.key(&[]), h.key(&[b""]));
    }

    #[test]
    fn key_round_trips_through_bytes() {
        let k = KeyHasher::with_secret(b"s").key(&[b"caller"]);
        assert_eq!(Key::from_bytes(k.to_bytes()), Some(k));
        assert_eq!(Key::from_bytes([0; 16]), None);
    }

    #[test]
    fn debug_output_hides_the_seed() {
        assert_eq!(
            format!("{:?}", KeyHasher::with_secret(b"s")),
            "KeyHasher { .. }"
        );
    }
}
