//! Finished sequences' KV caches, kept for reuse: looked up by the hash chain of their
//! full blocks of [`BLOCK_TOKENS`] positions, evicted least-recently-used.

/// Positions per KV block: the unit of the scheduler's pool and of prefix matching.
pub const BLOCK_TOKENS: usize = 16;

/// Blocks for a sequence that caches `positions` positions.
pub fn blocks_for(positions: usize) -> usize {
    positions.div_ceil(BLOCK_TOKENS).max(1)
}

/// The hash chain of the full blocks of `tokens`: entry `i` identifies blocks `0..=i`
/// (FNV-1a over the previous link and the block's ids).
pub fn block_hashes(tokens: &[u32]) -> Vec<u64> {
    let mut out = Vec::with_capacity(tokens.len() / BLOCK_TOKENS);
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for block in tokens.chunks_exact(BLOCK_TOKENS) {
        for &t in block {
            for b in t.to_le_bytes() {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
        out.push(h);
        // Mix in a separator so a chain is never a rehash of a longer block.
        h = h.rotate_left(17) ^ 0x9e37_79b9_7f4a_7c15;
    }
    out
}

/// A finished sequence's cache kept for reuse.
pub(crate) struct CacheEntry<C> {
    /// The tokens whose keys and values it holds.
    pub tokens: Vec<u32>,
    hashes: Vec<u64>,
    pub cache: C,
    pub blocks: usize,
    last_used: u64,
}

/// Finished sequences' caches, looked up by block hash chain, evicted LRU.
pub(crate) struct PrefixCache<C> {
    pub entries: Vec<CacheEntry<C>>,
    clock: u64,
}

impl<C> PrefixCache<C> {
    pub fn new() -> Self {
        PrefixCache { entries: Vec::new(), clock: 0 }
    }

    /// Blocks held by every entry.
    pub fn blocks(&self) -> usize {
        self.entries.iter().map(|e| e.blocks).sum()
    }

    /// The entry sharing the most full blocks with `tokens` (hashes checked, then the
    /// tokens themselves) among those whose cache is `usable` for that many tokens (a
    /// sliding-window ring may no longer hold the window before them), and how many
    /// tokens that is.
    pub fn lookup(
        &mut self,
        tokens: &[u32],
        hashes: &[u64],
        usable: impl Fn(&C, usize) -> bool,
    ) -> Option<(usize, usize)> {
        let mut best: Option<(usize, usize)> = None;
        for (i, e) in self.entries.iter().enumerate() {
            let blocks = e.hashes.iter().zip(hashes).take_while(|(a, b)| a == b).count();
            let n = blocks * BLOCK_TOKENS;
            if n > 0 && best.is_none_or(|(_, m)| n > m) && e.tokens[..n] == tokens[..n] && usable(&e.cache, n) {
                best = Some((i, n));
            }
        }
        if let Some((i, _)) = best {
            self.clock += 1;
            self.entries[i].last_used = self.clock;
        }
        best
    }

    /// Whether an entry holds all of `hashes`' blocks and `serves` every prefix the caller's
    /// cache would; it counts as used now if so.
    pub fn covers(&mut self, hashes: &[u64], serves: impl Fn(&C) -> bool) -> bool {
        let clock = self.clock + 1;
        let found = self
            .entries
            .iter_mut()
            .find(|e| e.hashes.len() >= hashes.len() && e.hashes[..hashes.len()] == *hashes && serves(&e.cache));
        match found {
            Some(e) => {
                self.clock = clock;
                e.last_used = clock;
                true
            }
            None => false,
        }
    }

    /// Keep `cache`, which holds `tokens` (whose full blocks hash to `hashes`); the
    /// caller has checked that no entry [`covers`](Self::covers) them already. Entries
    /// whose blocks the new one covers go, where `supersedes(new, old)` says the new cache
    /// serves every prefix the old one does.
    pub fn insert(
        &mut self,
        tokens: Vec<u32>,
        hashes: Vec<u64>,
        cache: C,
        blocks: usize,
        supersedes: impl Fn(&C, &C) -> bool,
    ) {
        if hashes.is_empty() {
            return; // not one full block: nothing to reuse
        }
        self.entries.retain(|e| {
            !(e.hashes.len() <= hashes.len()
                && e.hashes[..] == hashes[..e.hashes.len()]
                && supersedes(&cache, &e.cache))
        });
        self.clock += 1;
        self.entries.push(CacheEntry { tokens, hashes, cache, blocks, last_used: self.clock });
    }

    /// Drop the least recently used entry; its block count, or `None` when empty.
    pub fn evict_one(&mut self) -> Option<usize> {
        let i = self.entries.iter().enumerate().min_by_key(|(_, e)| e.last_used).map(|(i, _)| i)?;
        Some(self.entries.swap_remove(i).blocks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_chains_identify_prefixes() {
        let a: Vec<u32> = (0..40).collect();
        let mut b = a.clone();
        b[20] = 999; // second block differs
        let (ha, hb) = (block_hashes(&a), block_hashes(&b));
        assert_eq!(ha.len(), 2); // 40 tokens: two full blocks
        assert_eq!(ha[0], hb[0]);
        assert_ne!(ha[1], hb[1]);
        // A chain link depends on every earlier block.
        let mut c = a.clone();
        c[0] = 7;
        assert_ne!(block_hashes(&c)[1], ha[1]);
        assert_eq!(blocks_for(0), 1);
        assert_eq!(blocks_for(16), 1);
        assert_eq!(blocks_for(17), 2);
    }

    #[test]
    fn prefix_cache_finds_the_longest_match_and_evicts_lru() {
        let (any, always) = (|_: &&str, _: usize| true, |_: &&str, _: &&str| true);
        let mut p = PrefixCache::new();
        let long: Vec<u32> = (0..48).collect();
        let short: Vec<u32> = (0..20).collect();
        p.insert(short.clone(), block_hashes(&short), "short", 2, always);
        p.insert(long.clone(), block_hashes(&long), "long", 3, always); // covers `short`'s one full block
        assert_eq!(p.entries.len(), 1);
        let other: Vec<u32> = (100..140).collect();
        p.insert(other.clone(), block_hashes(&other), "other", 3, always);
        let query: Vec<u32> = (0..40).chain([7, 7]).collect();
        let (i, n) = p.lookup(&query, &block_hashes(&query), any).unwrap();
        assert_eq!((p.entries[i].cache, n), ("long", 32));
        assert!(p.lookup(&[5; 30], &block_hashes(&[5; 30]), any).is_none());
        // `long` was just used: `other` goes first.
        assert_eq!(p.evict_one(), Some(3));
        assert_eq!(p.entries[0].cache, "long");
        assert_eq!(p.blocks(), 3);
    }

    /// Caches that cannot serve every prefix (sliding-window rings that went on) neither
    /// hide nor replace one that can: a shorter entry stays beside a longer one, a lookup
    /// takes the longest usable match, and a covering entry counts only if it serves.
    #[test]
    fn entries_that_cannot_serve_a_prefix_do_not_displace_one_that_can() {
        let mut p = PrefixCache::new();
        let long: Vec<u32> = (0..64).collect();
        let short: Vec<u32> = (0..32).collect();
        // "long" is a ring that only serves its whole length: it supersedes nothing.
        let usable = |c: &&str, n: usize| *c != "long" || n == 64;
        let supersedes = |new: &&str, _: &&str| *new != "long";
        p.insert(short.clone(), block_hashes(&short), "short", 2, supersedes);
        p.insert(long.clone(), block_hashes(&long), "long", 4, supersedes);
        assert_eq!(p.entries.len(), 2);
        let query: Vec<u32> = (0..48).chain([9; 8]).collect();
        let (i, n) = p.lookup(&query, &block_hashes(&query), usable).unwrap();
        assert_eq!((p.entries[i].cache, n), ("short", 32));
        let (i, n) = p.lookup(&long, &block_hashes(&long), usable).unwrap();
        assert_eq!((p.entries[i].cache, n), ("long", 64));
        let mid: Vec<u32> = (0..48).collect();
        assert!(!p.covers(&block_hashes(&mid), |c| *c != "long"));
        assert!(p.covers(&block_hashes(&mid), |_| true));
    }
}
