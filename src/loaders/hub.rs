//! Hugging Face Hub download into the standard HF cache, shared with Python tools.
//!
//! Cache root: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`.
//! Layout (the same as `huggingface_hub`):
//!
//! ```text
//! models--org--name/
//!   blobs/<etag>                      file contents, named by the Hub's ETag (sha256 for LFS files)
//!   refs/main                         the commit hash `main` resolved to
//!   snapshots/<commit>/<filename>  -> ../../blobs/<etag>
//! ```
//!
//! A file is fetched with `GET {endpoint}/{repo}/resolve/{revision}/{file}` after a HEAD
//! request (redirects not followed) that yields `X-Repo-Commit` and the ETag
//! (`X-Linked-Etag` for LFS files, which redirect to a CDN). Downloads stream to
//! `blobs/<etag>.incomplete` and are renamed into place only when complete (and, for
//! LFS files, when their sha256 matches). `HF_ENDPOINT`, `HF_TOKEN` and `HF_HUB_OFFLINE`
//! are honoured; without network, files already in the cache are used.

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use sha2::{Digest, Sha256};

/// Why a file could not be had from the Hub. (Causes are in the message, not `source()`:
/// printing the chain would repeat them.)
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    /// HTTP 401 or 403.
    #[error("{url}: HTTP {code}: access denied (gated or private repo? set HF_TOKEN to a token with access)")]
    Denied { url: String, code: u16 },
    #[error("{url}: HTTP {code}")]
    Status { url: String, code: u16 },
    #[error("cannot reach the Hub at {endpoint}: {message}")]
    Unreachable { endpoint: String, message: String },
    /// The server answered, but not as a Hub does (headers, names, redirects).
    #[error("{url}: {message}")]
    Protocol { url: String, message: String },
    /// The transfer failed, was cut short, or its bytes are not the Hub's.
    #[error("downloading {url}: {message}")]
    Download { url: String, message: String },
    /// The cache could not be written.
    #[error("cannot {action} {}: {cause}", path.display())]
    Cache { action: &'static str, path: PathBuf, cause: std::io::Error },
}

type Result<T> = std::result::Result<T, HubError>;

