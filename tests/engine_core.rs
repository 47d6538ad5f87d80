//! The engine core (the scheduler every command runs on), where a request's KV cache
//! starts small and grows: a sequence that outgrows its first cache, and a conversation
//! whose pinned cache grows between turns, give the very bits of a run whose cache was
//! large enough from the start.

mod common;

use std::sync::Arc;

use batch_forge::backend::cpu::{CpuBackend, CpuOptions};
use batch_forge::engine::logprobs::token_logprobs;
use batch_forge::engine::scheduler::INITIAL_SLACK;
use batch_forge::engine::{
    Engine, Event, GenerateParams, Metrics, ModelText, Request, SCORE_CHUNK, SamplingParams, SchedulerConfig,
};
use batch_forge::loaders::{Gpt2Config, WeightStore, Weights};
use batch_forge::model::random::random_checkpoint;
use batch_forge::model::{CausalLm, Gpt2, WindowCaches};
use batch_forge::tokenizer::Tokenizer;
use common::fixture;

/// A random GPT-2 with a context of 900 positions (the fixtures have 128 at most, less
/// than a cache's first allocation), GPT-2's vocabulary and tokenizer.
fn long_context_engine() -> Engine<CpuBackend> {
    long_context_engine_with(CpuOptions::default())
}

fn long_context_engine_with(options: CpuOptions) -> Engine<CpuBackend> {
    let config = Gpt2Config {
        vocab_size: 50257,
        n_positions: 900,
        n_embd: 32,
        n_layer: 2,
        n_head: 2,
        n_inner: 128,
        layer_norm_epsilon: 1e-5,
        scale_attn_by_inverse_layer_idx: false,
        bos_token_id: 50256,
        eos_token_id: 50256,
    };
    let backend = CpuBackend::new(options).unwrap();
    let store = WeightStore::from_bytes("random", random_checkpoint(&config, 7)).unwrap();
    let model = Gpt2::load(&backend, config, &Weights::Safetensors(store)).unwrap();
    Engine {
        backend,
        model: Box::new(model),
        text: ModelText {
            tokenizer: Tokenizer::from_dir(&fixture("tiny-gpt2")).unwrap(),
            chat_template: None,
            chat_template_error: None,
            end_of_generation: vec![50256],
            bos_token_id: Some(50256),
        },
        speculation: None,
    }
}

/// (token, logprob bits) of each request, run together on one scheduler.
fn run(engine: &Engine<CpuBackend>, config: SchedulerConfig, requests: Vec<Request>) -> Vec<Vec<(u32, u64)>> {
    let mut s = batch_forge::engine::Scheduler::new(
        &engine.backend,
        &*engine.model,
        config,
        Vec::new(),
        Arc::new(Metrics::default()),
    );
    let mut got = vec![Vec::new(); requests.len()];
    for r in requests {
        s.add(r);
    }
    let mut events = Vec::new();
    while s.busy() {
        s.step(&mut events);
        for (id, e) in events.drain(..) {
            match e {
                Event::Token { id: t, logprobs } => got[id as usize].push((t, logprobs.unwrap().logprob.to_bits())),
                Event::Failed(e) => panic!("request {id}: {e}"),
                _ => {}
            }
        }
    }
    got
}

fn request(id: u64, prompt: &[u32], max_tokens: usize, seed: u64) -> Request {
    let sampling = SamplingParams { seed, ..SamplingParams::default() };
    let mut r = Request::new(id, prompt.to_vec(), max_tokens, sampling);
    r.ignore_eos = true;
    r.logprobs = Some(0);
    r
}

