//! The docs against the code: every command and flag `forge --help` lists is in
//! docs/cli.md, every environment variable the source reads is in docs/environment.md,
//! every metric `/metrics` renders is in docs/serving.md, and every relative link in the
//! README, CONTRIBUTING and docs/ points at a file (and a heading) that exists.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

fn help(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_forge")).args(args).arg("--help").output().unwrap();
    assert!(out.status.success(), "forge {args:?} --help failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// The subcommands `forge --help` lists, in its "Commands:" section.
fn subcommands() -> Vec<String> {
    let top = help(&[]);
    let section = top.split("Commands:").nth(1).expect("forge --help has a Commands section");
    let section = section.split("\n\n").next().unwrap();
    section.lines().filter_map(|l| l.split_whitespace().next()).filter(|c| *c != "help").map(str::to_owned).collect()
}

/// Every `--long-flag` that appears in a help text (the flags and their aliases).
fn long_flags(text: &str) -> BTreeSet<String> {
    let mut flags = BTreeSet::new();
    for word in text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-')) {
        if let Some(name) = word.strip_prefix("--")
            && name.chars().next().is_some_and(|c| c.is_ascii_lowercase())
        {
            flags.insert(format!("--{}", name.trim_end_matches('-')));
        }
    }
    flags
}

/// Whether `doc` mentions `flag` as a whole flag (not as the prefix of a longer one).
fn mentions_flag(doc: &str, flag: &str) -> bool {
    doc.match_indices(flag).any(|(i, _)| {
        let next = doc[i + flag.len()..].chars().next();
        !next.is_some_and(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    })
}

#[test]
fn every_command_and_flag_is_in_the_cli_reference() {
    let doc = read("docs/cli.md");
    let commands = subcommands();
    assert!(commands.len() >= 12, "too few subcommands parsed: {commands:?}");
    let mut missing = Vec::new();
    for cmd in &commands {
        if !doc.contains(&format!("## `forge {cmd}")) {
            missing.push(format!("a `## `forge {cmd}`` section"));
        }
        for flag in long_flags(&help(&[cmd])) {
            if flag != "--help" && flag != "--version" && !mentions_flag(&doc, &flag) {
                missing.push(format!("forge {cmd} {flag}"));
            }
        }
    }
    assert!(missing.is_empty(), "docs/cli.md lacks: {missing:#?}");
}

/// Quoted names right after one of `markers` in `text`: `env::var("NAME")` and the like.
fn quoted_after(text: &str, markers: &[&str], out: &mut BTreeSet<String>) {
    for marker in markers {
        for (i, _) in text.match_indices(marker) {
            let rest = &text[i + marker.len()..];
            let name: String =
                rest.chars().take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_').collect();
            if name.len() > 1 && rest[name.len()..].starts_with('"') {
                out.insert(name);
            }
        }
    }
}

/// The Rust and Python sources under `dir`.
fn source_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy();
        if path.is_dir() {
            // Not a local virtualenv, build outputs or caches.
            if !name.starts_with('.') && name != "target" && name != "__pycache__" {
                source_files(&path, out);
            }
        } else if path.extension().is_some_and(|e| e == "rs" || e == "py") {
            out.push(path);
        }
    }
}

#[test]
fn every_environment_variable_is_documented() {
    let mut files = Vec::new();
    for dir in ["src", "tests", "benches", "examples", "python"] {
        source_files(&root().join(dir), &mut files);
    }
    let markers =
        ["env::var(\"", "env::var_os(\"", "env = \"", "env_nonempty(\"", "truthy(\"", "environ.get(\"", "environ[\""];
    let mut vars = BTreeSet::new();
    for f in files.iter().filter(|f| !f.ends_with("tests/docs.rs")) {
        quoted_after(&std::fs::read_to_string(f).unwrap(), &markers, &mut vars);
    }
    // The parse finds the variables the engine is known to read.
    for known in [
        "BATCH_FORGE_ISA",
        "BATCH_FORGE_GPU",
        "FORGE_API_KEY",
        "HF_HUB_OFFLINE",
        "BATCH_FORGE_SMOLLM2",
        "BATCH_FORGE_BIN",
    ] {
        assert!(vars.contains(known), "{known} not found by the scan: {vars:?}");
    }
    let doc = read("docs/environment.md");
    let missing: Vec<_> = vars.iter().filter(|v| !doc.contains(&format!("`{v}`"))).collect();
    assert!(missing.is_empty(), "docs/environment.md lacks {missing:?}");
}

