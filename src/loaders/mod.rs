//! Everything that turns files into memory: safetensors, GGUF, config.json, model folders,
//! and the Hugging Face Hub cache/download.

pub mod checkpoint;
pub mod config;
pub mod gguf;
pub mod gguf_write;
pub mod hub;
pub mod llama_config;
pub mod safetensors;
pub mod weights;

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

pub use checkpoint::Weights;
pub use config::Gpt2Config;
pub use llama_config::LlamaConfig;
pub use weights::WeightStore;

/// The bytes of a model file: memory-mapped from disk, or built in memory (random
/// weights, tests, fuzzing). Readers validate a header against these bytes once and
/// then index them freely.
pub(crate) enum Backing {
    Mapped(Mapping),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Backing {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Backing::Mapped(m) => &m.0,
            Backing::Owned(v) => v,
        }
    }
}

/// Address ranges `(start, len)` of the live read-only file mappings below.
static LIVE_MAPPINGS: std::sync::Mutex<Vec<(usize, usize)>> = std::sync::Mutex::new(Vec::new());

/// A read-only file mapping, known to [`release`] while it lives.
pub(crate) struct Mapping(memmap2::Mmap);

impl Mapping {
    /// Map `file` read-only. Only file mappings are made here (never anonymous memory,
    /// which `release` would zero).
    ///
    /// # Safety
    /// As for `memmap2::Mmap::map`: the file is not truncated or rewritten while mapped.
    pub(crate) unsafe fn map(file: &std::fs::File) -> std::io::Result<Self> {
        // SAFETY: forwarded from the caller.
        let map = unsafe { memmap2::Mmap::map(file) }?;
        LIVE_MAPPINGS.lock().unwrap_or_else(|p| p.into_inner()).push((map.as_ptr() as usize, map.len()));
        Ok(Mapping(map))
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // Before the field's own drop unmaps it: `release` never sees an unmapped range.
        let key = (self.0.as_ptr() as usize, self.0.len());
        let mut live = LIVE_MAPPINGS.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = live.iter().position(|&r| r == key) {
            live.swap_remove(i);
        }
    }
}

/// Says that `bytes` have been copied where they are needed (a backend packed or
/// re-blocked them) and will not be read again soon. Where they lie inside a live model
/// file mapping, the whole pages among them leave this process's resident memory: a
/// later read (a second load of the same tensor) faults them back in from the file, so
/// nothing observable changes. Anything else (bytes in memory, other mappings) is left
/// alone. This is what keeps loading's peak memory near the steady state: the mapped
/// file and the packed copy are never both resident.
pub fn release(bytes: &[u8]) {
    #[cfg(all(unix, not(miri)))]
    {
        static PAGE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
        // SAFETY: sysconf has no preconditions.
        let page = *PAGE.get_or_init(|| usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096));
        let (start, end) = (bytes.as_ptr() as usize, bytes.as_ptr() as usize + bytes.len());
        let (a, b) = (start.next_multiple_of(page.max(1)), end / page.max(1) * page.max(1));
        if a >= b {
            return;
        }
        let live = LIVE_MAPPINGS.lock().unwrap_or_else(|p| p.into_inner());
        if live.iter().any(|&(s, len)| s <= start && end <= s + len) {
            // SAFETY: [a, b) lies inside a live read-only file mapping made by this module
            // (the lock keeps it from being unmapped meanwhile). MADV_DONTNEED on a file
            // mapping that is never written only drops pages, which the next access reads
            // back from the file; no memory is freed or changed from Rust's point of view.
            unsafe { libc::madvise(a as *mut libc::c_void, b - a, libc::MADV_DONTNEED) };
        }
    }
    #[cfg(any(not(unix), miri))]
    let _ = bytes;
}

/// The default model: GPT-2 124M on the Hub.
pub const DEFAULT_MODEL: &str = "openai-community/gpt2";

