//! `forge health`: ask a running `forge serve` whether it is ready, for container
//! health checks and scripts (an image needs no curl): exit status 0 when `/health`
//! answers 200, 1 otherwise, with the reason on stderr.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;

#[derive(Args)]
pub struct HealthArgs {
    /// The server's readiness URL (plain http).
    #[arg(long, default_value = "http://127.0.0.1:8080/health")]
    url: String,
    /// Seconds to wait for the answer.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=3600))]
    timeout: u64,
}

pub fn run(args: HealthArgs) -> anyhow::Result<()> {
    let (host, port, path) = parse_url(&args.url)?;
    let deadline = Instant::now() + Duration::from_secs(args.timeout);
    let left = || deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    // Every address the name resolves to (localhost may be ::1 first), until one answers.
    let addrs: Vec<_> =
        (host.as_str(), port).to_socket_addrs().with_context(|| format!("cannot resolve {host}"))?.collect();
    let mut stream = None;
    for addr in &addrs {
        if let Ok(s) = TcpStream::connect_timeout(addr, left()) {
            stream = Some(s);
            break;
        }
    }
    let Some(mut stream) = stream else { bail!("no server at {host}:{port}") };
    stream.set_write_timeout(Some(left()))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n")?;
    // Read until the answer is complete (its Content-Length, or the connection's end),
    // at most 64 KiB, within the one deadline.
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        stream.set_read_timeout(Some(left()))?;
        let n = match stream.read(&mut buf) {
            Ok(n) => n,
            Err(e) if answer.is_empty() => return Err(e).context(format!("no answer from {}", args.url)),
            Err(_) => break, // timed out after a partial answer: judge what came
        };
        if n == 0 {
            break;
        }
        answer.extend_from_slice(&buf[..n]);
        if answer.len() >= 64 * 1024 || complete(&answer) {
            break;
        }
    }
    let answer = String::from_utf8_lossy(&answer);
    let status = answer.lines().next().unwrap_or("");
    let code = status.split_whitespace().nth(1).unwrap_or("");
    if code == "200" {
        println!("ready ({})", args.url);
        return Ok(());
    }
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b.trim());
    // Our server explains a 503 ("the model is loading", "draining") in its error JSON.
    let reason = serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
        .unwrap_or_else(|| body.chars().take(200).collect());
    if status.is_empty() {
        bail!("not ready: an empty answer from {}", args.url);
    }
    bail!("not ready: {status} {reason}");
}

/// Whether `answer` holds its headers and the whole body its Content-Length announces.
fn complete(answer: &[u8]) -> bool {
    let Some(end) = answer.windows(4).position(|w| w == b"\r\n\r\n") else { return false };
    let head = String::from_utf8_lossy(&answer[..end]).to_ascii_lowercase();
    let length =
        head.lines().find_map(|l| l.strip_prefix("content-length:").and_then(|v| v.trim().parse::<usize>().ok()));
    length.is_some_and(|n| answer.len() >= end + 4 + n)
}

/// `http://host[:port][/path]` → (host, port, path).
fn parse_url(url: &str) -> anyhow::Result<(String, u16, String)> {
    let Some(rest) = url.strip_prefix("http://") else {
        bail!("--url must start with http:// (got {url:?})");
    };
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/health"),
    };
    let port_of = |p: &str| p.parse::<u16>().with_context(|| format!("bad port {p:?} in {url:?}"));
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let Some((host, after)) = v6.split_once(']') else { bail!("unclosed [ in {url:?}") };
        match after.strip_prefix(':') {
            Some(p) => (host, port_of(p)?),
            None if after.is_empty() => (host, 80),
            None => bail!("bad address {authority:?} in {url:?}"),
        }
    } else {
        match authority.rsplit_once(':') {
            Some((host, p)) => (host, port_of(p)?),
            None => (authority, 80),
        }
    };
    if host.is_empty() {
        bail!("no host in {url:?}");
    }
    Ok((host.to_string(), port, path.to_string()))
}

#[cfg(test)]
mod tests {
    use super::{complete, parse_url};

    #[test]
    fn an_answer_is_complete_at_its_content_length() {
        assert!(!complete(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n"));
        assert!(!complete(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nab"));
        assert!(complete(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nabcd"));
        assert!(!complete(b"HTTP/1.1 200 OK\r\n\r\nabcd")); // no length: read to the end
    }

    #[test]
    fn urls_parse_and_bad_ones_are_errors() {
        let p = |u: &str| parse_url(u).map_err(|e| e.to_string());
        assert_eq!(p("http://127.0.0.1:8080/health").unwrap(), ("127.0.0.1".into(), 8080, "/health".into()));
        assert_eq!(p("http://localhost").unwrap(), ("localhost".into(), 80, "/health".into()));
        assert_eq!(p("http://[::1]:9000/ready").unwrap(), ("::1".into(), 9000, "/ready".into()));
        assert_eq!(p("http://[::1]/h").unwrap(), ("::1".into(), 80, "/h".into()));
        assert!(p("https://x/health").unwrap_err().contains("http://"));
        assert!(p("http://x:99999/").unwrap_err().contains("bad port"));
        assert!(p("http://:80/").unwrap_err().contains("no host"));
    }
}
