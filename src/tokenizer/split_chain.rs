//! Pre-tokenizers that are a chain of regex splits: DeepSeek's and MiniCPM 5's (HF's
//! `Sequence` of `Split(Regex, Isolated)`, and for DeepSeek LLM and Coder a last `Digits`,
//! before `ByteLevel`; llama.cpp's `deepseek-llm`, `deepseek-coder`, `deepseek-v3` and
//! `minicpm5` lists of `regex_exprs`).
//!
//! Each regex splits every piece the previous one left: its matches and the text between
//! them become pieces. Each regex here is a hand-written scanner that finds the leftmost
//! match at or after a position as a backtracking regex does, in time linear in the text.

use unicode_general_category::{GeneralCategory as G, get_general_category};

use super::PreTokenizer;
use super::pretokenize::{is_letter, is_mark, is_number, is_space, llama3_pieces, space_len};

/// The leftmost match of one regex in `s` at or after byte `from`, as a byte range.
type Find = fn(&str, usize) -> Option<(usize, usize)>;

/// DeepSeek LLM's `tokenizer.json` splits (llama.cpp's `deepseek-llm`), in order.
pub const DEEPSEEK_LLM_SPLITS: [&str; 6] = [
    "[\r\n]",
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u{1f7d}ᾀ-ᾴᾶ-ᾼ\u{1fbe}ῂ-ῄῆ-ῌῐ-\u{1fd3}ῖ-\u{1fdb}ῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u{2126}ℨ\u{212a}-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    "\\s?[!-/:-~！-／：-～‘-‟\u{3000}-。]+",
    "\\s+$",
    "[一-龥ࠀ-一가-\u{d7ff}]+",
    "\\p{N}+",
];

/// DeepSeek Coder's (llama.cpp's `deepseek-coder`).
pub const DEEPSEEK_CODER_SPLITS: [&str; 5] =
    ["[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", "[一-龥ࠀ-一가-\u{d7ff}]+", "\\p{N}"];

/// DeepSeek V3's and R1's (llama.cpp's `deepseek-v3`, `hunyuan-dense`, `joyai-llm`,
/// `hy_v4`).
pub const DEEPSEEK_V3_SPLITS: [&str; 3] = [
    "\\p{N}{1,3}",
    "[一-龥\u{3040}-ゟ゠-ヿ]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
];

/// MiniCPM 5's (llama.cpp's `minicpm5`): numbers in threes, then Llama 3's pattern with
/// whole number runs on each piece left.
pub const MINICPM5_SPLITS: [&str; 2] = [
    "\\p{N}{1,3}",
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}+| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];

/// The scanners of [`MINICPM5_SPLITS`]. The second pattern matches at every position
/// (its last alternatives take any character), so its leftmost match is the next piece
/// of [`llama3_pieces`]: on the pieces the first split leaves (numbers of up to three
/// digits, or text without any), `\p{N}+` and Llama 3's `\p{N}{1,3}` match alike.
pub(crate) const MINICPM5: &[Find] = &[
    |s, from| run(s, from, 3, is_number),
    |s, from| llama3_pieces(&s[from..], 3).next().map(|p| (from, from + p.len())),
];

/// The scanners of [`DEEPSEEK_LLM_SPLITS`], in order.
pub(crate) const DEEPSEEK_LLM: &[Find] =
    &[newline, deepseek_letters, deepseek_punct, trailing_space, deepseek_cjk, |s, from| {
        run(s, from, usize::MAX, is_number)
    }];

/// DeepSeek LLM's own `tokenizer.json`: [`DEEPSEEK_LLM_SPLITS`] with every digit alone
/// (HF's `Digits(individual_digits)` last, where llama.cpp has `\p{N}+`).
pub(crate) const DEEPSEEK_LLM_DIGITS: &[Find] =
    &[newline, deepseek_letters, deepseek_punct, trailing_space, deepseek_cjk, |s, from| run(s, from, 1, is_number)];

