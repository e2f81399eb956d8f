//! Fixed-size keys: a 128-bit keyed hash of a caller's identity parts.
//!
//! The raw identity (an address, an API key) is never stored. The hash is keyed by a secret,
//! so a caller cannot choose identities that collide in the table.

use aes::cipher::{consts::U16, BlockBackend, BlockClosure, BlockEncrypt, BlockSizeUser, KeyInit};
use aes::Aes128Enc;

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

/// Turns identity parts into [`Key`]s with AES-128-CMAC (NIST SP 800-38B, RFC 4493) under a
/// secret key: a standard PRF, so a caller who does not know the key can neither predict a key
/// nor aim two identities at one.
///
/// One identity part (an address, an API key: the common case) is MACed as its bytes alone,
/// under one key; a list of parts is framed (its count, then each part but the last behind its
/// length, then the last) and MACed under another. With two independent keys a single part and
/// a framed list share a key only by chance, about 2^-128 for a pair, as any two messages do
/// under one key. A 16-byte address is one AES block.
///
/// On x86_64 the build assumes AES-NI (`.cargo/config.toml`; `sluice` checks for it at start),
/// so the rounds are inlined into the caller. Elsewhere the `aes` crate detects ARMv8's AES
/// instructions at run time, or falls back to its constant-time software AES: every instance
/// sharing a secret derives the same key on any CPU.
#[derive(Clone)]
pub struct KeyHasher {
    one: Cmac,
    framed: Cmac,
}

impl std::fmt::Debug for KeyHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The keys are secret: never print them.
        f.write_str("KeyHasher { .. }")
    }
}

impl KeyHasher {
    /// A hasher with keys drawn from the operating system's generator, fresh per process.
    pub fn new_random() -> Self {
        KeyHasher {
            one: Cmac::new(rand::random()),
            framed: Cmac::new(rand::random()),
        }
    }

    /// A hasher whose keys are derived from `secret`, so every instance sharing the secret (e.g.
    /// gateways sharing a store) derives the same key for the same identity.
    ///
    /// The derivation is NIST SP 800-56C's two steps with AES-CMAC: extract a key from the
    /// secret under a fixed salt, then expand it in SP 800-108's counter mode into the 256 bits
    /// of the two keys.
    pub fn with_secret(secret: &[u8]) -> Self {
        let extracted = Cmac::new(*b"sluice key v3 sa").mac(secret);
        let expand = Cmac::new(extracted);
        let block = |i: u32| {
            // [i]_32 || label || 0x00 || [L]_32, as SP 800-108 lays it out.
            let input = [
                &i.to_be_bytes()[..],
                b"sluice identity keys",
                &[0],
                &256u32.to_be_bytes(),
            ]
            .concat();
            expand.mac(&input)
        };
        KeyHasher {
            one: Cmac::new(block(1)),
            framed: Cmac::new(block(2)),
        }
    }

    /// The key of an identity made of `parts`. A list of parts is framed by their count and
    /// lengths, so `["ab", "c"]`, `["a", "bc"]` and `["abc"]` give different keys.
    #[inline]
    pub fn key(&self, parts: &[&[u8]]) -> Key {
        let tag = match parts {
            [one] => self.one.mac(one),
            _ => self.framed.mac_framed(parts),
        };
        let h1 = u64::from_le_bytes(first_half(&tag));
        let h2 = u64::from_le_bytes(first_half(&tag[8..]));
        // Zero marks a free slot; a 2^-128 event, mapped away rather than ignored.
        Key([h1, h2 | u64::from(h1 == 0 && h2 == 0)])
    }
}

/// The first 8 of `bytes` (at least 8).
#[inline(always)]
fn first_half(bytes: &[u8]) -> [u8; 8] {
    let mut half = [0; 8];
    half.copy_from_slice(&bytes[..8]);
    half
}

/// AES-128-CMAC under one key: the cipher and the two subkeys for the last block.
#[derive(Clone)]
struct Cmac {
    cipher: Aes128Enc,
    /// The subkey for a last block that is whole (K1 in RFC 4493)...
    whole: u128,
    /// ...and for one that is padded (K2).
    padded: u128,
}

