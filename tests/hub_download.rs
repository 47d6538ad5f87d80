//! Model download into the HF cache, for real, against a local server on 127.0.0.1 that
//! serves fixture files in the Hub's URL layout (`/{repo}/resolve/{rev}/{file}`), with
//! LFS-style redirects to a CDN path for weights.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

use batch_forge::backend::reference::ReferenceBackend;
use batch_forge::engine::{Engine, GenerateParams};
use batch_forge::loaders::hub::{HubClient, HubError};
use batch_forge::loaders::safetensors::{OwnedTensor, SafetensorsFile, serialize};
use batch_forge::loaders::{FetchError, ResolveError, resolve_model};
use common::*;
use sha2::{Digest, Sha256};
use tiny_http::{Header, Response, Server};

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

fn sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

struct FakeHub {
    endpoint: String,
    /// Authorization headers seen.
    auth: Arc<Mutex<Vec<String>>>,
}

/// Serve `repos` (repo id → file name → bytes). Files ending in .safetensors behave like
/// LFS files: HEAD/GET on `resolve` answer 302 to `/cdn/<sha256>` with `X-Linked-Etag`.
/// `corrupt` makes the CDN send different bytes than the ETag promises.
fn serve(repos: HashMap<String, HashMap<String, Vec<u8>>>, corrupt: bool) -> FakeHub {
    let server = Server::http("127.0.0.1:0").unwrap();
    let port = server.server_addr().to_ip().unwrap().port();
    let auth = Arc::new(Mutex::new(Vec::new()));
    let seen = auth.clone();
    let header = |k: &str, v: &str| Header::from_bytes(k.as_bytes(), v.as_bytes()).unwrap();
    std::thread::spawn(move || {
        let mut cdn: HashMap<String, Vec<u8>> = HashMap::new();
        for files in repos.values() {
            for bytes in files.values() {
                cdn.insert(sha256(bytes), bytes.clone());
            }
        }
        for rq in server.incoming_requests() {
            for h in rq.headers() {
                if h.field.equiv("Authorization") {
                    seen.lock().unwrap().push(h.value.to_string());
                }
            }
            let url = rq.url().to_owned();
            if let Some(sha) = url.strip_prefix("/cdn/") {
                let mut body = cdn.get(sha).cloned().unwrap_or_default();
                if corrupt && !body.is_empty() {
                    body[100] ^= 1;
                }
                rq.respond(Response::from_data(body)).unwrap();
                continue;
            }
            let found = url.split_once("/resolve/main/").and_then(|(repo, file)| {
                repos.get(repo.trim_start_matches('/')).and_then(|r| r.get(file)).map(|b| (file.to_owned(), b.clone()))
            });
            let Some((file, bytes)) = found else {
                rq.respond(Response::from_string("Entry not found").with_status_code(404)).unwrap();
                continue;
            };
            let sha = sha256(&bytes);
            let resp = if file.ends_with(".safetensors") {
                Response::from_data(Vec::new())
                    .with_status_code(302)
                    .with_header(header("Location", &format!("/cdn/{sha}")))
                    .with_header(header("X-Linked-Etag", &format!("\"{sha}\"")))
                    .with_header(header("X-Linked-Size", &bytes.len().to_string()))
            } else {
                Response::from_data(bytes).with_header(header("ETag", &format!("\"{}\"", &sha[..40])))
            };
            rq.respond(resp.with_header(header("X-Repo-Commit", COMMIT))).unwrap();
        }
    });
    FakeHub { endpoint: format!("http://127.0.0.1:{port}"), auth }
}

fn files_of(dir: &Path, names: &[&str]) -> HashMap<String, Vec<u8>> {
    names.iter().map(|n| (n.to_string(), std::fs::read(dir.join(n)).unwrap())).collect()
}

fn client(endpoint: &str, cache: &Path) -> HubClient {
    HubClient {
        endpoint: endpoint.into(),
        token: Some("hf_test_token".into()),
        cache_dir: cache.into(),
        offline: false,
        progress: false,
    }
}

fn greedy_ids(dir: &Path, prompt: &[u32]) -> Vec<u32> {
    let engine = Engine::load(ReferenceBackend, dir).unwrap();
    let params = GenerateParams::greedy(40);
    engine.generate(prompt, &params, |_| Ok(())).unwrap().generated_ids
}

const MODEL_FILES: [&str; 4] = ["config.json", "tokenizer.json", "model.safetensors", "generation_config.json"];

