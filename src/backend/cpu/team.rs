//! A spinning thread team for decode-sized work.
//!
//! A decode step of a 30-layer model runs ~120 matrix-vector products of a few hundred
//! microseconds each. Handing each to rayon costs a thread wake-up (10–20 µs on a VM, a
//! futex round trip) because rayon's idle workers go to sleep between them; that is a
//! fifth of SmolLM2's step at 2 threads. Here helpers spin (`spin_loop`) for a short while
//! after each job, so the next one starts within a microsecond, then poll with a
//! `yield_now` between polls (after [`SPIN_ALONE`]: the step's rayon work between team
//! jobs gets the cores; 16-sequence q8_0 decode went from 756-785 to 797-843 tok/s with
//! it, SmolLM2 Q4_1 from 614-689 to 734-806), and park after [`SPIN`] without work, so an
//! idle team costs nothing.
//!
//! [`run`] splits `n_parts` parts over the caller and `threads − 1` helpers (`threads` =
//! the current rayon pool's size, i.e. `-t`) and returns when all are done;
//! [`run_balanced`] gives each thread a contiguous run of items and lets a thread done
//! early finish the others' from their ends (teams of up to 16); [`split_mut`] and [`split2_mut`] cut slices
//! into one run per thread for a decode step's row-wise work. A team busy
//! with another caller (tests run in parallel) is not waited for: the caller falls back to
//! rayon.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long a helper spins without work before it parks.
const SPIN: Duration = Duration::from_micros(200);

/// How long a helper spins without work before it starts yielding its time slice between
/// polls: between team jobs a step may run rayon work on every core (a prefill's, or a
/// batch of more than [`SPLIT_MAX_ROWS`] rows: a decode step's own row-wise work runs on
/// the team), and a helper spinning at full speed would take a core's share from it.
const SPIN_ALONE: Duration = Duration::from_micros(5);

/// The job: a type-erased `&(dyn Fn(usize) + Sync)` valid while `run` waits.
#[derive(Clone, Copy)]
struct Job {
    f: *const (dyn Fn(usize) + Sync),
    n_parts: usize,
}

// SAFETY: the pointee is `Sync` and `run` keeps it alive until every helper is done.
unsafe impl Send for Job {}

struct Shared {
    /// Incremented for each job; helpers run a job once per new value.
    generation: AtomicUsize,
    /// Helpers that finished the current job.
    done: AtomicUsize,
    job: Mutex<Option<Job>>,
    /// A part panicked on a helper (re-raised by `run`).
    panicked: AtomicBool,
    /// Parked helpers wait here for the next generation.
    wake: Condvar,
    /// Set when the team could not be built: its helpers return.
    exit: AtomicBool,
    parked: Mutex<usize>,
}

pub struct Team {
    helpers: usize,
    shared: Arc<Shared>,
    /// One caller at a time.
    busy: AtomicBool,
}

impl Team {
    /// A team of `helpers` threads, or `None` when the threads cannot be started (those
    /// that did start are told to exit).
    fn new(helpers: usize) -> Option<Team> {
        let shared = Arc::new(Shared {
            generation: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            job: Mutex::new(None),
            panicked: AtomicBool::new(false),
            exit: AtomicBool::new(false),
            wake: Condvar::new(),
            parked: Mutex::new(0),
        });
        for index in 1..=helpers {
            let for_helper = Arc::clone(&shared);
            let spawned = std::thread::Builder::new()
                .name(format!("forge-team-{index}"))
                .spawn(move || helper(&for_helper, index));
            if spawned.is_err() {
                shared.exit.store(true, Ordering::Release);
                shared.generation.fetch_add(1, Ordering::AcqRel);
                let _parked = shared.parked.lock().unwrap_or_else(|p| p.into_inner());
                shared.wake.notify_all();
                return None;
            }
        }
        Some(Team { helpers, shared, busy: AtomicBool::new(false) })
    }
}

fn helper(shared: &Shared, index: usize) {
    let mut seen = 0usize;
    loop {
        let mut idle_since = Instant::now();
        let mut spins = 0u32;
        loop {
            if shared.generation.load(Ordering::Acquire) != seen {
                break;
            }
            std::hint::spin_loop();
            spins += 1;
            if !spins.is_multiple_of(64) {
                continue;
            }
            let idle = idle_since.elapsed();
            if idle > SPIN_ALONE && idle <= SPIN {
                std::thread::yield_now();
            }
            if spins.is_multiple_of(256) && idle > SPIN {
                let mut parked = shared.parked.lock().unwrap_or_else(|p| p.into_inner());
                *parked += 1;
                while shared.generation.load(Ordering::Acquire) == seen {
                    parked = shared.wake.wait(parked).unwrap_or_else(|p| p.into_inner());
                }
                *parked -= 1;
                idle_since = Instant::now();
            }
        }
        seen = shared.generation.load(Ordering::Acquire);
        if shared.exit.load(Ordering::Acquire) {
            return;
        }
        let job = *shared.job.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(job) = job
            && index < job.n_parts
        {
            // SAFETY: `run` published this job for generation `seen` and does not return
            // (so the closure stays alive) until `done` counts every helper.
            let f = unsafe { &*job.f };
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(index))).is_err() {
                shared.panicked.store(true, Ordering::Release);
            }
        }
        shared.done.fetch_add(1, Ordering::AcqRel);
    }
}

