//! The TOML as written: serde structs whose leaves keep their spans so that validation can
//! point at the offending value. Nothing here is checked beyond its TOML type.

use std::collections::BTreeMap;

use serde::Deserialize;
use toml::Spanned;

pub(crate) type S<T> = Spanned<T>;

/// A section or entry written as a TOML table (`[gateway]`, `{ min = "2s", max = "5s" }`),
/// and only as one. serde's derived structs also take an array, matching its elements to the
/// fields by position, so `respond = [201, "x", "text/plain"]` and `admin = ["127.0.0.1:9"]`
/// were read without a key named and past `deny_unknown_fields` (found by review).
#[derive(Debug, Default)]
pub(crate) struct Table<T>(pub T);

impl<T> std::ops::Deref for Table<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Table<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for Visitor<T> {
            type Value = Table<T>;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a table")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<Table<T>, A::Error> {
                T::deserialize(serde::de::value::MapAccessDeserializer::new(map)).map(Table)
            }
        }
        d.deserialize_map(Visitor(std::marker::PhantomData))
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawConfig {
    #[serde(default)]
    pub gateway: Table<RawGateway>,
    #[serde(default)]
    pub admin: Table<RawAdmin>,
    #[serde(default)]
    pub identity: Table<RawIdentity>,
    #[serde(default)]
    pub responses: Table<RawResponses>,
    #[serde(default)]
    pub upstreams: BTreeMap<S<String>, Table<RawUpstream>>,
    #[serde(default)]
    pub routes: Vec<Table<RawRoute>>,
    #[serde(default)]
    pub limits: Vec<Table<RawLimit>>,
    #[serde(default)]
    pub store: Table<RawStore>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawGateway {
    pub listen: Option<S<String>>,
    pub max_in_flight: Option<S<i64>>,
    pub max_held: Option<S<i64>>,
    pub max_connections: Option<S<i64>>,
    pub max_connections_per_ip: Option<S<i64>>,
    pub health_path: Option<S<String>>,
    pub header_timeout: Option<S<String>>,
    pub send_timeout: Option<S<String>>,
    pub max_body_size: Option<S<String>>,
    pub shutdown_grace: Option<S<String>>,
    pub drain_delay: Option<S<String>>,
    pub overload_retry_after: Option<Table<RawRange>>,
    pub merge_slashes: Option<bool>,
    pub count_unrouted: Option<bool>,
    pub min_body_rate: Option<S<String>>,
    pub min_body_rate_grace: Option<S<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawRange {
    pub min: S<String>,
    pub max: S<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawAdmin {
    pub listen: Option<S<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawIdentity {
    pub api_key: Option<S<Vec<S<String>>>>,
    pub trusted_proxies: Option<Vec<S<String>>>,
    pub client_ip_header: Option<S<String>>,
    pub ipv6_prefix: Option<S<i64>>,
    pub allow_trust_all: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawResponses {
    pub problem_base: Option<S<String>>,
    pub legacy_headers: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawUpstream {
    pub url: S<String>,
    pub connect_timeout: Option<S<String>>,
    pub timeout: Option<S<String>>,
    pub idle_connections: Option<S<i64>>,
    pub tunnel_idle_timeout: Option<S<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawRoute {
    pub name: S<String>,
    pub path: S<String>,
    pub methods: Option<S<Vec<S<String>>>>,
    pub host: Option<S<String>>,
    pub upstream: Option<S<String>>,
    pub respond: Option<Table<RawRespond>>,
    pub cost: Option<S<i64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawRespond {
    pub status: S<i64>,
    pub body: Option<S<String>>,
    pub content_type: Option<S<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawLimit {
    pub name: S<String>,
    pub by: S<OneOrMany>,
    pub algorithm: Option<S<String>>,
    pub quota: S<i64>,
    pub window: Option<S<String>>,
    pub burst: Option<S<i64>>,
    pub routes: Option<S<Vec<S<String>>>>,
    pub mode: Option<S<String>>,
    pub max_delay: Option<S<String>>,
    pub block_for: Option<S<String>>,
    pub max_keys: Option<S<i64>>,
}

/// A string, or a list of strings each with its place in the file (so that an error in one
/// element points at it). Deserialized by hand: serde's `untagged` buffers the value, which
/// loses the elements' places and says only that nothing matched.
#[derive(Debug)]
pub(crate) enum OneOrMany {
    One(String),
    Many(Vec<S<String>>),
}

impl OneOrMany {
    /// The items, each with its place in the file when it has one of its own.
    pub(crate) fn items(&self) -> Vec<(&str, Option<std::ops::Range<usize>>)> {
        match self {
            OneOrMany::One(s) => vec![(s.as_str(), None)],
            OneOrMany::Many(v) => v
                .iter()
                .map(|s| (s.get_ref().as_str(), Some(s.span())))
                .collect(),
        }
    }
}

impl<'de> Deserialize<'de> for OneOrMany {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = OneOrMany;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string or a list of strings")
            }

            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<OneOrMany, E> {
                Ok(OneOrMany::One(v.to_owned()))
            }

            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<OneOrMany, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element::<S<String>>()? {
                    items.push(item);
                }
                Ok(OneOrMany::Many(items))
            }
        }
        d.deserialize_any(Visitor)
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawStore {
    pub kind: Option<S<String>>,
    pub url: Option<S<String>>,
    pub timeout: Option<S<String>>,
    pub on_error: Option<S<String>>,
    pub instances: Option<S<i64>>,
    pub hash_secret_env: Option<S<String>>,
}