#[test]
fn every_metric_is_documented() {
    let metrics = batch_forge::engine::Metrics::default();
    // With a pool, as once a model is loaded: the router names appear too.
    metrics.kv_blocks_total.store(8, std::sync::atomic::Ordering::Relaxed);
    let text = metrics.render();
    assert!(text.contains("vllm:kv_cache_usage_perc"), "{text}");
    let names: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.split_whitespace().next()).collect();
    assert!(names.len() >= 20, "{text}");
    let doc = read("docs/serving.md");
    let missing: Vec<_> = names.iter().filter(|n| !doc.contains(&format!("`{n}`"))).collect();
    assert!(missing.is_empty(), "docs/serving.md lacks {missing:?}");
}

/// GitHub's anchor for a heading: lower case, spaces to `-`, other punctuation dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The lines of a markdown text outside its fenced code blocks.
fn prose_lines(markdown: &str) -> impl Iterator<Item = &str> {
    let mut in_code = false;
    markdown.lines().filter(move |line| {
        if line.starts_with("```") {
            in_code = !in_code;
            return false;
        }
        !in_code
    })
}

fn anchors(markdown: &str) -> BTreeSet<String> {
    prose_lines(markdown).filter(|l| l.starts_with('#')).map(|l| anchor(l.trim_start_matches('#'))).collect()
}

/// The targets of `[text](target)` links outside code blocks.
fn link_targets(markdown: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in prose_lines(markdown) {
        for (i, _) in line.match_indices("](") {
            if let Some(end) = line[i + 2..].find(')') {
                out.push(line[i + 2..i + 2 + end].to_owned());
            }
        }
    }
    out
}

#[test]
fn every_link_in_the_docs_resolves() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for page in &pages() {
        let text = read(page);
        let dir = Path::new(page).parent().unwrap();
        for target in link_targets(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (file, frag) = target.split_once('#').map_or((target.as_str(), None), |(f, a)| (f, Some(a)));
            let path = if file.is_empty() { PathBuf::from(page) } else { dir.join(file) };
            let full = root().join(&path);
            if !full.exists() {
                broken.push(format!("{page}: {target} (no {})", path.display()));
                continue;
            }
            if let Some(frag) = frag
                && full.extension().is_some_and(|e| e == "md")
                && !anchors(&std::fs::read_to_string(&full).unwrap()).contains(frag)
            {
                broken.push(format!("{page}: {target} (no such heading)"));
            }
        }
    }
    assert!(checked > 30, "only {checked} links found");
    assert!(broken.is_empty(), "broken links: {broken:#?}");
}

/// Every page the docs consist of, relative to the repository root.
fn pages() -> Vec<String> {
    let mut pages: Vec<String> = vec!["README.md".into(), "CONTRIBUTING.md".into(), "CHANGELOG.md".into()];
    for entry in std::fs::read_dir(root().join("docs")).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        if name.ends_with(".md") {
            pages.push(format!("docs/{name}"));
        }
    }
    pages
}

/// The other direction: every `--flag` docs/cli.md names is a flag of some command, or a
/// llama.cpp flag that `forge generate` refuses by name.
#[test]
fn every_flag_in_the_cli_reference_exists() {
    let mut known = long_flags(&help(&[]));
    for cmd in subcommands() {
        known.extend(long_flags(&help(&[&cmd])));
    }
    // Lines that run other programs (cargo, Python scripts) name their flags, not forge's.
    let doc: String = read("docs/cli.md")
        .lines()
        .filter(|l| !l.contains("cargo ") && !l.contains("python") && !l.contains(".py "))
        .map(|l| format!("{l}\n"))
        .collect();
    let mut unknown = Vec::new();
    for flag in long_flags(&doc) {
        if known.contains(&flag) {
            continue;
        }
        let out = Command::new(env!("CARGO_BIN_EXE_forge")).args(["generate", &flag]).output().unwrap();
        if !String::from_utf8_lossy(&out.stderr).contains(&format!("not supported: {flag}")) {
            unknown.push(flag);
        }
    }
    assert!(unknown.is_empty(), "docs/cli.md names flags forge neither has nor refuses: {unknown:?}");
}