fn cache_error(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> HubError {
    let path = path.to_owned();
    move |cause| HubError::Cache { action, path, cause }
}

pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Where and how to reach the Hub; `from_env` reads the standard HF variables.
#[derive(Clone, Debug)]
pub struct HubClient {
    pub endpoint: String,
    pub token: Option<String>,
    pub cache_dir: PathBuf,
    pub offline: bool,
    pub progress: bool,
}

fn env_nonempty(key: &str) -> Option<String> {
    std::env::var(key).ok().filter(|v| !v.is_empty())
}

/// The HF cache root as `huggingface_hub` computes it.
pub fn default_cache_dir() -> PathBuf {
    if let Some(p) = env_nonempty("HF_HUB_CACHE") {
        return PathBuf::from(p);
    }
    if let Some(p) = env_nonempty("HF_HOME") {
        return PathBuf::from(p).join("hub");
    }
    let home = env_nonempty("HOME").or_else(|| env_nonempty("USERPROFILE")).unwrap_or_else(|| ".".into());
    PathBuf::from(home).join(".cache").join("huggingface").join("hub")
}

/// Hub repo ids look like `name` or `org/name` with `[A-Za-z0-9._-]` parts.
pub fn is_repo_id(s: &str) -> bool {
    let parts: Vec<&str> = s.split('/').collect();
    !s.is_empty()
        && parts.len() <= 2
        && parts.iter().all(|p| {
            !p.is_empty()
                && !p.starts_with('.')
                && !p.contains("..")
                && p.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        })
}

struct FileMeta {
    commit: String,
    etag: String,
    size: Option<u64>,
}

impl HubClient {
    pub fn from_env() -> Self {
        let truthy = |k: &str| {
            env_nonempty(k).is_some_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"))
        };
        HubClient {
            endpoint: env_nonempty("HF_ENDPOINT")
                .unwrap_or_else(|| DEFAULT_ENDPOINT.into())
                .trim_end_matches('/')
                .to_owned(),
            token: env_nonempty("HF_TOKEN"),
            cache_dir: default_cache_dir(),
            offline: truthy("HF_HUB_OFFLINE"),
            progress: true,
        }
    }

    pub fn repo_dir(&self, repo_id: &str) -> PathBuf {
        self.cache_dir.join(format!("models--{}", repo_id.replace('/', "--")))
    }

    /// A file from the cache snapshot that `revision` points to, if present.
    pub fn cached_file(&self, repo_id: &str, revision: &str, filename: &str) -> Option<PathBuf> {
        let repo = self.repo_dir(repo_id);
        let commit = fs::read_to_string(repo.join("refs").join(revision)).ok()?;
        let path = repo.join("snapshots").join(commit.trim()).join(filename);
        path.is_file().then_some(path)
    }

    /// `Ok(None)` when the Hub says the file does not exist (404).
    pub fn get_file(&self, repo_id: &str, revision: &str, filename: &str) -> Result<Option<PathBuf>> {
        if self.offline {
            return Ok(self.cached_file(repo_id, revision, filename));
        }
        let meta = match self.head(repo_id, revision, filename) {
            Ok(Some(m)) => m,
            Ok(None) => return Ok(None),
            Err(e) => {
                // Unreachable Hub: fall back to the cache, as huggingface_hub does.
                if let Some(p) = self.cached_file(repo_id, revision, filename) {
                    return Ok(Some(p));
                }
                return Err(e);
            }
        };
        let repo = self.repo_dir(repo_id);
        let blob = repo.join("blobs").join(&meta.etag);
        let snapshot = repo.join("snapshots").join(&meta.commit).join(filename);
        if !blob.is_file() {
            self.download(repo_id, revision, filename, &meta, &blob)?;
        }
        link_snapshot(&blob, &snapshot)?;
        let refs = repo.join("refs");
        fs::create_dir_all(&refs).map_err(cache_error("create", &refs))?;
        write_atomic(&refs.join(revision), meta.commit.as_bytes())?;
        Ok(Some(snapshot))
    }

    fn url(&self, repo_id: &str, revision: &str, filename: &str) -> String {
        format!("{}/{repo_id}/resolve/{revision}/{filename}", self.endpoint)
    }

    fn agent(&self, follow_redirects: bool) -> ureq::Agent {
        ureq::AgentBuilder::new()
            .redirects(if follow_redirects { 5 } else { 0 })
            .timeout_connect(Duration::from_secs(10))
            .timeout_read(Duration::from_secs(60))
            .user_agent(concat!("batch_forge/", env!("CARGO_PKG_VERSION")))
            .build()
    }

    fn request(&self, agent: &ureq::Agent, method: &str, url: &str) -> ureq::Request {
        let req = agent.request(method, url);
        match &self.token {
            Some(t) => req.set("Authorization", &format!("Bearer {t}")),
            None => req,
        }
    }

    /// A request that got no usable answer: denied, another status, or no connection.
    fn request_error(&self, url: &str, e: ureq::Error) -> HubError {
        let url = url.to_owned();
        match e {
            ureq::Error::Status(code @ (401 | 403), _) => HubError::Denied { url, code },
            ureq::Error::Status(code, _) => HubError::Status { url, code },
            e => HubError::Unreachable { endpoint: self.endpoint.clone(), message: e.to_string() },
        }
    }

    fn head(&self, repo_id: &str, revision: &str, filename: &str) -> Result<Option<FileMeta>> {
        let agent = self.agent(false);
        let mut url = self.url(repo_id, revision, filename);
        for _ in 0..5 {
            let resp = match self.request(&agent, "HEAD", &url).call() {
                Ok(r) => r,
                Err(ureq::Error::Status(404, _)) => return Ok(None),
                Err(ureq::Error::Status(code, r)) if (300..400).contains(&code) => r,
                Err(e) => return Err(self.request_error(&url, e)),
            };
            let header = |k: &str| resp.header(k).map(|v| v.trim().to_owned());
            let etag = header("X-Linked-Etag").or_else(|| header("ETag"));
            let commit = header("X-Repo-Commit");
            if let (Some(etag), Some(commit)) = (etag, commit) {
                let etag = etag.trim_start_matches("W/").trim_matches('"').to_owned();
                let size = header("X-Linked-Size").or_else(|| header("Content-Length")).and_then(|s| s.parse().ok());
                validate_name(&etag, "ETag", &url)?;
                validate_name(&commit, "X-Repo-Commit", &url)?;
                return Ok(Some(FileMeta { commit, etag, size }));
            }
            // A redirect without metadata (a renamed repo): follow relative redirects only.
            match header("Location") {
                Some(loc) if (300..400).contains(&resp.status()) && loc.starts_with('/') => {
                    url = format!("{}{loc}", self.endpoint);
                }
                _ => {
                    let message = "the server did not send X-Repo-Commit and ETag headers (is HF_ENDPOINT a Hub?)";
                    return Err(HubError::Protocol { url, message: message.into() });
                }
            }
        }
        Err(HubError::Protocol { url, message: "too many redirects".into() })
    }

    fn download(&self, repo_id: &str, revision: &str, filename: &str, meta: &FileMeta, blob: &Path) -> Result<()> {
        let url = self.url(repo_id, revision, filename);
        let failed = |message: String| HubError::Download { url: url.clone(), message };
        let resp = self.request(&self.agent(true), "GET", &url).call().map_err(|e| self.request_error(&url, e))?;
        let total = meta.size.or_else(|| resp.header("Content-Length").and_then(|s| s.parse().ok()));
        let blobs = blob.parent().expect("blobs dir");
        fs::create_dir_all(blobs).map_err(cache_error("create", blobs))?;
        let partial = blob.with_extension("incomplete");
        let mut out = fs::File::create(&partial).map_err(cache_error("create", &partial))?;
        let bar = if self.progress {
            let bar = indicatif::ProgressBar::with_draw_target(total, indicatif::ProgressDrawTarget::stderr());
            bar.set_style(
                indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} {eta}")
                    .expect("valid template")
                    .progress_chars("=> "),
            );
            bar.set_message(filename.to_owned());
            bar
        } else {
            indicatif::ProgressBar::hidden()
        };
        let mut reader = resp.into_reader();
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; 1 << 16];
        let mut written = 0u64;
        let result: Result<()> = (|| {
            loop {
                let n = reader.read(&mut buf).map_err(|e| failed(e.to_string()))?;
                if n == 0 {
                    break;
                }
                out.write_all(&buf[..n]).map_err(cache_error("write", &partial))?;
                hasher.update(&buf[..n]);
                written += n as u64;
                bar.set_position(written);
            }
            out.sync_all().map_err(cache_error("write", &partial))?;
            if let Some(t) = total
                && t != written
            {
                return Err(failed(format!("got {written} bytes, expected {t} (connection cut?)")));
            }
            // LFS ETags are the sha256 of the content: verify it.
            if meta.etag.len() == 64 && meta.etag.bytes().all(|b| b.is_ascii_hexdigit()) {
                let got: String = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
                if !got.eq_ignore_ascii_case(&meta.etag) {
                    return Err(failed(format!("sha256 {got} does not match the Hub's {}", meta.etag)));
                }
            }
            Ok(())
        })();
        bar.finish_and_clear();
        if let Err(e) = result {
            let _ = fs::remove_file(&partial);
            return Err(e);
        }
        fs::rename(&partial, blob).map_err(cache_error("move into place", &partial))?;
        Ok(())
    }
}

