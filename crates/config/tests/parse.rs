//! The configuration parser against the shipped file and against bad files, with the exact
//! error text a user sees.

use std::path::Path;
use std::time::Duration;

use sluice_config::{parse, Algorithm, KeyPart, Mode, RouteAction};

const SHIPPED: &str = include_str!("../../../config/sluice.toml");

fn errors(text: &str) -> Vec<String> {
    match parse(text, Path::new("c.toml")) {
        Ok(_) => panic!("config was accepted:\n{text}"),
        Err(e) => e.0.iter().map(ToString::to_string).collect(),
    }
}

/// The shipped file with `from` replaced by `to` (which must occur).
fn shipped_with(from: &str, to: &str) -> String {
    assert!(SHIPPED.contains(from), "shipped config lacks {from:?}");
    SHIPPED.replacen(from, to, 1)
}

#[test]
fn shipped_config_is_accepted_as_written() {
    let c = parse(SHIPPED, Path::new("config/sluice.toml")).expect("shipped config is valid");
    assert_eq!(c.gateway.max_in_flight.get(), 256);
    assert_eq!(c.gateway.max_held.get(), 1024);
    assert_eq!(c.gateway.health_path.as_deref(), Some("/health"));
    assert_eq!(c.gateway.overload_retry_after.max, Duration::from_secs(5));
    assert_eq!(c.routes.len(), 3);
    assert_eq!(c.routes[1].cost.get(), 5);
    assert!(matches!(c.routes[0].action, RouteAction::Respond(_)));
    assert_eq!(c.routes[2].action, RouteAction::Upstream(0));
    assert_eq!(c.limits.len(), 6);
    assert_eq!(c.limits[5].by, vec![KeyPart::Ip]);
    assert_eq!(c.gateway.max_connections_per_ip.map(|n| n.get()), Some(256));
    assert_eq!(
        c.limits[0].algorithm,
        Algorithm::TokenBucket {
            burst: 40.try_into().unwrap()
        }
    );
    assert_eq!(c.limits[2].by, vec![KeyPart::ApiKey, KeyPart::Route]);
    assert_eq!(c.limits[2].routes, Some(vec![1]));
    assert_eq!(c.limits[3].algorithm, Algorithm::Concurrency);
    assert_eq!(c.limits[4].mode, Mode::DryRun);
    assert_eq!(c.limits[4].block_for, Some(Duration::from_secs(600)));
    assert_eq!(c.identity.trusted_proxies.len(), 2);
    assert_eq!(c.upstreams[0].idle_connections, 256);
    assert_eq!(c.upstreams[0].tunnel_idle_timeout, Duration::from_secs(60));
    assert_eq!(c.gateway.send_timeout, Duration::from_secs(60));
    assert_eq!(c.gateway.max_body_size, Some(10 << 20));
    let quick = parse(
        &shipped_with("send_timeout = \"60s\"", "send_timeout = \"5s\""),
        Path::new("c.toml"),
    )
    .unwrap();
    assert_eq!(quick.gateway.send_timeout, Duration::from_secs(5));
}

#[test]
fn empty_file_takes_every_default() {
    let c = parse("", Path::new("e.toml")).unwrap();
    assert_eq!(c.gateway.listen.to_string(), "127.0.0.1:8080");
    assert_eq!(c.admin.listen.to_string(), "127.0.0.1:9901");
    assert_eq!(c.gateway.header_timeout, Duration::from_secs(10));
    assert_eq!(c.gateway.send_timeout, Duration::from_secs(60));
    assert_eq!(c.gateway.max_body_size, None);
    assert_eq!(c.gateway.max_connections, None);
    assert_eq!(c.identity.ipv6_prefix, 64);
    assert!(c.gateway.merge_slashes);
    assert!(c.gateway.count_unrouted);
    assert_eq!(
        c.gateway.min_body_rate,
        Some(sluice_config::MinBodyRate {
            bytes_per_second: 240,
            grace: Duration::from_secs(5)
        })
    );
    assert!(c.routes.is_empty());
}

#[test]
fn min_body_rate_is_a_size_per_second_and_zero_turns_it_off() {
    let c = parse(
        "[gateway]\nmin_body_rate = \"1KiB\"\nmin_body_rate_grace = \"2s\"\n",
        Path::new("c.toml"),
    )
    .unwrap();
    let rate = c.gateway.min_body_rate.unwrap();
    assert_eq!(
        (rate.bytes_per_second, rate.grace),
        (1024, Duration::from_secs(2))
    );
    let off = parse("[gateway]\nmin_body_rate = \"0B\"\n", Path::new("c.toml")).unwrap();
    assert_eq!(off.gateway.min_body_rate, None);
    let e = errors("[gateway]\nmin_body_rate = \"fast\"\n");
    assert!(
        e[0].starts_with("c.toml:2:17: gateway.min_body_rate: \"fast\" is not a size"),
        "{e:?}"
    );
}

/// Any token in capitals is a method (RFC 9110 section 9.1), `-` and `_` included (review:
/// `M-SEARCH` was "not an HTTP method (write it in capitals)").
#[test]
fn extension_methods_with_dashes_are_methods() {
    let text = shipped_with("methods = [\"GET\"]", "methods = [\"M-SEARCH\", \"X_Y\"]");
    let c = parse(&text, Path::new("c.toml")).unwrap();
    let names: Vec<_> = c.routes[1]
        .methods
        .as_ref()
        .unwrap()
        .iter()
        .map(|m| m.as_str())
        .collect();
    assert_eq!(names, ["M-SEARCH", "X_Y"]);
}

#[test]
fn drain_delay_is_zero_by_default_and_may_be_zero() {
    let c = parse("", Path::new("c.toml")).unwrap();
    assert_eq!(c.gateway.drain_delay, Duration::ZERO);
    for (text, delay) in [("0s", 0), ("5s", 5)] {
        let toml = format!("[gateway]\ndrain_delay = \"{text}\"\n");
        let c = parse(&toml, Path::new("c.toml")).unwrap();
        assert_eq!(c.gateway.drain_delay, Duration::from_secs(delay));
    }
    let e = errors("[gateway]\ndrain_delay = \"soon\"\n");
    assert!(
        e[0].starts_with("c.toml:2:15: gateway.drain_delay: \"soon\" is not a duration"),
        "{e:?}"
    );
    let e = errors("[gateway]\ndrain_delay = 5\n");
    assert!(e[0].contains("gateway.drain_delay"), "{e:?}");
    assert!(e[0].contains("\"5s\""), "{e:?}");
}

#[test]
fn client_ip_header_is_one_of_two_and_x_forwarded_for_by_default() {
    use sluice_config::ClientIpHeader;
    let header = |v: &str| format!("[identity]\nclient_ip_header = \"{v}\"\n");
    let c = parse(&header("Forwarded"), Path::new("c.toml")).unwrap();
    assert_eq!(c.identity.client_ip_header, ClientIpHeader::Forwarded);
    let c = parse("", Path::new("c.toml")).unwrap();
    assert_eq!(c.identity.client_ip_header, ClientIpHeader::XForwardedFor);
    assert_eq!(
        errors(&header("x-real-ip")),
        ["c.toml:2:20: identity.client_ip_header: \"x-real-ip\" is not \"x-forwarded-for\" or \"forwarded\""]
    );
}