/// Teams by size, created on first use and kept (parked when idle); `None` for one
/// thread, for more threads than the CPUs (spinning helpers would then wait for time
/// slices: rayon serves that case), or when threads cannot be started.
fn team(threads: usize) -> Option<&'static Team> {
    /// (threads, its team or `None` when it could not be built).
    type Registry = Mutex<Vec<(usize, Option<&'static Team>)>>;
    static TEAMS: OnceLock<Registry> = OnceLock::new();
    // Asked once: `available_parallelism` reads cgroup files on every call, and `run`
    // is called for every matrix of every step.
    static CPUS: OnceLock<usize> = OnceLock::new();
    let cpus = *CPUS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    if threads < 2 || threads > cpus {
        return None;
    }
    let mut teams = TEAMS.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, t)) = teams.iter().find(|(n, _)| *n == threads) {
        return *t;
    }
    let t: Option<&'static Team> = Team::new(threads - 1).map(|t| &*Box::leak(Box::new(t)));
    teams.push((threads, t));
    t
}

/// Run `f(0) .. f(n_parts - 1)`, part `i` on thread `i` of a team the size of the current
/// rayon pool (part 0 on the caller). Returns `false` without running anything when no
/// team is free (one thread, or another caller holds it): the caller then uses rayon.
pub fn run(n_parts: usize, f: &(dyn Fn(usize) + Sync)) -> bool {
    let threads = rayon::current_num_threads();
    let Some(team) = team(threads) else { return false };
    if n_parts != threads || team.busy.swap(true, Ordering::Acquire) {
        return false;
    }
    let shared = &team.shared;
    // SAFETY (of the transmute): only the lifetime is erased; the pointer is used by helpers
    // strictly before `done` reaches `helpers`, which this function waits for below.
    let f_static: *const (dyn Fn(usize) + Sync) = unsafe { std::mem::transmute(f as *const (dyn Fn(usize) + Sync)) };
    *shared.job.lock().unwrap_or_else(|p| p.into_inner()) = Some(Job { f: f_static, n_parts });
    shared.done.store(0, Ordering::Release);
    shared.generation.fetch_add(1, Ordering::AcqRel);
    if *shared.parked.lock().unwrap_or_else(|p| p.into_inner()) > 0 {
        shared.wake.notify_all();
    }
    // Part 0 here; a panic in it waits for the helpers (they borrow `f`) before unwinding.
    let mine = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(0)));
    let mut spins = 0u32;
    while shared.done.load(Ordering::Acquire) < team.helpers {
        std::hint::spin_loop();
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(1 << 14) {
            std::thread::yield_now(); // a helper descheduled: let it run
        }
    }
    *shared.job.lock().unwrap_or_else(|p| p.into_inner()) = None;
    let helper_panicked = shared.panicked.swap(false, Ordering::AcqRel);
    team.busy.store(false, Ordering::Release);
    if let Err(payload) = mine {
        std::panic::resume_unwind(payload);
    }
    if helper_panicked {
        panic!("a part of a team job panicked on a helper thread");
    }
    true
}

/// Teams up to this size balance [`run_balanced`] work (one cursor each, on the stack).
const BALANCE_MAX_THREADS: usize = 16;

/// A run `front..back` of items in one atomic word (front in the high half).
fn pack(front: usize, back: usize) -> u64 {
    (front as u64) << 32 | back as u64
}

fn unpack(v: u64) -> (usize, usize) {
    ((v >> 32) as usize, (v & 0xFFFF_FFFF) as usize)
}

/// Take up to `n` items from the front (`from_back` false) or the back of a run.
fn take(cursor: &AtomicU64, n: usize, from_back: bool) -> Option<std::ops::Range<usize>> {
    let mut v = cursor.load(Ordering::Acquire);
    loop {
        let (front, back) = unpack(v);
        if front >= back {
            return None;
        }
        let (next, range) = if from_back {
            let cut = back.saturating_sub(n).max(front);
            (pack(front, cut), cut..back)
        } else {
            let cut = front.saturating_add(n).min(back);
            (pack(cut, back), front..cut)
        };
        match cursor.compare_exchange_weak(v, next, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return Some(range),
            Err(now) => v = now,
        }
    }
}

