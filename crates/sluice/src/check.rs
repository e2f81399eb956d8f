//! `sluice check`: what the configuration means, in words; and `--upstream` overrides.

use std::fmt::Write;
use std::path::Path;

use sluice_config::{
    format_duration, format_size, Algorithm, Config, ConfigError, ConfigErrors, KeyPart, Mode,
    RouteAction, Store,
};
use sluice_config::{printable, redact_url, OnError};

/// A summary of the routes and limits `config` defines.
pub(crate) fn describe(file: &Path, config: &Config) -> String {
    let mut out = String::new();
    let g = &config.gateway;
    let _ = writeln!(out, "{}: ok", file.display());
    let body = g
        .max_body_size
        .map_or_else(|| "no limit".to_owned(), format_size);
    let mut connections = g.max_connections.map_or_else(
        || "the smallest of half the open-files limit, what it leaves beside an upstream connection per request in flight, and one per 256 KiB of memory".to_owned(),
        |n| n.to_string(),
    );
    if let Some(n) = g.max_connections_per_ip {
        connections.push_str(&format!(" ({n} per client address)"));
    }
    let _ = writeln!(
        out,
        "listen {} (admin {}), max_in_flight {}, max_held {}, max_connections {connections}, request bodies {body}",
        g.listen, config.admin.listen, g.max_in_flight, g.max_held
    );
    if let Some(health) = &g.health_path {
        let _ = writeln!(
            out,
            "health_path {health} (answered by sluice, outside every limit)"
        );
    }
    let _ = match &config.store {
        Store::Memory => writeln!(out, "store: memory (this instance counts alone)"),
        Store::Redis(r) => writeln!(
            out,
            "store: redis {} (timeout {}, on_error {}, instances {}, secret from ${})",
            printable(redact_url(&r.url)),
            format_duration(r.timeout),
            match r.on_error {
                OnError::Allow => "allow",
                OnError::Deny => "deny",
                OnError::Local => "local",
            },
            r.instances,
            r.hash_secret_env
        ),
    };
    // Read from the environment when the gateway starts, so not part of the file: said here,
    // or a file `check` passed would not `run` where it was checked.
    if let Store::Redis(r) = &config.store {
        if std::env::var_os(&r.hash_secret_env).is_none_or(|v| v.is_empty()) {
            let _ = writeln!(
                out,
                "  warning: ${} is empty or not set here: `sluice run` refuses to start without it",
                r.hash_secret_env
            );
        }
    }
    let _ = writeln!(out, "routes:");
    if config.routes.is_empty() {
        let _ = writeln!(
            out,
            "  none: every request will be answered 404 (a route is a [[routes]] table)"
        );
    }
    for r in &config.routes {
        // `GET` matches `HEAD` too (docs/configuration.md, `methods`): said where it applies.
        let methods = r.methods.as_ref().map_or("*".to_owned(), |m| {
            let mut shown: Vec<&str> = m.iter().map(|m| m.as_str()).collect();
            if shown.contains(&"GET") && !shown.contains(&"HEAD") {
                shown.push("(HEAD)");
            }
            shown.join(",")
        });
        let target = match &r.action {
            RouteAction::Upstream(i) => {
                let up = &config.upstreams[*i];
                let authority = up.url.authority().map_or("", |a| a.as_str());
                format!("-> {} (http://{authority})", up.name)
            }
            RouteAction::Respond(resp) => format!("-> respond {}", resp.status.as_u16()),
        };
        let host = r
            .host
            .as_deref()
            .map(|h| format!(" host {h}"))
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "  {:<16} {methods} {}{host} cost {} {target}",
            r.name, r.path, r.cost
        );
    }
    let _ = writeln!(out, "limits:");
    for l in &config.limits {
        let by: Vec<String> = l.by.iter().map(key_part).collect();
        let rate = match (l.algorithm, l.window) {
            (Algorithm::Concurrency, _) => format!("{} in flight", l.quota),
            (Algorithm::TokenBucket { burst }, Some(w)) => {
                format!("{} per {} burst {burst}", l.quota, format_duration(w))
            }
            (_, Some(w)) => format!("{} per {}", l.quota, format_duration(w)),
            (_, None) => l.quota.to_string(),
        };
        let routes = match &l.routes {
            None if config.gateway.count_unrouted && l.counts_unrouted() => {
                "all routes and requests no route matches".to_owned()
            }
            None => "all routes".to_owned(),
            Some(rs) => rs
                .iter()
                .map(|i| config.routes[*i].name.as_str())
                .collect::<Vec<_>>()
                .join(","),
        };
        let mode = match l.mode {
            Mode::Enforce => "enforce".to_owned(),
            Mode::DryRun => "dry_run".to_owned(),
            Mode::Delay { max_delay } => format!("delay up to {}", format_duration(max_delay)),
        };
        let block = l
            .block_for
            .map(|b| format!(", block {}", format_duration(b)))
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "  {:<16} {} by {} {rate} on {routes}, {mode}{block}",
            l.name,
            l.algorithm.name(),
            by.join("+")
        );
    }
    for (route, limits) in several_delay_limits(config) {
        let _ = writeln!(
            out,
            "  warning: route {route} has several delay limits ({}): a request waits for the longest hold, and the others hold at its arrival, not at the upstream (give a route one delay limit; docs/configuration.md, `mode`)",
            limits.join(", ")
        );
    }
    for warning in dry_run_costs_too_large(config) {
        let _ = writeln!(out, "  warning: {warning}");
    }
    out
}