/// A sequence of 600 tokens outgrows its first cache (prompt + 256 positions) twice,
/// beside one that never does; each token and log-probability equals, bit for bit, the
/// same request on a scheduler that allocates every reserved position up front
/// (batch-invariant kernels, so batching changes nothing either), and the sequence
/// beside it equals its run alone.
#[test]
fn a_growing_cache_changes_no_bit() {
    let e = long_context_engine();
    let prompt: Vec<u32> = (0..9).map(|i| 1000 + 37 * i).collect();
    let short = INITIAL_SLACK - 10; // fits the first cache
    let long = 600;
    let config = |parallel, initial_slack| SchedulerConfig {
        parallel,
        ctx_size: 2048,
        batch_tokens: 64,
        prefix_cache: false,
        initial_slack,
        step_delay: std::time::Duration::ZERO,
    };
    let opts = CpuOptions { batch_invariant: true, ..Default::default() };
    let e = Engine { backend: CpuBackend::new(opts).unwrap(), ..e };
    let together = run(&e, config(2, INITIAL_SLACK), vec![request(0, &prompt, long, 3), request(1, &prompt, short, 4)]);
    assert_eq!(together[0].len(), long);
    let reserved = run(&e, config(1, usize::MAX), vec![request(0, &prompt, long, 3)]);
    assert_eq!(together[0], reserved[0], "a growing cache against one allocated whole");
    let other = run(&e, config(1, INITIAL_SLACK), vec![request(0, &prompt, short, 4)]);
    assert_eq!(together[1], other[0], "the sequence beside a growing one");
    // And from one prefill of the whole text into a cache that never grows: every
    // generated token's log-probability, bit for bit (a prefill row equals a decode row
    // with these kernels).
    let mut text = prompt.clone();
    text.extend(together[0][..long - 1].iter().map(|&(t, _)| t));
    let logits = e.logits_all(&text).unwrap();
    for (k, &(t, bits)) in together[0].iter().enumerate() {
        let lp = token_logprobs(logits.row(prompt.len() - 1 + k), t, 0);
        assert_eq!(lp.logprob.to_bits(), bits, "token {k}");
    }
}

/// A conversation's cache stays pinned between turns and grows when a turn needs more:
/// each turn reuses every cached position and generates what a fresh run on the whole
/// conversation generates.
#[test]
fn a_session_grows_and_changes_nothing() {
    let e = long_context_engine();
    let mut session = e.new_session(899);
    let params = |n, seed| GenerateParams {
        max_new_tokens: n,
        sampling: SamplingParams { seed, ..SamplingParams::default() },
        ignore_eos: true,
        max_context: None,
        logprobs: None,
    };
    let mut conversation: Vec<u32> = (0..7).map(|i| 2000 + 11 * i).collect();
    for (turn, n) in [(0u64, 40), (1, 300), (2, 280)] {
        let g = e.generate_in(&mut session, &conversation, &params(n, turn), |_| Ok(())).unwrap();
        let fresh = e.generate(&conversation, &params(n, turn), |_| Ok(())).unwrap();
        assert_eq!(g.generated_ids, fresh.generated_ids, "turn {turn}");
        // Every position but the last generated token's (never fed) and the new message's.
        let reused = if turn == 0 { 0 } else { conversation.len() - 5 };
        assert_eq!(g.reused_prompt_tokens, reused, "turn {turn}");
        conversation.extend(&g.generated_ids);
        conversation.extend([5, 6, 7, 8]); // the next user message
    }
    // A turn the caller stops early (a stop string) keeps what it cached: the next
    // turn reuses the prompt and the tokens fed before the stop.
    let mut seen = 0;
    let stopped = e
        .generate_in(&mut session, &conversation, &params(50, 7), |_| {
            seen += 1;
            if seen == 5 { Err(batch_forge::engine::Halt::Stop) } else { Ok(()) }
        })
        .unwrap();
    assert_eq!((stopped.generated_ids.len(), stopped.stop), (5, batch_forge::engine::StopReason::Stop));
    let mut next = conversation.clone();
    next.extend(&stopped.generated_ids);
    next.extend([9, 10]);
    let g = e.generate_in(&mut session, &next, &params(3, 8), |_| Ok(())).unwrap();
    assert_eq!(g.reused_prompt_tokens, conversation.len() + 4, "every position fed before the stop");
    assert_eq!(g.generated_ids, e.generate(&next, &params(3, 8), |_| Ok(())).unwrap().generated_ids);
    // Cleared: nothing is reused.
    session.clear();
    let g = e.generate_in(&mut session, &conversation[..20], &params(3, 9), |_| Ok(())).unwrap();
    assert_eq!(g.reused_prompt_tokens, 0);
}