/// `f(range)` over `0..n` on the team: thread `p` reads its contiguous run (the `p`-th of
/// `threads` equal runs) front to back, `own` items a claim, then helps the others
/// finish theirs from the back, `steal` items a claim. So each run stays one forward
/// stream for its owner (as the hardware prefetcher likes), and a thread that a slower
/// core or a late start left behind is helped instead of waited for. Every item is
/// claimed exactly once (compare-and-swap on each run's `front..back`). A team larger
/// than 16, or more than 2³² items, gets the plain runs without the help. Returns `false`
/// without running anything when no team is free: the caller then uses rayon.
pub fn run_balanced(n: usize, own: usize, steal: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) -> bool {
    let threads = rayon::current_num_threads();
    // Run p's start, in 64 bits (no overflow of n · p on 32-bit targets).
    let start = |p: usize| (n as u64 * p as u64 / threads.max(1) as u64) as usize;
    if threads > BALANCE_MAX_THREADS || n > u32::MAX as usize {
        return run(threads, &|p| f(start(p)..start(p + 1)));
    }
    let cursors: [AtomicU64; BALANCE_MAX_THREADS] =
        std::array::from_fn(|p| AtomicU64::new(if p < threads { pack(start(p), start(p + 1)) } else { 0 }));
    let part = |p: usize| {
        while let Some(r) = take(&cursors[p], own.max(1), false) {
            f(r);
        }
        for k in 1..threads {
            while let Some(r) = take(&cursors[(p + k) % threads], steal.max(1), true) {
                f(r);
            }
        }
    };
    run(threads, &part)
}

/// Row-wise work of up to this many rows (a decode step, alone or batched) runs on the
/// team through [`split_mut`] and [`split2_mut`]: a rayon region would cost a worker's
/// wake-up, more than the work, and leave the team's helper yielding beside it.
pub const SPLIT_MAX_ROWS: usize = 32;

/// A raw pointer handed to the parts of a job (see [`split2_mut`]).
struct PartPtr<T>(*mut T);
impl<T> Clone for PartPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for PartPtr<T> {}
// SAFETY: each part dereferences a disjoint range only (see `split2_mut`), and `T: Send`.
unsafe impl<T: Send> Send for PartPtr<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for PartPtr<T> {}
impl<T> PartPtr<T> {
    /// The pointer (a method, so closures capture the whole `Sync` wrapper).
    fn get(self) -> *mut T {
        self.0
    }
}

/// What [`split2_mut`] runs on each part: `(first piece, part of a, part of b)`.
pub type PairParts<'a, A, B> = dyn Fn(usize, &mut [A], &mut [B]) + Sync + 'a;

/// [`split2_mut`] over one slice: `f(first, part)` on contiguous runs of whole
/// `chunk`-sized pieces of `data`, one run per thread.
pub fn split_mut<T: Send>(data: &mut [T], chunk: usize, f: &(dyn Fn(usize, &mut [T]) + Sync)) {
    split2_mut(data, chunk, &mut [] as &mut [u8], 0, &|first, a, _| f(first, a));
}

