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

/// Whether `c` is a letter (`\p{L}`).
pub(crate) fn is_letter(c: char) -> bool {
    class_of(c) == Class::Letter
}

/// Whether `c` is whitespace (`\s`: Unicode's `White_Space`).
pub(crate) fn is_space(c: char) -> bool {
    class_of(c) == Class::Space
}

/// Whether `c` is a mark (`\p{M}`: combining accents, vowel signs, enclosing marks).
pub(crate) fn is_mark(c: char) -> bool {
    !c.is_ascii() && matches!(get_general_category(c), G::NonspacingMark | G::SpacingMark | G::EnclosingMark)
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

/// The pattern of Llama 3's `tokenizer.json` (llama.cpp's `llama-bpe`, `llama3`):
/// the [`llama3_pieces`] scanner with up to three digits a piece.
pub const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 2's (llama.cpp's `qwen2`): the same with one digit a piece.
pub const QWEN2_PATTERN: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 3.5's (llama.cpp's `qwen35`): Qwen 2's with marks (`\p{M}`) in words, not in
/// punctuation runs.
pub const QWEN35_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Iterator over the pieces of [`LLAMA3_PATTERN`] (`max_digits` 3), [`QWEN2_PATTERN`]
/// (`max_digits` 1) or [`QWEN35_PATTERN`] (`marks`), which tile the text.
pub struct Llama3Pieces<'a> {
    text: &'a str,
    pos: usize,
    max_digits: usize,
    /// Marks belong to words (Qwen 3.5's `[\p{L}\p{M}]+`), not to punctuation runs.
    marks: bool,
}

pub fn llama3_pieces(text: &str, max_digits: usize) -> Llama3Pieces<'_> {
    Llama3Pieces { text, pos: 0, max_digits, marks: false }
}

/// The pieces of [`QWEN35_PATTERN`].
pub fn qwen35_pieces(text: &str) -> Llama3Pieces<'_> {
    Llama3Pieces { text, pos: 0, max_digits: 1, marks: true }
}

/// A contraction at the start of `s`, ASCII letters in either case (llama.cpp's `'[sS]|…`).
fn contraction_len_any_case(s: &[u8]) -> Option<usize> {
    if s.first() != Some(&b'\'') {
        return None;
    }
    let lower = |i: usize| s.get(i).map(u8::to_ascii_lowercase);
    match (lower(1), lower(2)) {
        (Some(b'r'), Some(b'e')) | (Some(b'v'), Some(b'e')) | (Some(b'l'), Some(b'l')) => Some(3),
        (Some(b's' | b't' | b'm' | b'd'), _) => Some(2),
        _ => None,
    }
}

impl Llama3Pieces<'_> {
    /// Bytes of the piece at the start of `rest` (not empty): the pattern's alternatives
    /// in order, as a backtracking regex takes the first that matches.
    fn piece_len(&self, rest: &str) -> usize {
        if let Some(n) = contraction_len_any_case(rest.as_bytes()) {
            return n;
        }
        let c0 = rest.chars().next().expect("not empty");
        let class0 = class_of(c0);
        let wordy = |c: char| class_of(c) == Class::Letter || (self.marks && is_mark(c));
        let run =
            |from: usize| rest[from..].char_indices().find(|&(_, c)| !wordy(c)).map_or(rest.len(), |(i, _)| from + i);
        // `[^\r\n\p{L}\p{N}]?\p{L}+` (Qwen 3.5: `[\p{L}\p{M}]+`; a mark first is in
        // both the prefix and the run: the run ends in the same place either way)
        if wordy(c0) {
            return run(0);
        }
        let next = rest[c0.len_utf8()..].chars().next();
        if class0 != Class::Number && c0 != '\r' && c0 != '\n' && next.is_some_and(wordy) {
            return run(c0.len_utf8());
        }
        tail_len(rest, self.max_digits, b"\r\n", self.marks)
    }
}