#[test]
fn route_hosts_are_matched_without_port_or_trailing_dot() {
    let route = |host: &str| {
        format!("[[routes]]\nname = \"a\"\npath = \"/\"\nhost = \"{host}\"\nrespond = {{ status = 200 }}\n")
    };
    let c = parse(&route("API.Example.com."), Path::new("c.toml")).unwrap();
    assert_eq!(c.routes[0].host.as_deref(), Some("api.example.com"));
    assert_eq!(
        errors(&route("api.example.com:8080")),
        ["c.toml:4:8: routes[0].host: \"api.example.com:8080\" has a port: a route matches its host on any port (write the host alone)"]
    );
}

#[test]
fn empty_lists_that_would_switch_something_off_silently_are_refused() {
    let text = shipped_with("methods = [\"GET\"]", "methods = []");
    let text = text.replacen("routes = [\"search\"]", "routes = []", 1);
    let text = text.replacen(
        "api_key = [\"header:x-api-key\", \"bearer\"]",
        "api_key = []",
        1,
    );
    assert_eq!(
        errors(&text),
        [
            "c.toml:24:11: identity.api_key: an empty list finds no key, so every limit by \"api_key\" would count nobody; leave the key out for the default [\"header:x-api-key\", \"bearer\"]",
            "c.toml:47:11: routes[1].methods: an empty list matches no request; leave the key out for every method",
            "c.toml:73:10: limits[2].routes: an empty list limits no route; leave the key out for every route",
        ]
    );
}

#[test]
fn a_route_shadowed_by_an_earlier_one_but_for_case_is_refused() {
    let route = |name: &str, path: &str, extra: &str| {
        format!("[[routes]]\nname = \"{name}\"\npath = \"{path}\"\n{extra}respond = {{ status = 200 }}\n\n")
    };
    let text = [
        route("a", "/v1/search", "methods = [\"GET\"]\n"),
        route("b", "/V1/Search", "methods = [\"HEAD\"]\n"),
        route("c", "/v1/SEARCH", "methods = [\"POST\"]\n"),
        route("d", "/v1/search", "host = \"a.example\"\n"),
        route("e", "/v1/search", ""),
        route("f", "/v1/search", "methods = [\"PUT\"]\n"),
    ]
    .concat();
    // b: `GET` also matches `HEAD`; f: e matches every method. c and e each match a method
    // no earlier route with that path and host does.
    assert_eq!(
        errors(&text),
        [
            "c.toml:9:8: routes[1].path: \"/V1/Search\" is routes[0]'s path (paths match regardless of case), with the same host and every method of this route: this route could never match",
            "c.toml:32:8: routes[5].path: \"/v1/search\" is routes[4]'s path (paths match regardless of case), with the same host and every method of this route: this route could never match",
        ]
    );
    // A route with no host matches every host: a later one of the same path with a host is
    // never reached; written first, it is.
    let dead = [
        route("any", "/x", ""),
        route("one", "/X", "host = \"a.example\"\n"),
    ]
    .concat();
    assert_eq!(
        errors(&dead),
        ["c.toml:8:8: routes[1].path: \"/X\" is routes[0]'s path (paths match regardless of case), with no host (so every host, this route's too) and every method of this route: this route could never match (among routes of the same path the first written is matched: write the one with a host first)"]
    );
    let live = [
        route("one", "/X", "host = \"a.example\"\n"),
        route("any", "/x", ""),
    ]
    .concat();
    assert!(parse(&live, Path::new("c.toml")).is_ok());
    // Many hosts on one path: each route is compared with the earlier ones of its host and
    // those of none, whichever came first.
    let hosts = [
        route("a", "/", "host = \"a.example\"\n"),
        route("b", "/", "host = \"b.example\"\nmethods = [\"GET\"]\n"),
        route("b2", "/", "host = \"B.example.\"\nmethods = [\"HEAD\"]\n"),
        route("any", "/", "methods = [\"POST\"]\n"),
        route("c", "/", "host = \"c.example\"\nmethods = [\"POST\"]\n"),
        route("a2", "/", "host = \"a.example\"\nmethods = [\"POST\"]\n"),
    ]
    .concat();
    assert_eq!(
        errors(&hosts),
        [
            "c.toml:16:8: routes[2].path: \"/\" is routes[1]'s path (paths match regardless of case), with the same host and every method of this route: this route could never match",
            "c.toml:29:8: routes[4].path: \"/\" is routes[3]'s path (paths match regardless of case), with no host (so every host, this route's too) and every method of this route: this route could never match (among routes of the same path the first written is matched: write the one with a host first)",
            "c.toml:36:8: routes[5].path: \"/\" is routes[0]'s path (paths match regardless of case), with the same host and every method of this route: this route could never match",
        ]
    );
}

#[test]
fn route_and_health_paths_must_be_in_the_normal_form_requests_are_matched_in() {
    let text = "[gateway]\nhealth_path = \"/health/./x\"\n\n\
                [[routes]]\nname = \"a\"\npath = \"/v1//a\"\nrespond = { status = 200 }\n\n\
                [[routes]]\nname = \"b\"\npath = \"/v1/%62;x\"\nrespond = { status = 200 }\n\n\
                [[routes]]\nname = \"c\"\npath = \"/v1/%zz\"\nrespond = { status = 200 }\n\n\
                [[routes]]\nname = \"d\"\npath = \"/café\"\nrespond = { status = 200 }\n";
    assert_eq!(
        errors(text),
        [
            "c.toml:2:15: gateway.health_path: \"/health/./x\" is not in normal form, and requests are matched after they are brought to it (write \"/health/x\")",
            "c.toml:6:8: routes[0].path: \"/v1//a\" is not in normal form, and requests are matched after they are brought to it (write \"/v1/a\")",
            "c.toml:11:8: routes[1].path: \"/v1/%62;x\" is not in normal form, and requests are matched after they are brought to it (write \"/v1/b\")",
            "c.toml:16:8: routes[2].path: \"/v1/%zz\" has a \"%\" not followed by two hexadecimal digits",
            "c.toml:21:8: routes[3].path: \"/café\" is not in normal form, and requests are matched after they are brought to it (write \"/caf%C3%A9\")",
        ]
    );
    // With slashes kept as they are, a route may name an empty segment.
    let kept = text.replace("[gateway]\n", "[gateway]\nmerge_slashes = false\n");
    let e = errors(&kept);
    assert_eq!(e.len(), 4, "{e:?}");
    assert!(!e.iter().any(|e| e.contains("routes[0]")), "{e:?}");
}

#[test]
fn bad_duration_names_file_line_column_key_and_value() {
    let text = shipped_with(
        "quota = 1000\nwindow = \"1h\"",
        "quota = 1000\nwindow = \"1 minute\"",
    );
    let line = text.lines().position(|l| l.contains("1 minute")).unwrap() + 1;
    assert_eq!(
        errors(&text),
        vec![format!(
            "c.toml:{line}:10: limits[1].window: \"1 minute\" is not a duration (try \"60s\")"
        )]
    );
}

#[test]
fn unknown_keys_are_errors_with_their_path() {
    let e = errors("[gateway]\nlisten = \"127.0.0.1:1\"\nlisten_port = 3\n");
    assert_eq!(e.len(), 1);
    assert!(e[0].starts_with("c.toml:3:1: gateway"), "{}", e[0]);
    assert!(e[0].contains("unknown field `listen_port`"), "{}", e[0]);
}

#[test]
fn wrong_types_are_errors_with_their_path() {
    let e = errors("[[limits]]\nname = \"x\"\nby = \"ip\"\nquota = \"ten\"\nwindow = \"1s\"\n");
    assert_eq!(e.len(), 1);
    assert!(
        e[0].starts_with("c.toml:4:9: limits[0].quota: invalid type: string \"ten\""),
        "{}",
        e[0]
    );
}