/// `f(first, a_part, b_part)` over `a` and `b` cut into pieces of `a_chunk` and `b_chunk`
/// elements (the same number of pieces; a last piece may be short), one contiguous run of
/// pieces per thread of the current rayon pool: run `p` holds pieces `first = n·p/threads`
/// up to `n·(p+1)/threads`. On the team, else rayon over the same runs (one thread: one
/// call). `b_chunk` 0 means no `b` (empty parts). Not meant to nest: a part calling it
/// again finds the team busy and falls back to rayon.
pub fn split2_mut<A: Send, B: Send>(a: &mut [A], a_chunk: usize, b: &mut [B], b_chunk: usize, f: &PairParts<'_, A, B>) {
    assert!(a_chunk > 0 || a.is_empty(), "split2_mut: pieces of no elements");
    let n = a.len().div_ceil(a_chunk.max(1));
    assert!(b_chunk == 0 || b.len().div_ceil(b_chunk) == n, "split2_mut: piece counts differ");
    let threads = rayon::current_num_threads().min(n);
    if threads < 2 {
        return f(0, a, if b_chunk == 0 { &mut [] } else { b });
    }
    let (a_len, b_len) = (a.len(), if b_chunk == 0 { 0 } else { b.len() });
    let (pa, pb) = (PartPtr(a.as_mut_ptr()), PartPtr(b.as_mut_ptr()));
    let part = |p: usize| {
        let (first, end) = (n * p / threads, n * (p + 1) / threads);
        let range = |chunk: usize, len: usize| (first * chunk).min(len)..(end * chunk).min(len);
        let (ra, rb) = (range(a_chunk, a_len), range(b_chunk, b_len));
        // SAFETY: run p's ranges lie inside `a` and `b` (clamped to their lengths) and are
        // disjoint from every other run's (the runs partition 0..n); `a` and `b` stay
        // mutably borrowed until every part has returned (`run` and rayon wait).
        let (sa, sb) = unsafe {
            (
                std::slice::from_raw_parts_mut(pa.get().add(ra.start), ra.len()),
                std::slice::from_raw_parts_mut(pb.get().add(rb.start), rb.len()),
            )
        };
        f(first, sa, sb);
    };
    if threads != rayon::current_num_threads() || !run(threads, &part) {
        use rayon::prelude::*;
        (0..threads).into_par_iter().for_each(part);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each part runs exactly once; a panicking part (caller's or a helper's) surfaces as a
    /// panic of `run` after every helper is done, and the team keeps working.
    #[test]
    fn parts_run_once_and_panics_surface() {
        let n = rayon::current_num_threads();
        if team(n).is_none() {
            eprintln!("SKIP: no team for {n} threads on this machine");
            return;
        }
        let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
        let count = |p: usize| {
            hits[p].fetch_add(1, Ordering::SeqCst);
        };
        while !run(n, &count) {} // another test may hold the team for a moment
        assert!(hits.iter().all(|h| h.load(Ordering::SeqCst) == 1));
        for bad in [0, n - 1] {
            let panicking = |p: usize| assert_ne!(p, bad, "part {p} fails");
            let r = std::panic::catch_unwind(|| while !run(n, &panicking) {});
            assert!(r.is_err(), "a panic in part {bad} must surface");
        }
        while !run(n, &count) {}
        assert!(hits.iter().all(|h| h.load(Ordering::SeqCst) == 2));
    }

    /// Balanced runs hand out every item exactly once, whatever `n` and the claim sizes,
    /// with one thread slowed down so the other steals from its run.
    #[test]
    fn balanced_runs_cover_every_item_once() {
        let threads = rayon::current_num_threads();
        if team(threads).is_none() {
            eprintln!("SKIP: no team for {threads} threads on this machine");
            return;
        }
        for (n, own, steal) in [(0, 4, 2), (1, 4, 2), (3, 1, 1), (97, 4, 2), (1000, 7, 3), (64, 0, 0)] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            let first_claim = AtomicBool::new(true);
            let f = |r: std::ops::Range<usize>| {
                if r.start == 0 && first_claim.swap(false, Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(5)); // thread 0 lags: others steal
                }
                for i in r {
                    hits[i].fetch_add(1, Ordering::SeqCst);
                }
            };
            while !run_balanced(n, own, steal, &f) {} // another test may hold the team
            assert!(hits.iter().all(|h| h.load(Ordering::SeqCst) == 1), "n {n}: {hits:?}");
        }
    }

    /// Every piece is visited exactly once, with the right index, whatever the sizes (a
    /// short last piece, fewer pieces than threads, none).
    #[test]
    fn split_covers_every_piece_once() {
        // The team (this machine's thread count), and rayon pools of 3 and 5 threads (no
        // team of that size, so the rayon fallback splits, even on one CPU).
        split_cases();
        for threads in [3, 5] {
            rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap().install(split_cases);
        }
        let r = std::panic::catch_unwind(|| {
            split_mut(&mut [0u8; 64], 4, &|first, _| assert_ne!(first, 0, "a part fails"));
        });
        assert!(r.is_err(), "a panicking part must surface");
    }

    fn split_cases() {
        for (len, chunk) in [(0, 4), (1, 4), (7, 3), (64, 16), (100, 7), (33 * 5, 5)] {
            let mut a: Vec<usize> = vec![usize::MAX; len];
            let mut b: Vec<usize> = vec![usize::MAX; len.div_ceil(chunk) * 2];
            split2_mut(&mut a, chunk, &mut b, 2, &|first, pa, pb| {
                for (i, v) in pa.iter_mut().enumerate() {
                    *v = first * chunk + i;
                }
                for (i, v) in pb.iter_mut().enumerate() {
                    *v = first * 2 + i;
                }
            });
            assert!(a.iter().enumerate().all(|(i, &v)| v == i), "{len}/{chunk}: {a:?}");
            assert!(b.iter().enumerate().all(|(i, &v)| v == i), "{len}/{chunk}: {b:?}");
            let mut c = vec![0u8; len];
            split_mut(&mut c, chunk, &|_, p| p.iter_mut().for_each(|v| *v += 1));
            assert!(c.iter().all(|&v| v == 1));
        }
    }
}
