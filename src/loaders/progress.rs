//! Progress of a model load on stderr: a bar over the weights' bytes as the model takes
//! its tensors, drawn only when stderr is a terminal (quiet when piped or logged) and
//! cleared when the load ends. The bar lives in a thread-local slot that
//! [`crate::loaders::Weights::get`] advances, so no model's load code knows about it;
//! a model must therefore take its tensors on the thread that started the bar (tensors
//! taken on other threads are not counted, which only makes the bar stop short).

use std::cell::RefCell;
use std::collections::HashSet;
use std::io::IsTerminal;

struct Current {
    id: u64,
    bar: indicatif::ProgressBar,
    /// Tensors already counted: a model that looks a tensor up twice (a tied head, an
    /// existence check) counts its bytes once.
    seen: HashSet<String>,
}

thread_local! {
    static CURRENT: RefCell<Option<Current>> = const { RefCell::new(None) };
    static NEXT_ID: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// The bar of one load; it is cleared when this is dropped.
pub struct LoadProgress {
    id: u64,
    bar: indicatif::ProgressBar,
}

/// Start a bar for a load of `total_bytes` of weights, labelled `what`. A bar already
/// running on this thread stops counting.
pub fn start(what: &str, total_bytes: u64) -> LoadProgress {
    let bar = if std::io::stderr().is_terminal() {
        let bar = indicatif::ProgressBar::with_draw_target(
            Some(total_bytes),
            indicatif::ProgressDrawTarget::stderr_with_hz(10),
        );
        bar.set_style(
            indicatif::ProgressStyle::with_template("loading {msg} [{bar:30}] {bytes}/{total_bytes}")
                .expect("valid template")
                .progress_chars("=> "),
        );
        bar.set_message(what.to_owned());
        bar
    } else {
        indicatif::ProgressBar::hidden()
    };
    let id = NEXT_ID.with(|n| {
        n.set(n.get() + 1);
        n.get()
    });
    CURRENT.with(|c| *c.borrow_mut() = Some(Current { id, bar: bar.clone(), seen: HashSet::new() }));
    LoadProgress { id, bar }
}

/// Count the tensor `name` of `bytes` bytes as taken by the model being loaded on this
/// thread, if a bar runs and the tensor was not counted yet.
pub fn advance(name: &str, bytes: usize) {
    CURRENT.with(|c| {
        if let Some(cur) = c.borrow_mut().as_mut()
            && cur.seen.insert(name.to_owned())
        {
            cur.bar.inc(bytes as u64);
        }
    });
}

impl Drop for LoadProgress {
    fn drop(&mut self) {
        self.bar.finish_and_clear();
        CURRENT.with(|c| {
            let mut c = c.borrow_mut();
            if c.as_ref().is_some_and(|cur| cur.id == self.id) {
                *c = None;
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bar_counts_each_tensor_once_while_it_lives() {
        let p = start("test", 100);
        advance("a", 30);
        advance("b", 20);
        advance("a", 30); // looked up again: not counted twice
        assert_eq!(p.bar.position(), 50);
        drop(p);
        CURRENT.with(|c| assert!(c.borrow().is_none()));
        advance("c", 10); // no bar: nothing to count, no panic
    }

    #[test]
    fn dropping_an_older_bar_leaves_the_newer_one_counting() {
        let first = start("first", 10);
        let second = start("second", 10);
        drop(first);
        advance("x", 4);
        assert_eq!(second.bar.position(), 4);
    }
}
