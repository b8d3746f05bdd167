//! `PeerUrl`: the normalised base URL of a sibling router's internal listener.
//!
//! Every source (static list, DNS, EndpointSlices) produces peers in this one form so that
//! set equality, deduplication and self-exclusion compare like with like: `HTTP://Router:80/`
//! and `http://router` are the same peer, and `[::1]` written in any IPv6 spelling is one host.
//! Only a base URL is accepted (scheme, host, port, optional path prefix); userinfo, query and
//! fragment are rejected because the snapshot client appends its own path and query.

use std::fmt;
use std::net::{IpAddr, SocketAddr};

use thiserror::Error;

/// Longest peer URL accepted, so a hostile flag or slice cannot make us hold huge strings.
pub const PEER_URL_MAX_BYTES: usize = 2048;

/// Why a string is not a usable peer base URL.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum PeerUrlError {
    #[error("peer URL is empty")]
    Empty,
    #[error("peer URL is {len_bytes} bytes, over the limit of {PEER_URL_MAX_BYTES}")]
    TooLong { len_bytes: usize },
    #[error("peer URL {url:?}: scheme must be http or https")]
    UnsupportedScheme { url: String },
    #[error("peer URL {url:?}: {what} is not allowed in a peer base URL")]
    NotABaseUrl { url: String, what: &'static str },
    #[error("peer URL {url:?}: missing host")]
    MissingHost { url: String },
    #[error("peer URL {url:?}: invalid host")]
    InvalidHost { url: String },
    #[error("peer URL {url:?}: invalid port")]
    InvalidPort { url: String },
}

/// A normalised peer base URL, e.g. `http://10.0.0.5:8081` (always with an explicit port,
/// lower-case scheme and host, canonical IP spelling, no trailing slash).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PeerUrl {
    normalised: String,
    host: String,
    port: u16,
}

impl PeerUrl {
    /// Parses and normalises `raw`. A missing scheme means `http://`, because the internal
    /// listener is plain HTTP inside the cluster unless said otherwise.
    pub fn parse(raw: &str) -> Result<Self, PeerUrlError> {
        let trimmed = raw.trim();
        if trimmed.is_empty() {
            return Err(PeerUrlError::Empty);
        }
        if trimmed.len() > PEER_URL_MAX_BYTES {
            return Err(PeerUrlError::TooLong {
                len_bytes: trimmed.len(),
            });
        }
        let owned = || trimmed.to_string();
        let (scheme, rest) = match trimmed.split_once("://") {
            Some((scheme, rest)) => (scheme.to_ascii_lowercase(), rest),
            None => ("http".to_string(), trimmed),
        };
        let default_port = match scheme.as_str() {
            "http" => 80,
            "https" => 443,
            _ => return Err(PeerUrlError::UnsupportedScheme { url: owned() }),
        };
        if rest.contains('?') {
            return Err(PeerUrlError::NotABaseUrl {
                url: owned(),
                what: "a query",
            });
        }
        if rest.contains('#') {
            return Err(PeerUrlError::NotABaseUrl {
                url: owned(),
                what: "a fragment",
            });
        }
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        if authority.contains('@') {
            return Err(PeerUrlError::NotABaseUrl {
                url: owned(),
                what: "userinfo",
            });
        }
        let (host_raw, port_raw) =
            split_host_port(authority).ok_or_else(|| PeerUrlError::InvalidHost { url: owned() })?;
        if host_raw.is_empty() {
            return Err(PeerUrlError::MissingHost { url: owned() });
        }
        let host =
            normalise_host(host_raw).ok_or_else(|| PeerUrlError::InvalidHost { url: owned() })?;
        let port = match port_raw {
            None | Some("") => default_port,
            Some(p) => p
                .parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| PeerUrlError::InvalidPort { url: owned() })?,
        };
        let path = path.trim_end_matches('/');
        Ok(Self::assemble(&scheme, host, port, path))
    }

    /// The URL of a sibling found by address (DNS answer, EndpointSlice address).
    pub fn from_socket_addr(https: bool, addr: SocketAddr) -> Self {
        let scheme = if https { "https" } else { "http" };
        Self::assemble(scheme, host_of_ip(addr.ip()), addr.port(), "")
    }

    fn assemble(scheme: &str, host: String, port: u16, path: &str) -> Self {
        let normalised = format!("{scheme}://{host}:{port}{path}");
        Self {
            normalised,
            host,
            port,
        }
    }

    pub fn as_str(&self) -> &str {
        &self.normalised
    }

    /// Host as it appears in the URL (IPv6 in brackets), lower-case.
    pub fn host(&self) -> &str {
        &self.host
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The host as an IP address, when it is one (used to exclude our own pod by IP).
    pub fn ip(&self) -> Option<IpAddr> {
        self.host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse()
            .ok()
    }
}

impl fmt::Display for PeerUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.normalised)
    }
}