#[test]
fn every_problem_is_reported_at_once() {
    let text = r#"
[upstreams.app]
url = "http://127.0.0.1:3000"

[[routes]]
name = "a"
path = "/a"
upstream = "nope"
cost = 9

[[routes]]
name = "a"
path = "b"
respond = { status = 200 }

[[limits]]
name = "l"
by = "ip"
algorithm = "fixed_window"
quota = 0
window = "1s"
burst = 3

[[limits]]
name = "l"
by = ["ip", "cookie"]
quota = 1
window = "1s"
mode = "delay"
routes = ["zzz"]
"#;
    let e = errors(text);
    let expected = [
        "c.toml:8:12: routes[0].upstream: \"nope\" is not an upstream (known: \"app\")",
        "c.toml:12:8: routes[1].name: \"a\" is already the name of another entry in [[routes]]",
        "c.toml:13:8: routes[1].path: \"b\" is not a path (it must start with \"/\" and hold no query, fragment or spaces)",
        "c.toml:20:9: limits[0].quota: 0 is not allowed: it must be between 1 and 4294967295",
        "c.toml:22:9: limits[0].burst: 3 is not used: burst applies to token_bucket limits only, not fixed_window",
        "c.toml:25:8: limits[1].name: \"l\" is already the name of another entry in [[limits]]",
        "c.toml:26:13: limits[1].by[1]: \"cookie\" is not a key part (write \"ip\", \"api_key\", \"route\", \"global\" or \"header:<name>\")",
        "c.toml:29:8: limits[1].mode: \"delay\" needs max_delay, the longest a request may be held (e.g. max_delay = \"500ms\")",
        "c.toml:30:11: limits[1].routes[0]: \"zzz\" is not a route (known: \"a\", \"a\")",
    ];
    assert_eq!(e, expected);
}

/// A problem in one key does not hide the others of its limit or upstream: `sluice check`
/// lists them in one round, in the file's order.
#[test]
fn problems_beside_a_bad_block_for_or_upstream_name_are_reported_too() {
    let text = r#"
[upstreams."bad name"]
url = "notaurl"
timeout = "zz"

[[limits]]
name = "l"
by = "ip"
quota = 1
window = "1s"
block_for = "x"
max_keys = 0
"#;
    assert_eq!(
        errors(text),
        [
            "c.toml:2:12: upstreams.bad name: \"bad name\" is not a usable name (1 to 64 ASCII letters, digits, '-', '_' or '.')",
            "c.toml:3:7: upstreams.bad name.url: \"notaurl\" has no scheme (write e.g. \"http://127.0.0.1:3000\")",
            "c.toml:4:11: upstreams.bad name.timeout: \"zz\" is not a duration (write an integer and a unit: 500ms, 2s, 10m, 1h, 1d)",
            "c.toml:11:13: limits[0].block_for: \"x\" is not a duration (write an integer and a unit: 500ms, 2s, 10m, 1h, 1d)",
            "c.toml:12:12: limits[0].max_keys: 0 is not allowed: it must be between 1 and 4294967295",
        ]
    );
}

#[test]
fn cost_larger_than_burst_is_refused() {
    let text = shipped_with("cost = 5", "cost = 6");
    let text = text.replacen("mode = \"dry_run\"", "mode = \"enforce\"", 1);
    let e = errors(&text);
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(e[0].ends_with("routes[1].cost: 6 is larger than the burst of limit \"search-per-ip\" (5): no request on route \"search\" could ever pass"), "{}", e[0]);
}

/// A dry-run limit refuses nothing, so a cost it can never hold is not an error (`check` and
/// `run` warn of it instead). Review: the shipped file's dry-run limit was refused so.
#[test]
fn cost_larger_than_a_dry_run_limits_burst_is_accepted() {
    let text = shipped_with("cost = 5", "cost = 6");
    assert!(text.contains("name = \"search-per-ip\"\nby = \"ip\"\nroutes = [\"search\"]\nquota = 5\nwindow = \"1m\"\nmode = \"dry_run\""));
    let c = parse(&text, Path::new("c.toml")).expect("a dry-run limit refuses nothing");
    assert_eq!(c.routes[1].cost.get(), 6);
}

#[test]
fn a_per_address_cap_must_be_below_the_connection_cap() {
    let text = shipped_with(
        "max_connections_per_ip = 256",
        "max_connections_per_ip = 256\nmax_connections = 256",
    );
    let e = errors(&text);
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(e[0].ends_with("gateway.max_connections_per_ip: 256 is not below max_connections (256): one client could still take every place"), "{}", e[0]);
}

#[test]
fn a_body_rate_grace_without_a_body_rate_is_refused() {
    let text = shipped_with(
        "[gateway]\n",
        "[gateway]\nmin_body_rate = \"0B\"\nmin_body_rate_grace = \"1h\"\n",
    );
    let e = errors(&text);
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(e[0].ends_with("gateway.min_body_rate_grace: \"1h\" is not used: min_body_rate is off (0B), so no body is asked a rate"), "{}", e[0]);
}

/// Every request looks for each place an API key may be and reads each part of each key:
/// lists of them are bounded.
#[test]
fn key_sources_and_key_parts_are_bounded() {
    let sources: Vec<String> = (0..17).map(|i| format!("\"header:x-k{i}\"")).collect();
    let text = format!("[identity]\napi_key = [{}]\n", sources.join(", "));
    assert_eq!(
        errors(&text),
        ["c.toml:2:11: identity.api_key: 17 sources: at most 16 (each is looked for on every request)"]
    );
    let parts: Vec<String> = (0..9).map(|i| format!("\"header:x-p{i}\"")).collect();
    let text = format!(
        "[[limits]]\nname = \"l\"\nby = [{}]\nquota = 1\nwindow = \"1s\"\n",
        parts.join(", ")
    );
    assert_eq!(
        errors(&text),
        ["c.toml:3:6: limits[0].by: 9 parts: at most 8 (each is read and hashed on every request the limit covers)"]
    );
    // Eight parts, and sixteen sources, are taken.
    let fit = text.replace("\"header:x-p0\", ", "");
    assert!(parse(&fit, Path::new("c.toml")).is_ok());
    let sixteen = format!("[identity]\napi_key = [{}]\n", sources[1..].join(", "));
    assert!(parse(&sixteen, Path::new("c.toml")).is_ok());
}

/// Every route keeps the list of limits on it: a configuration of thousands of routes under
/// thousands of limits is refused with the place that passed the bound, instead of taking
/// gigabytes at start (review: 10,000 x 10,000 aborted for memory).
#[test]
fn routes_times_their_limits_are_bounded() {
    let routes: String = (0..2_000)
        .map(|i| {
            format!("[[routes]]\nname = \"r{i}\"\npath = \"/r{i}\"\nrespond = {{ status = 200 }}\n")
        })
        .collect();
    let limit = |i: usize, on: &str| {
        format!("[[limits]]\nname = \"l{i}\"\nby = \"ip\"\nquota = 1\nwindow = \"1s\"\n{on}")
    };
    let many: String = (0..2_000).map(|i| limit(i, "")).collect();
    let e = errors(&format!("{routes}{many}"));
    assert_eq!(e.len(), 1, "{e:?}");
    // 2,001 pairs a limit (the unrouted requests too): the 2,000th limit passes 4,000,000.
    assert!(
        e[0].contains(":17997:8: limits[1999]: routes x the limits on them pass 4000000 pairs here (2000 routes;"),
        "{}",
        e[0]
    );
    // Limits that name their routes count those only.
    let named: String = (0..2_000)
        .map(|i| limit(i, "routes = [\"r1\", \"r2\"]\n"))
        .collect();
    assert!(parse(&format!("{routes}{named}"), Path::new("c.toml")).is_ok());
}