/// `Engine::score` (the Python package's `score`) prefills a long text in chunks of
/// `SCORE_CHUNK` rows with the server's kernels: each token's log-probability and
/// alternatives equal, bit for bit, those of one forward over the whole text; and scoring
/// a prompt plus its greedy continuation gives the log-probabilities generation reported.
#[test]
fn scoring_in_chunks_equals_one_pass_and_generation() {
    let engine = long_context_engine_with(CpuOptions { batch_invariant: true, ..CpuOptions::default() });
    let ids: Vec<u32> = (0..700u32).map(|i| (i * 7919 + 13) % 50257).collect();
    assert!(ids.len() > SCORE_CHUNK);
    let scored = engine.score(&ids, 2).unwrap();
    assert_eq!(scored.len(), ids.len() - 1);
    let logits = engine.logits_all(&ids).unwrap();
    for (j, s) in scored.iter().enumerate() {
        let want = token_logprobs(&logits.data[j * logits.cols..(j + 1) * logits.cols], ids[j + 1], 2);
        assert_eq!(s.id, ids[j + 1]);
        assert_eq!(s.logprob.to_bits(), want.logprob.to_bits(), "position {j}: {} vs {}", s.logprob, want.logprob);
        assert_eq!(s.top, want.top, "position {j}");
    }
    assert!(engine.score(&ids[..1], 0).unwrap().is_empty());

    let params = GenerateParams { logprobs: Some(0), ignore_eos: true, ..GenerateParams::greedy(20) };
    let g = engine.generate(&ids[..50], &params, |_| Ok(())).unwrap();
    let scored = engine.score(&[&ids[..50], &g.generated_ids[..]].concat(), 0).unwrap();
    assert_eq!(g.logprobs.len(), 20);
    for (k, t) in g.logprobs.iter().enumerate() {
        assert_eq!((scored[49 + k].id, scored[49 + k].logprob.to_bits()), (t.id, t.logprob.to_bits()), "token {k}");
    }
}

/// Runs `requests` in turn on one scheduler (a finished one's cache stays in the prefix
/// cache for the next): each one's (token, logprob bits), and the prefix-cache hits.
fn run_in_turn(
    model: &dyn CausalLm<CpuBackend>,
    backend: &CpuBackend,
    config: SchedulerConfig,
    requests: Vec<Request>,
) -> (Vec<Vec<(u32, u64)>>, u64) {
    let metrics = Arc::new(Metrics::default());
    let mut s = batch_forge::engine::Scheduler::new(backend, model, config, Vec::new(), metrics.clone());
    let mut got = Vec::new();
    for r in requests {
        s.add(r);
        let mut events = Vec::new();
        let mut tokens = Vec::new();
        while s.busy() {
            s.step(&mut events);
            for (id, e) in events.drain(..) {
                match e {
                    Event::Token { id: t, logprobs } => tokens.push((t, logprobs.unwrap().logprob.to_bits())),
                    Event::Failed(e) => panic!("request {id}: {e}"),
                    _ => {}
                }
            }
        }
        got.push(tokens);
    }
    (got, metrics.prefix_cache_hits.load(std::sync::atomic::Ordering::Relaxed))
}

