//! Incremental detokenization that only ever emits complete UTF-8.
//!
//! One character (an emoji, a CJK ideograph) often spans several byte-level tokens.
//! `StreamDecoder` buffers the bytes of a partial character until it completes, so a
//! streaming client never sees a broken character. Invalid bytes become U+FFFD, as
//! HF's `decode` does.

#[derive(Default, Debug)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Add the bytes of one or more tokens; returns the text that is now complete.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        let mut out = String::new();
        self.push_into(bytes, &mut out);
        out
    }

    /// Like [`push`](Self::push), appending the completed text to `out` (no allocation
    /// once `out` has grown).
    pub fn push_into(&mut self, bytes: &[u8], out: &mut String) {
        self.pending.extend_from_slice(bytes);
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&self.pending[..valid]).expect("checked valid prefix"));
                    match e.error_len() {
                        // An incomplete sequence at the end: hold it back.
                        None => {
                            self.pending.drain(..valid);
                            return;
                        }
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// Bytes held back waiting for the rest of a character.
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// End of stream: whatever is still held back can never complete.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_back_partial_characters() {
        let rocket = "🚀".as_bytes();
        let mut d = StreamDecoder::new();
        assert_eq!(d.push(b"go "), "go ");
        assert_eq!(d.push(&rocket[..1]), "");
        assert_eq!(d.push(&rocket[1..3]), "");
        assert_eq!(d.pending_len(), 3);
        assert_eq!(d.push(&rocket[3..]), "🚀");
        assert_eq!(d.finish(), "");
    }

    #[test]
    fn invalid_bytes_become_replacement_chars() {
        let mut d = StreamDecoder::new();
        assert_eq!(d.push(&[b'a', 0xFF, b'b']), "a\u{FFFD}b");
        assert_eq!(d.push(&[0xE6, 0x9D]), "");
        assert_eq!(d.finish(), "\u{FFFD}");
    }
}