#[test]
fn downloads_into_the_hf_cache_layout_and_reuses_it_offline() {
    let src = fixture("tiny-gpt2");
    let hub = serve(HashMap::from([("org/tiny".to_string(), files_of(&src, &MODEL_FILES))]), false);
    let cache = tempfile::tempdir().unwrap();
    let dir = resolve_model("org/tiny", &client(&hub.endpoint, cache.path()), true, "generate").unwrap();

    let repo = cache.path().join("models--org--tiny");
    assert_eq!(dir, repo.join("snapshots").join(COMMIT));
    assert_eq!(std::fs::read_to_string(repo.join("refs/main")).unwrap(), COMMIT);
    let weights = std::fs::read(src.join("model.safetensors")).unwrap();
    let blob = repo.join("blobs").join(sha256(&weights));
    assert_eq!(std::fs::read(&blob).unwrap(), weights);
    let link = std::fs::read_link(dir.join("model.safetensors")).unwrap();
    assert_eq!(link, PathBuf::from("../../blobs").join(sha256(&weights)));
    assert!(
        std::fs::read_dir(repo.join("blobs"))
            .unwrap()
            .all(|e| { !e.unwrap().file_name().to_string_lossy().ends_with(".incomplete") })
    );
    assert!(hub.auth.lock().unwrap().iter().all(|a| a == "Bearer hf_test_token"));
    assert!(!hub.auth.lock().unwrap().is_empty());

    let p = &reference("tiny-gpt2")["prompts"][2];
    assert_eq!(greedy_ids(&dir, &ids(&p["prompt_ids"])), ids(&p["generated_ids"]));

    // Offline, and with the server gone: served from the cache.
    let mut offline = client("http://127.0.0.1:9", cache.path());
    offline.offline = true;
    assert_eq!(resolve_model("org/tiny", &offline, true, "generate").unwrap(), dir);
    offline.offline = false; // unreachable endpoint, cached files: still works
    assert_eq!(resolve_model("org/tiny", &offline, true, "generate").unwrap(), dir);
}

#[test]
fn unreachable_hub_without_cache_says_how_to_get_files() {
    let cache = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let e = resolve_model("org/absent", &client(&format!("http://127.0.0.1:{port}"), cache.path()), true, "generate")
        .unwrap_err();
    let msg = format!("{e:#}");
    assert!(msg.contains("cannot reach the Hub") && msg.contains("huggingface-cli download org/absent"), "{msg}");
    assert!(
        matches!(&e, ResolveError::Fetch { cause, .. } if matches!(**cause, FetchError::Hub(HubError::Unreachable { .. }))),
        "{e:?}"
    );
}

#[test]
fn corrupt_download_is_rejected_and_leaves_no_blob() {
    let src = fixture("tiny-gpt2");
    let hub = serve(HashMap::from([("org/tiny".to_string(), files_of(&src, &MODEL_FILES))]), true);
    let cache = tempfile::tempdir().unwrap();
    let e = resolve_model("org/tiny", &client(&hub.endpoint, cache.path()), true, "generate").unwrap_err();
    assert!(format!("{e:#}").contains("sha256"), "{e:#}");
    assert!(
        matches!(&e, ResolveError::Fetch { cause, .. } if matches!(**cause, FetchError::Hub(HubError::Download { .. }))),
        "{e:?}"
    );
    let blobs = cache.path().join("models--org--tiny/blobs");
    let weights_sha = sha256(&std::fs::read(src.join("model.safetensors")).unwrap());
    assert!(!blobs.join(&weights_sha).exists());
    assert!(!blobs.join(format!("{weights_sha}.incomplete")).exists());
}

/// Split a checkpoint into two shards plus `model.safetensors.index.json`, as
/// `save_pretrained(max_shard_size=...)` does.
fn sharded(src: &Path) -> HashMap<String, Vec<u8>> {
    let f = SafetensorsFile::open(&src.join("model.safetensors")).unwrap();
    let names: Vec<String> = f.names().map(String::from).collect();
    let mut files = files_of(src, &["config.json", "tokenizer.json"]);
    let mut weight_map = serde_json::Map::new();
    for (i, chunk) in names.chunks(names.len().div_ceil(2)).enumerate() {
        let shard = format!("model-{:05}-of-00002.safetensors", i + 1);
        let tensors: Vec<OwnedTensor> = chunk
            .iter()
            .map(|n| {
                let t = f.get(n).unwrap();
                OwnedTensor { name: n.clone(), dtype: t.dtype, shape: t.shape.to_vec(), bytes: t.bytes.to_vec() }
            })
            .collect();
        for n in chunk {
            weight_map.insert(n.clone(), shard.clone().into());
        }
        files.insert(shard, serialize(&tensors, &Default::default()));
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    files.insert("model.safetensors.index.json".into(), index.to_string().into_bytes());
    files
}

#[test]
fn sharded_checkpoints_download_and_match_hf_via_the_cli() {
    let hub = serve(HashMap::from([("org/sharded".to_string(), sharded(&fixture("tiny-gpt2")))]), false);
    let cache = tempfile::tempdir().unwrap();
    let p = &reference("tiny-gpt2")["prompts"][1];
    let o = Command::new(env!("CARGO_BIN_EXE_forge"))
        .args([
            "generate",
            "--model",
            "org/sharded",
            "--prompt",
            p["text"].as_str().unwrap(),
            "--greedy",
            "-n",
            "40",
            "--json",
        ])
        .env("HF_ENDPOINT", &hub.endpoint)
        .env("HF_HUB_CACHE", cache.path())
        .env_remove("HF_HUB_OFFLINE")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(ids(&v["generated_ids"]), ids(&p["generated_ids"]));
    let snap = cache.path().join("models--org--sharded/snapshots").join(COMMIT);
    assert!(snap.join("model-00002-of-00002.safetensors").is_file());
    assert!(!snap.join("model.safetensors").exists());
}
