//! IP networks in CIDR notation, for `trusted_proxies`.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

/// An IP network: an address and a prefix length. Host bits are zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// The network address (host bits cleared).
    pub fn addr(&self) -> IpAddr {
        self.addr
    }

    /// The prefix length in bits.
    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    /// Whether this network holds every address of its family (`0.0.0.0/0`, `::/0`).
    pub fn is_everything(&self) -> bool {
        self.prefix == 0
    }

    /// Whether `ip` lies in this network. An IPv4-mapped IPv6 address (`::ffff:a.b.c.d`)
    /// is compared as the IPv4 address it carries.
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip.to_canonical()) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                mask_v4(u32::from(ip), self.prefix) == u32::from(net)
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                mask_v6(u128::from(ip), self.prefix) == u128::from(net)
            }
            _ => false,
        }
    }
}

/// Clears all but the first `prefix` bits of an IPv4 address.
pub fn mask_v4(bits: u32, prefix: u8) -> u32 {
    match prefix {
        0 => 0,
        p if p >= 32 => bits,
        p => bits & (u32::MAX << (32 - p)),
    }
}

/// Clears all but the first `prefix` bits of an IPv6 address.
pub fn mask_v6(bits: u128, prefix: u8) -> u128 {
    match prefix {
        0 => 0,
        p if p >= 128 => bits,
        p => bits & (u128::MAX << (128 - p)),
    }
}

impl FromStr for Cidr {
    type Err = String;

    /// Accepts `10.0.0.0/8`, `::1/128`, or a bare address (a single host).
    fn from_str(s: &str) -> Result<Self, String> {
        let bad =
            || format!("\"{s}\" is not an IP network (write e.g. \"10.0.0.0/8\" or \"::1/128\")");
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let mut addr: IpAddr = addr.parse().map_err(|_| bad())?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            Some(p) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => {
                p.parse::<u8>().ok().filter(|p| *p <= max).ok_or_else(bad)?
            }
            Some(_) => return Err(bad()),
            None => max,
        };
        // Peers are compared as IPv4 when they are IPv4-mapped (`::ffff:a.b.c.d`), so such a
        // network is the IPv4 one it maps: written as IPv6 it would never match.
        let mut prefix = prefix;
        if let IpAddr::V6(a) = addr {
            if let (Some(v4), 96..) = (a.to_ipv4_mapped(), prefix) {
                addr = IpAddr::V4(v4);
                prefix -= 96;
            }
        }
        let net = match addr {
            IpAddr::V4(a) => IpAddr::V4(mask_v4(u32::from(a), prefix).into()),
            IpAddr::V6(a) => IpAddr::V6(mask_v6(u128::from(a), prefix).into()),
        };
        if net != addr {
            return Err(format!(
                "\"{s}\" has host bits set (the network is \"{net}/{prefix}\")"
            ));
        }
        Ok(Cidr { addr, prefix })
    }
}

/// Whether `nets` together hold every address of IPv4, or every address of IPv6: trusting
/// them is trusting everyone of that family, however it is split (`0.0.0.0/1` and
/// `128.0.0.0/1`).
pub(crate) fn cover_a_family(nets: &[Cidr]) -> bool {
    let covered = |v6: bool| {
        let bits: u32 = if v6 { 128 } else { 32 };
        let mut ranges: Vec<(u128, u128)> = nets
            .iter()
            .filter(|n| n.addr.is_ipv6() == v6)
            .map(|n| {
                let start = match n.addr {
                    IpAddr::V4(a) => u128::from(u32::from(a)),
                    IpAddr::V6(a) => u128::from(a),
                };
                let host_bits = bits - u32::from(n.prefix);
                let span = if host_bits == 128 {
                    u128::MAX
                } else {
                    (1u128 << host_bits) - 1
                };
                (start, start + span)
            })
            .collect();
        ranges.sort_unstable();
        let last = if v6 { u128::MAX } else { u128::from(u32::MAX) };
        // The first address not yet covered, walking the sorted ranges.
        let mut next = 0u128;
        for (start, end) in ranges {
            if start > next {
                return false;
            }
            if end >= last {
                return true;
            }
            next = next.max(end + 1);
        }
        false
    };
    covered(false) || covered(true)
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn contains_checks_the_prefix() {
        let net: Cidr = "10.0.0.0/8".parse().unwrap();
        assert!(net.contains(ip("10.1.2.3")));
        assert!(!net.contains(ip("11.0.0.1")));
        assert!(
            net.contains(ip("::ffff:10.9.9.9")),
            "IPv4-mapped IPv6 is IPv4"
        );
        let v6: Cidr = "2001:db8::/32".parse().unwrap();
        assert!(v6.contains(ip("2001:db8:1::1")));
        assert!(!v6.contains(ip("10.0.0.1")));
    }

    #[test]
    fn bare_address_is_one_host() {
        let net: Cidr = "127.0.0.1".parse().unwrap();
        assert_eq!(net.prefix(), 32);
        assert!(!net.contains(ip("127.0.0.2")));
    }

    #[test]
    fn malformed_networks_are_refused() {
        for bad in [
            "10.0.0.0/33",
            "10.0.0/8",
            "x",
            "10.0.0.1/8",
            "::/129",
            "1.2.3.4/",
            "1.2.3.4/+8",
        ] {
            assert!(bad.parse::<Cidr>().is_err(), "{bad}");
        }
        assert!("0.0.0.0/0".parse::<Cidr>().unwrap().is_everything());
    }

    #[test]
    fn ipv4_mapped_networks_are_the_ipv4_ones() {
        let net: Cidr = "::ffff:127.0.0.1".parse().unwrap();
        assert_eq!(net.to_string(), "127.0.0.1/32");
        let net: Cidr = "::ffff:10.0.0.0/104".parse().unwrap();
        assert_eq!(net.to_string(), "10.0.0.0/8");
        assert!(net.contains(ip("10.1.1.1")));
    }

    #[test]
    fn networks_that_together_hold_a_family_are_found() {
        let nets =
            |list: &[&str]| -> Vec<Cidr> { list.iter().map(|s| s.parse().unwrap()).collect() };
        assert!(cover_a_family(&nets(&["0.0.0.0/1", "128.0.0.0/1"])));
        assert!(cover_a_family(&nets(&[
            "128.0.0.0/1",
            "10.0.0.0/8",
            "0.0.0.0/1"
        ])));
        assert!(cover_a_family(&nets(&["::/1", "8000::/1"])));
        assert!(cover_a_family(&nets(&["0.0.0.0/0"])));
        assert!(cover_a_family(&nets(&["::/0"])));
        assert!(!cover_a_family(&nets(&["0.0.0.0/1", "128.0.0.0/2"])));
        assert!(!cover_a_family(&nets(&["0.0.0.0/1", "::/1", "8000::/2"])));
        assert!(!cover_a_family(&nets(&["10.0.0.0/8", "127.0.0.1"])));
        assert!(!cover_a_family(&[]));
    }
}