#[test]
fn trusting_everyone_needs_an_explicit_yes() {
    // Whole, or split in halves: it is still everyone.
    for (networks, expected) in [
        (
            "\"0.0.0.0/0\"",
            "identity.trusted_proxies[0]: \"0.0.0.0/0\" trusts every peer",
        ),
        (
            "\"0.0.0.0/1\", \"128.0.0.0/1\"",
            "identity.trusted_proxies: \"0.0.0.0/1\", \"128.0.0.0/1\" together hold every address of IPv4 or of IPv6",
        ),
        // Named as written (review: the error quoted "0.0.0.0/0", a value not in the file),
        // and as trusting everyone even after the same network in another spelling.
        (
            "\"::ffff:0:0/96\"",
            "identity.trusted_proxies[0]: \"::ffff:0:0/96\" (as 0.0.0.0/0) trusts every peer",
        ),
        (
            "\"0.0.0.0/0\", \"::ffff:0:0/96\"",
            "identity.trusted_proxies[1]: \"::ffff:0:0/96\" (as 0.0.0.0/0) trusts every peer",
        ),
    ] {
        let text = shipped_with("\"127.0.0.1/32\", \"10.0.0.0/8\"", networks);
        let e = errors(&text);
        assert!(e.iter().any(|e| e.contains(expected)), "{e:?}");
        let allowed = text.replace(
            "ipv6_prefix = 64",
            "ipv6_prefix = 64\nallow_trust_all = true",
        );
        if networks.starts_with("\"0.0.0.0/0\", ") {
            let e = errors(&allowed);
            assert!(e[0].ends_with("identity.trusted_proxies[1]: \"::ffff:0:0/96\" is listed twice (as 0.0.0.0/0)"), "{e:?}");
        } else {
            assert!(parse(&allowed, Path::new("c.toml")).is_ok());
        }
    }
}

#[test]
fn bad_values_in_other_sections_are_named() {
    let cases = [
        (
            "listen = \"127.0.0.1:8080\"",
            "listen = \"localhost\"",
            "gateway.listen: \"localhost\" is not an address and port",
        ),
        (
            "\"10.0.0.0/8\"",
            "\"10.0.0.0/33\"",
            "identity.trusted_proxies[1]: \"10.0.0.0/33\" is not an IP network",
        ),
        (
            "ipv6_prefix = 64",
            "ipv6_prefix = 129",
            "identity.ipv6_prefix: 129 is not a prefix length between 1 and 128",
        ),
        (
            "\"bearer\"]",
            "\"cookie:x\"]",
            "identity.api_key[1]: \"cookie:x\" is not a key source",
        ),
        (
            "url = \"http://127.0.0.1:3000\"",
            "url = \"https://x:1\"",
            "upstreams.app.url: \"https://x:1\" is not supported",
        ),
        (
            "idle_connections = 256",
            "idle_connections = 70000",
            "upstreams.app.idle_connections: 70000 is not allowed: it must be between 0 and 65535",
        ),
        (
            "tunnel_idle_timeout = \"60s\"",
            "tunnel_idle_timeout = \"0s\"",
            "upstreams.app.tunnel_idle_timeout: \"0s\" must be longer than zero",
        ),
        (
            "methods = [\"GET\"]",
            "methods = [\"get\"]",
            "routes[1].methods: \"get\" is not an HTTP method",
        ),
        (
            "methods = [\"GET\"]",
            "methods = [\"CONNECT\"]",
            "routes[1].methods: \"CONNECT\" is never routed",
        ),
        (
            "methods = [\"GET\"]",
            "methods = [\"GET X\"]",
            "routes[1].methods: \"GET X\" is not an HTTP method (a method is a token",
        ),
        (
            "max = \"5s\"",
            "max = \"1s\"",
            "gateway.overload_retry_after: min \"2s\" is longer than max \"1s\"",
        ),
        (
            "algorithm = \"concurrency\"",
            "algorithm = \"leaky\"",
            "limits[3].algorithm: \"leaky\" is not an algorithm",
        ),
        (
            "max_body_size = \"10MiB\"",
            "max_body_size = \"10mb\"",
            "gateway.max_body_size: \"10mb\" is not a size (write an integer and a unit: 512KiB, 10MiB, 1GiB, 100MB, 4096B)",
        ),
        (
            "max_body_size = \"10MiB\"",
            "max_body_size = \"0B\"",
            "gateway.max_body_size: \"0B\" must be larger than zero",
        ),
        (
            "quota = 1000\nwindow = \"1h\"",
            "quota = 1000\nwindow = \"36501d\"",
            "limits[1].window: \"36501d\" is too long: at most 36500d (100 years)",
        ),
        (
            "mode = \"dry_run\"",
            "mode = \"dry_run\"\nmax_delay = \"1s\"",
            "limits[4].max_delay: \"1s\" is not used",
        ),
        (
            "status = 200,",
            "status = 700,",
            "routes[0].respond.status: 700 is not a status code",
        ),
    ];
    for (from, to, expected) in cases {
        let e = errors(&shipped_with(from, to));
        assert!(
            e.iter().any(|m| m.contains(expected)),
            "{to}: expected {expected:?} in {e:?}"
        );
    }
}

#[test]
fn concurrency_limit_with_a_window_is_refused() {
    let text = shipped_with("quota = 10\n", "quota = 10\nwindow = \"1s\"\n");
    assert!(errors(&text)[0].contains(
        "limits[3].window: \"1s\" is not used: a concurrency limit counts requests in flight"
    ));
}

#[test]
fn names_must_be_header_safe_and_block_for_needs_a_window_limit() {
    let e = errors(&shipped_with("name = \"per-ip\"", "name = \"per ip\""));
    assert!(
        e[0].contains("limits[0].name: \"per ip\" is not a usable name"),
        "{e:?}"
    );
    let e = errors(&shipped_with(
        "quota = 10\n",
        "quota = 10\nblock_for = \"1m\"\n",
    ));
    assert!(
        e[0].contains("limits[3].block_for: \"1m\" is not used: a concurrency slot frees"),
        "{e:?}"
    );
}

