//! llama.cpp's GBNF grammars, rewritten in llguidance's Lark dialect.
//!
//! GBNF (llama.cpp `grammars/README.md`): rules `name ::= body`, `root` the start;
//! bodies of `"strings"` (escapes `\n \r \t \\ \" \xHH \uHHHH \UHHHHHHHH`), character
//! classes `[a-z]`, `[^"\\]`, `.` (any character), rule names, `( … )`, `|`, `*`, `+`,
//! `?`, `{m}`, `{m,}`, `{m,n}`, `{,n}`, and `#` comments. The rewrite: `name:` for each
//! rule (`root` becomes `start`; other names lower-cased with `-` as `_`, prefixed so
//! they cannot clash), strings as JSON strings, a class or `.` as a one-character
//! regex, the rest as it is. Token references (`<[id]>`, `<think>`) are refused.

/// `text` (GBNF) as a Lark grammar, or an error naming what could not be read.
pub fn gbnf_to_lark(text: &str) -> Result<String, String> {
    let tokens = lex(text)?;
    let mut out = String::new();
    let mut i = 0;
    let mut has_root = false;
    if tokens.is_empty() {
        return Err("GBNF grammar: no rules".into());
    }
    while i < tokens.len() {
        let (Tok::Name(name), Some(Tok::Define)) = (&tokens[i], tokens.get(i + 1)) else {
            return Err(format!("GBNF grammar: expected `name ::=` at {}", tokens[i].describe()));
        };
        has_root |= name == "root";
        out.push_str(&rule_name(name));
        out.push(':');
        i += 2;
        let start = i;
        while i < tokens.len() && !(matches!(tokens[i], Tok::Name(_)) && matches!(tokens.get(i + 1), Some(Tok::Define)))
        {
            out.push(' ');
            match &tokens[i] {
                Tok::Name(n) => out.push_str(&rule_name(n)),
                Tok::Str(s) => out.push_str(&serde_json::to_string(s).expect("a string")),
                Tok::Class(c) => {
                    out.push('/');
                    out.push_str(&c.replace('/', "\\/"));
                    out.push('/');
                }
                Tok::Any => out.push_str("/(?s:.)/"),
                Tok::Punct(p) => out.push_str(p),
                Tok::Define => return Err("GBNF grammar: `::=` without a rule name before it".into()),
            }
            i += 1;
        }
        if i == start {
            return Err(format!("GBNF grammar: rule {name} is empty"));
        }
        out.push('\n');
    }
    if !has_root {
        return Err("GBNF grammar: no `root` rule".into());
    }
    Ok(out)
}

fn rule_name(name: &str) -> String {
    if name == "root" { "start".into() } else { format!("r_{}", name.replace('-', "_").to_lowercase()) }
}

enum Tok {
    Name(String),
    Define,
    Str(String),
    /// A character class in regex syntax, brackets included.
    Class(String),
    Any,
    Punct(String),
}

impl Tok {
    fn describe(&self) -> String {
        match self {
            Tok::Name(n) => format!("`{n}`"),
            Tok::Define => "`::=`".into(),
            Tok::Str(s) => format!("{s:?}"),
            Tok::Class(c) => c.clone(),
            Tok::Any => "`.`".into(),
            Tok::Punct(p) => format!("`{p}`"),
        }
    }
}

/// One escape after `\` in a string or class: the character it stands for.
fn escape(chars: &mut std::iter::Peekable<std::str::Chars>) -> Result<char, String> {
    let hex = |chars: &mut std::iter::Peekable<std::str::Chars>, n: usize| -> Result<char, String> {
        let digits: String = (0..n).filter_map(|_| chars.next()).collect();
        u32::from_str_radix(&digits, 16)
            .ok()
            .filter(|_| digits.len() == n)
            .and_then(char::from_u32)
            .ok_or_else(|| format!("GBNF grammar: bad escape \\{digits}"))
    };
    match chars.next() {
        Some('n') => Ok('\n'),
        Some('r') => Ok('\r'),
        Some('t') => Ok('\t'),
        Some('x') => hex(chars, 2),
        Some('u') => hex(chars, 4),
        Some('U') => hex(chars, 8),
        Some(c @ ('\\' | '"' | '[' | ']' | '-' | '^')) => Ok(c),
        Some(c) => Err(format!("GBNF grammar: unknown escape \\{c}")),
        None => Err("GBNF grammar: a backslash at the end".into()),
    }
}

/// A character inside a regex class, escaped where the regex needs it.
fn class_char(c: char, out: &mut String) {
    match c {
        '\\' | ']' | '[' | '^' | '-' | '&' | '~' => {
            out.push('\\');
            out.push(c);
        }
        c if c.is_control() || c == ' ' => out.push_str(&format!("\\x{{{:x}}}", c as u32)),
        c => out.push(c),
    }
}

