//! The container image: the repository's `Dockerfile` (its `prebuilt` target), built around
//! the `forge` binary this build made, on a base made of the host's own loader and the
//! libraries the binary links (no image registry is reached). Run as a user runs it
//! (`docker run -v MODELS:/models IMAGE serve -m /models/M.gguf`), it becomes healthy
//! through its own `HEALTHCHECK`, answers the official `openai` client, and on `docker
//! stop` (SIGTERM) finishes the request in flight, then exits 0; run with no arguments,
//! its own command serves `/models/model.gguf`.
//!
//! Needs a running Docker daemon: `.ci/run` starts one where it can and then sets
//! `BATCH_FORGE_DOCKER=1`, which turns "no daemon" into a failure. Elsewhere the test is
//! skipped, loudly.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

fn docker(args: &[&str]) -> Output {
    Command::new("docker").args(args).output().expect("run docker")
}

/// `docker ARGS`, which must succeed; its stdout, trimmed.
fn docker_ok(args: &[&str]) -> String {
    let out = docker(args);
    assert!(
        out.status.success(),
        "docker {}: {}\n{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn daemon_available() -> bool {
    let required = std::env::var("BATCH_FORGE_DOCKER").is_ok_and(|v| v == "1");
    let up = Command::new("docker")
        .args(["info", "--format", "{{.ServerVersion}}"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !up {
        let msg = "no Docker daemon (docker info failed): the container test did not run";
        assert!(!required, "{msg}, although BATCH_FORGE_DOCKER=1 says .ci/run started one");
        eprintln!("SKIP: {msg}");
    }
    up
}

/// Removes the container and the images however the test ends.
struct Cleanup {
    container: String,
    images: Vec<String>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = docker(&["rm", "-f", "-v", &self.container]);
        for image in &self.images {
            let _ = docker(&["rmi", "-f", image]);
        }
    }
}

/// A root file system holding what `binary` needs to start: the dynamic loader and the
/// shared libraries `ldd` lists (glibc's, as a slim Debian image has them), and `/tmp`.
fn base_root(binary: &Path, root: &Path) {
    let out = Command::new("ldd").arg(binary).output().expect("run ldd");
    assert!(out.status.success(), "ldd {}: {}", binary.display(), String::from_utf8_lossy(&out.stderr));
    let mut libs = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or "/lib64/ld-linux-x86-64.so.2 (0x...)"
        let path = match line.split_once("=>") {
            Some((_, right)) => right.split_whitespace().next(),
            None => line.split_whitespace().next(),
        };
        if let Some(p) = path.filter(|p| p.starts_with('/')) {
            libs.push(PathBuf::from(p));
        }
    }
    assert!(libs.iter().any(|l| l.to_string_lossy().contains("libc.so")), "ldd found no libc: {libs:?}");
    for lib in libs {
        let dest = root.join(lib.strip_prefix("/").unwrap());
        std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
        std::fs::copy(&lib, &dest).unwrap_or_else(|e| panic!("copy {}: {e}", lib.display()));
    }
    let tmp = root.join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o1777)).unwrap();
    }
}