/// A warning for each route whose cost is larger than what a dry-run limit on it can ever
/// hold: the limit refuses nothing, but logs every request of the route as one it would
/// refuse forever (an enforced one is an error of the configuration).
pub(crate) fn dry_run_costs_too_large(config: &Config) -> Vec<String> {
    let mut out = Vec::new();
    for (r, route) in config.routes.iter().enumerate() {
        for limit in config.limits.iter().filter(|l| l.mode == Mode::DryRun) {
            match limit.capacity() {
                Some((capacity, what)) if limit.applies_to(r) && route.cost > capacity => {
                    out.push(format!(
                        "route {}'s cost ({}) is larger than the {what} of dry-run limit {} ({capacity}): every request of the route is logged as one it would refuse forever, and enforcing the limit would refuse them all",
                        route.name, route.cost, limit.name
                    ));
                }
                _ => {}
            }
        }
    }
    out
}

/// Routes with more than one enforced `delay` limit, and those limits' names: each charges a
/// request as of its own hold, and the request waits for the longest (docs/configuration.md).
pub(crate) fn several_delay_limits(config: &Config) -> Vec<(&str, Vec<&str>)> {
    (0..config.routes.len())
        .filter_map(|r| {
            let delay: Vec<&str> = config
                .limits
                .iter()
                .filter(|l| matches!(l.mode, Mode::Delay { .. }) && l.applies_to(r))
                .map(|l| l.name.as_str())
                .collect();
            (delay.len() > 1).then(|| (config.routes[r].name.as_str(), delay))
        })
        .collect()
}

fn key_part(p: &KeyPart) -> String {
    match p {
        KeyPart::Ip => "ip".into(),
        KeyPart::ApiKey => "api_key".into(),
        KeyPart::Route => "route".into(),
        KeyPart::Global => "global".into(),
        KeyPart::Header(h) => format!("header:{h}"),
    }
}

/// Loads `file` with `--upstream NAME=URL` overrides: each override's URL is checked as the
/// file's are, in place of the file's URL for that upstream (so a placeholder there does not
/// stop it).
pub(crate) fn load(file: &Path, overrides: &[String]) -> Result<Config, ConfigErrors> {
    let mut urls: Vec<(String, String)> = Vec::new();
    let mut errors = Vec::new();
    for o in overrides {
        // Printed as the file's errors are: one line, control characters escaped.
        let err = |message: String| ConfigError {
            location: None,
            key: printable(format!("--upstream {o}")),
            message: printable(message),
        };
        let Some((name, url)) = o.split_once('=') else {
            errors.push(err("write NAME=URL, e.g. app=http://127.0.0.1:8000".into()));
            continue;
        };
        if urls.iter().any(|(n, _)| n == name) {
            errors.push(err(format!(
                "\"{name}\" is given twice: which one was meant?"
            )));
            continue;
        }
        urls.push((name.to_owned(), url.to_owned()));
    }
    if !errors.is_empty() {
        return Err(ConfigErrors(errors));
    }
    sluice_config::load_with(file, &urls)
}