fn lex(text: &str) -> Result<Vec<Tok>, String> {
    let mut tokens = Vec::new();
    let mut chars = text.chars().peekable();
    while let Some(&c) = chars.peek() {
        match c {
            c if c.is_whitespace() => {
                chars.next();
            }
            '#' => while chars.next().is_some_and(|c| c != '\n') {},
            ':' => {
                chars.next();
                if chars.next() != Some(':') || chars.next() != Some('=') {
                    return Err("GBNF grammar: expected `::=`".into());
                }
                tokens.push(Tok::Define);
            }
            '"' => {
                chars.next();
                let mut s = String::new();
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => s.push(escape(&mut chars)?),
                        Some(c) => s.push(c),
                        None => return Err("GBNF grammar: a string is not closed".into()),
                    }
                }
                if s.is_empty() {
                    tokens.push(Tok::Punct("\"\"".into())); // the empty string
                } else {
                    tokens.push(Tok::Str(s));
                }
            }
            '[' => {
                chars.next();
                let mut class = String::from("[");
                if chars.peek() == Some(&'^') {
                    chars.next();
                    class.push('^');
                }
                let mut members = 0;
                loop {
                    match chars.next() {
                        Some(']') if members > 0 || class.ends_with('[') || class.ends_with('^') => break,
                        Some('\\') => class_char(escape(&mut chars)?, &mut class),
                        Some('-') if members > 0 && chars.peek().is_some_and(|&n| n != ']') => class.push('-'),
                        Some(c) => class_char(c, &mut class),
                        None => return Err("GBNF grammar: a character class is not closed".into()),
                    }
                    members += 1;
                }
                if members == 0 {
                    return Err("GBNF grammar: an empty character class".into());
                }
                class.push(']');
                tokens.push(Tok::Class(class));
            }
            '.' => {
                chars.next();
                tokens.push(Tok::Any);
            }
            '(' | ')' | '|' | '*' | '+' | '?' => {
                chars.next();
                tokens.push(Tok::Punct(c.to_string()));
            }
            '{' => {
                chars.next();
                let mut body = String::new();
                loop {
                    match chars.next() {
                        Some('}') => break,
                        Some(c) if c.is_ascii_digit() || c == ',' || c == ' ' => body.push(c),
                        _ => return Err("GBNF grammar: a repetition {m,n} is not closed or not numeric".into()),
                    }
                }
                let body: String = body.chars().filter(|c| *c != ' ').collect();
                let body = if body.starts_with(',') { format!("0{body}") } else { body };
                if body.is_empty() {
                    return Err("GBNF grammar: an empty repetition {}".into());
                }
                tokens.push(Tok::Punct(format!("{{{body}}}")));
            }
            '<' => return Err("GBNF grammar: token references (<...>) are not supported".into()),
            c if c.is_ascii_alphanumeric() || c == '-' || c == '_' => {
                let mut name = String::new();
                while let Some(&c) = chars.peek() {
                    if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                        name.push(c);
                        chars.next();
                    } else {
                        break;
                    }
                }
                tokens.push(Tok::Name(name));
            }
            c => return Err(format!("GBNF grammar: unexpected character {c:?}")),
        }
    }
    Ok(tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_strings_classes_and_repetitions() {
        let g = r#"
            # a list of words
            root ::= "[" word ("," ws word){0,3} "]"
            word ::= [a-zA-Z_]+ | "\"q\\n\""
            ws   ::= [ \t\n]*   # spaces
            any-thing ::= [^"\\] . {,2}
        "#;
        let lark = gbnf_to_lark(g).unwrap();
        let want = [
            r#"start: "[" r_word ( "," r_ws r_word ) {0,3} "]""#,
            r#"r_word: /[a-zA-Z_]/ + | "\"q\\n\"""#,
            r#"r_ws: /[\x{20}\x{9}\x{a}]/ *"#,
            r#"r_any_thing: /[^"\\]/ /(?s:.)/ {0,2}"#,
        ];
        assert_eq!(lark.lines().collect::<Vec<_>>(), want);
    }

    #[test]
    fn bad_grammars_say_why() {
        for (g, want) in [
            ("root = \"a\"", "unexpected character '='"),
            ("root ::= \"a", "not closed"),
            ("word ::= \"a\"", "no `root` rule"),
            ("root ::= <think>", "token references"),
            ("root ::= \"\\q\"", "unknown escape \\q"),
            ("", "no rules"),
            ("root ::=", "rule root is empty"),
        ] {
            let e = gbnf_to_lark(g).unwrap_err();
            assert!(e.contains(want), "{g:?}: {e}");
        }
    }
}