/// Splits `host[:port]` or `[v6][:port]`; `None` when brackets are unbalanced or a bare
/// IPv6 address is written without them (its colons would be ambiguous with the port).
fn split_host_port(authority: &str) -> Option<(&str, Option<&str>)> {
    if let Some(after_bracket) = authority.strip_prefix('[') {
        let close = after_bracket.find(']')?;
        let host = &authority[..close + 2];
        let tail = &after_bracket[close + 1..];
        return match tail {
            "" => Some((host, None)),
            _ => Some((host, Some(tail.strip_prefix(':')?))),
        };
    }
    match authority.matches(':').count() {
        0 => Some((authority, None)),
        1 => authority.split_once(':').map(|(h, p)| (h, Some(p))),
        _ => None,
    }
}

fn normalise_host(host: &str) -> Option<String> {
    if let Some(inner) = host.strip_prefix('[') {
        let inner = inner.strip_suffix(']')?;
        let ip: std::net::Ipv6Addr = inner.parse().ok()?;
        return Some(host_of_ip(IpAddr::V6(ip)));
    }
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Some(host_of_ip(ip));
    }
    let valid = host
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_');
    valid.then(|| host.trim_end_matches('.').to_ascii_lowercase())
}

fn host_of_ip(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => v4.to_string(),
            None => format!("[{v6}]"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spellings_of_one_peer_normalise_to_one_url() {
        let forms = [
            "http://10.0.0.5:8081",
            "HTTP://10.0.0.5:8081/",
            "10.0.0.5:8081",
            " http://10.0.0.5:8081// ",
        ];
        for form in forms {
            assert_eq!(
                PeerUrl::parse(form).unwrap().as_str(),
                "http://10.0.0.5:8081",
                "form {form:?}"
            );
        }
        assert_eq!(
            PeerUrl::parse("http://Router-1.NS.svc.:80")
                .unwrap()
                .as_str(),
            "http://router-1.ns.svc:80"
        );
        assert_eq!(
            PeerUrl::parse("https://router").unwrap().as_str(),
            "https://router:443"
        );
        assert_eq!(
            PeerUrl::parse("http://[0:0:0:0:0:0:0:1]:8081").unwrap(),
            PeerUrl::parse("http://[::1]:8081").unwrap()
        );
        assert_eq!(
            PeerUrl::parse("http://[::ffff:10.0.0.5]:8081").unwrap(),
            PeerUrl::parse("http://10.0.0.5:8081").unwrap()
        );
    }

    #[test]
    fn path_prefix_is_kept_without_trailing_slash() {
        assert_eq!(
            PeerUrl::parse("http://gw:8081/router/").unwrap().as_str(),
            "http://gw:8081/router"
        );
    }

    #[test]
    fn non_base_urls_get_typed_errors() {
        assert_eq!(PeerUrl::parse("  "), Err(PeerUrlError::Empty));
        assert!(matches!(
            PeerUrl::parse("ftp://x:1"),
            Err(PeerUrlError::UnsupportedScheme { .. })
        ));
        assert!(matches!(
            PeerUrl::parse("http://x:1/?a=b"),
            Err(PeerUrlError::NotABaseUrl {
                what: "a query",
                ..
            })
        ));
        assert!(matches!(
            PeerUrl::parse("http://u:p@x:1"),
            Err(PeerUrlError::NotABaseUrl {
                what: "userinfo",
                ..
            })
        ));
        assert!(matches!(
            PeerUrl::parse("http://:8081"),
            Err(PeerUrlError::MissingHost { .. })
        ));
        assert!(matches!(
            PeerUrl::parse("http://::1:8081"),
            Err(PeerUrlError::InvalidHost { .. })
        ));
        assert!(matches!(
            PeerUrl::parse("http://[::1:8081"),
            Err(PeerUrlError::InvalidHost { .. })
        ));
        assert!(matches!(
            PeerUrl::parse("http://x:99999"),
            Err(PeerUrlError::InvalidPort { .. })
        ));
        assert!(matches!(
            PeerUrl::parse("http://x:0"),
            Err(PeerUrlError::InvalidPort { .. })
        ));
        assert!(matches!(
            PeerUrl::parse("http://a b:1"),
            Err(PeerUrlError::InvalidHost { .. })
        ));
        let long = format!("http://{}:1", "a".repeat(PEER_URL_MAX_BYTES));
        assert!(matches!(
            PeerUrl::parse(&long),
            Err(PeerUrlError::TooLong { .. })
        ));
    }

    #[test]
    fn socket_addr_urls_match_parsed_urls_and_expose_the_ip() {
        let v4: SocketAddr = "10.1.2.3:8081".parse().unwrap();
        let v6: SocketAddr = "[fd00::1]:8081".parse().unwrap();
        let u4 = PeerUrl::from_socket_addr(false, v4);
        let u6 = PeerUrl::from_socket_addr(false, v6);
        assert_eq!(u4, PeerUrl::parse("http://10.1.2.3:8081").unwrap());
        assert_eq!(u6.as_str(), "http://[fd00::1]:8081");
        assert_eq!(u4.ip(), Some(v4.ip()));
        assert_eq!(u6.ip(), Some(v6.ip()));
        assert_eq!(PeerUrl::parse("http://router:1").unwrap().ip(), None);
    }
}
