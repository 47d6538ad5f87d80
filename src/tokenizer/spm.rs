//! SentencePiece BPE (`tokenizer.ggml.model = "llama"`: Gemma, Llama 2, Mistral,
//! TinyLlama), as llama.cpp's `llm_tokenizer_spm` runs it and HF's converted tokenizer
//! agrees with.
//!
//! ```text
//! text  = (" " if add_space_prefix and the fragment starts the text or follows a special token) + fragment
//! text  = text with every ' ' replaced by '▁' (U+2581)
//! syms  = the UTF-8 characters of text
//! while some adjacent pair (a, b) of syms spells a vocabulary piece:
//!     merge the pair whose piece has the highest score (leftmost on ties)
//! each sym → its piece's id, or (byte fallback) the ids of `<0xXX>` for each of its bytes
//! ```
//!
//! There is no pre-tokenizer: merges may cross `▁`. The scores are the GGUF's
//! `tokenizer.ggml.scores` (SentencePiece's, the negated merge order for BPE models), so
//! the highest score is the earliest merge.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// The vocabulary of a SentencePiece model, as the encoder needs it.
pub(crate) struct Spm {
    /// UTF-8 bytes of each piece (with `▁`) → (id, score).
    pieces: HashMap<Vec<u8>, (u32, f32)>,
    /// The `<0xXX>` token of each byte, where the vocabulary has one.
    byte_tokens: [Option<u32>; 256],
    /// What a byte without a `<0xXX>` token becomes.
    unknown: Option<u32>,
    /// Whether raw text that starts the input or follows a special token gets a space.
    pub(crate) add_space_prefix: bool,
}

/// A symbol: bytes `start .. start + len` of the escaped text (`len` 0 once merged away).
struct Sym {
    start: usize,
    len: usize,
    prev: usize,
    next: usize,
}

const NONE: usize = usize::MAX;

/// A candidate merge of symbols `left` and its right neighbour.
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    /// Bytes of the merged piece; a mismatch means a symbol has changed since.
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    /// The largest is the highest score, then the leftmost.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score.total_cmp(&other.score).then_with(|| other.left.cmp(&self.left))
    }
}

impl Spm {
    /// `pieces`: (text, id, score) of every token that merges may form (normal tokens).
    pub(crate) fn new(
        pieces: impl IntoIterator<Item = (String, u32, f32)>,
        byte_tokens: [Option<u32>; 256],
        unknown: Option<u32>,
        add_space_prefix: bool,
    ) -> Self {
        let mut map = HashMap::new();
        for (text, id, score) in pieces {
            // The last of two equal pieces wins, as llama.cpp's text → id map keeps it.
            map.insert(text.into_bytes(), (id, score));
        }
        Spm { pieces: map, byte_tokens, unknown, add_space_prefix }
    }

    /// Encode one fragment of raw text (no special tokens in it) into `out`.
    /// `prefix`: put a space first (see [`Spm::add_space_prefix`]).
    pub(crate) fn encode(&self, text: &str, prefix: bool, out: &mut Vec<u32>) {
        if text.is_empty() {
            return;
        }
        let mut escaped = String::with_capacity(text.len() + text.len() / 4 + 3);
        if prefix && self.add_space_prefix {
            escaped.push('▁');
        }
        for c in text.chars() {
            escaped.push(if c == ' ' { '▁' } else { c });
        }
        let bytes = escaped.as_bytes();
        let mut syms: Vec<Sym> = Vec::with_capacity(escaped.len());
        for (i, (start, c)) in escaped.char_indices().enumerate() {
            syms.push(Sym { start, len: c.len_utf8(), prev: i.wrapping_sub(1), next: i + 1 });
        }
        let n = syms.len();
        syms[n - 1].next = NONE;
        let mut heap = BinaryHeap::with_capacity(n);
        let try_add = |heap: &mut BinaryHeap<Bigram>, syms: &[Sym], left: usize, right: usize| {
            if left == NONE || right == NONE {
                return;
            }
            let (start, size) = (syms[left].start, syms[left].len + syms[right].len);
            if let Some(&(_, score)) = self.pieces.get(&bytes[start..start + size]) {
                heap.push(Bigram { score, left, right, size });
            }
        };
        for i in 1..n {
            try_add(&mut heap, &syms, i - 1, i);
        }
        while let Some(b) = heap.pop() {
            let (l, r) = (&syms[b.left], &syms[b.right]);
            if l.len == 0 || r.len == 0 || l.len + r.len != b.size {
                continue; // stale: one of the two has merged since
            }
            let after = r.next;
            syms[b.left].len = b.size;
            syms[b.left].next = after;
            syms[b.right].len = 0;
            if after != NONE {
                syms[after].prev = b.left;
            }
            try_add(&mut heap, &syms, syms[b.left].prev, b.left);
            try_add(&mut heap, &syms, b.left, after);
        }
        let mut i = 0;
        while i != NONE {
            let s = &syms[i];
            let piece = &bytes[s.start..s.start + s.len];
            match self.pieces.get(piece) {
                Some(&(id, _)) => out.push(id),
                // Byte fallback: a character the vocabulary lacks, byte by byte.
                None => out.extend(piece.iter().filter_map(|&b| self.byte_tokens[b as usize].or(self.unknown))),
            }
            i = s.next;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spm(pieces: &[(&str, f32)]) -> Spm {
        let mut bytes = [None; 256];
        for b in 0..=255u8 {
            bytes[b as usize] = Some(1000 + b as u32);
        }
        Spm::new(pieces.iter().enumerate().map(|(i, &(t, s))| (t.to_owned(), i as u32, s)), bytes, Some(999), false)
    }

    #[test]
    fn merges_by_score_then_leftmost() {
        // ids: a 0, b 1, ab 2, bc 3, c 4, abcd 5, d 6
        let t = spm(&[("a", 0.0), ("b", 0.0), ("ab", -2.0), ("bc", -1.0), ("c", 0.0), ("abcd", -3.0), ("d", 0.0)]);
        let enc = |s: &str| {
            let mut v = Vec::new();
            t.encode(s, true, &mut v);
            v
        };
        // "bc" outscores "ab": a + bc (no piece "abc" to merge into).
        assert_eq!(enc("abc"), [0, 3]);
        // A merged symbol merges on with its neighbours: "abcd" is reached only through
        // pieces that exist, so it stays a + bc + d here.
        assert_eq!(enc("abcd"), [0, 3, 6]);
        // Equal scores: the leftmost pair first.
        assert_eq!(enc("abab"), [2, 2]);
        // Characters outside the vocabulary fall back to bytes; a space is '▁' (E2 96 81).
        assert_eq!(enc("aé b"), [0, 1000 + 0xc3, 1000 + 0xa9, 1000 + 0xe2, 1000 + 0x96, 1000 + 0x81, 1]);
    }

    #[test]
    fn space_prefix_only_when_asked() {
        let mut t = spm(&[("▁a", 0.0), ("a", -1.0)]);
        let mut v = Vec::new();
        t.encode("a", true, &mut v);
        assert_eq!(v, [1]);
        t.add_space_prefix = true;
        v.clear();
        t.encode("a", true, &mut v);
        assert_eq!(v, [0]);
        v.clear();
        t.encode("a", false, &mut v);
        assert_eq!(v, [1]);
    }
}