/// Gemma 3's sliding-window layers kept as rings that wrap many times: prompts prefilled
/// in chunks longer than a ring takes at once, then decoded, give every token and
/// log-probability of whole caches bit for bit. A cached prefix is reused only while the
/// finished sequence's rings still hold the window before it: a prompt that shares the
/// start of a long finished sequence computes it again (and equals its run alone), unless
/// a shorter finished sequence's cache still holds it; one that shares nearly all of the
/// long one is a hit (and equals its run alone too).
#[test]
fn sliding_window_rings_change_no_bit() {
    let opts = CpuOptions { batch_invariant: true, ..Default::default() };
    let e = Engine::load(CpuBackend::new(opts).unwrap(), &fixture("tiny-gemma3")).unwrap();
    // Rings of the 3-key window plus 8 (the real models keep 512 more: the fixture's
    // context of 128 positions would never wrap them).
    let inner = Engine::load(CpuBackend::new(opts).unwrap(), &fixture("tiny-gemma3")).unwrap().model;
    let rings = WindowCaches { inner, ring_rows: Some(8) };
    let windows: Vec<_> = (0..e.model.info().n_layer).map(|l| e.model.layer_window(l)).collect();
    assert_eq!(windows, [Some(3), Some(3), None, Some(3)]);
    let config = |prefix_cache| SchedulerConfig {
        parallel: 2,
        ctx_size: 256,
        batch_tokens: 16, // chunks of 16 rows; a ring of 11 slots takes 9 at a time
        prefix_cache,
        initial_slack: INITIAL_SLACK,
        step_delay: std::time::Duration::ZERO,
    };
    let p: Vec<u32> = (0..48).map(|i| (7 + 31 * i) % 384).collect();
    let a = request(0, &p, 40, 1);
    let (whole, _) = run_in_turn(&*e.model, &e.backend, config(false), vec![a.clone()]);
    let (ringed, _) = run_in_turn(&rings, &e.backend, config(false), vec![a.clone()]);
    assert_eq!(whole[0].len(), 40);
    assert_eq!(ringed, whole, "rings against whole caches");
    // A's 88 tokens (87 positions written) leave its rings holding positions 76.. . B
    // shares its first 32 (two blocks): the keys before position 32 are gone, so B is a
    // miss. C shares 80 (five blocks): the window before 80 is held, so C is a hit.
    let mut text = p.clone();
    text.extend(whole[0].iter().map(|&(t, _)| t));
    let b: Vec<u32> = p[..32].iter().copied().chain([5, 6, 7, 8, 9]).collect();
    let c: Vec<u32> = text[..80].iter().copied().chain([10, 11, 12]).collect();
    let (b, c) = (request(1, &b, 20, 2), request(2, &c, 20, 3));
    let (cached, hits) = run_in_turn(&rings, &e.backend, config(true), vec![a.clone(), b.clone()]);
    assert_eq!(hits, 0, "a prefix whose window the ring overwrote");
    let (alone, _) = run_in_turn(&*e.model, &e.backend, config(false), vec![b.clone()]);
    assert_eq!(cached[1], alone[0], "a miss computed again");
    // A short sequence S that shares B's two blocks, before A: A's entry covers S's blocks
    // but its rings went on past them, so S's entry stays and B is a hit on it (A is a
    // hit on S too). Both equal their runs alone.
    let short: Vec<u32> = p[..32].iter().copied().chain([1]).collect();
    let s = request(3, &short, 1, 4);
    let (cached, hits) = run_in_turn(&rings, &e.backend, config(true), vec![s, a.clone(), b.clone()]);
    assert_eq!(hits, 2, "B reuses the short sequence's cache, which A's does not replace");
    assert_eq!((&cached[1], &cached[2]), (&whole[0], &alone[0]));
    let (alone_c, _) = run_in_turn(&*e.model, &e.backend, config(false), vec![c.clone()]);
    // At the edge: A generating 42 tokens writes 89 positions, so its rings hold 78..,
    // exactly the window C's position 80 reads (78, 79, 80): a hit. One token more and
    // position 78 is gone: a miss. Both equal C's run alone.
    for (generated, want_hits) in [(40, 1), (42, 1), (43, 0)] {
        let a = request(0, &p, generated, 1);
        let (cached, hits) = run_in_turn(&rings, &e.backend, config(true), vec![a, c.clone()]);
        assert_eq!(hits, want_hits, "C after A generated {generated}");
        assert_eq!(cached[1], alone_c[0], "C after A generated {generated}");
    }
}

/// A model that cannot be loaded says whose fault it is, as a typed error: the path, the
/// architecture the files name, their configuration, the weights, the file format.
#[test]
fn load_errors_say_whose_fault_it_is() {
    use batch_forge::model::load::{LoadError, load_model};
    let b = CpuBackend::new(CpuOptions::default()).unwrap();
    let empty = tempfile::tempdir().unwrap();
    assert!(matches!(load_model(&b, empty.path()), Err(LoadError::NotAModel { .. })));
    let edit = |key: &str, value: serde_json::Value| {
        let (tmp, copy) = common::fixture_copy("tiny-llama");
        let path = copy.join("config.json");
        let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        c[key] = value;
        std::fs::write(&path, c.to_string()).unwrap();
        (tmp, copy)
    };
    let (_t, copy) = edit("model_type", "mamba".into());
    match load_model(&b, &copy) {
        Err(LoadError::Unsupported { name, supported, .. }) => {
            assert_eq!(name, "mamba");
            assert!(supported.contains("gemma3_text") && supported.contains("qwen3"), "{supported}");
        }
        _ => panic!("mamba: not Unsupported"),
    }
    let (_t, copy) = edit("num_key_value_heads", 3.into());
    assert!(matches!(load_model(&b, &copy), Err(LoadError::Config { .. })));
    // The config is checked before any weight is opened.
    std::fs::remove_file(copy.join("model.safetensors")).unwrap();
    assert!(matches!(load_model(&b, &copy), Err(LoadError::Config { .. })));
    let (_t, copy) = common::fixture_copy("tiny-llama");
    std::fs::remove_file(copy.join("model.safetensors")).unwrap();
    assert!(matches!(load_model(&b, &copy), Err(LoadError::Weights { .. })));
    let not_gguf = empty.path().join("x.gguf");
    std::fs::write(&not_gguf, b"not a gguf file").unwrap();
    assert!(matches!(load_model(&b, &not_gguf), Err(LoadError::Gguf(_))));
    assert!(load_model(&b, &fixture("tiny-llama")).is_ok());
}