/// The scanners of [`DEEPSEEK_CODER_SPLITS`], in order.
pub(crate) const DEEPSEEK_CODER: &[Find] = &[
    newline,
    |s, from| space_then_run(s, from, is_letter),
    |s, from| space_then_run(s, from, is_punct),
    deepseek_cjk,
    |s, from| run(s, from, 1, is_number),
];

/// The scanners of [`DEEPSEEK_V3_SPLITS`], in order.
pub(crate) const DEEPSEEK_V3: &[Find] = &[
    |s, from| run(s, from, 3, is_number),
    |s, from| run(s, from, usize::MAX, in_ranges(&DEEPSEEK_V3_CJK)),
    |s, from| {
        s[from..].char_indices().find_map(|(i, _)| deepseek_v3_len(&s[from + i..]).map(|n| (from + i, from + i + n)))
    },
];

/// `\s?[A-Za-zµÀ-ÖØ-ö…]+`: DeepSeek LLM's letters, with one whitespace character before.
fn deepseek_letters(s: &str, from: usize) -> Option<(usize, usize)> {
    space_then_run(s, from, is_deepseek_letter)
}

/// `\s?[!-/:-~！-／：-～‘-‟\u{3000}-。]+`: DeepSeek LLM's punctuation.
fn deepseek_punct(s: &str, from: usize) -> Option<(usize, usize)> {
    space_then_run(s, from, in_ranges(&DEEPSEEK_PUNCT))
}

/// `[一-龥ࠀ-一가-\u{d7ff}]+`: DeepSeek LLM's and Coder's CJK runs.
fn deepseek_cjk(s: &str, from: usize) -> Option<(usize, usize)> {
    run(s, from, usize::MAX, in_ranges(&DEEPSEEK_CJK))
}

/// The letter class of [`DEEPSEEK_LLM_SPLITS`]' second regex, as inclusive ranges.
const DEEPSEEK_LETTERS: [(u32, u32); 87] = [
    (0x41, 0x5A),
    (0x61, 0x7A),
    (0xB5, 0xB5),
    (0xC0, 0xD6),
    (0xD8, 0xF6),
    (0xF8, 0x1BA),
    (0x1BC, 0x1BF),
    (0x1C4, 0x293),
    (0x295, 0x2AF),
    (0x370, 0x373),
    (0x376, 0x376),
    (0x377, 0x377),
    (0x37B, 0x37D),
    (0x37F, 0x37F),
    (0x386, 0x386),
    (0x388, 0x38A),
    (0x38C, 0x38C),
    (0x38E, 0x3A1),
    (0x3A3, 0x3F5),
    (0x3F7, 0x481),
    (0x48A, 0x52F),
    (0x531, 0x556),
    (0x10A0, 0x10C5),
    (0x13A0, 0x13F5),
    (0x13F8, 0x13FD),
    (0x1C90, 0x1CBA),
    (0x1CBD, 0x1CBF),
    (0x1D00, 0x1D2B),
    (0x1D6B, 0x1D77),
    (0x1D79, 0x1D9A),
    (0x1E00, 0x1F15),
    (0x1F18, 0x1F1D),
    (0x1F20, 0x1F45),
    (0x1F48, 0x1F4D),
    (0x1F50, 0x1F57),
    (0x1F59, 0x1F59),
    (0x1F5B, 0x1F5B),
    (0x1F5D, 0x1F5D),
    (0x1F5F, 0x1F7D),
    (0x1F80, 0x1FB4),
    (0x1FB6, 0x1FBC),
    (0x1FBE, 0x1FBE),
    (0x1FC2, 0x1FC4),
    (0x1FC6, 0x1FCC),
    (0x1FD0, 0x1FD3),
    (0x1FD6, 0x1FDB),
    (0x1FE0, 0x1FEC),
    (0x1FF2, 0x1FF4),
    (0x1FF6, 0x1FFC),
    (0x2102, 0x2102),
    (0x2107, 0x2107),
    (0x210A, 0x2113),
    (0x2115, 0x2115),
    (0x2119, 0x211D),
    (0x2124, 0x2124),
    (0x2126, 0x2126),
    (0x2128, 0x2128),
    (0x212A, 0x212D),
    (0x212F, 0x2134),
    (0x2139, 0x2139),
    (0x213C, 0x213F),
    (0x2145, 0x2149),
    (0x214E, 0x214E),
    (0x2183, 0x2183),
    (0x2184, 0x2184),
    (0x2C00, 0x2C7B),
    (0x2C7E, 0x2CE4),
    (0x2CEB, 0x2CEE),
    (0x2CF2, 0x2CF2),
    (0x2CF3, 0x2CF3),
    (0xA640, 0xA66D),
    (0xA680, 0xA69B),
    (0xA722, 0xA76F),
    (0xA771, 0xA787),
    (0xA78B, 0xA78E),
    (0xAB70, 0xABBF),
    (0xFB00, 0xFB06),
    (0xFB13, 0xFB17),
    (0xFF21, 0xFF3A),
    (0xFF41, 0xFF5A),
    (0x10400, 0x1044F),
    (0x104B0, 0x104D3),
    (0x104D8, 0x104FB),
    (0x10C80, 0x10CB2),
    (0x10CC0, 0x10CF2),
    (0x118A0, 0x118DF),
    (0x1E900, 0x1E943),
];

