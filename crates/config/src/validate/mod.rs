//! Raw TOML -> validated [`Config`]. Every problem is collected, not just the first.

mod limits;
mod routes;
mod sections;
mod store;

use std::num::NonZeroU32;
use std::ops::Range;
use std::path::Path;
use std::time::Duration;

use crate::duration::{parse_duration, parse_whole_seconds};
use crate::error::{ConfigError, Source};
use crate::model::Config;
use crate::raw::{RawConfig, RawLimit, Table, S};

/// The longest duration any key takes: 100 years. Far beyond any real window or timeout, and
/// well inside what the limiter counts in (u64 nanoseconds, 584 years) and tokio's timers.
const MAX_DURATION: Duration = Duration::from_secs(36_500 * 86_400);

/// Collects errors while turning raw values into typed ones.
pub(crate) struct Validator<'a> {
    src: Source<'a>,
    errors: Vec<ConfigError>,
    /// Upstreams declared but refused: routes naming them are not told they do not exist.
    refused_upstreams: Vec<String>,
    /// `--upstream NAME=URL`: checked in place of the file's URL for `NAME`.
    url_overrides: &'a [(String, String)],
}

/// The most (route, limit) pairs a configuration may make: 128 MB of the gateway's memory.
const MAX_ROUTE_LIMIT_PAIRS: usize = 4_000_000;

impl<'a> Validator<'a> {
    pub(crate) fn new(
        file: &'a Path,
        text: &'a str,
        url_overrides: &'a [(String, String)],
    ) -> Self {
        Self {
            src: Source::new(file, text),
            errors: Vec::new(),
            refused_upstreams: Vec::new(),
            url_overrides,
        }
    }

    pub(crate) fn config(mut self, raw: &RawConfig) -> Result<Config, Vec<ConfigError>> {
        let gateway = self.gateway(&raw.gateway);
        let gateway_span = raw.gateway.listen.as_ref().map(S::span);
        let admin = self.admin(&raw.admin, &gateway, gateway_span);
        let identity = self.identity(&raw.identity);
        let responses = self.responses(&raw.responses);
        let upstreams = self.upstreams(&raw.upstreams);
        for (name, url) in self.url_overrides {
            if !raw.upstreams.keys().any(|n| n.get_ref() == name) {
                let message = format!(
                    "\"{name}\" is not an upstream in {}",
                    self.src.file().display()
                );
                let url = crate::host::redact_url(url);
                self.err(None, &format!("--upstream {name}={url}"), message);
            }
        }
        let routes = self.routes(&raw.routes, &upstreams, gateway.merge_slashes);
        let limits = self.limits(&raw.limits, &raw.routes, &routes);
        if limits.len() == raw.limits.len() {
            self.route_limit_pairs(&limits, &raw.limits, routes.len());
        }
        let store = self.store(&raw.store);
        if matches!(store, crate::model::Store::Redis(_)) && limits.len() == raw.limits.len() {
            self.redis_exact(&limits, &raw.limits);
        }
        if self.errors.is_empty() {
            Ok(Config {
                gateway,
                admin,
                identity,
                responses,
                upstreams,
                routes,
                limits,
                store,
            })
        } else {
            // In the file's order, as an editor walks them; those of no place (overrides) last.
            self.errors.sort_by_key(|e| {
                e.location
                    .as_ref()
                    .map_or((1, 0, 0), |l| (0, l.line, l.column))
            });
            Err(self.errors)
        }
    }

    /// The gateway keeps, for each route (and for requests no route matches), the limits
    /// that apply to it: a pair costs about 32 bytes at start. 5,000 routes under 5,000
    /// limits took 860 MB, 10,000 under 10,000 aborted for memory (review): refused here,
    /// with the place that passed the bound, instead.
    fn route_limit_pairs(
        &mut self,
        limits: &[crate::model::Limit],
        raw: &[Table<RawLimit>],
        routes: usize,
    ) {
        let mut pairs: usize = 0;
        for (i, (l, r)) in limits.iter().zip(raw).enumerate() {
            pairs += l.routes.as_ref().map_or(routes + 1, Vec::len);
            if pairs > MAX_ROUTE_LIMIT_PAIRS {
                let msg = format!("routes x the limits on them pass {MAX_ROUTE_LIMIT_PAIRS} pairs here ({routes} routes; each pair costs about 32 bytes of memory): give limits a routes list, or merge routes that share their limits");
                self.err(Some(r.name.span()), &format!("limits[{i}]"), msg);
                return;
            }
        }
    }