/// A request's pick hook sees each pick's logits and decides the token: the sequence takes
/// the hook's token (not the sampler's), and its events report it.
#[test]
fn a_pick_hook_decides_the_token() {
    use batch_forge::engine::scheduler::PickHook;
    let e = Engine::load(CpuBackend::new(CpuOptions::default()).unwrap(), &fixture("tiny-gpt2")).unwrap();
    let seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = seen.clone();
    let vocab = e.model.info().vocab_size;
    let mut r = request(0, &[15496, 995], 6, 1);
    r.pick_hook = Some(PickHook(Arc::new(move |logits: &[f32], _| {
        assert_eq!(logits.len(), vocab);
        count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        7
    })));
    let config = SchedulerConfig::single(64);
    let mut s = e.scheduler(config);
    s.add(r);
    let mut events = Vec::new();
    let mut tokens = Vec::new();
    while s.busy() {
        s.step(&mut events);
        for (_, ev) in events.drain(..) {
            if let Event::Token { id, logprobs } = ev {
                tokens.push(id);
                // The log-probability is the hook's token's.
                assert_eq!(logprobs.unwrap().id, 7);
            }
        }
    }
    assert_eq!(tokens, [7; 6]);
    assert_eq!(seen.load(std::sync::atomic::Ordering::Relaxed), 6);
}

/// Generation errors are typed by whose they are: the caller's input (an empty or too long
/// prompt, a session that is full, sampling out of range) or the caller's own callback,
/// whose error arrives whole (an `io::Error` under it is still found, as the CLI looks for
/// a broken pipe).
#[test]
fn generation_errors_say_whose_fault_it_is() {
    use batch_forge::engine::EngineError;
    let e = Engine::load(CpuBackend::new(CpuOptions::default()).unwrap(), &fixture("tiny-gpt2")).unwrap();
    let params = GenerateParams::greedy(4);
    let ok = |_| Ok(());
    assert!(matches!(e.generate(&[], &params, ok), Err(EngineError::EmptyPrompt)));
    let long = vec![11u32; 200]; // the context is 128
    match e.generate(&long, &params, ok) {
        Err(err @ EngineError::PromptTooLong { len: 200, n_ctx: 128, .. }) => assert!(err.is_input()),
        other => panic!("{:?}", other.map(|g| g.generated_ids)),
    }
    let capped = GenerateParams { max_context: Some(8), ..GenerateParams::greedy(4) };
    match e.generate(&[11; 9], &capped, ok) {
        Err(EngineError::PromptTooLong { whose, .. }) => assert_eq!(whose, "the context size (-c)"),
        other => panic!("{:?}", other.map(|g| g.generated_ids)),
    }
    let hot = GenerateParams { sampling: SamplingParams { top_p: 2.0, ..SamplingParams::default() }, ..params.clone() };
    assert!(matches!(e.generate(&[11, 12], &hot, ok), Err(EngineError::Sampling(_))));
    // The caller's own error comes back whole: its type, its kind and its message.
    let pipe = |_| Err(std::io::Error::new(std::io::ErrorKind::BrokenPipe, "writing: broken pipe").into());
    let err = e.generate(&[11, 12], &params, pipe).map(|g| g.generated_ids).unwrap_err();
    assert!(!err.is_input());
    assert_eq!(err.to_string(), "writing: broken pipe");
    // What the CLI asks to end quietly on `forge ... | head`, through anyhow's chain.
    let wrapped = anyhow::Error::from(err).context("generating");
    let kinds: Vec<_> = wrapped.chain().filter_map(batch_forge::engine::io_error_kind).collect();
    assert_eq!(kinds, [std::io::ErrorKind::BrokenPipe], "{wrapped:#}");
    assert_eq!(format!("{wrapped:#}"), "generating: writing: broken pipe");
}