/// The alternatives Llama 3's and GPT-4o's patterns share after their letter ones, at the
/// start of `rest` (not empty, not starting a letter match): `\p{N}{1,max_digits}`, then
/// ` ?[^\s\p{L}\p{N}]+` followed by any of `trailing` (`[\r\n]*`, GPT-4o's `[\r\n/]*`),
/// then whitespace: `\s*[\r\n]+`, `\s+(?!\S)`, `\s+`. With `marks`, the punctuation
/// run stops at a mark (Qwen 3.5's `[^\s\p{L}\p{M}\p{N}]+`).
fn tail_len(rest: &str, max_digits: usize, trailing: &[u8], marks: bool) -> usize {
    let c0 = rest.chars().next().expect("not empty");
    let other = |c: char| class_of(c) == Class::Other && !(marks && is_mark(c));
    if class_of(c0) == Class::Number {
        return rest
            .char_indices()
            .take(max_digits)
            .take_while(|&(_, c)| class_of(c) == Class::Number)
            .last()
            .map_or(0, |(i, c)| i + c.len_utf8());
    }
    let body = if c0 == ' ' { 1 } else { 0 };
    if rest[body..].chars().next().is_some_and(other) {
        let end = rest[body..].char_indices().find(|&(_, c)| !other(c)).map_or(rest.len(), |(i, _)| body + i);
        return end + rest[end..].bytes().take_while(|b| trailing.contains(b)).count();
    }
    space_len(rest)
}

/// The whitespace alternatives `\s*[\r\n]+|\s+(?!\S)|\s+` at the start of `rest`: to the
/// last CR or LF of its whitespace run; else the run, less its last character when a
/// non-space follows and the run is longer than one. 0 if `rest` starts with no whitespace.
pub(crate) fn space_len(rest: &str) -> usize {
    let end = rest.char_indices().find(|&(_, c)| class_of(c) != Class::Space).map_or(rest.len(), |(i, _)| i);
    if let Some(nl) = rest[..end].rfind(['\r', '\n']) {
        return nl + 1;
    }
    if end == rest.len() {
        return end;
    }
    let last = rest[..end].chars().next_back().map_or(0, char::len_utf8);
    if end > last { end - last } else { end }
}

impl<'a> Iterator for Llama3Pieces<'a> {
    type Item = &'a str;

    fn next(&mut self) -> Option<&'a str> {
        if self.pos >= self.text.len() {
            return None;
        }
        let rest = &self.text[self.pos..];
        let piece = &rest[..self.piece_len(rest)];
        self.pos += piece.len();
        Some(piece)
    }
}

/// GPT-4o's pattern (`o200k_base`; llama.cpp's `gpt-4o`, `llama4`, `kanana2`, `talkie`,
/// `minimax-m2`): a word is letters with one leading non-letter, split where lower case
/// turns to upper (`HTTPServer` → `HTTPServer`, `helloWorld` → `hello`, `World`), with a
/// trailing contraction; numbers in threes; punctuation keeps following newlines and `/`.
pub const GPT4O_PATTERN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Mistral's Tekken (llama.cpp's `tekken`): GPT-4o's without contractions, one digit a piece.
pub const TEKKEN_PATTERN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// What a character is to [`GPT4O_PATTERN`]'s letter alternatives: in the "upper" class
/// `[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]`, the "lower" class `[\p{Ll}\p{Lm}\p{Lo}\p{M}]`
/// (modifier and other letters and marks are in both).
#[derive(Clone, Copy)]
struct CaseClass {
    upper: bool,
    lower: bool,
}

fn case_class_of(c: char) -> CaseClass {
    if c.is_ascii() {
        return CaseClass { upper: c.is_ascii_uppercase(), lower: c.is_ascii_lowercase() };
    }
    let (upper, lower) = match get_general_category(c) {
        G::UppercaseLetter | G::TitlecaseLetter => (true, false),
        G::LowercaseLetter => (false, true),
        G::ModifierLetter | G::OtherLetter | G::NonspacingMark | G::SpacingMark | G::EnclosingMark => (true, true),
        _ => (false, false),
    };
    CaseClass { upper, lower }
}

/// Iterator over the pieces of [`GPT4O_PATTERN`] (`tekken` false) or [`TEKKEN_PATTERN`]
/// (`tekken` true), which tile the text.
pub struct Gpt4oPieces<'a> {
    text: &'a str,
    pos: usize,
    tekken: bool,
}