/// Every route the server answers is in docs/serving.md.
#[test]
fn every_route_is_documented() {
    let api = read("src/serve/api.rs");
    let mut routes = BTreeSet::new();
    quoted_after_path(&api, ".route(\"", &mut routes);
    assert!(routes.len() >= 10 && routes.contains("/health"), "{routes:?}");
    let doc = read("docs/serving.md");
    let missing: Vec<_> = routes.iter().filter(|r| !doc.contains(&format!("{r}`"))).collect();
    assert!(missing.is_empty(), "docs/serving.md lacks the routes {missing:?}");
}

fn quoted_after_path(text: &str, marker: &str, out: &mut BTreeSet<String>) {
    for (i, _) in text.match_indices(marker) {
        let rest = &text[i + marker.len()..];
        if let Some(end) = rest.find('"') {
            out.insert(rest[..end].to_owned());
        }
    }
}

/// The files the docs name in code spans (`tests/x.rs`, `scripts/y.py`, `src/...`) exist,
/// and a test named as `tests/x.rs::name` is a function of that file.
#[test]
fn every_file_and_test_the_docs_name_exists() {
    let prefixes =
        ["tests/", "scripts/", "src/", "docs/", "fuzz/", "benches/", "examples/", "deploy/", ".ci/", "python/"];
    let mut missing = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let text = read(&page);
        for span in text.split('`').skip(1).step_by(2) {
            let Some(word) = span.split_whitespace().next() else { continue };
            if !prefixes.iter().any(|p| word.starts_with(p)) || word.contains('<') || word.contains('*') {
                continue;
            }
            let (path, item) = word.split_once("::").map_or((word, None), |(p, i)| (p, Some(i)));
            let path = path.trim_end_matches([',', '.', ':', ')']);
            checked += 1;
            let full = root().join(path);
            if !full.exists() {
                missing.push(format!("{page}: {path}"));
            } else if let Some(item) = item
                && path.ends_with(".rs")
            {
                let name: String = item.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                if !std::fs::read_to_string(&full).unwrap().contains(&format!("fn {name}")) {
                    missing.push(format!("{page}: {path}::{name}"));
                }
            }
        }
    }
    assert!(checked > 50, "only {checked} paths found");
    assert!(missing.is_empty(), "the docs name files or tests that do not exist: {missing:#?}");
}

/// The other direction for variables: every `BATCH_FORGE_*` or `FORGE_*` name the docs
/// mention is read or set somewhere (the sources, the tests, the benches, `.ci/run`, the
/// Dockerfile).
#[test]
fn every_variable_the_docs_name_is_read() {
    let mut code = String::new();
    let mut files = Vec::new();
    for dir in ["src", "tests", "benches", "examples", "python"] {
        source_files(&root().join(dir), &mut files);
    }
    for f in files.iter().filter(|f| !f.ends_with("tests/docs.rs")) {
        code.push_str(&std::fs::read_to_string(f).unwrap());
    }
    code.push_str(&read(".ci/run"));
    code.push_str(&read("Dockerfile"));
    let mut names = BTreeSet::new();
    for page in pages() {
        let text = read(&page);
        for (i, _) in text.match_indices("FORGE_") {
            let start = text[..i].rfind(|c: char| !(c.is_ascii_uppercase() || c == '_')).map_or(0, |j| j + 1);
            let end =
                i + text[i..].find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')).unwrap_or(0);
            let name = &text[start..end];
            if name.len() > "FORGE_".len() && !name.ends_with('_') {
                names.insert(name.to_owned());
            }
        }
    }
    assert!(names.contains("BATCH_FORGE_ISA"), "{names:?}");
    let unread: Vec<_> =
        names.iter().filter(|n| !code.contains(&format!("\"{n}\"")) && !code.contains(&format!("{n}="))).collect();
    assert!(unread.is_empty(), "the docs name variables nothing reads: {unread:?}");
}
