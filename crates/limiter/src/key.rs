//! Fixed-size keys: a 128-bit keyed hash of a caller's identity parts.
//!
//! The raw identity (an address, an API key) is never stored. The hash is keyed by a secret
//! seed, so a caller cannot choose identities that collide in the table.

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
    k0: u64,
    k1: u64,
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
        KeyHasher { k0, k1 }
    }

    /// A hasher whose seed is derived from `secret`, so every instance sharing the secret (e.g.
    /// gateways sharing a store) derives the same key for the same identity.
    pub fn with_secret(secret: &[u8]) -> Self {
        let derive = KeyHasher {
            k0: 0x736c_7569_6365_2d6b,
            k1: 0x6579_2d73_6565_6431,
        };
        let [k0, k1] = derive.hash(&[b"sluice key seed v2", secret]);
        KeyHasher { k0, k1 }
    }

    /// The key of an identity made of `parts`. Each part is framed by its length, so
    /// `["ab", "c"]` and `["a", "bc"]` give different keys.
    #[inline]
    pub fn key(&self, parts: &[&[u8]]) -> Key {
        let [h1, h2] = self.hash(parts);
        // Zero marks a free slot; a 2^-128 event, mapped away rather than ignored (in the
        // second word: the first must not wait for the second, see `Table`'s shards).
        Key([h1, h2 | u64::from(h1 == 0 && h2 == 0)])
    }

    /// SipHash-1-3 with 128-bit output over the parts as whole 64-bit words: each part but the
    /// last is its length, then its bytes zero-padded to a multiple of 8; the last is its
    /// padded bytes alone, and the final block's seven free bytes say its length and how many
    /// parts there are. Uniquely decodable (the count and the last length tell where the last
    /// part starts and ends), so distinct part lists are distinct messages; and the most
    /// common identity, one part, costs no length word (one SipHash round fewer). Written out
    /// instead of `siphasher`'s byte-buffering `Hasher` because a key is hashed per limit per
    /// request and whole words need no tail handling: ~2x faster on short identities. A test
    /// checks it against `siphasher`.
    #[inline]
    fn hash(&self, parts: &[&[u8]]) -> [u64; 2] {
        let mut s = Sip::new(self.k0, self.k1);
        let Some((last, framed)) = parts.split_last() else {
            return s.finish128(0);
        };
        for part in framed {
            s.compress(part.len() as u64);
            s.compress_padded(part);
        }
        s.compress_padded(last);
        s.finish128(trailer(last.len(), parts.len()))
    }
}

/// The final block's seven free bytes: the last part's length (32 bits) and the number of
/// parts (24 bits). Identity parts are request header values and configuration lists, far
/// below either bound; beyond them the figures saturate.
#[inline]
fn trailer(last_len: usize, parts: usize) -> u64 {
    let len = u64::try_from(last_len).unwrap_or(u64::MAX).min(0xffff_ffff);
    let count = u64::try_from(parts).unwrap_or(u64::MAX).min(0xff_ffff);
    len | count << 32
}

/// SipHash-1-3-128 state over a stream of 64-bit words.
struct Sip {
    v: [u64; 4],
    /// Words compressed so far.
    words: u64,
}

impl Sip {
    #[inline]
    fn new(k0: u64, k1: u64) -> Self {
        Sip {
            v: [
                k0 ^ 0x736f_6d65_7073_6575,
                k1 ^ 0x646f_7261_6e64_6f6d ^ 0xee,
                k0 ^ 0x6c79_6765_6e65_7261,
                k1 ^ 0x7465_6462_7974_6573,
            ],
            words: 0,
        }
    }

    #[inline(always)]
    fn round(&mut self) {
        let [v0, v1, v2, v3] = &mut self.v;
        *v0 = v0.wrapping_add(*v1);
        *v1 = v1.rotate_left(13) ^ *v0;
        *v0 = v0.rotate_left(32);
        *v2 = v2.wrapping_add(*v3);
        *v3 = v3.rotate_left(16) ^ *v2;
        *v0 = v0.wrapping_add(*v3);
        *v3 = v3.rotate_left(21) ^ *v0;
        *v2 = v2.wrapping_add(*v1);
        *v1 = v1.rotate_left(17) ^ *v2;
        *v2 = v2.rotate_left(32);
    }