/// The punctuation class of [`DEEPSEEK_LLM_SPLITS`]' third regex (ASCII punctuation and
/// letters, their full-width forms, quotation marks, U+3000–U+3002).
const DEEPSEEK_PUNCT: [(u32, u32); 6] =
    [(0x21, 0x2F), (0x3A, 0x7E), (0xFF01, 0xFF0F), (0xFF1A, 0xFF5E), (0x2018, 0x201F), (0x3000, 0x3002)];

/// `[一-龥ࠀ-一가-퟿]`: CJK ideographs, U+0800–U+4E00, Hangul syllables and what follows.
const DEEPSEEK_CJK: [(u32, u32); 3] = [(0x4E00, 0x9FA5), (0x800, 0x4E00), (0xAC00, 0xD7FF)];

/// `[一-龥぀-ゟ゠-ヿ]`: CJK ideographs, hiragana, katakana.
const DEEPSEEK_V3_CJK: [(u32, u32); 3] = [(0x4E00, 0x9FA5), (0x3040, 0x309F), (0x30A0, 0x30FF)];

/// Membership in a character class given as inclusive ranges.
fn in_ranges(ranges: &'static [(u32, u32)]) -> impl Fn(char) -> bool {
    move |c| ranges.iter().any(|&(a, b)| (a..=b).contains(&u32::from(c)))
}

/// Membership in [`DEEPSEEK_LETTERS`] (sorted, disjoint): a binary search.
fn is_deepseek_letter(c: char) -> bool {
    let c = u32::from(c);
    let i = DEEPSEEK_LETTERS.partition_point(|&(_, hi)| hi < c);
    DEEPSEEK_LETTERS.get(i).is_some_and(|&(lo, _)| lo <= c)
}

/// `\p{P}`: punctuation.
fn is_punct(c: char) -> bool {
    matches!(
        get_general_category(c),
        G::ConnectorPunctuation
            | G::DashPunctuation
            | G::OpenPunctuation
            | G::ClosePunctuation
            | G::InitialPunctuation
            | G::FinalPunctuation
            | G::OtherPunctuation
    )
}

/// `\p{S}`: symbols.
fn is_symbol(c: char) -> bool {
    matches!(get_general_category(c), G::MathSymbol | G::CurrencySymbol | G::ModifierSymbol | G::OtherSymbol)
}

/// End of the run of `class` characters from byte `from` of `s`, at most `max` of them.
fn run_end(s: &str, from: usize, max: usize, class: impl Fn(char) -> bool) -> usize {
    let mut end = from;
    for (n, (i, c)) in s[from..].char_indices().enumerate() {
        if n == max || !class(c) {
            break;
        }
        end = from + i + c.len_utf8();
    }
    end
}