    pub(crate) fn err(
        &mut self,
        span: Option<Range<usize>>,
        key: &str,
        message: impl Into<String>,
    ) {
        let e = self.src.error(span, key, message);
        self.errors.push(e);
    }

    /// A duration value, or `default` when absent. On error the default is returned too, so
    /// validation goes on and reports everything at once.
    pub(crate) fn duration(
        &mut self,
        v: &Option<S<String>>,
        key: &str,
        default: Duration,
    ) -> Duration {
        match v {
            None => default,
            Some(v) => self.required_duration(v, key).unwrap_or(default),
        }
    }

    /// A duration longer than zero and at most [`MAX_DURATION`].
    pub(crate) fn required_duration(&mut self, v: &S<String>, key: &str) -> Option<Duration> {
        self.checked_duration(v, key, parse_duration(v.get_ref()))
    }

    /// [`Self::required_duration`] in whole seconds, which `why` explains.
    pub(crate) fn required_whole_seconds(
        &mut self,
        v: &S<String>,
        key: &str,
        why: &str,
    ) -> Option<Duration> {
        self.checked_duration(v, key, parse_whole_seconds(v.get_ref(), why))
    }

    /// A duration of zero (`"0s"`, which turns something off) to [`MAX_DURATION`].
    pub(crate) fn duration_or_zero(&mut self, v: &S<String>, key: &str) -> Option<Duration> {
        match parse_duration(v.get_ref()) {
            Ok(d) if d.is_zero() => Some(d),
            parsed => self.checked_duration(v, key, parsed),
        }
    }

    fn checked_duration(
        &mut self,
        v: &S<String>,
        key: &str,
        parsed: Result<Duration, String>,
    ) -> Option<Duration> {
        match parsed {
            Ok(d) if d.is_zero() => {
                self.err(
                    Some(v.span()),
                    key,
                    format!("\"{}\" must be longer than zero", v.get_ref()),
                );
                None
            }
            Ok(d) if d > MAX_DURATION => {
                self.err(
                    Some(v.span()),
                    key,
                    format!(
                        "\"{}\" is too long: at most 36500d (100 years)",
                        v.get_ref()
                    ),
                );
                None
            }
            Ok(d) => Some(d),
            Err(msg) => {
                self.err(Some(v.span()), key, msg);
                None
            }
        }
    }

    /// An integer in `1..=u32::MAX`.
    pub(crate) fn positive_u32(&mut self, v: &S<i64>, key: &str) -> Option<NonZeroU32> {
        self.integer::<u32>(v, key, 1, u32::MAX.into())
            .and_then(NonZeroU32::new)
    }

    /// An integer in `min..=max` (a range that `T` holds).
    pub(crate) fn integer<T: TryFrom<i64>>(
        &mut self,
        v: &S<i64>,
        key: &str,
        min: i64,
        max: i64,
    ) -> Option<T> {
        let n = *v.get_ref();
        let value = (min..=max)
            .contains(&n)
            .then(|| T::try_from(n).ok())
            .flatten();
        if value.is_none() {
            let why = format!("{n} is not allowed: it must be between {min} and {max}");
            self.err(Some(v.span()), key, why);
        }
        value
    }

    /// Reports names used twice within one list.
    pub(crate) fn unique_names<'n>(
        &mut self,
        section: &str,
        names: impl Iterator<Item = &'n S<String>>,
    ) {
        let mut seen = std::collections::HashSet::new();
        for (i, name) in names.enumerate() {
            let n = name.get_ref().as_str();
            if !seen.insert(n) {
                self.err(
                    Some(name.span()),
                    &format!("{section}[{i}].name"),
                    format!("\"{n}\" is already the name of another entry in [[{section}]]"),
                );
            }
            if !usable_name(n) {
                self.err(
                    Some(name.span()),
                    &format!("{section}[{i}].name"),
                    unusable_name(n),
                );
            }
        }
    }
}

/// Whether `n` can name a route, limit or upstream: names travel in response headers
/// (RateLimit-Policy), logs, `sluice check`'s output and store keys.
pub(crate) fn usable_name(n: &str) -> bool {
    let safe = |c: char| c.is_ascii_alphanumeric() || "-_.".contains(c);
    !n.is_empty() && n.len() <= 64 && n.chars().all(safe)
}

/// Why `n` is refused as a name.
pub(crate) fn unusable_name(n: &str) -> String {
    format!("\"{n}\" is not a usable name (1 to 64 ASCII letters, digits, '-', '_' or '.')")
}
