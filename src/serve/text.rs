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
        // A stop can only begin in the unsent text (see `hold_back`).
        let found = self.stops.iter().filter_map(|s| self.text[self.sent..].find(s.as_str())).min();
        if let Some(at) = found {
            self.text.truncate(self.sent + at);
            self.stopped = true;
        }
        self.stopped
    }

    /// The end of the generation: bytes of a character that never completed become U+FFFD.
    pub fn finish(&mut self) {
        if !self.stopped {
            let rest = self.decoder.finish();
            self.text.push_str(&rest);
            let found = self.stops.iter().filter_map(|s| self.text[self.sent..].find(s.as_str())).min();
            if let Some(at) = found {
                self.text.truncate(self.sent + at);
                self.stopped = true;
            }
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