/// Errors found by TOML's own reading still name the key and the value; values cannot forge
/// lines of their own; nonsense that would fail at run time is refused here.
#[test]
fn every_error_names_its_key_and_a_printable_value() {
    let text = "[gateway]\nmax_in_flight = 99999999999999999999999\n";
    assert_eq!(
        errors(text),
        ["c.toml:2:17: gateway.max_in_flight: 99999999999999999999999: number too large to fit in target type (TOML integers stop at 9223372036854775807)"]
    );
    let text = "[[routes]]\nname = \"a\"\npath = \"/\"\nupstream = \"u\"\n[[routes]]\nname = \"b\"\ncost = 1e99\n";
    assert_eq!(
        errors(text),
        ["c.toml:7:8: routes[1].cost: 1e99: invalid type: floating point, expected an integer"]
    );
    // serde's names for sluice's own types are put in the file's words, and an inline table
    // is shown whole.
    for (text, expected) in [
        (
            "gateway = 1\n",
            "c.toml:1:11: gateway: invalid type: integer `1`, expected a table",
        ),
        (
            "[[limits]]\nname = \"l\"\nby = 1\nquota = 1\n",
            "c.toml:3:6: limits[0].by: invalid type: integer `1`, expected a string or a list of strings",
        ),
        (
            // An element of a list written over several lines is pointed at, and named.
            "[[limits]]\nname = \"l\"\nby = [\n  \"ip\",\n  7,\n]\nquota = 1\n",
            "c.toml:5:3: limits[0].by[1]: invalid type: integer `7`, expected a string",
        ),
        (
            "[gateway]\noverload_retry_after = {min=\"2s\"}\n",
            "c.toml:2:24: gateway.overload_retry_after: {min=\"2s\"}: missing field `max`",
        ),
        (
            "[gateway]\nlisten = [\"a\", 1]\n",
            "c.toml:2:10: gateway.listen: [\"a\", 1]: invalid type: sequence, expected a string",
        ),
        (
            "[gateway]\noverload_retry_after = {min = \"\\\"}\"} # '}'\n",
            "c.toml:2:24: gateway.overload_retry_after: {min = \"\\\"}\"}: missing field `max`",
        ),
    ] {
        assert_eq!(errors(text), [expected]);
    }
    let got: Vec<Vec<String>> = [
        "upstreams.app.url = \"http://127.0.0.1:1\"\nupstreams.app.bogus = 1\n",
        "[upstreams.app]\ntimeout = \"1s\"\n",
        "[upstreams.app.extra]\nx = 1\n",
    ]
    .iter()
    .map(|t| errors(t))
    .collect();
    assert_eq!(
        got,
        [
            ["c.toml:2:15: upstreams.app.bogus: unknown field `bogus`, expected one of `url`, `connect_timeout`, `timeout`, `idle_connections`, `tunnel_idle_timeout`"],
            ["c.toml:1:1: upstreams.app: missing field `url`"],
            ["c.toml:1:16: upstreams.app.extra: unknown field `extra`, expected one of `url`, `connect_timeout`, `timeout`, `idle_connections`, `tunnel_idle_timeout`"],
        ]
    );
    // A route naming a refused upstream is not told the upstream does not exist.
    let text = "[upstreams.app]\nurl = \"127.0.0.1:1\"\n[[routes]]\nname = \"r\"\npath = \"/\"\nmethods = [\"GET\", \"GET\"]\nupstream = \"app\"\n";
    assert_eq!(
        errors(text),
        [
            "c.toml:2:7: upstreams.app.url: \"127.0.0.1:1\" has no scheme (write e.g. \"http://127.0.0.1:3000\")",
            "c.toml:6:19: routes[0].methods: \"GET\" is listed twice",
        ]
    );
    let text = "[upstreams.app]\nurl = \"http://127.0.0.1:1\"\nbogus = 1\n";
    assert_eq!(
        errors(text),
        ["c.toml:3:1: upstreams.app.bogus: unknown field `bogus`, expected one of `url`, `connect_timeout`, `timeout`, `idle_connections`, `tunnel_idle_timeout`"]
    );
}

#[test]
fn nonsense_that_would_only_fail_at_run_time_is_refused() {
    let text = r#"
[upstreams.a]
url = "127.0.0.1:3900"
[upstreams.b]
url = "http://127.0.0.1:70000"
[upstreams.c]
url = "http://127.0.0.1:0"
[upstreams.d]
url = "http://[::1]"
[upstreams.e]
url = "http://user:pw@127.0.0.1"
[upstreams.f]
url = "http://127.0.0.1:+80"
[upstreams.g]
url = "http://127.0.0.1:80#x"
[upstreams.h]
url = "http://user:hunter2 pw@127.0.0.1"
[upstreams.i]
url = "http://user:hun\"ter2@127.0.0.1"

[[routes]]
name = "empty"
path = "/empty"
respond = { status = 204, body = "gone" }

[[routes]]
name = "typeless"
path = "/typeless"
respond = { status = 200, content_type = " " }

[[routes]]
name = "wild"
path = "/wild"
host = "*.example.com"
upstream = "d"

[[routes]]
name = "odd\nname"
path = "/odd"
upstream = "d"

[[limits]]
name = "l"
by = "ip"
quota = 1
window = "1s"
routes = ["wild", "wild"]
"#;
    assert_eq!(
        errors(text),
        [
            "c.toml:3:7: upstreams.a.url: \"127.0.0.1:3900\" has no scheme (write e.g. \"http://127.0.0.1:3000\")",
            "c.toml:5:7: upstreams.b.url: \"http://127.0.0.1:70000\" has a port outside 1 to 65535",
            "c.toml:7:7: upstreams.c.url: \"http://127.0.0.1:0\" has a port outside 1 to 65535",
            "c.toml:11:7: upstreams.e.url: \"http://user:***@127.0.0.1\" has a user or password: an upstream URL is scheme, host and port only",
            "c.toml:13:7: upstreams.f.url: \"http://127.0.0.1:+80\" has a port that is not a number",
            "c.toml:15:7: upstreams.g.url: \"http://127.0.0.1:80#x\" has a fragment; an upstream URL is scheme, host and port only",
            "c.toml:17:7: upstreams.h.url: \"http://user:***@127.0.0.1\" is not a URL (write e.g. \"http://127.0.0.1:3000\")",
            "c.toml:19:7: upstreams.i.url: \"http://user:***@127.0.0.1\" is not a URL (write e.g. \"http://127.0.0.1:3000\")",
            "c.toml:24:34: routes[0].respond.body: a 204 response has no body: \"gone\" would never be sent (leave body out)",
            "c.toml:29:42: routes[1].respond.content_type: \" \" is empty (leave content_type out for \"text/plain; charset=utf-8\")",
            "c.toml:34:8: routes[2].host: \"*.example.com\": wildcards are not supported; a route matches one host exactly (leave host out for every host)",
            "c.toml:38:8: routes[3].name: \"odd\\nname\" is not a usable name (1 to 64 ASCII letters, digits, '-', '_' or '.')",
            "c.toml:47:19: limits[0].routes[1]: \"wild\" is listed twice",
        ]
    );
}

#[test]
fn a_file_that_is_not_utf8_is_refused_at_the_first_bad_byte() {
    let path = std::env::temp_dir().join(format!("sluice-not-utf8-{}.toml", std::process::id()));
    std::fs::write(&path, b"[gateway]\nhealth_path = \"/h\xffx\"\n").unwrap();
    let err = sluice_config::load(&path).unwrap_err().to_string();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(
        err,
        format!(
            "{}:2:18: byte 0xff is not UTF-8: a TOML file must be UTF-8 text",
            path.display()
        )
    );
}

/// A path that is no configuration file (a directory, a device, a huge file) is refused before
/// it is read whole: no memory filled, no endless read; a pipe is read.
#[test]
fn only_regular_files_of_sane_size_are_read() {
    let err = |p: &Path| sluice_config::load(p).unwrap_err().to_string();
    let dir = std::env::temp_dir();
    assert_eq!(
        err(&dir),
        format!("cannot read {}: it is a directory", dir.display())
    );
    assert!(err(Path::new("/dev/zero"))
        .ends_with("it is not a regular file or a pipe (a device or a socket)"));
    // A pipe is read (a templated file handed over by `<(envsubst < t)`).
    let fifo = dir.join(format!("sluice-fifo-{}.toml", std::process::id()));
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    assert!(made.is_ok_and(|s| s.success()), "mkfifo");
    let writer = {
        let fifo = fifo.clone();
        std::thread::spawn(move || std::fs::write(fifo, "[gateway]\nmax_in_flight = 7\n"))
    };
    let config = sluice_config::load(&fifo);
    writer.join().unwrap().unwrap();
    std::fs::remove_file(&fifo).unwrap();
    assert_eq!(config.unwrap().gateway.max_in_flight.get(), 7);
    let big = dir.join(format!("sluice-big-{}.toml", std::process::id()));
    let file = std::fs::File::create(&big).unwrap();
    file.set_len(17 << 20).unwrap(); // sparse: no 17 MiB written
    let e = err(&big);
    std::fs::remove_file(&big).unwrap();
    assert!(
        e.ends_with("it is larger than 16 MiB, which no configuration needs"),
        "{e}"
    );
}

