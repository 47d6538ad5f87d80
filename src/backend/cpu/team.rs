//! A spinning thread team for decode-sized work.
//!
//! A decode step of a 30-layer model runs ~120 matrix-vector products of a few hundred
//! microseconds each. Handing each to rayon costs a thread wake-up (10–20 µs on a VM, a
//! futex round trip) because rayon's idle workers go to sleep between them; that is a
//! fifth of SmolLM2's step at 2 threads. Here helpers spin (`spin_loop`) for a short while
//! after each job, so the next one starts within a microsecond, and park after
//! [`SPIN`] without work, so an idle team costs nothing.
//!
//! [`run`] splits `n_parts` parts over the caller and `threads − 1` helpers (`threads` =
//! the current rayon pool's size, i.e. `-t`) and returns when all are done. A team busy
//! with another caller (tests run in parallel) is not waited for: the caller falls back to
//! rayon.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long a helper spins without work before it parks.
const SPIN: Duration = Duration::from_micros(200);

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
    parked: Mutex<usize>,
}

pub struct Team {
    helpers: usize,
    shared: Arc<Shared>,
    /// One caller at a time.
    busy: AtomicBool,
}

impl Team {
    fn new(helpers: usize) -> Team {
        let shared = Arc::new(Shared {
            generation: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            job: Mutex::new(None),
            panicked: AtomicBool::new(false),
            wake: Condvar::new(),
            parked: Mutex::new(0),
        });
        for index in 1..=helpers {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name(format!("forge-team-{index}"))
                .spawn(move || helper(&shared, index))
                .expect("spawning a team thread");
        }
        Team { helpers, shared, busy: AtomicBool::new(false) }
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
            if spins.is_multiple_of(256) && idle_since.elapsed() > SPIN {
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

/// Teams by size, created on first use and kept (parked when idle).
fn team(threads: usize) -> Option<&'static Team> {
    static TEAMS: OnceLock<Mutex<Vec<&'static Team>>> = OnceLock::new();
    if threads < 2 {
        return None;
    }
    let mut teams = TEAMS.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    if let Some(t) = teams.iter().find(|t| t.helpers == threads - 1) {
        return Some(t);
    }
    let t: &'static Team = Box::leak(Box::new(Team::new(threads - 1)));
    teams.push(t);
    Some(t)
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
    while shared.done.load(Ordering::Acquire) < team.helpers {
        std::hint::spin_loop();
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