#[test]
fn image_becomes_healthy_serves_and_drains_on_docker_stop() {
    if !daemon_available() {
        return;
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let binary = Path::new(env!("CARGO_BIN_EXE_forge"));
    let tag = format!("forge-test-{}", std::process::id());
    let base = format!("{tag}-base");
    let _cleanup = Cleanup { container: tag.clone(), images: vec![tag.clone(), base.clone()] };
    let dir = tempfile::tempdir().unwrap();

    // The base image: no registry, no package manager; `docker import` of a tarball.
    let root = dir.path().join("root");
    base_root(binary, &root);
    let tarball = dir.path().join("base.tar");
    let tar = Command::new("tar").arg("-C").arg(&root).arg("-cf").arg(&tarball).arg(".").status().unwrap();
    assert!(tar.success());
    docker_ok(&["import", tarball.to_str().unwrap(), &base]);

    // The build context: the repository's Dockerfile and this build's binary.
    let context = dir.path().join("context");
    std::fs::create_dir_all(&context).unwrap();
    std::fs::copy(repo.join("Dockerfile"), context.join("Dockerfile")).unwrap();
    std::fs::copy(binary, context.join("forge")).unwrap();
    docker_ok(&[
        "build",
        "--quiet",
        "--target",
        "prebuilt",
        "--build-arg",
        &format!("RUNTIME_IMAGE={base}"),
        "--build-arg",
        "FORGE_BINARY=forge",
        "-t",
        &tag,
        context.to_str().unwrap(),
    ]);
    // The image is its base and the binary: well under the 100 MB a CPU image may take.
    let size: u64 = docker_ok(&["image", "inspect", "-f", "{{.Size}}", &tag]).parse().unwrap();
    assert!(size < 100_000_000, "the image is {size} bytes");
    // The image runs as a non-root user and checks its own health.
    assert_eq!(docker_ok(&["image", "inspect", "-f", "{{.Config.User}}", &tag]), "10001:10001");
    let check = docker_ok(&["image", "inspect", "-f", "{{json .Config.Healthcheck.Test}}", &tag]);
    assert!(check.contains("\"forge\",\"health\""), "{check}");

    // As a user runs it: a folder of models on the volume, `serve -m` one of them (the
    // image's FORGE_HOST makes it reachable); a 20 ms pause per step makes a 60-token
    // answer last long enough to stop the container in the middle of it.
    let models = repo.join("tests/fixtures/tiny-gpt2");
    let volume = format!("{}:/models:ro", models.display());
    let logs = |name: &str| {
        let out = docker(&["logs", name]);
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
    };
    let start = |name: &str, volume: &str, command: &[&str]| -> String {
        let mut args = vec!["run", "-d", "--name", name, "-p", "127.0.0.1::8080", "--health-interval", "1s"];
        args.extend(["-e", "BATCH_FORGE_STEP_DELAY_MS=20", "-v", volume, &tag]);
        args.extend(command);
        docker_ok(&args);
        let t0 = Instant::now();
        loop {
            // Docker's own verdict, from the image's HEALTHCHECK (`forge health`).
            let health = docker_ok(&["inspect", "-f", "{{.State.Health.Status}}", name]);
            if health == "healthy" {
                break;
            }
            let running = docker_ok(&["inspect", "-f", "{{.State.Running}}", name]);
            assert!(running == "true", "the container stopped: {}", logs(name));
            assert!(t0.elapsed() < Duration::from_secs(90), "never healthy ({health}): {}", logs(name));
            std::thread::sleep(Duration::from_millis(200));
        }
        let port = docker_ok(&["port", name, "8080/tcp"]);
        format!("http://{}", port.lines().next().unwrap())
    };
    let base_url = start(&tag, &volume, &["serve", "-m", "/models/tiny-gpt2.q8_0.gguf"]);

    let greedy = ureq::post(&format!("{base_url}/v1/completions"))
        .send_string(&json!({"prompt": "Hello", "max_tokens": 8, "temperature": 0}).to_string())
        .unwrap_or_else(|e| panic!("{e}: {}", logs(&tag)));
    let greedy: Value = serde_json::from_str(&greedy.into_string().unwrap()).unwrap();
    assert_eq!(greedy["usage"]["completion_tokens"], 8, "{greedy}");
    assert_eq!(greedy["model"], "tiny-gpt2.q8_0.gguf", "{greedy}");
    // The official openai client gets the same answer, where .ci/run provides it.
    match std::env::var_os("BATCH_FORGE_OPENAI_PYTHON") {
        Some(python) => {
            let script = "import sys, openai\n\
                          c = openai.OpenAI(base_url=sys.argv[1] + '/v1', api_key='none')\n\
                          r = c.completions.create(model='any', prompt='Hello', max_tokens=8, temperature=0)\n\
                          print(r.choices[0].text, end='')";
            let out = Command::new(python).args(["-c", script, &base_url]).output().unwrap();
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            assert_eq!(String::from_utf8_lossy(&out.stdout), greedy["choices"][0]["text"].as_str().unwrap());
        }
        None => {
            let msg = "BATCH_FORGE_OPENAI_PYTHON is not set: the openai client was not tried against the image";
            assert!(!std::env::var("CI").is_ok_and(|v| v == "true"), "{msg}");
            eprintln!("SKIP: {msg}");
        }
    }

    // A stream in flight, then `docker stop` (SIGTERM; SIGKILL only after 30 s).
    let body = json!({"prompt": "a", "max_tokens": 60, "stream": true, "ignore_eos": true, "temperature": 0,
                      "stream_options": {"include_usage": true}});
    let r = ureq::post(&format!("{base_url}/v1/completions")).send_string(&body.to_string()).unwrap();
    let mut lines = BufReader::new(r.into_reader()).lines();
    assert!(lines.next().unwrap().unwrap().starts_with("data: "));
    let mut stop = Command::new("docker").args(["stop", "-t", "30", &tag]).stdout(Stdio::null()).spawn().unwrap();
    let rest: Vec<String> = lines.map_while(Result::ok).filter(|l| l.starts_with("data: ")).collect();
    assert_eq!(rest.last().map(String::as_str), Some("data: [DONE]"), "{rest:?}");
    assert!(!rest.iter().any(|l| l.contains("\"error\"")), "{rest:?}");
    let usage = rest
        .iter()
        .filter_map(|l| serde_json::from_str::<Value>(&l[6..]).ok())
        .find_map(|v| v["usage"]["completion_tokens"].as_u64());
    assert_eq!(usage, Some(60), "the stream was cut short: {rest:?}");
    assert!(stop.wait().unwrap().success());
    assert_eq!(docker_ok(&["inspect", "-f", "{{.State.ExitCode}}", &tag]), "0", "{}", logs(&tag));
    let log = logs(&tag);
    assert!(log.contains("drained: every request in flight finished"), "{log}");

    // The image's own command: one model mounted as /models/model.gguf, no arguments.
    let second = format!("{tag}-default");
    let _cleanup_second = Cleanup { container: second.clone(), images: Vec::new() };
    let file = format!("{}:/models/model.gguf:ro", models.join("tiny-gpt2.q8_0.gguf").display());
    let base_url = start(&second, &file, &[]);
    let r = ureq::post(&format!("{base_url}/v1/completions"))
        .send_string(&json!({"prompt": "Hello", "max_tokens": 8, "temperature": 0}).to_string())
        .unwrap_or_else(|e| panic!("{e}: {}", logs(&second)));
    let v: Value = serde_json::from_str(&r.into_string().unwrap()).unwrap();
    assert_eq!(v["model"], "model.gguf", "{v}");
    assert_eq!(v["choices"][0]["text"], greedy["choices"][0]["text"], "the same model, the same answer");
}
