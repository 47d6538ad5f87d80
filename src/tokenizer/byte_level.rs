//! GPT-2's reversible byte <-> printable-character table.
//!
//! Vocabulary files store every token as a string of "printable" characters: the 188
//! bytes that are already printable stand for themselves, and the other 68 are shifted
//! to U+0100.. in byte order (so a space is `Ġ` = U+0120). This module maps both ways.

/// `BYTE_TO_CHAR[b]` is the character that stands for byte `b` in vocab files.
pub fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut shifted = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        table[b as usize] = if printable {
            char::from(b)
        } else {
            shifted += 1;
            char::from_u32(255 + shifted).expect("U+0100..U+0143 are valid chars")
        };
    }
    table
}

/// Decode a vocab-file token string back to its raw bytes; `None` if a character is
/// not one of the 256 byte stand-ins.
pub fn token_string_to_bytes(token: &str, table: &[char; 256]) -> Option<Vec<u8>> {
    token
        .chars()
        .map(|c| {
            let code = c as u32;
            // Fast inverse: printable bytes map to themselves, the rest to 0x100..0x143.
            if code < 256 && table[code as usize] == c {
                Some(code as u8)
            } else if (0x100..0x144).contains(&code) {
                table.iter().position(|&t| t == c).map(|b| b as u8)
            } else {
                None
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_a_bijection_with_gpt2_space_char() {
        let t = byte_to_char_table();
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'a' as usize], 'a');
        let mut seen = std::collections::HashSet::new();
        for c in t {
            assert!(seen.insert(c));
        }
        for b in 0..=255u8 {
            let s = t[b as usize].to_string();
            assert_eq!(token_string_to_bytes(&s, &t), Some(vec![b]));
        }
        assert_eq!(token_string_to_bytes("\u{3042}", &t), None);
    }
}