/// ETags and commit hashes become file names: allow only safe characters.
fn validate_name(s: &str, what: &str, url: &str) -> Result<()> {
    if s.is_empty() || s.len() > 128 || !s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_')) {
        return Err(HubError::Protocol {
            url: url.to_owned(),
            message: format!("the Hub sent an unusable {what}: {s:?}"),
        });
    }
    Ok(())
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    fs::write(&tmp, bytes).map_err(cache_error("write", &tmp))?;
    fs::rename(&tmp, path).map_err(cache_error("write", path))?;
    Ok(())
}

/// Point `snapshot` at `blob` with a relative symlink (a copy where symlinks are unavailable).
fn link_snapshot(blob: &Path, snapshot: &Path) -> Result<()> {
    let dir = snapshot.parent().expect("snapshot has a parent");
    fs::create_dir_all(dir).map_err(cache_error("create", dir))?;
    if snapshot.is_file() {
        return Ok(());
    }
    let _ = fs::remove_file(snapshot); // a dangling link
    #[cfg(unix)]
    {
        // snapshots/<commit>/<file> → ../../blobs/<etag>, one more ../ per subfolder in the file name.
        let depth = snapshot
            .strip_prefix(blob.parent().and_then(Path::parent).expect("repo dir"))
            .map_or(2, |p| p.components().count() - 1);
        let mut target = PathBuf::new();
        for _ in 0..depth {
            target.push("..");
        }
        target.push("blobs");
        target.push(blob.file_name().expect("blob name"));
        if std::os::unix::fs::symlink(&target, snapshot).is_ok() {
            return Ok(());
        }
    }
    fs::copy(blob, snapshot).map_err(cache_error("copy into", snapshot))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_ids() {
        assert!(is_repo_id("gpt2"));
        assert!(is_repo_id("openai-community/gpt2"));
        assert!(!is_repo_id("a/b/c"));
        assert!(!is_repo_id("../x"));
        assert!(!is_repo_id("/abs"));
        assert!(!is_repo_id(""));
    }
}