    #[inline(always)]
    fn compress(&mut self, m: u64) {
        self.words += 1;
        self.v[3] ^= m;
        self.round();
        self.v[0] ^= m;
    }

    /// `bytes`, zero-padded to whole words.
    #[inline(always)]
    fn compress_padded(&mut self, bytes: &[u8]) {
        let mut words = bytes.chunks_exact(8);
        for w in &mut words {
            self.compress(u64::from_le_bytes(w.try_into().expect("8 bytes")));
        }
        let rest = words.remainder();
        if !rest.is_empty() {
            let mut word = [0u8; 8];
            word[..rest.len()].copy_from_slice(rest);
            self.compress(u64::from_le_bytes(word));
        }
    }

    /// Ends the message with seven more bytes, `trailer`'s low 56 bits: the last block is
    /// they and the message's length in bytes (mod 256).
    #[inline]
    fn finish128(mut self, trailer: u64) -> [u64; 2] {
        let b =
            (self.words.wrapping_mul(8).wrapping_add(7) << 56) | (trailer & 0x00ff_ffff_ffff_ffff);
        self.v[3] ^= b;
        self.round();
        self.v[0] ^= b;
        self.v[2] ^= 0xee;
        for _ in 0..3 {
            self.round();
        }
        let h1 = self.v[0] ^ self.v[1] ^ self.v[2] ^ self.v[3];
        self.v[1] ^= 0xdd;
        for _ in 0..3 {
            self.round();
        }
        let h2 = self.v[0] ^ self.v[1] ^ self.v[2] ^ self.v[3];
        [h1, h2]
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
        assert_ne!(h.key(&[b""]), h.key(&[b"", b""]));
        assert_ne!(h.key(&[b"a\0"]), h.key(&[b"a"]));
        assert_ne!(h.key(&[b"abcdefgh", b""]), h.key(&[b"", b"abcdefgh"]));
        // A framed part's length word cannot pose as a last part's bytes.
        assert_ne!(
            h.key(&[b"x", b"12345678"]),
            h.key(&[&[1, 0, 0, 0, 0, 0, 0, 0, b'x', 0, 0, 0, 0, 0, 0, 0, b'1']])
        );
    }

    #[test]
    fn hash_is_siphash13_128_of_the_framed_padded_parts_and_their_trailer() {
        use siphasher::sip128::{Hasher128 as _, SipHasher13};
        use std::hash::Hasher as _;
        let h = KeyHasher {
            k0: 0x0706_0504_0302_0100,
            k1: 0x0f0e_0d0c_0b0a_0908,
        };
        let long: Vec<u8> = (0..=255).collect();
        let parts: [&[&[u8]]; 6] = [
            &[],
            &[b""],
            &[b"1234567"],
            &[b"12345678", b"9"],
            &[b"abc", &long, b"", b"0123456789abcdef"],
            &[&long[..13], &long[..3], &long[..8]],
        ];
        for p in parts {
            let mut reference = SipHasher13::new_with_keys(h.k0, h.k1);
            let pad = |part: &[u8]| (8 - part.len() % 8) % 8;
            if let Some((last, framed)) = p.split_last() {
                for part in framed {
                    reference.write(&(part.len() as u64).to_le_bytes());
                    reference.write(part);
                    reference.write(&[0; 7][..pad(part)]);
                }
                reference.write(last);
                reference.write(&[0; 7][..pad(last)]);
            }
            let (len, count) = (p.last().map_or(0, |l| l.len()), p.len());
            reference.write(&(len as u32).to_le_bytes());
            reference.write(&(count as u32).to_le_bytes()[..3]);
            let r = reference.finish128();
            assert_eq!(h.hash(p), [r.h1, r.h2], "parts {p:?}");
        }
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