/// An error inside a string (a bad escape, a string never closed) names the string's key, with
/// the index of the array of tables it sits in, and its message is one line.
#[test]
fn errors_inside_strings_name_the_strings_key() {
    let head = "[[routes]]\nname = \"x\"\npath = \"/x\"\n[[routes]]\nname = \"y\"\npath = \"/y\"\n[routes.respond]\nstatus = 200\n";
    let e = errors(&format!("{head}body = \"wor\\qld\"\n"));
    assert_eq!(e.len(), 1);
    assert!(
        e[0].starts_with(
            "c.toml:9:12: routes[1].respond.body: \"wor\\qld\": invalid escape sequence; expected "
        ),
        "{e:?}"
    );
    let e = errors(&format!("{head}body = \"\"\"\nhello\nwor\\qld\"\"\"\n"));
    assert!(
        e[0].starts_with("c.toml:11:4: routes[1].respond.body: wor\\qld\"\"\": invalid escape sequence; expected "),
        "{e:?}"
    );
    let e = errors(&format!("{head}body = \"\"\"\nabc\n"));
    assert!(
        e[0].starts_with("c.toml:9:8: routes[1].respond.body: \"\"\": invalid multiline"),
        "{e:?}"
    );
    // A `#` or a quote inside a string does not confuse the scan.
    let e = errors(&format!("{head}content_type = 'a\"#b'\nbody = \"x\\q\"\n"));
    assert!(
        e[0].contains(": routes[1].respond.body: \"x\\q\": invalid escape"),
        "{e:?}"
    );
}

/// Every prefix of a file full of strings, comments and tables is answered without a panic.
#[test]
fn every_cut_of_a_file_is_answered_without_a_panic() {
    let text = "# a 'comment' with \"quotes\"\n[gateway]\nlisten = \"127.0.0.1:1\" # x\n[[routes]]\nname = 'r#1'\npath = \"/\\u00e9\"\n[routes.respond]\nbody = \"\"\"\nline \"one\"\n\\\n  two\"\"\"\"\ncontent_type = '''a\nb'''\n[[limits]]\nname = \"l\"\n";
    for cut in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
        let _ = parse(&text[..cut], Path::new("c.toml"));
    }
}

/// An upstream host a resolver would read as another address than the one written (octal,
/// one number, hex) or no address at all is refused, as `trusted_proxies` refuses `010.0.0.0/8`.
#[test]
fn upstream_hosts_are_names_or_plain_addresses() {
    for host in [
        "0177.0.0.1",
        "2130706433",
        "0x7f.0.0.1",
        "999.0.0.1",
        "a..b",
    ] {
        let e = errors(&format!("[upstreams.a]\nurl = \"http://{host}:3900\"\n"));
        assert_eq!(
            e,
            [format!("c.toml:2:7: upstreams.a.url: \"http://{host}:3900\" has a host that is neither a name (letters, digits, '-', '_' and '.'), a dotted IPv4 address nor a bracketed IPv6 one")]
        );
    }
    for host in ["127.0.0.1", "[::1]", "app.internal", "app"] {
        let text = format!("[upstreams.a]\nurl = \"http://{host}:3900\"\n");
        assert!(parse(&text, Path::new("c.toml")).is_ok(), "{host}");
    }
}

/// `RateLimit-Policy` tells windows in whole seconds; a window it cannot tell is refused.
#[test]
fn windows_are_whole_seconds() {
    for window in ["500ms", "1500ms", "999ms"] {
        let text =
            format!("[[limits]]\nname = \"l\"\nby = \"ip\"\nquota = 10\nwindow = \"{window}\"\n");
        assert_eq!(
            errors(&text),
            [format!("c.toml:5:10: limits[0].window: \"{window}\" is not a whole number of seconds: the RateLimit fields tell callers windows in seconds (write e.g. \"1s\" with the quota to match)")]
        );
    }
    let text = "[[limits]]\nname = \"l\"\nby = \"ip\"\nquota = 10\nwindow = \"2000ms\"\n";
    assert!(parse(text, Path::new("c.toml")).is_ok());
    // A fraction is not pointed at a millisecond form that would be refused next (review:
    // "1.5s" was told to try "1500ms"); where milliseconds are fine, it still is.
    let text = "[[limits]]\nname = \"l\"\nby = \"ip\"\nquota = 10\nwindow = \"1.5s\"\n";
    assert_eq!(
        errors(text),
        ["c.toml:5:10: limits[0].window: \"1.5s\" is not a duration, nor a whole number of seconds: the RateLimit fields tell callers windows in seconds (write e.g. \"1s\" with the quota to match)"]
    );
    let text = "[gateway]\noverload_retry_after = { min = \"1.5s\", max = \"2500ms\" }\n";
    assert_eq!(
        errors(text),
        [
            "c.toml:2:32: gateway.overload_retry_after.min: \"1.5s\" is not a duration, nor a whole number of seconds: Retry-After is sent in seconds",
            "c.toml:2:46: gateway.overload_retry_after.max: \"2500ms\" is not a whole number of seconds: Retry-After is sent in seconds",
        ]
    );
    let text = "[[limits]]\nname = \"l\"\nby = \"ip\"\nquota = 10\nwindow = \"1s\"\nmode = \"delay\"\nmax_delay = \"1.5s\"\n";
    assert_eq!(
        errors(text),
        ["c.toml:7:13: limits[0].max_delay: \"1.5s\" is not a duration (try \"1500ms\")"]
    );
}

/// The slips serde's own words do not explain get a hint of what to write (review).
#[test]
fn common_slips_are_told_what_to_write() {
    for (text, expected) in [
        (
            "[limits]\nname = \"a\"\n",
            "c.toml:1:1: limits: invalid type: table, expected a sequence (each entry is its own [[limits]] table, with two brackets)",
        ),
        (
            "[[limits]]\nname = \"a\"\nby = \"ip\"\nquota = 1\nwindow = 60\n",
            "c.toml:5:10: limits[0].window: invalid type: integer `60`, expected a string (a duration is a string with a unit: write \"60s\")",
        ),
        (
            "[gateway]\nmax_body_size = 1000\n",
            "c.toml:2:17: gateway.max_body_size: invalid type: integer `1000`, expected a string (a size is a string with a unit: write \"1000B\" or \"1000KiB\")",
        ),
        // Only values the key takes are suggested (review: "0s", "-10s").
        (
            "[gateway]\nheader_timeout = 0\n",
            "c.toml:2:18: gateway.header_timeout: invalid type: integer `0`, expected a string (a duration is a string with a unit, such as \"30s\")",
        ),
        (
            "[gateway]\ndrain_delay = 0\n",
            "c.toml:2:15: gateway.drain_delay: invalid type: integer `0`, expected a string (a duration is a string with a unit: write \"0s\")",
        ),
        (
            "[gateway]\nmax_body_size = -5\n",
            "c.toml:2:17: gateway.max_body_size: invalid type: integer `-5`, expected a string (a size is a string with a unit, such as \"1MiB\")",
        ),
        (
            "[[limits]]\nname = \"a\"\nby = \"ip\"\nquota = 1\nwindow = \"1s\"\nroutes = \"api\"\n",
            "c.toml:6:10: limits[0].routes: invalid type: string \"api\", expected a sequence (write a list: [\"api\"])",
        ),
        (
            "[[limits]]\nname = \"a\"\nby = \"ip\"\nquota = 1\nwindow = \"99999999999999999999d\"\n",
            "c.toml:5:10: limits[0].window: \"99999999999999999999d\" is too long: at most 36500d (100 years)",
        ),
    ] {
        assert_eq!(errors(text), [expected], "{text}");
    }
}