impl Cmac {
    fn new(key: [u8; 16]) -> Self {
        let cipher = Aes128Enc::new(&key.into());
        let mut l = aes::Block::default();
        cipher.encrypt_block(&mut l);
        // Subkeys are doublings in GF(2^128), the block read as a big-endian number.
        let double = |x: u128| (x << 1) ^ (0x87 * (x >> 127));
        let k1 = double(u128::from_be_bytes(l.into()));
        let k2 = double(k1);
        Cmac {
            cipher,
            whole: u128::from_le_bytes(k1.to_be_bytes()),
            padded: u128::from_le_bytes(k2.to_be_bytes()),
        }
    }

    /// The tag of `message`.
    #[inline]
    fn mac(&self, message: &[u8]) -> [u8; 16] {
        self.tag(Bytes(message))
    }

    /// The tag of `parts` framed: their count, each part but the last behind its length
    /// (both 64-bit little-endian), then the last. Uniquely decodable: the count says how many
    /// lengths to read, and the last part runs to the end.
    #[inline]
    fn mac_framed(&self, parts: &[&[u8]]) -> [u8; 16] {
        self.tag(Framed(parts))
    }

    #[inline(always)]
    fn tag<'c, M>(&'c self, message: M) -> [u8; 16]
    where
        for<'t> Chain<'c, 't, M>: BlockClosure<BlockSize = U16>,
    {
        let mut tag = 0;
        self.cipher.encrypt_with_backend(Chain {
            cmac: self,
            message,
            tag: &mut tag,
        });
        tag.to_le_bytes()
    }
}

/// CMAC's CBC chain over a message `M`, run inside the cipher's backend: with AES-NI the whole
/// chain is compiled into the `aes` crate's `#[target_feature(enable = "aes")]` function, so
/// its rounds are inlined and the run-time check is made once per key, not per block.
///
/// Blocks are `u128`s read little-endian (byte `i` in bits `8i..8i+8`) and assembled in
/// registers: copying pieces into a byte buffer made the block's 16-byte load wait on the
/// copy's narrower stores (perf: a third of a hot-key hash).
struct Chain<'c, 't, M> {
    cmac: &'c Cmac,
    message: M,
    tag: &'t mut u128,
}

/// One part's bytes, MACed as they are.
struct Bytes<'a>(&'a [u8]);

/// Parts, MACed framed.
struct Framed<'a>(&'a [&'a [u8]]);

impl<M> BlockSizeUser for Chain<'_, '_, M> {
    type BlockSize = U16;
}

impl BlockClosure for Chain<'_, '_, Bytes<'_>> {
    #[inline(always)]
    fn call<B: BlockBackend<BlockSize = U16>>(self, backend: &mut B) {
        let mut state = 0;
        let mut rest = self.message.0;
        while rest.len() > 16 {
            let (block, more) = rest.split_at(16);
            state = encrypt(backend, state ^ up_to_16(block));
            rest = more;
        }
        *self.tag = encrypt(backend, state ^ self.cmac.last(rest));
    }
}

impl BlockClosure for Chain<'_, '_, Framed<'_>> {
    #[inline(always)]
    fn call<B: BlockBackend<BlockSize = U16>>(self, backend: &mut B) {
        let mut chain = Cbc {
            backend,
            state: 0,
            pending: [0; 16],
            filled: 0,
        };
        let parts = self.message.0;
        chain.write(&(parts.len() as u64).to_le_bytes());
        if let Some((last, framed)) = parts.split_last() {
            for part in framed {
                chain.write(&(part.len() as u64).to_le_bytes());
                chain.write(part);
            }
            chain.write(last);
        }
        let Cbc {
            backend,
            state,
            pending,
            filled,
        } = chain;
        *self.tag = encrypt(backend, state ^ self.cmac.last(&pending[..filled]));
    }
}

impl Cmac {
    /// The last block of a message (1 to 16 bytes, or none if the message is empty), padded
    /// if short and masked with its subkey.
    #[inline(always)]
    fn last(&self, rest: &[u8]) -> u128 {
        let n = rest.len();
        if n == 16 {
            up_to_16(rest) ^ self.whole
        } else {
            // The padding's 1 bit, in the byte after the message.
            let pad = if n < 8 {
                u128::from(0x80u64 << (8 * n))
            } else {
                u128::from(0x80u64 << (8 * (n - 8))) << 64
            };
            (up_to_16(rest) | pad) ^ self.padded
        }
    }
}

