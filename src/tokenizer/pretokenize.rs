//! GPT-2's pre-tokenizer, written out as a scanner instead of a regex.
//!
//! The pattern it reproduces (OpenAI's `encoder.py`, HF's ByteLevel `use_regex`):
//!
//! ```text
//! 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//! ```
//!
//! Alternatives are tried in that order at each position. The subtle one is
//! `\s+(?!\S)`: a run of whitespace followed by a non-space gives up its last
//! character, so that `"a   b"` splits as `a`, `"  "`, `" b"`.

use unicode_general_category::{GeneralCategory as G, get_general_category};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Class {
    Letter,
    Number,
    Space,
    Other,
}

fn class_of(c: char) -> Class {
    if c.is_ascii() {
        return match c {
            'a'..='z' | 'A'..='Z' => Class::Letter,
            '0'..='9' => Class::Number,
            ' ' | '\t' | '\n' | '\r' | '\x0b' | '\x0c' => Class::Space,
            _ => Class::Other,
        };
    }
    if c.is_whitespace() {
        return Class::Space;
    }
    match get_general_category(c) {
        G::UppercaseLetter | G::LowercaseLetter | G::TitlecaseLetter | G::ModifierLetter | G::OtherLetter => {
            Class::Letter
        }
        G::DecimalNumber | G::LetterNumber | G::OtherNumber => Class::Number,
        _ => Class::Other,
    }
}

/// Whether `c` is a number character (`\p{N}`: decimal digits, letter numbers such as
/// Roman numerals, other numbers such as `²` or `½`).
pub(crate) fn is_number(c: char) -> bool {
    class_of(c) == Class::Number
}

/// Iterator over the pre-token pieces of `text`, as `&str` slices that tile it exactly.
pub struct PreTokens<'a> {
    text: &'a str,
    pos: usize,
}

pub fn pre_tokenize(text: &str) -> PreTokens<'_> {
    PreTokens { text, pos: 0 }
}

/// Length in bytes of a contraction (`'s`, `'t`, `'re`, `'ve`, `'m`, `'ll`, `'d`) at the start of `s`.
fn contraction_len(s: &[u8]) -> Option<usize> {
    if s.first() != Some(&b'\'') {
        return None;
    }
    match s.get(1..3) {
        Some(b"re") | Some(b"ve") | Some(b"ll") => return Some(3),
        _ => {}
    }
    match s.get(1) {
        Some(b's' | b't' | b'm' | b'd') => Some(2),
        _ => None,
    }
}

impl<'a> PreTokens<'a> {
    /// End of the run of characters of `class` starting at byte `from`.
    fn run_end(&self, from: usize, class: Class) -> usize {
        let rest = &self.text[from..];
        rest.char_indices().find(|&(_, c)| class_of(c) != class).map_or(self.text.len(), |(i, _)| from + i)
    }

    fn next_piece_end(&self) -> usize {
        let start = self.pos;
        let rest = &self.text[start..];
        if let Some(n) = contraction_len(rest.as_bytes()) {
            return start + n;
        }
        let mut chars = rest.chars();
        let first = chars.next().expect("called with text left");
        // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: an optional single space, then a run.
        let (body_start, body_char) = if first == ' ' {
            match chars.next() {
                Some(c) => (start + 1, c),
                None => (start, first),
            }
        } else {
            (start, first)
        };
        let body_class = class_of(body_char);
        if body_class != Class::Space {
            return self.run_end(body_start, body_class);
        }
        // `\s+(?!\S)` then `\s+`.
        let end = self.run_end(start, Class::Space);
        if end == self.text.len() {
            return end;
        }
        let last_len = self.text[start..end].chars().next_back().map_or(0, char::len_utf8);
        if end - start > last_len { end - last_len } else { end }
    }
}

impl<'a> Iterator for PreTokens<'a> {
    type Item = &'a str;

    fn next(&mut self) -> Option<&'a str> {
        if self.pos >= self.text.len() {
            return None;
        }
        let end = self.next_piece_end();
        let piece = &self.text[self.pos..end];
        self.pos = end;
        Some(piece)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(s: &str) -> Vec<&str> {
        pre_tokenize(s).collect()
    }

    #[test]
    fn splits_like_gpt2_regex() {
        assert_eq!(split("Hello world"), ["Hello", " world"]);
        assert_eq!(split("a   b"), ["a", "  ", " b"]);
        assert_eq!(split("a \n b"), ["a", " \n", " b"]);
        assert_eq!(split("trailing  "), ["trailing", "  "]);
        assert_eq!(split("I'm it's we'll"), ["I", "'m", " it", "'s", " we", "'ll"]);
        assert_eq!(split("x1234y"), ["x", "1234", "y"]);
        assert_eq!(split(" ?!"), [" ?!"]);
        assert_eq!(split("\n\nHi"), ["\n", "\n", "Hi"]);
        assert_eq!(split(" "), [" "]);
        assert_eq!(split("東京 🚀"), ["東京", " 🚀"]);
    }
}
