//! Generated tokens → the text a client sees: whole UTF-8 characters only, stop
//! strings matched across token boundaries and never emitted (a possible start of one
//! is held back until it is decided), and each token's place in the text for
//! log-probabilities.

use crate::engine::TokenLogprobs;
use crate::tokenizer::{StreamDecoder, Tokenizer};

/// One generated token as reported with its log-probability.
#[derive(Clone, Debug)]
pub struct TokenOut {
    pub id: u32,
    /// Byte offset in the completion text where this token's text begins.
    pub offset: usize,
    pub logprobs: Option<TokenLogprobs>,
}

/// Accumulates a completion's text.
pub struct TextOut<'a> {
    tokenizer: &'a Tokenizer,
    stops: &'a [String],
    decoder: StreamDecoder,
    text: String,
    /// Bytes of `text` handed out so far.
    sent: usize,
    tokens: Vec<TokenOut>,
    sent_tokens: usize,
    stopped: bool,
}

impl<'a> TextOut<'a> {
    pub fn new(tokenizer: &'a Tokenizer, stops: &'a [String]) -> Self {
        TextOut {
            tokenizer,
            stops,
            decoder: StreamDecoder::new(),
            text: String::new(),
            sent: 0,
            tokens: Vec::new(),
            sent_tokens: 0,
            stopped: false,
        }
    }

    /// Add a token. Returns true when a stop string has now appeared: the text is cut
    /// where it begins and the rest of the generation is to be dropped.
    pub fn push(&mut self, id: u32, logprobs: Option<TokenLogprobs>) -> bool {
        if self.stopped {
            return true;
        }
        let offset = self.text.len();
        let bytes = self.tokenizer.token_bytes(id).unwrap_or(&[]);
        self.decoder.push_into(bytes, &mut self.text);
        self.tokens.push(TokenOut { id, offset, logprobs });
        self.find_stop(offset);
        self.stopped
    }

    /// Cut the text at the first stop string that ends after byte `new_from` (text up
    /// to there was searched before). A stop can only begin in the unsent text (see
    /// `hold_back`) and within the longest stop's reach of the new text, so each token
    /// costs a search over a bounded window, not the whole completion.
    fn find_stop(&mut self, new_from: usize) {
        let longest = self.stops.iter().map(|s| s.len()).max().unwrap_or(0);
        let mut from = new_from.saturating_sub(longest.saturating_sub(1)).max(self.sent);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        let found = self.stops.iter().filter_map(|s| self.text[from..].find(s.as_str())).min();
        if let Some(at) = found {
            self.text.truncate(from + at);
            self.stopped = true;
        }
    }

    /// The end of the generation: bytes of a character that never completed become U+FFFD.
    pub fn finish(&mut self) {
        if !self.stopped {
            let from = self.text.len();
            let rest = self.decoder.finish();
            self.text.push_str(&rest);
            self.find_stop(from);
        }
    }

    pub fn stopped(&self) -> bool {
        self.stopped
    }

    pub fn text(&self) -> &str {
        &self.text
    }

    pub fn tokens(&self) -> &[TokenOut] {
        let end = self.text.len();
        let n = self.tokens.iter().take_while(|t| t.offset < end || (t.offset == end && !self.stopped)).count();
        &self.tokens[..n]
    }

    /// Bytes at the end of the text that could begin a stop string.
    fn hold_back(&self) -> usize {
        let t = &self.text[self.sent..];
        let mut keep = 0;
        for s in self.stops {
            for (k, _) in s.char_indices().skip(1) {
                if k > keep && t.ends_with(&s[..k]) {
                    keep = k;
                }
            }
        }
        keep
    }

    /// The text that can be sent now (all of it once `done` or stopped) and the tokens
    /// whose text begins in what has been sent.
    pub fn take_ready(&mut self, done: bool) -> (String, Vec<TokenOut>) {
        let end = if done || self.stopped { self.text.len() } else { self.text.len() - self.hold_back() };
        let end = end.max(self.sent);
        let delta = self.text[self.sent..end].to_owned();
        self.sent = end;
        let mut toks = Vec::new();
        while self.sent_tokens < self.tokens.len() {
            let t = &self.tokens[self.sent_tokens];
            let released = t.offset < end || (done && !self.stopped && t.offset == end);
            if !released {
                break;
            }
            toks.push(t.clone());
            self.sent_tokens += 1;
        }
        (delta, toks)
    }

    /// The text of one token for log-probability lists (lossy where it splits a character).
    pub fn piece(&self, id: u32) -> String {
        String::from_utf8_lossy(self.tokenizer.token_bytes(id).unwrap_or(&[])).into_owned()
    }

    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        self.tokenizer.token_bytes(id).unwrap_or(&[]).to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpt2() -> Tokenizer {
        Tokenizer::from_dir(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gpt2-tokenizer"))
            .unwrap()
    }

    /// Push `text`'s tokens one by one; returns the streamed deltas and the final text.
    fn run(tok: &Tokenizer, text: &str, stops: &[String]) -> (Vec<String>, String, bool) {
        let mut out = TextOut::new(tok, stops);
        let mut deltas = Vec::new();
        for id in tok.encode(text) {
            let stopped = out.push(id, None);
            deltas.push(out.take_ready(false).0);
            if stopped {
                break;
            }
        }
        out.finish();
        deltas.push(out.take_ready(true).0);
        (deltas, out.text().to_owned(), out.stopped())
    }

    #[test]
    fn stop_strings_are_cut_across_tokens_and_never_sent() {
        let tok = gpt2();
        let stops = vec!["lo wor".to_owned()];
        let (deltas, text, stopped) = run(&tok, "Hello world, hello", &stops);
        assert!(stopped);
        assert_eq!(text, "Hel");
        assert_eq!(deltas.concat(), "Hel");
        // A possible start of the stop ("lo", "lo w") was held back, never sent early.
        let stops = vec!["lo there".to_owned()];
        let (deltas, text, stopped) = run(&tok, "Hello world", &stops);
        assert!(!stopped);
        assert_eq!(text, "Hello world");
        assert_eq!(deltas.concat(), "Hello world");
        assert!(deltas.iter().all(|d| !d.ends_with("lo")), "{deltas:?}");
    }

    #[test]
    fn multi_byte_characters_are_sent_whole_and_stops_inside_them_work() {
        let tok = gpt2();
        let text = "go 🚀 now é!";
        assert!(tok.encode("🚀").len() > 1, "the rocket spans several byte tokens");
        let (deltas, got, _) = run(&tok, text, &[]);
        assert_eq!(got, text);
        assert_eq!(deltas.concat(), text);
        assert!(deltas.iter().all(|d| !d.contains('\u{fffd}')), "{deltas:?}");
        let (deltas, got, stopped) = run(&tok, text, &["🚀".to_owned()]);
        assert!(stopped);
        assert_eq!((got.as_str(), deltas.concat()), ("go ", "go ".to_owned()));
        // "é" holds no "e": the stop matches the plain letter only.
        let (_, got, stopped) = run(&tok, "é and e", &["e".to_owned()]);
        assert!(stopped);
        assert_eq!(got, "é and ");
    }

    #[test]
    fn token_offsets_follow_the_text() {
        let tok = gpt2();
        let mut out = TextOut::new(&tok, &[]);
        for id in tok.encode("Hello world") {
            out.push(id, None);
        }
        out.finish();
        let offsets: Vec<usize> = out.tokens().iter().map(|t| t.offset).collect();
        assert_eq!(offsets, [0, 5]);
    }
}
