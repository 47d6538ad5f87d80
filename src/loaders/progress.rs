//! Progress of a model load on stderr: a bar over the weights' bytes as the model takes
//! its tensors, drawn only when stderr is a terminal (quiet when piped or logged) and
//! cleared when the load ends. The bar lives in a thread-local slot that
//! [`crate::loaders::Weights::get`] advances, so no model's load code knows about it.

use std::cell::RefCell;
use std::io::IsTerminal;

thread_local! {
    static CURRENT: RefCell<Option<indicatif::ProgressBar>> = const { RefCell::new(None) };
}

/// The bar of one load; it is cleared and the slot emptied when this is dropped.
pub struct LoadProgress {
    bar: indicatif::ProgressBar,
}

/// Start a bar for a load of `total_bytes` of weights, labelled `what`. A bar already
/// running on this thread is replaced.
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
    CURRENT.with(|c| *c.borrow_mut() = Some(bar.clone()));
    LoadProgress { bar }
}

/// Count `bytes` of weights as taken by the model being loaded on this thread, if any.
pub fn advance(bytes: usize) {
    CURRENT.with(|c| {
        if let Some(bar) = c.borrow().as_ref() {
            bar.inc(bytes as u64);
        }
    });
}

impl Drop for LoadProgress {
    fn drop(&mut self) {
        self.bar.finish_and_clear();
        CURRENT.with(|c| *c.borrow_mut() = None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bar_counts_while_it_lives_and_is_gone_after() {
        let p = start("test", 100);
        advance(30);
        advance(20);
        assert_eq!(p.bar.position(), 50);
        drop(p);
        CURRENT.with(|c| assert!(c.borrow().is_none()));
        advance(10); // no bar: nothing to count, no panic
    }
}