/// The engine's other entry points: perplexity's windows, speculation's settings and the
/// chat template say whose fault a failure is in their types.
#[test]
fn windows_drafts_and_templates_have_typed_errors() {
    use batch_forge::chat::{Message, TemplateError};
    use batch_forge::engine::EngineError;
    use batch_forge::engine::speculate::{DraftMethod, Speculation};
    let mut e = Engine::load(CpuBackend::new(CpuOptions::default()).unwrap(), &fixture("tiny-gpt2")).unwrap();
    let ok = |_: &_| Ok(());
    let text = vec![11u32; 64];
    for (n_ctx, chunks, says) in
        [(2, None, "at least 4"), (129, None, "exceeds"), (40, None, "two windows"), (8, Some(0), "one window")]
    {
        match e.perplexity(&text, n_ctx, chunks, ok) {
            Err(err @ EngineError::Windows(_)) => assert!(err.is_input() && err.to_string().contains(says), "{err}"),
            other => panic!("-c {n_ctx}: {:?}", other.map(|s| s.windows)),
        }
    }
    let stop = |_: &_| Err("enough".into());
    assert!(matches!(e.perplexity(&text, 8, None, stop), Err(EngineError::Callback(_))));
    let bad = Speculation { method: DraftMethod::Ngram(2), draft_max: 0, draft_min: 0, batch_max: 1 };
    match e.speculate(bad, None) {
        Err(err @ EngineError::Speculation(_)) => assert!(err.is_input() && err.to_string().contains("--draft-max")),
        other => panic!("{other:?}"),
    }
    let hi = [Message::new("user", "hi")];
    assert!(matches!(e.chat_prompt_ids(&hi), Err(TemplateError::Missing)));
    let dir = tempfile::tempdir().unwrap();
    let raises = dir.path().join("raises.jinja");
    std::fs::write(&raises, "{{ raise_exception('roles must alternate') }}").unwrap();
    e.use_chat_template_file(&raises).unwrap();
    assert!(matches!(e.chat_prompt_ids(&hi), Err(TemplateError::Render(m)) if m == "roles must alternate"));
    let broken = dir.path().join("broken.jinja");
    std::fs::write(&broken, "{% if %}").unwrap();
    match e.use_chat_template_file(&broken) {
        Err(TemplateError::File { path, message }) => {
            assert!(path == broken && message.starts_with("does not compile"))
        }
        other => panic!("{other:?}"),
    }
    let missing = dir.path().join("missing.jinja");
    match e.use_chat_template_file(&missing) {
        Err(err @ TemplateError::File { .. }) => {
            assert!(err.to_string().starts_with(&format!("{}: cannot read the chat template", missing.display())))
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(e.logits_all(&[]), Err(EngineError::EmptyPrompt)));
    assert!(matches!(e.logits_all(&[11; 129]), Err(EngineError::PromptTooLong { len: 129, n_ctx: 128, .. })));
}

/// A backend's failures say what failed: arguments that do not fit (a token id outside
/// the vocabulary, a cache of another model), or memory.
#[test]
fn backend_errors_say_what_failed() {
    use batch_forge::backend::{Backend, BackendError, SeqSlice};
    use batch_forge::model::load::load_model;
    use batch_forge::model::{Batch, LogitRows};
    let b = CpuBackend::new(CpuOptions::default()).unwrap();
    let l = load_model(&b, &fixture("tiny-gpt2")).unwrap();
    let mut cache = l.model.new_cache(&b, 8).unwrap();
    let seqs = [SeqSlice { rows: 0..2, start_pos: 0 }];
    let bad = Batch { tokens: &[11, 1 << 30], seqs: &seqs };
    match l.model.forward(&b, &bad, &mut [&mut cache], LogitRows::All) {
        Err(BackendError::Invalid(m)) => assert!(m.contains("token id 1073741824 is out of range"), "{m}"),
        other => panic!("{:?}", other.err()),
    }
    let mut wrong = b.new_kv_cache(1, 8, 4).unwrap();
    let ok = Batch { tokens: &[11, 12], seqs: &seqs };
    assert!(matches!(l.model.forward(&b, &ok, &mut [&mut wrong], LogitRows::All), Err(BackendError::Invalid(_))));
    assert!(matches!(b.new_kv_cache(2, usize::MAX / 2, 768), Err(BackendError::Memory(_))));
    assert!(l.model.forward(&b, &ok, &mut [&mut cache], LogitRows::All).is_ok());
}