/// Listeners that could not both be bound are refused by `check`, not found by `run`.
#[test]
fn admin_and_gateway_listeners_that_would_clash_are_refused() {
    for (gateway, admin, what) in [
        ("127.0.0.1:9000", "127.0.0.1:9000", "is also"),
        ("0.0.0.0:9000", "127.0.0.1:9000", "shares its port with"),
        ("127.0.0.1:9000", "[::]:9000", "shares its port with"),
        (
            "127.0.0.1:9000",
            "[::ffff:127.0.0.1]:9000",
            "shares its port with",
        ),
    ] {
        let text = format!("[gateway]\nlisten = \"{gateway}\"\n[admin]\nlisten = \"{admin}\"\n");
        let e = errors(&text);
        assert_eq!(e.len(), 1, "{e:?}");
        assert!(
            e[0].starts_with("c.toml:4:10: admin.listen: admin.listen \"") && e[0].contains(what),
            "{e:?}"
        );
    }
    // Not written, the admin's default is pointed at through gateway.listen.
    let e = errors("[gateway]\nlisten = \"0.0.0.0:9901\"\n");
    assert!(e[0].starts_with("c.toml:2:10: gateway.listen: admin.listen \"127.0.0.1:9901\" shares its port with gateway.listen \"0.0.0.0:9901\""), "{e:?}");
    for (gateway, admin) in [
        ("0.0.0.0:9000", "[::1]:9000"),
        ("127.0.0.1:9000", "127.0.0.2:9000"),
        ("127.0.0.1:0", "127.0.0.1:0"),
        ("0.0.0.0:9000", "0.0.0.0:9001"),
    ] {
        let text = format!("[gateway]\nlisten = \"{gateway}\"\n[admin]\nlisten = \"{admin}\"\n");
        assert!(
            parse(&text, Path::new("c.toml")).is_ok(),
            "{gateway} {admin}"
        );
    }
}

/// `health_path` is answered by sluice before routing; a route may still hold it (the
/// catch-all `/` with `health_path = "/"`, as load balancers probe by default): the route gets
/// every other path under it.
#[test]
fn a_route_may_hold_the_health_path() {
    let text = "[gateway]\nhealth_path = \"/\"\n[[routes]]\nname = \"all\"\npath = \"/\"\nrespond = { status = 200 }\n";
    assert!(parse(text, Path::new("c.toml")).is_ok());
}

/// Upstream names follow the rule route and limit names do: they are printed by `check` and
/// in logs, where a control character would forge output.
#[test]
fn upstream_names_are_usable_names() {
    let e = errors("[upstreams.\"x\\u001b[31m\\nfake\"]\nurl = \"http://127.0.0.1:1\"\n");
    assert_eq!(
        e,
        ["c.toml:1:12: upstreams.x\\u{1b}[31m\\nfake: \"x\\u{1b}[31m\\nfake\" is not a usable name (1 to 64 ASCII letters, digits, '-', '_' or '.')"]
    );
    let e = errors("[upstreams.\"\"]\nurl = \"http://127.0.0.1:1\"\n[[routes]]\nname = \"r\"\npath = \"/\"\nupstream = \"\"\n");
    assert_eq!(
        e.len(),
        1,
        "a route naming it is not told it is missing: {e:?}"
    );
}

/// Values that would be silently unused, repeated or odd are refused where they are written.
#[test]
fn repeated_unused_or_odd_values_are_refused() {
    let cases = [
        (
            "[[routes]]\nname = \"r\"\npath = \"/\"\nrespond = { status = 205, body = \"x\" }\n",
            "routes[0].respond.body: a 205 response has no body",
        ),
        (
            "[responses]\nproblem_base = \"urn:x\\u0000\"\n",
            "responses.problem_base: \"urn:x\\u{0}\" is not an absolute URI",
        ),
        (
            "[identity]\napi_key = [\"bearer\", \"header:x-api-key\", \"bearer\"]\n",
            "identity.api_key[2]: \"bearer\" is listed twice",
        ),
        (
            "[identity]\ntrusted_proxies = [\"10.0.0.0/8\", \"::ffff:10.0.0.0/104\"]\n",
            "identity.trusted_proxies[1]: \"::ffff:10.0.0.0/104\" is listed twice (as 10.0.0.0/8)",
        ),
        (
            "[store]\nkind = \"redis\"\nurl = \"redis://h\"\non_error = \"allow\"\ninstances = 3\n",
            "store.instances: 3 is not used: only on_error = \"local\" divides the quota among instances",
        ),
        (
            "[[routes]]\nname = \"r\"\npath = \"/\"\nhost = \"a..b\"\nrespond = { status = 200 }\n",
            "routes[0].host: \"a..b\" is not a host name",
        ),
    ];
    // Review: hosts a route could never match were taken as having no port.
    let cases = cases.into_iter().map(|(t, e)| (t.to_owned(), e.to_owned())).chain(
        ["example.com:", "a:b", "a:65536", "[::1]x", "a:+80", "::1", "a:0"].map(|host| {
            (
                format!("[[routes]]\nname = \"r\"\npath = \"/\"\nhost = \"{host}\"\nrespond = {{ status = 200 }}\n"),
                format!("routes[0].host: \"{host}\" is not a host name"),
            )
        }),
    ).chain(
        ["-:x", "+:x", "1http://x/", "https://ex.com/<x>", "http://x/%zz", "http://x/%4", "a:b\\\\c"].map(|base| {
            (
                format!("[responses]\nproblem_base = \"{base}\"\n"),
                format!("responses.problem_base: \"{}\" is not an absolute URI", base.replace("\\\\", "\\")),
            )
        }),
    );
    let (mut fine_hosts, mut fine_bases) = (Vec::new(), Vec::new());
    for host in ["[::1]", "a.example.", "api-1_x.example.com"] {
        fine_hosts.push(format!("[[routes]]\nname = \"r\"\npath = \"/\"\nhost = \"{host}\"\nrespond = {{ status = 200 }}\n"));
    }
    for base in [
        "urn:sluice:problem:",
        "https://api.example.com/problems/",
        "tag:x.org,2026:p%2F#",
    ] {
        fine_bases.push(format!("[responses]\nproblem_base = \"{base}\"\n"));
    }
    for text in fine_hosts.iter().chain(&fine_bases) {
        assert!(parse(text, Path::new("c.toml")).is_ok(), "{text}");
    }
    assert_eq!(
        errors("[[routes]]\nname = \"r\"\npath = \"/\"\nhost = \"[::1]:80\"\nrespond = { status = 200 }\n"),
        ["c.toml:4:8: routes[0].host: \"[::1]:80\" has a port: a route matches its host on any port (write the host alone)"]
    );
    for (text, expected) in cases {
        let e = errors(&text);
        assert_eq!(e.len(), 1, "{e:?}");
        assert!(e[0].contains(&expected), "{text}: {e:?}");
    }
}