/// `[\r\n]`.
fn newline(s: &str, from: usize) -> Option<(usize, usize)> {
    s.as_bytes()[from..].iter().position(|&b| b == b'\r' || b == b'\n').map(|i| (from + i, from + i + 1))
}

/// `class{1,max}`: the first `class` character and up to `max - 1` more that follow.
fn run(s: &str, from: usize, max: usize, class: impl Fn(char) -> bool) -> Option<(usize, usize)> {
    let (i, _) = s[from..].char_indices().find(|&(_, c)| class(c))?;
    Some((from + i, run_end(s, from + i, max, class)))
}

/// `\s?class+`: the first `class` character, with the whitespace character before it if
/// there is one (at or after `from`), and the run that follows.
fn space_then_run(s: &str, from: usize, class: impl Fn(char) -> bool) -> Option<(usize, usize)> {
    let mut space_before = None;
    for (i, c) in s[from..].char_indices() {
        let i = from + i;
        if class(c) {
            return Some((space_before.unwrap_or(i), run_end(s, i, usize::MAX, class)));
        }
        space_before = is_space(c).then_some(i);
    }
    None
}

/// `\s+$`: the whitespace that ends `s`.
fn trailing_space(s: &str, from: usize) -> Option<(usize, usize)> {
    let start = s.trim_end_matches(is_space).len().max(from);
    (start < s.len()).then_some((start, s.len()))
}

/// Bytes of [`DEEPSEEK_V3_SPLITS`]' last regex matched at the start of `rest` (not
/// empty), its alternatives tried in order; `None` where none matches there.
fn deepseek_v3_len(rest: &str) -> Option<usize> {
    let mut chars = rest.chars();
    let c0 = chars.next()?;
    let c1 = chars.next();
    let n0 = c0.len_utf8();
    // `[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+`
    if c0.is_ascii_punctuation() && c1.is_some_and(|c| c.is_ascii_alphabetic()) {
        return Some(run_end(rest, 1, usize::MAX, |c| c.is_ascii_alphabetic()));
    }
    // `[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+` (a mark first is in both classes: the run
    // ends in the same place either way)
    let letter_or_mark = |c: char| is_letter(c) || is_mark(c);
    if letter_or_mark(c0) {
        return Some(run_end(rest, 0, usize::MAX, letter_or_mark));
    }
    if c0 != '\r' && c0 != '\n' && !is_punct(c0) && !is_symbol(c0) && c1.is_some_and(letter_or_mark) {
        return Some(run_end(rest, n0, usize::MAX, letter_or_mark));
    }
    // ` ?[\p{P}\p{S}]+[\r\n]*`
    let punct_or_symbol = |c: char| is_punct(c) || is_symbol(c);
    let body = if c0 == ' ' && c1.is_some_and(punct_or_symbol) { 1 } else { 0 };
    if rest[body..].chars().next().is_some_and(punct_or_symbol) {
        let end = run_end(rest, body, usize::MAX, punct_or_symbol);
        return Some(end + rest[end..].bytes().take_while(|&b| b == b'\r' || b == b'\n').count());
    }
    // `\s*[\r\n]+|\s+(?!\S)|\s+`
    let n = space_len(rest);
    (n > 0).then_some(n)
}

/// The scanners of `pre`, if it is a chain of splits.
pub(crate) fn chain_of(pre: PreTokenizer) -> Option<&'static [Find]> {
    match pre {
        PreTokenizer::DeepSeekLlm => Some(DEEPSEEK_LLM),
        PreTokenizer::DeepSeekLlmDigits => Some(DEEPSEEK_LLM_DIGITS),
        PreTokenizer::DeepSeekCoder => Some(DEEPSEEK_CODER),
        PreTokenizer::DeepSeekV3 => Some(DEEPSEEK_V3),
        PreTokenizer::MiniCpm5 => Some(MINICPM5),
        _ => None,
    }
}