/// Resolve `--model`: an existing folder or `.gguf` file is used as is; otherwise a Hub
/// repo id is fetched into (or found in) the HF cache. Returns the folder holding the
/// model files, or the GGUF file.
/// With `weights` false only config and tokenizer files are fetched. `command` is the
/// `forge` subcommand, named in the hint for getting a missing model.
pub fn resolve_model(model: &str, hub: &hub::HubClient, weights: bool, command: &str) -> anyhow::Result<PathBuf> {
    let as_path = Path::new(model);
    if as_path.is_dir() {
        return Ok(as_path.to_owned());
    }
    const EXPECTED: &str = "--model takes a model folder (config.json, model.safetensors, tokenizer.json), \
                            a .gguf file, or a Hub repo id like openai-community/gpt2";
    if as_path.is_file() {
        if crate::model::load::is_gguf(as_path) {
            return Ok(as_path.to_owned());
        }
        let folder = as_path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        bail!("{model:?} is a file, not a model folder; {EXPECTED} (did you mean --model {}?)", folder.display());
    }
    // A name ending in a model file's extension, or with more than one `/`, is a path (a
    // Hub repo id is `name` or `owner/name`): say it does not exist rather than ask the Hub.
    let file_ext = as_path
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| ["gguf", "safetensors", "bin", "pt", "pth", "json"].iter().any(|x| e.eq_ignore_ascii_case(x)));
    if file_ext {
        bail!("no such file: {model:?}; {EXPECTED}");
    }
    let looks_like_path = model.starts_with('.')
        || model.starts_with('/')
        || model.starts_with('~')
        || model.contains('\\')
        || model.matches('/').count() > 1;
    if looks_like_path || !hub::is_repo_id(model) {
        bail!("model folder {model:?} does not exist (and it is not a Hub repo id like openai-community/gpt2)");
    }
    if hub.offline && hub.cached_file(model, "main", "config.json").is_none() {
        bail!(
            "HF_HUB_OFFLINE is set and {model} is not in the HF cache at {}; unset HF_HUB_OFFLINE to download it \
             (`forge {command} --model {model}`), or pass a local folder with --model PATH",
            hub.cache_dir.display()
        );
    }
    fetch_from_hub(model, "main", hub, weights).with_context(|| {
        let how = format!(
            "to get the files, run `forge {command} --model {model}` (or `huggingface-cli download {model}`) on a machine that reaches {}, \
             or pass a local folder holding config.json, model.safetensors and tokenizer.json with --model PATH",
            hub.endpoint
        );
        format!("cannot get model {model:?} from the Hub or the cache at {}; {how}", hub.cache_dir.display())
    })
}

fn fetch_from_hub(repo: &str, revision: &str, hub: &hub::HubClient, weights: bool) -> anyhow::Result<PathBuf> {
    let missing = |name: &str| {
        if hub.offline {
            anyhow::anyhow!(
                "HF_HUB_OFFLINE is set and {name} of {repo} is not in the HF cache at {}; unset HF_HUB_OFFLINE to download it",
                hub.cache_dir.display()
            )
        } else {
            anyhow::anyhow!("{repo} has no {name}")
        }
    };
    let need =
        |name: &str| -> anyhow::Result<PathBuf> { hub.get_file(repo, revision, name)?.ok_or_else(|| missing(name)) };
    let config = need("config.json")?;
    let dir = config.parent().expect("snapshot dir").to_owned();
    if hub.get_file(repo, revision, "tokenizer.json")?.is_none() {
        need("vocab.json")?;
        need("merges.txt")?;
    }
    if weights && hub.get_file(repo, revision, "model.safetensors")?.is_none() {
        let index = hub.get_file(repo, revision, "model.safetensors.index.json")?.ok_or_else(|| {
            if hub.offline {
                missing("model.safetensors")
            } else {
                anyhow::anyhow!("{repo} has neither model.safetensors nor model.safetensors.index.json")
            }
        })?;
        for shard in weights::shard_files(&index)? {
            need(&shard)?;
        }
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    /// Pages given back by `release` read back unchanged (from the file), whatever range is
    /// released (page-aligned or not, empty, the whole file); bytes outside a mapping are
    /// left alone; a dropped mapping is forgotten.
    #[test]
    fn released_pages_read_back_from_the_file() {
        let data: Vec<u8> = (0..300_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        let mut file = tempfile::NamedTempFile::new().unwrap();
        std::io::Write::write_all(&mut file, &data).unwrap();
        let f = std::fs::File::open(file.path()).unwrap();
        // SAFETY: a private temporary file nobody else writes while it is mapped.
        let map = unsafe { super::Mapping::map(&f) }.unwrap();
        let (start, len) = (map.0.as_ptr() as usize, map.0.len());
        assert!(super::LIVE_MAPPINGS.lock().unwrap().contains(&(start, len)));
        let bytes: &[u8] = &map.0;
        assert_eq!(bytes, &data[..]);
        for range in [5..70_001, 0..4096, 8192..8192, 100_000..300_000, 0..300_000] {
            super::release(&bytes[range]);
            assert_eq!(bytes, &data[..], "after releasing a range");
        }
        let owned = data.clone();
        super::release(&owned);
        assert_eq!(owned, data);
        // And the pages do leave: the mapping's resident size (smaps) falls to ~0.
        #[cfg(target_os = "linux")]
        {
            let rss_kib = || -> u64 {
                let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
                let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&format!("{start:x}-")));
                assert!(lines.next().is_some(), "mapping not in smaps");
                let rss = lines.find(|l| l.starts_with("Rss:")).unwrap();
                rss.split_whitespace().nth(1).unwrap().parse().unwrap()
            };
            let total: u64 = bytes.iter().step_by(4096).map(|&b| u64::from(b)).sum();
            std::hint::black_box(total);
            assert!(rss_kib() >= 250, "touching every page made {} KiB resident", rss_kib());
            super::release(bytes);
            assert!(rss_kib() <= 8, "{} KiB still resident after release", rss_kib());
            assert_eq!(bytes, &data[..]);
        }
        drop(map);
        assert!(!super::LIVE_MAPPINGS.lock().unwrap().contains(&(start, len)));
    }
}
