//! The fast backend's decode loop makes no heap allocations once warm: activations come
//! from a recycled pool, attention scratch is reserved for the whole cache, positions
//! live on the stack. Checked with a counting global allocator.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use batch_forge::backend::SeqSlice;
use batch_forge::backend::cpu::CpuOptions;
use batch_forge::engine::{SamplingParams, TokenPicker};
use batch_forge::model::{Batch, LogitRows};
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

/// Heap allocations on the decode pool's threads in 52 warm decode steps, each token
/// chosen by the engine's `TokenPicker` with `sampling`.
fn allocations_in_warm_decode(sampling: SamplingParams) -> usize {
    let engine = cpu_engine("tiny-gpt2", CpuOptions::default());
    let (b, m) = (&engine.backend, &engine.model);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    pool.broadcast(|_| COUNTED.with(|c| c.set(true)));
    pool.install(|| {
        let mut cache = m.new_cache(b, 100).unwrap();
        let mut picker = TokenPicker::new(sampling).unwrap();
        picker.reserve(100);
        let prompt = [464u32, 2068, 7586, 21831];
        picker.accept_prompt(&prompt);
        let seqs = [SeqSlice { rows: 0..4, start_pos: 0 }];
        let out =
            m.forward(b, &Batch { tokens: &prompt, seqs: &seqs }, &mut [&mut cache], LogitRows::LastOfEachSeq).unwrap();
        let mut next = picker.pick(b, &out, 0, 3).unwrap();
        drop(out);
        let mut step = |pos: usize, next: &mut u32| {
            let seqs = [SeqSlice { rows: 0..1, start_pos: pos }];
            let out = m
                .forward(b, &Batch { tokens: &[*next], seqs: &seqs }, &mut [&mut cache], LogitRows::LastOfEachSeq)
                .unwrap();
            *next = picker.pick(b, &out, pos - 3, pos).unwrap();
        };
        // Warm-up: the pool fills with every buffer size a step needs.
        for pos in 4..20 {
            step(pos, &mut next);
        }
        let before = ALLOCS.load(Ordering::Relaxed);
        for pos in 20..72 {
            step(pos, &mut next);
        }
        ALLOCS.load(Ordering::Relaxed) - before
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
        seed: 1,
        ..SamplingParams::greedy()
    };
    for (what, params) in [("greedy", SamplingParams::greedy()), ("sampled", sampled), ("penalized", penalized)] {
        let n = allocations_in_warm_decode(params);
        assert_eq!(n, 0, "{n} heap allocations in 52 warm {what} decode steps");
    }
}
