//! Replicas behind a router: two `forge serve` processes behind nginx (round robin, as a
//! Kubernetes Service or any HTTP load balancer spreads requests). One replica runs this
//! CPU's best kernel level, the other the portable kernels (`BATCH_FORGE_ISA=portable`),
//! as two machines with different CPUs would. The same request gets the same answer,
//! tokens and logprobs, bit for bit, from either replica, greedy and seeded alike; each
//! replica's `/metrics` carries the names the Gateway API Inference Extension reads.
//!
//! Needs nginx (`.ci/run` installs Debian's `nginx-light`); without it the test skips
//! loudly, and fails under `CI=true`.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

struct Replica {
    child: Child,
    addr: String,
    log: Arc<Mutex<String>>,
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn replica(model: &Path, isa: Option<&str>) -> Replica {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_forge"));
    cmd.args(["serve", "-m", model.to_str().unwrap(), "--port", "0", "-t", "1", "-np", "2"])
        .env("RUST_LOG", "info")
        .env_remove("FORGE_API_KEY")
        .env_remove("FORGE_HOST")
        .env_remove("BATCH_FORGE_ISA")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if let Some(isa) = isa {
        cmd.env("BATCH_FORGE_ISA", isa);
    }
    let mut child = cmd.spawn().expect("start forge serve");
    let stderr = child.stderr.take().unwrap();
    let log = Arc::new(Mutex::new(String::new()));
    let (tx, rx) = mpsc::channel();
    let log2 = log.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if let Some(addr) = line.strip_prefix("listening on http://") {
                let _ = tx.send(addr.to_owned());
            }
            log2.lock().unwrap().push_str(&format!("{line}\n"));
        }
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("the replica did not start: {}", log.lock().unwrap()));
    let r = Replica { child, addr, log };
    wait_ready(&format!("http://{}", r.addr), &r.log);
    r
}