/// The pieces `pre` splits `text` into (they tile it), if `pre` is a chain of splits.
pub fn split_chain_pieces(text: &str, pre: PreTokenizer) -> Option<Vec<&str>> {
    let mut pieces = Vec::new();
    for_each_piece(text, chain_of(pre)?, &mut |p| pieces.push(p));
    Some(pieces)
}

/// Calls `f` with each piece of `text` split by `chain`, in order (the pieces tile it).
pub(crate) fn for_each_piece<'a>(text: &'a str, chain: &[Find], f: &mut impl FnMut(&'a str)) {
    let Some((find, rest)) = chain.split_first() else {
        if !text.is_empty() {
            f(text);
        }
        return;
    };
    let mut pos = 0;
    while pos < text.len() {
        let Some((start, end)) = find(text, pos) else { break };
        if start > pos {
            for_each_piece(&text[pos..start], rest, f);
        }
        for_each_piece(&text[start..end], rest, f);
        pos = end;
    }
    if pos < text.len() {
        for_each_piece(&text[pos..], rest, f);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(text: &str, chain: &[Find]) -> Vec<String> {
        let mut out = Vec::new();
        for_each_piece(text, chain, &mut |p| out.push(p.to_owned()));
        out
    }

    /// The ranges of the first bracketed class in `pattern`.
    fn class_ranges(pattern: &str) -> Vec<(u32, u32)> {
        let body = &pattern[pattern.find('[').unwrap() + 1..pattern.rfind(']').unwrap()];
        let chars: Vec<u32> = body.chars().map(u32::from).collect();
        let (mut out, mut i) = (Vec::new(), 0);
        while i < chars.len() {
            if chars.get(i + 1) == Some(&u32::from('-')) && i + 2 < chars.len() {
                out.push((chars[i], chars[i + 2]));
                i += 3;
            } else {
                out.push((chars[i], chars[i]));
                i += 1;
            }
        }
        out
    }

    #[test]
    fn range_tables_are_the_patterns_classes() {
        assert_eq!(class_ranges(DEEPSEEK_LLM_SPLITS[1]), DEEPSEEK_LETTERS);
        assert_eq!(class_ranges(DEEPSEEK_LLM_SPLITS[2]), DEEPSEEK_PUNCT);
        assert_eq!(class_ranges(DEEPSEEK_LLM_SPLITS[4]), DEEPSEEK_CJK);
        assert_eq!(class_ranges(DEEPSEEK_CODER_SPLITS[3]), DEEPSEEK_CJK);
        assert_eq!(class_ranges(DEEPSEEK_V3_SPLITS[1]), DEEPSEEK_V3_CJK);
    }

    #[test]
    fn the_letter_table_is_sorted_and_disjoint() {
        assert!(DEEPSEEK_LETTERS.windows(2).all(|w| w[0].0 <= w[0].1 && w[0].1 < w[1].0));
        for c in (0..0x20000).filter_map(char::from_u32) {
            assert_eq!(is_deepseek_letter(c), in_ranges(&DEEPSEEK_LETTERS)(c), "{c:?}");
        }
    }

    #[test]
    fn chains_split_like_their_regexes() {
        assert_eq!(split("Hello world!\n  ok  ", DEEPSEEK_LLM), ["Hello", " world", "!", "\n", " ", " ok", "  "]);
        assert_eq!(split("x12345y 你好", DEEPSEEK_LLM), ["x", "12345", "y", " ", "你好"]);
        assert_eq!(split("x12345y", DEEPSEEK_CODER), ["x", "1", "2", "3", "4", "5", "y"]);
        assert_eq!(split("x12345y", DEEPSEEK_V3), ["x", "123", "45", "y"]);
        assert_eq!(split("a.b's (ok)\n\n  z", DEEPSEEK_V3), ["a", ".b", "'s", " (", "ok", ")\n\n", " ", " z"]);
    }
}
