//! Read-only file mappings that model bytes are borrowed from, and [`release`]: how a
//! backend that has copied weights out of a mapping gives its pages back. Loaders make
//! the mappings; backends release what they packed; neither knows the other.

/// Address ranges `(start, len)` of the live read-only file mappings below.
static LIVE_MAPPINGS: std::sync::Mutex<Vec<(usize, usize)>> = std::sync::Mutex::new(Vec::new());

/// A read-only file mapping, known to [`release`] while it lives.
pub(crate) struct Mapping(pub(crate) memmap2::Mmap);

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
