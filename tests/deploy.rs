//! The Kubernetes manifests in `deploy/kubernetes/`: the core objects validate against
//! Kubernetes' own OpenAPI schemas (the `kubernetes-validate` package, strict: no unknown
//! fields) for the oldest release they need and the newest; the InferencePool holds the
//! fields its CRD requires; and the pieces agree with each other and with forge: the
//! Deployment's command line starts a real server, the probes name real routes, the
//! ports, labels and user match, the termination grace period covers the drain, the
//! autoscaler's metric is one `/metrics` serves.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;

/// The oldest Kubernetes the manifests need (the `sleep` preStop action is on by default
/// from 1.30).
const OLDEST: &str = "1.30.0";

const SCRIPT: &str = r#"
import json, sys
import kubernetes_validate
from kubernetes_validate import utils
out = []
for path in sys.argv[2:]:
    for doc in utils.resources_from_file(path):
        results = []
        for version in (sys.argv[1], utils.latest_version()):
            try:
                kubernetes_validate.validate(doc, version, strict=True)
                results.append("passed")
            except utils.SchemaNotFoundError:
                results.append("no schema")
            except utils.ValidationError as e:
                results.append(f"invalid at {list(e.path)}: {e.message}")
        out.append({"file": path, "doc": doc, "results": results})
print(json.dumps(out))
"#;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn manifests() -> Vec<PathBuf> {
    let mut files = Vec::new();
    for dir in ["deploy/kubernetes", "deploy/kubernetes/gateway"] {
        for e in std::fs::read_dir(repo().join(dir)).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "yaml") {
                files.push(p);
            }
        }
    }
    files.sort();
    files
}

/// Every document of every manifest, with its validation results; None (after a loud
/// skip) without the Python that has `kubernetes-validate`.
fn validated() -> Option<Vec<Value>> {
    let Some(python) = std::env::var_os("BATCH_FORGE_OPENAI_PYTHON") else {
        let msg = "BATCH_FORGE_OPENAI_PYTHON is not set: point it at a Python with `kubernetes-validate` \
                   (.ci/run makes one): the manifest test did not run";
        assert!(!std::env::var("CI").is_ok_and(|v| v == "true"), "{msg}");
        eprintln!("SKIP: {msg}");
        return None;
    };
    let out = Command::new(python).arg("-c").arg(SCRIPT).arg(OLDEST).args(manifests()).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    Some(serde_json::from_slice(&out.stdout).unwrap())
}

fn find<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    let found: Vec<&Value> = docs.iter().map(|d| &d["doc"]).filter(|d| d["kind"] == kind).collect();
    assert_eq!(found.len(), 1, "one {kind} expected");
    found[0]
}

/// The value after `flag` in a command line.
fn arg<'a>(args: &'a [String], flag: &str) -> &'a str {
    let i = args.iter().position(|a| a == flag).unwrap_or_else(|| panic!("{flag} not in {args:?}"));
    &args[i + 1]
}