fn wait_ready(base: &str, log: &Mutex<String>) {
    let t0 = Instant::now();
    while !ureq::get(&format!("{base}/health")).call().is_ok_and(|r| r.status() == 200) {
        assert!(t0.elapsed() < Duration::from_secs(120), "{base} never ready: {}", log.lock().unwrap());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// nginx in the foreground with everything under `dir`, round robin over `upstreams`,
/// naming the replica that answered in an `x-upstream` header.
struct Nginx(Child);

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn nginx(nginx: &Path, dir: &Path, port: u16, upstreams: &[&str]) -> Nginx {
    let d = dir.display();
    let servers: String = upstreams.iter().map(|u| format!("        server {u};\n")).collect();
    let conf = format!(
        "daemon off;\nmaster_process off;\nworker_processes 1;\npid {d}/nginx.pid;\nerror_log {d}/error.log;\n\
         events {{ worker_connections 64; }}\n\
         http {{\n    access_log off;\n    client_body_temp_path {d}/body;\n    proxy_temp_path {d}/proxy;\n\
         \x20   fastcgi_temp_path {d}/fastcgi;\n    uwsgi_temp_path {d}/uwsgi;\n    scgi_temp_path {d}/scgi;\n\
         \x20   upstream forge {{\n{servers}    }}\n\
         \x20   server {{\n        listen 127.0.0.1:{port};\n        location / {{\n\
         \x20           proxy_pass http://forge;\n            proxy_http_version 1.1;\n\
         \x20           proxy_buffering off;\n            add_header x-upstream $upstream_addr always;\n\
         \x20       }}\n    }}\n}}\n"
    );
    let path = dir.join("nginx.conf");
    std::fs::write(&path, conf).unwrap();
    let child = Command::new(nginx)
        .arg("-p")
        .arg(dir)
        .arg("-c")
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start nginx");
    Nginx(child)
}

fn find_nginx() -> Option<PathBuf> {
    let found =
        ["/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/bin/nginx"].iter().map(PathBuf::from).find(|p| p.is_file());
    if found.is_none() {
        let msg = "nginx not found (apt-get install nginx-light; .ci/run does this): the replica test did not run";
        assert!(!std::env::var("CI").is_ok_and(|v| v == "true"), "{msg}");
        eprintln!("SKIP: {msg}");
    }
    found
}

/// SmolLM2 where `.ci/run` fetched it, else the tiny GPT-2 fixture.
fn model() -> PathBuf {
    match std::env::var_os("BATCH_FORGE_SMOLLM2").map(PathBuf::from) {
        Some(p) if p.is_file() => p,
        _ => Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-gpt2/tiny-gpt2.q8_0.gguf"),
    }
}

#[test]
fn replicas_on_different_kernel_levels_answer_the_same_through_a_router() {
    let Some(nginx_bin) = find_nginx() else { return };
    let model = model();
    let a = replica(&model, None);
    let b = replica(&model, Some("portable"));
    // Which kernel level each replica runs (its "model loaded" line names it).
    let isa = |r: &Replica| {
        let t0 = Instant::now();
        loop {
            let log = r.log.lock().unwrap().clone();
            if let Some(line) = log.lines().find(|l| l.contains("model loaded")) {
                let at = line.find("isa=\"").unwrap_or_else(|| panic!("{line}")) + 5;
                return line[at..].split('"').next().unwrap().to_owned();
            }
            assert!(t0.elapsed() < Duration::from_secs(10), "no \"model loaded\" line: {log}");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let (isa_a, isa_b) = (isa(&a), isa(&b));
    eprintln!("replica A runs {isa_a}, replica B {isa_b}");
    assert_eq!(isa_b, "portable");
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        assert_ne!(isa_a, "portable", "replica A should run this CPU's SIMD kernels");
    } else {
        eprintln!("note: this CPU has no SIMD kernel level: both replicas run the portable kernels");
    }
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let _router = nginx(&nginx_bin, dir.path(), port, &[&a.addr, &b.addr]);
    let router = format!("http://127.0.0.1:{port}");
    let t0 = Instant::now();
    while ureq::get(&format!("{router}/health")).call().is_err() {
        let log = std::fs::read_to_string(dir.path().join("error.log")).unwrap_or_default();
        assert!(t0.elapsed() < Duration::from_secs(30), "nginx never answered: {log}");
        std::thread::sleep(Duration::from_millis(50));
    }

    let requests = [
        json!({"prompt": "The capital of France is", "max_tokens": 24, "temperature": 0, "logprobs": 3}),
        json!({"prompt": "A line about the sea:", "max_tokens": 24, "temperature": 0.9, "seed": 11, "logprobs": 1}),
    ];
    for body in requests {
        // Four times through the router: round robin sends two to each replica.
        let mut answers = Vec::new();
        let mut served_by = BTreeSet::new();
        for _ in 0..4 {
            let r = ureq::post(&format!("{router}/v1/completions"))
                .send_string(&body.to_string())
                .unwrap_or_else(|e| panic!("{e}: {}\n{}", a.log.lock().unwrap(), b.log.lock().unwrap()));
            served_by.insert(r.header("x-upstream").unwrap_or("").to_owned());
            let v: Value = serde_json::from_str(&r.into_string().unwrap()).unwrap();
            let choice = &v["choices"][0];
            assert_eq!(v["usage"]["completion_tokens"].as_u64().map(|n| n > 0), Some(true), "{v}");
            // The text and every token's logprob (as the JSON numbers print them, so
            // equal strings mean equal f32 bits).
            answers.push((choice["text"].to_string(), choice["logprobs"].to_string()));
        }
        let want: BTreeSet<String> = [a.addr.clone(), b.addr.clone()].into();
        assert_eq!(served_by, want, "the router did not use both replicas");
        assert!(answers.iter().all(|x| *x == answers[0]), "{body}: the replicas differ: {answers:#?}");
        assert!(answers[0].1.contains("\"token_logprobs\":[-"), "{}", answers[0].1);
    }

    // Each replica's own /metrics carries the router's names.
    for r in [&a, &b] {
        let text = ureq::get(&format!("http://{}/metrics", r.addr)).call().unwrap().into_string().unwrap();
        for name in ["vllm:num_requests_waiting{", "vllm:num_requests_running{", "vllm:kv_cache_usage_perc{"] {
            assert!(text.contains(name), "{name} missing from {}: {text}", r.addr);
        }
        assert!(text.contains("vllm:cache_config_info{") && text.contains("block_size=\"16\""), "{text}");
    }
}