#[inline(always)]
fn encrypt<B: BlockBackend<BlockSize = U16>>(backend: &mut B, block: u128) -> u128 {
    let mut b = aes::Block::from(block.to_le_bytes());
    backend.proc_block((&mut b).into());
    u128::from_le_bytes(b.into())
}

/// A CBC-MAC over bytes written in pieces, holding back the last block (whole or not) for
/// CMAC's subkey. Framed identities are the less common kind and short, so a byte buffer.
struct Cbc<'b, B> {
    backend: &'b mut B,
    state: u128,
    pending: [u8; 16],
    filled: usize,
}

impl<B: BlockBackend<BlockSize = U16>> Cbc<'_, B> {
    #[inline(always)]
    fn write(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.filled == 16 {
                // More follows, so the full block is not the last.
                self.state = encrypt(self.backend, self.state ^ u128::from_le_bytes(self.pending));
                (self.pending, self.filled) = ([0; 16], 0);
            }
            let (now, rest) = bytes.split_at(bytes.len().min(16 - self.filled));
            self.pending[self.filled..self.filled + now.len()].copy_from_slice(now);
            self.filled += now.len();
            bytes = rest;
        }
    }
}

/// Up to 16 bytes as a little-endian number, zero-extended, read as two overlapping words
/// (or halves, or bytes) instead of copied: where they overlap they hold the same bytes.
#[inline(always)]
fn up_to_16(bytes: &[u8]) -> u128 {
    let n = bytes.len();
    debug_assert!(n <= 16);
    let word = |at: usize| u64::from_le_bytes(first_half(&bytes[at..]));
    let half = |at: usize| {
        u64::from(u32::from_le_bytes([
            bytes[at],
            bytes[at + 1],
            bytes[at + 2],
            bytes[at + 3],
        ]))
    };
    let (lo, hi) = match n {
        9..=16 => (word(0), word(n - 8) >> (8 * (16 - n))),
        8 => (word(0), 0),
        4..=7 => (half(0) | half(n - 4) << (8 * (n - 4)), 0),
        0..=3 => {
            let lo = bytes
                .iter()
                .enumerate()
                .fold(0, |v, (i, &b)| v | u64::from(b) << (8 * i));
            (lo, 0)
        }
        _ => unreachable!("a block is at most 16 bytes"),
    };
    u128::from(hi) << 64 | u128::from(lo)
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
        // Lists against lists, under the same key: what the framing keeps apart. Without the
        // lengths the first two pairs would be the same bytes; without the count, the third.
        assert_ne!(h.key(&[b"ab", b"c"]), h.key(&[b"a", b"bc"]));
        assert_ne!(h.key(&[b"abcdefgh", b""]), h.key(&[b"", b"abcdefgh"]));
        assert_ne!(h.key(&[b"", b"", b""]), h.key(&[b"", &[0; 8]]));
        assert_ne!(h.key(&[]), h.key(&[b"", b""]));
        // One part against a list: under another key, whatever the bytes.
        assert_ne!(h.key(&[b"abc"]), h.key(&[b"abc", b""]));
        assert_ne!(h.key(&[]), h.key(&[b""]));
        assert_ne!(h.key(&[b""]), h.key(&[b"", b""]));
        assert_ne!(h.key(&[b"a\0"]), h.key(&[b"a"]));
    }

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
            .collect()
    }

    #[test]
    fn cmac_matches_rfc_4493s_examples() {
        let key: [u8; 16] = hex("2b7e151628aed2a6abf7158809cf4f3c").try_into().unwrap();
        let cmac = Cmac::new(key);
        assert_eq!(
            cmac.whole.to_le_bytes().to_vec(),
            hex("fbeed618357133667c85e08f7236a8de")
        );
        assert_eq!(
            cmac.padded.to_le_bytes().to_vec(),
            hex("f7ddac306ae266ccf90bc11ee46d513b")
        );
        let message = hex(concat!(
            "6bc1bee22e409f96e93d7e117393172a",
            "ae2d8a571e03ac9c9eb76fac45af8e51",
            "30c81c46a35ce411e5fbc1191a0a52ef",
            "f69f2445df4f9b17ad2b417be66c3710",
        ));
        let examples = [
            (0, "bb1d6929e95937287fa37d129b756746"),
            (16, "070a16b46b4d4144f79bdd9dd04a287c"),
            (40, "dfa66747de9ae63030ca32611497c827"),
            (64, "51f0bebf7e3b9d92fc49741779363cfe"),
        ];
        for (len, tag) in examples {
            assert_eq!(cmac.mac(&message[..len]).to_vec(), hex(tag), "{len} bytes");
        }
    }

    #[test]
    fn every_length_reads_each_byte_in_its_place() {
        // Lengths 0 to 40 cross every case of the word reads and the block boundaries: each
        // byte changed alone changes the tag, and equals a byte-at-a-time reading's tag.
        let cmac = Cmac::new(*b"0123456789abcdef");
        let message: Vec<u8> = (1..=40).collect();
        for len in 0..=40 {
            let m = &message[..len];
            let tag = cmac.mac(m);
            for i in 0..len {
                let mut changed = m.to_vec();
                changed[i] ^= 0x5a;
                assert_ne!(cmac.mac(&changed), tag, "byte {i} of {len}");
            }
            let pieces: Vec<&[u8]> = m.chunks(1).collect();
            let mut framed = Vec::new();
            framed.extend_from_slice(&(pieces.len() as u64).to_le_bytes());
            for piece in &pieces[..pieces.len().saturating_sub(1)] {
                framed.extend_from_slice(&(piece.len() as u64).to_le_bytes());
                framed.extend_from_slice(piece);
            }
            framed.extend_from_slice(pieces.last().copied().unwrap_or_default());
            assert_eq!(cmac.mac_framed(&pieces), cmac.mac(&framed), "{len} pieces");
            let word = up_to_16(&m[..len.min(16)]);
            let bytes = m[..len.min(16)]
                .iter()
                .rev()
                .fold(0u128, |v, &b| v << 8 | u128::from(b));
            assert_eq!(word, bytes, "{len} bytes read");
        }
    }

    #[test]
    fn a_key_is_the_cmac_of_one_part_or_of_the_framed_parts_under_another_key() {
        let h = KeyHasher::with_secret(b"s");
        let as_key = |tag: [u8; 16]| Key::from_bytes(tag).expect("nonzero");
        assert_eq!(h.key(&[b"10.0.0.1"]), as_key(h.one.mac(b"10.0.0.1")));
        assert_eq!(
            h.key(&[b"route", b"10.0.0.1"]),
            as_key(h.framed.mac_framed(&[b"route", b"10.0.0.1"]))
        );
        // The same message under the two keys: a one-part identity never poses as a list.
        let framed_bytes = [&2u64.to_le_bytes()[..], &0u64.to_le_bytes(), b"x"].concat();
        assert_eq!(
            h.framed.mac(&framed_bytes),
            h.framed.mac_framed(&[b"", b"x"])
        );
        assert_ne!(h.key(&[&framed_bytes]), h.key(&[b"", b"x"]));
    }

    #[test]
    fn keys_from_a_secret_are_the_same_on_every_build() {
        // Instances sharing a secret name callers alike in Redis whatever their CPU (AES-NI,
        // ARMv8 or the software AES: `scripts/test` runs this with the software one too), and
        // a change here renames every caller's key there. The values were computed apart,
        // with OpenSSL's CMAC through Python's `cryptography`:
        //   extract = CMAC(b"sluice key v3 sa", secret)
        //   key i = CMAC(extract, [i]_32 || b"sluice identity keys" || 0 || [256]_32), i = 1, 2
        //   one part: CMAC(key 1, part); a list: CMAC(key 2, count || (len || part)* || last),
        //   count and lengths u64 little-endian
        //   lengths: CMAC(key 1, CMAC(key 1, m[..0]) || ... || CMAC(key 1, m[..48])),
        //   m = bytes 1 to 48: every way a last block can be whole, padded, or empty
        let h = KeyHasher::with_secret(b"s");
        let hex = |bytes: &[u8]| bytes.iter().map(|b| format!("{b:02x}")).collect::<String>();
        assert_eq!(
            hex(&h.key(&[b"10.0.0.1"]).to_bytes()),
            "a0e26df01f332a20c3ebcf173d2d93e4"
        );
        assert_eq!(
            hex(&h.key(&[b"route", b"key-1"]).to_bytes()),
            "a12472cf6b9e5d7b4f2cf5b2395006bf"
        );
        let m: Vec<u8> = (1..=48).collect();
        let tags: Vec<u8> = (0..=48).flat_map(|n| h.one.mac(&m[..n])).collect();
        assert_eq!(hex(&h.one.mac(&tags)), "404ff687409ab39958998917f3af6ab8");
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