pub fn gpt4o_pieces(text: &str, tekken: bool) -> Gpt4oPieces<'_> {
    Gpt4oPieces { text, pos: 0, tekken }
}

/// The optional prefix `[^\r\n\p{L}\p{N}]`: a character that is not a letter, a number,
/// CR or LF (spaces, punctuation, marks).
fn is_prefix(c: char) -> bool {
    c != '\r' && c != '\n' && !matches!(class_of(c), Class::Letter | Class::Number)
}

impl Gpt4oPieces<'_> {
    /// End of `U*L+` (`second` false: the first letter alternative) or `U+L*` (true:
    /// the second) matched at byte `from` of `rest`, as a backtracking regex finds it.
    /// Reads only the characters the match covers plus the upper run it scans, so a
    /// text is split in linear time.
    fn letters_end(rest: &str, from: usize, second: bool) -> Option<usize> {
        let mut chars = rest[from..].char_indices().map(|(i, c)| (from + i + c.len_utf8(), case_class_of(c)));
        // The greedy run of "upper" characters; where the last of them that is also
        // "lower" ends; the character after the run.
        let (mut any_upper, mut upper_end, mut lower_in_upper) = (false, from, None);
        let mut after = None;
        for (end, c) in chars.by_ref() {
            if !c.upper {
                after = Some((end, c));
                break;
            }
            (any_upper, upper_end) = (true, end);
            if c.lower {
                lower_in_upper = Some(end);
            }
        }
        // The run of "lower" characters right after the upper run.
        let lower_end = match after {
            Some((end, c)) if c.lower => Some(chars.take_while(|(_, c)| c.lower).last().map_or(end, |(e, _)| e)),
            _ => None,
        };
        if second {
            // `U+L*`: at least one upper, then any lower.
            return any_upper.then(|| lower_end.unwrap_or(upper_end));
        }
        // `U*L+`: after the greedy run, L+ takes the lower run that follows; failing that
        // U* gives back characters until the one it gives back can start L+ (which then
        // ends there: the next one is upper, not lower).
        lower_end.or(lower_in_upper)
    }

    fn piece_len(&self, rest: &str) -> usize {
        let c0 = rest.chars().next().expect("not empty");
        // The two letter alternatives, each with its optional prefix first.
        for second in [false, true] {
            let starts: &[usize] = if is_prefix(c0) { &[c0.len_utf8(), 0] } else { &[0] };
            for &from in starts {
                if let Some(end) = Self::letters_end(rest, from, second) {
                    let contraction =
                        if self.tekken { 0 } else { contraction_len_any_case(&rest.as_bytes()[end..]).unwrap_or(0) };
                    return end + contraction;
                }
            }
        }
        tail_len(rest, if self.tekken { 1 } else { 3 }, b"\r\n/", false)
    }
}

impl<'a> Iterator for Gpt4oPieces<'a> {
    type Item = &'a str;

    fn next(&mut self) -> Option<&'a str> {
        if self.pos >= self.text.len() {
            return None;
        }
        let rest = &self.text[self.pos..];
        let piece = &rest[..self.piece_len(rest)];
        self.pos += piece.len();
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

    #[test]
    fn splits_like_llama3_regex() {
        let split = |s: &'static str, d: usize| llama3_pieces(s, d).collect::<Vec<_>>();
        assert_eq!(split("Hello world", 3), ["Hello", " world"]);
        assert_eq!(split("x12345y", 3), ["x", "123", "45", "y"]);
        assert_eq!(split("x12345y", 1), ["x", "1", "2", "3", "4", "5", "y"]);
        assert_eq!(split("I'M (ok)\n\n  next", 3), ["I", "'M", " (", "ok", ")\n\n", " ", " next"]);
        assert_eq!(split("a \n\t b", 3), ["a", " \n", "\t", " b"]);
        assert_eq!(split(" 42", 3), [" ", "42"]);
        assert_eq!(split("end  ", 3), ["end", "  "]);
    }
}