#[test]
fn kubernetes_manifests_validate_and_agree_with_forge() {
    let Some(docs) = validated() else { return };
    let kinds: Vec<&str> = docs.iter().filter_map(|d| d["doc"]["kind"].as_str()).collect();
    for kind in
        ["Deployment", "Service", "HorizontalPodAutoscaler", "PersistentVolumeClaim", "InferencePool", "HTTPRoute"]
    {
        assert!(kinds.contains(&kind), "no {kind} in {kinds:?}");
    }
    for d in &docs {
        let kind = d["doc"]["kind"].as_str().unwrap();
        let results = d["results"].as_array().unwrap();
        // Kubernetes' schemas know the core kinds; the CRDs' are checked below by hand.
        let want = if ["InferencePool", "HTTPRoute"].contains(&kind) { "no schema" } else { "passed" };
        for r in results {
            assert_eq!(r, want, "{kind} in {}", d["file"]);
        }
    }

    let deployment = find(&docs, "Deployment");
    let pod = &deployment["spec"]["template"];
    let labels = &pod["metadata"]["labels"];
    assert_eq!(&deployment["spec"]["selector"]["matchLabels"], labels);
    assert_eq!(&find(&docs, "Service")["spec"]["selector"], labels);
    let container = &pod["spec"]["containers"][0];
    let args: Vec<String> =
        container["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap().to_owned()).collect();
    let port = container["ports"][0]["containerPort"].as_u64().unwrap();
    assert_eq!(arg(&args, "--port"), port.to_string());
    assert_eq!(find(&docs, "Service")["spec"]["ports"][0]["targetPort"], container["ports"][0]["name"]);

    // Probes: readiness on /health (503 while loading or draining), liveness on /live.
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/health");
    assert_eq!(container["startupProbe"]["httpGet"]["path"], "/health");
    assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/live");
    let api = std::fs::read_to_string(repo().join("src/serve/api.rs")).unwrap();
    for route in ["\"/health\"", "\"/live\"", "\"/metrics\""] {
        assert!(api.contains(&format!(".route({route}")), "no route {route} in src/serve/api.rs");
    }

    // The grace period covers the preStop pause, the drain and forge's 10 s of grace.
    let pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"].as_u64().unwrap();
    let drain: u64 = arg(&args, "--drain-timeout").parse().unwrap();
    let grace = pod["spec"]["terminationGracePeriodSeconds"].as_u64().unwrap();
    assert!(grace >= pre_stop + drain + 10, "grace {grace} < preStop {pre_stop} + drain {drain} + 10");

    // The pod's user is the image's.
    let dockerfile = std::fs::read_to_string(repo().join("Dockerfile")).unwrap();
    let user = dockerfile.lines().find_map(|l| l.strip_prefix("USER ")).expect("USER in the Dockerfile");
    let uid = pod["spec"]["securityContext"]["runAsUser"].as_u64().unwrap();
    assert_eq!(user.split(':').next().unwrap(), uid.to_string());

    // The autoscaler scales this Deployment on a gauge /metrics serves.
    let hpa = find(&docs, "HorizontalPodAutoscaler");
    assert_eq!(hpa["spec"]["scaleTargetRef"]["name"], deployment["metadata"]["name"]);
    let metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"].as_str().unwrap();
    let metrics = batch_forge::engine::Metrics::default().render();
    assert!(metrics.contains(&format!("# TYPE {metric} gauge")), "{metric} is not a gauge of /metrics");

    // The InferencePool: the fields its CRD (inference.networking.k8s.io/v1) requires,
    // selecting these pods on this port; the HTTPRoute sends to it.
    let pool = find(&docs, "InferencePool");
    assert_eq!(pool["apiVersion"], "inference.networking.k8s.io/v1");
    assert_eq!(&pool["spec"]["selector"]["matchLabels"], labels);
    let ports = pool["spec"]["targetPorts"].as_array().unwrap();
    assert!((1..=8).contains(&ports.len()));
    assert_eq!(ports[0]["number"].as_u64(), Some(port));
    let epp = &pool["spec"]["endpointPickerRef"];
    assert!(epp["name"].is_string() && epp["port"]["number"].is_u64(), "{epp}");
    assert!(["FailOpen", "FailClose"].contains(&epp["failureMode"].as_str().unwrap()));
    let route = find(&docs, "HTTPRoute");
    let backend = &route["spec"]["rules"][0]["backendRefs"][0];
    assert_eq!((&backend["kind"], &backend["name"]), (&pool["kind"], &pool["metadata"]["name"]));
    assert_eq!(backend["group"], "inference.networking.k8s.io");

    // The Deployment's command line, as the pod runs it (FORGE_HOST from its env), starts
    // a server that becomes ready: on a fixture model and any free port.
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_forge"));
    let model = repo().join("tests/fixtures/tiny-gpt2/tiny-gpt2.q8_0.gguf");
    let run: Vec<String> = args
        .iter()
        .map(|a| match a.as_str() {
            "/models/model.gguf" => model.to_str().unwrap().to_owned(),
            a if a == port.to_string() => "0".to_owned(),
            a => a.to_owned(),
        })
        .collect();
    for e in container["env"].as_array().unwrap() {
        let value = e["value"].as_str().unwrap();
        // Every interface in the pod; the loopback one here.
        let value = if value == "0.0.0.0" { "127.0.0.1" } else { value };
        cmd.env(e["name"].as_str().unwrap(), value);
    }
    let mut child = cmd.args(&run).stderr(Stdio::piped()).stdout(Stdio::null()).spawn().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        let mut log = String::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            log.push_str(&line);
            log.push('\n');
            if line.starts_with("listening on ") {
                // Keep reading after this: a closed pipe would fail the server's next
                // log line.
                let _ = tx.send(Ok(line));
            }
        }
        let _ = tx.send(Err(log));
    });
    let started = rx.recv_timeout(Duration::from_secs(30));
    // Listening is printed before the model loads: ready means /health answers 200.
    let ready = match &started {
        Ok(Ok(line)) => {
            let base = line.trim_start_matches("listening on ").to_owned();
            assert!(base.starts_with("http://127.0.0.1:"), "{line}");
            let t0 = std::time::Instant::now();
            loop {
                if ureq::get(&format!("{base}/health")).call().is_ok_and(|r| r.status() == 200) {
                    break true;
                }
                if t0.elapsed() > Duration::from_secs(30) || child.try_wait().unwrap().is_some() {
                    break false;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        _ => false,
    };
    let _ = child.kill();
    let _ = child.wait();
    assert!(ready, "forge {run:?} did not become ready: {started:?}");
}