#[test]
fn count_unrouted_can_be_turned_off_and_takes_only_a_boolean() {
    let c = parse("[gateway]\ncount_unrouted = false\n", Path::new("u.toml")).unwrap();
    assert!(!c.gateway.count_unrouted);
    let e = parse("[gateway]\ncount_unrouted = \"no\"\n", Path::new("u.toml"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("u.toml:2:") && e.contains("count_unrouted"),
        "{e}"
    );
}

#[test]
fn a_bucket_that_takes_over_100_years_to_fill_is_refused() {
    let limit = |burst: u32| {
        format!("[[limits]]\nname = \"huge\"\nby = \"ip\"\nquota = 1\nwindow = \"36500d\"\nburst = {burst}\n")
    };
    assert!(parse(&limit(1), Path::new("c.toml")).is_ok());
    assert_eq!(
        errors(&limit(4_294_967_295)),
        ["c.toml:6:9: limits[0].burst: a bucket of 4294967295 refilled 1 per 36500d takes more than 36500d (100 years) to fill: lower the burst or shorten the window"]
    );
}

#[test]
fn max_keys_defaults_to_a_million_and_is_a_count() {
    let limit = "[[limits]]\nname = \"k\"\nby = \"api_key\"\nquota = 5\nwindow = \"1m\"\n";
    let c = parse(limit, Path::new("c.toml")).unwrap();
    assert_eq!(c.limits[0].max_keys.get(), 1_000_000);
    let c = parse(&format!("{limit}max_keys = 50000\n"), Path::new("c.toml")).unwrap();
    assert_eq!(c.limits[0].max_keys.get(), 50_000);
    let e = errors(&format!("{limit}max_keys = 0\n"));
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(
        e[0].starts_with("c.toml:6:12: limits[0].max_keys: "),
        "{}",
        e[0]
    );
}

/// A section or entry is a table and only a table: an array in its place was read by position
/// (`respond = [201, "x", "text/plain"]` served a 201, `admin = ["127.0.0.1:9999"]` listened
/// there), past the check for unknown keys (found by review). And a table where one value
/// goes is said in TOML's words.
#[test]
fn an_array_is_no_table_and_a_table_is_no_value() {
    for (text, said) in [
        (
            "[[routes]]\nname = \"r\"\npath = \"/\"\nrespond = [201, \"x\", \"text/plain\"]\n",
            "c.toml:4:11: routes[0].respond: [201, \"x\", \"text/plain\"]: invalid type: sequence, expected a table",
        ),
        (
            "admin = [\"127.0.0.1:9999\"]\n",
            "c.toml:1:9: admin: [\"127.0.0.1:9999\"]: invalid type: sequence, expected a table",
        ),
        (
            "[gateway]\noverload_retry_after = [\"3s\", \"7s\"]\n",
            "c.toml:2:24: gateway.overload_retry_after: [\"3s\", \"7s\"]: invalid type: sequence, expected a table",
        ),
        (
            "[[gateway]]\nlisten = \"127.0.0.1:1\"\n",
            "c.toml:1:1: gateway: invalid type: sequence, expected a table",
        ),
        (
            "[gateway]\nmax_held.x = 1\n",
            "c.toml:2:10: gateway.max_held.x: invalid type: table, expected one value",
        ),
    ] {
        assert_eq!(errors(text), [said], "{text}");
    }
}

/// A control character is named wherever it stands (review: one in a comment gave a line with
/// no message at all).
#[test]
fn a_control_character_is_named_even_in_a_comment() {
    let said = |text: &str| errors(text).join("\n");
    assert_eq!(
        said("# c\u{1}mment\n"),
        "c.toml:1:4: control character U+0001 is not allowed here: TOML allows none but tab outside strings, comments included (inside a string, write it as \\u0001)"
    );
    let e = said("[gateway]\nlisten = \"127.0.0.1:1\" # \u{7f}\n");
    assert!(
        e.starts_with("c.toml:2:26: gateway.listen: control character U+007F is not allowed here"),
        "{e}"
    );
}

/// The file's name is printed as one printable line: a name holding a newline could forge a
/// line of its own (found by review).
#[test]
fn a_file_name_cannot_forge_a_line() {
    let e = parse("x = 1\n", Path::new("evil\nfake.toml:1:1: forged")).unwrap_err();
    assert_eq!(e.0.len(), 1);
    let line = e.to_string();
    assert!(
        !line.contains('\n') && line.starts_with("evil\\nfake.toml"),
        "{line}"
    );
    let missing = sluice_config::load(Path::new("/nonexistent/a\nb.toml")).unwrap_err();
    assert!(!missing.to_string().contains('\n'), "{missing}");
}

/// Review: the key an error is about was read from the text around it, which quoted table
/// names, inline tables and a multi-line string holding a `[x]` line misled. It is read from
/// the parsed document's spans.
#[test]
fn errors_name_keys_under_quoted_tables_inside_inline_tables_and_after_long_strings() {
    let route = "[[routes]]\nname = \"r\"\npath = \"/\"\n";
    let cases = [
        (
            "[upstreams.\"app\"]\nurl = \"http://127.0.0.1:1\"\nbogus = 1\n".to_owned(),
            "c.toml:3:1: upstreams.app.bogus: ",
        ),
        (
            format!("{route}respond = {{ status = \"x\" }}\n"),
            "c.toml:4:22: routes[0].respond.status: ",
        ),
        (
            format!("{route}respond = {{ status = 200, body = \"\"\"\n[x]\n\"\"\", bogus = 1 }}\n"),
            "c.toml:6:6: routes[0].respond.bogus: ",
        ),
        (
            format!("{route}respond = {{ status = 200, body = \"\"\"\n[x]\nname = 1\"\"\" }}\n[[limits]]\nname = \"l\"\nquota = \"many\"\n"),
            "c.toml:9:9: limits[0].quota: ",
        ),
    ];
    for (text, want) in cases {
        let e = errors(&text);
        assert!(
            e.iter().any(|e| e.starts_with(want)),
            "{want}\n{e:#?}\n{text}"
        );
    }
}

/// A date-time where another value goes is called one (toml hands it to serde as a map).
#[test]
fn a_date_time_is_called_one() {
    let e =
        errors("[upstreams.app]\nurl = \"http://127.0.0.1:1\"\ntimeout = 1979-05-27T07:32:00Z\n");
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(e[0].contains("invalid type: date-time"), "{e:?}");
    let e = errors("[gateway]\nlisten = { a = 1 }\n");
    assert!(e[0].contains("invalid type: table"), "{e:?}");
}

/// A table may be written with dotted keys, as TOML allows, also where a route's `respond`
/// or the gateway's `overload_retry_after` goes (review: both were refused as "invalid type:
/// table, expected one value", while other dotted keys were read).
#[test]
fn tables_written_with_dotted_keys_are_read() {
    let text = "[gateway]\noverload_retry_after.min = \"3s\"\noverload_retry_after.max = \"7s\"\n\n[[routes]]\nname = \"a\"\npath = \"/a\"\nrespond.status = 201\nrespond.body = \"made\\n\"\n";
    let c = parse(text, Path::new("c.toml")).unwrap();
    assert_eq!(c.gateway.overload_retry_after.min, Duration::from_secs(3));
    assert_eq!(c.gateway.overload_retry_after.max, Duration::from_secs(7));
    let RouteAction::Respond(r) = &c.routes[0].action else {
        panic!("{:?}", c.routes[0].action);
    };
    assert_eq!((r.status.as_u16(), &*r.body), (201, "made\n"));
    // Their errors are still placed at the value.
    let text = "[[routes]]\nname = \"a\"\npath = \"/a\"\nrespond.status = 99\n";
    assert_eq!(
        errors(text),
        ["c.toml:4:18: routes[0].respond.status: 99 is not a status code between 200 and 599"]
    );
    let text = "[gateway]\noverload_retry_after.min = \"9s\"\noverload_retry_after.max = \"7s\"\n";
    assert_eq!(
        errors(text),
        ["c.toml:2:28: gateway.overload_retry_after: min \"9s\" is longer than max \"7s\""]
    );
}
