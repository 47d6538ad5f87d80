//! The engine's decode loop on the fast backend makes no heap allocations once warm:
//! activations come from a recycled pool, attention scratch is reserved for the whole
//! cache, the scheduler's step reuses its scratch. Checked with a counting global
//! allocator.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use batch_forge::backend::cpu::CpuOptions;
use batch_forge::engine::{GenerateParams, SamplingParams};
use common::*;

struct Counting;
/// Allocations made on the decode pool's threads (other threads of the test harness
/// are not the decode loop's business).
static ALLOCS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static COUNTED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn count() {
    if COUNTED.with(|c| c.get()) {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
    }
}

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        count();
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        count();
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Heap allocations on the decode pool's threads in 52 warm decode steps of
/// `Engine::generate` (the engine's scheduler: plan, forward, token picker, update),
/// each token chosen with `sampling`.
fn allocations_in_warm_decode(sampling: SamplingParams) -> usize {
    let engine = cpu_engine("tiny-gpt2", CpuOptions::default());
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    pool.broadcast(|_| COUNTED.with(|c| c.set(true)));
    pool.install(|| {
        let prompt = [464u32, 2068, 7586, 21831];
        let params = GenerateParams { ignore_eos: true, sampling, ..GenerateParams::greedy(72) };
        let (mut n, mut before, mut after) = (0, 0, 0);
        // Warm-up: the first 20 tokens fill the pool with every buffer size a step needs.
        let g = engine
            .generate(&prompt, &params, |_| {
                n += 1;
                if n == 20 {
                    before = ALLOCS.load(Ordering::Relaxed);
                } else if n == 72 {
                    after = ALLOCS.load(Ordering::Relaxed);
                }
                Ok(())
            })
            .unwrap();
        assert_eq!(g.generated_ids.len(), 72);
        after - before
    })
}

#[test]
fn warm_decode_steps_do_not_allocate() {
    let sampled =
        SamplingParams { temperature: 0.8, top_k: 40, top_p: 0.95, min_p: 0.05, seed: 1, ..SamplingParams::greedy() };
    let penalized = SamplingParams {
        temperature: 0.8,
        repeat_penalty: 1.3,
        repeat_last_n: 64,
        presence_penalty: 0.5,
        frequency_penalty: 0.25,
        seed: 1,
        ..SamplingParams::greedy()
    };
    for (what, params) in [("greedy", SamplingParams::greedy()), ("sampled", sampled), ("penalized", penalized)] {
        let n = allocations_in_warm_decode(params);
        assert_eq!(n, 0, "{n} heap allocations in 52 warm {what} decode steps");
    }
}
