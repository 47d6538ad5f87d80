//! Weight storage in transparent huge pages, for matrices of every size.
//!
//! A decode step streams every weight byte once, and x86's hardware prefetchers stop at
//! each 4 KiB page boundary: on 4 KiB pages a single thread's weight stream stalls at
//! every page. A 2 MiB huge page lets it run on. The kernel only backs a 2 MiB-aligned
//! range of one mapping with a huge page, so a matrix allocated on its own gets none
//! when it is smaller than about 4 MiB (most of a small model's: GPT-2's 768 × 768
//! Q4_0 projection is 331 KB). Here matrices are carved, back to back, from shared
//! 2 MiB-aligned regions advised with `MADV_HUGEPAGE` (64 MiB each; a matrix of 16 MiB
//! or more gets a region of its own, freed with it). A region lives while any matrix
//! carved from it does, and the arena holds the one it is filling; pages of a region
//! that nothing has touched cost no memory.
//!
//! Measured on a Zen 4 (docs/benchmarks.md): GPT-2 124M Q4_0 decode at 1 thread
//! 158 → 188 tokens/s, f16 67 → 82.

use std::alloc::{Layout, alloc, dealloc};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

/// Huge-page size (x86-64 and aarch64 Linux with 4 KiB base pages).
const HUGE: usize = 2 << 20;
/// Size of a shared region.
const REGION: usize = 64 << 20;
/// Matrices this large get a region of their own (freed with them).
const OWN_REGION: usize = REGION / 4;
/// Below this, a plain allocation (too small for its pages to matter).
const SMALL: usize = 64 << 10;
/// Carved buffers start on a cache line.
const ALIGN: usize = 64;

/// One 2 MiB-aligned allocation, freed when its last buffer (and the arena) let go.
struct Region {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: a Region is an owned allocation with no interior state; every access to its
// bytes goes through a `WeightBuf` that owns a disjoint range of it.
unsafe impl Send for Region {}
// SAFETY: as above; `&Region` gives no access to the bytes.
unsafe impl Sync for Region {}

impl Region {
    fn new(bytes: usize) -> Option<Region> {
        let size = bytes.max(1).checked_next_multiple_of(HUGE)?;
        let layout = Layout::from_size_align(size, HUGE).ok()?;
        // SAFETY: the layout's size is at least HUGE, never zero.
        let ptr = NonNull::new(unsafe { alloc(layout) })?;
        #[cfg(target_os = "linux")]
        // SAFETY: [ptr, ptr + size) is this allocation; MADV_HUGEPAGE only changes how the
        // kernel backs its pages, never their contents. Failure is harmless.
        unsafe {
            libc::madvise(ptr.as_ptr() as *mut libc::c_void, layout.size(), libc::MADV_HUGEPAGE);
        }
        Some(Region { ptr, layout })
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: allocated in `Region::new` with this layout, freed once.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// The region being filled, and how many of its bytes are taken.
static ARENA: Mutex<Option<(Arc<Region>, usize)>> = Mutex::new(None);

/// A weight array: `n` elements of `T` in huge-page memory (see the module doc), or a
/// plain `Vec` when small, under miri, or off Linux. Dereferences to `[T]`.
pub struct WeightBuf<T: Copy> {
    inner: Inner<T>,
}

enum Inner<T> {
    Plain(Vec<T>),
    Carved { _region: Arc<Region>, ptr: NonNull<T>, len: usize },
}

// SAFETY: a carved buffer owns its range of the region exclusively (like a `Box<[T]>`);
// the shared `Arc<Region>` only keeps the allocation alive.
unsafe impl<T: Copy + Send> Send for WeightBuf<T> {}
// SAFETY: `&WeightBuf` gives only shared access to the elements.
unsafe impl<T: Copy + Sync> Sync for WeightBuf<T> {}

impl<T: Copy> WeightBuf<T> {
    /// `n` copies of `value`.
    pub fn filled(n: usize, value: T) -> WeightBuf<T> {
        // (An overflowing size takes the plain path, whose allocation then fails loudly.)
        let bytes = n.checked_mul(std::mem::size_of::<T>()).unwrap_or(0);
        if cfg!(miri) || !cfg!(target_os = "linux") || bytes < SMALL || std::mem::align_of::<T>() > ALIGN {
            return WeightBuf { inner: Inner::Plain(vec![value; n]) };
        }
        let Some((region, offset)) = carve(bytes) else {
            return WeightBuf { inner: Inner::Plain(vec![value; n]) };
        };
        // SAFETY: [offset, offset + bytes) lies inside the region (`carve`), is aligned to
        // ALIGN ≥ align_of::<T>(), and belongs to this buffer alone.
        let ptr = unsafe { NonNull::new_unchecked(region.ptr.as_ptr().add(offset) as *mut T) };
        for i in 0..n {
            // SAFETY: element i is inside the carved range (n · size_of::<T>() = bytes).
            unsafe { ptr.as_ptr().add(i).write(value) };
        }
        WeightBuf { inner: Inner::Carved { _region: region, ptr, len: n } }
    }

    /// Whether the buffer lives in a huge-page region (else a plain allocation).
    #[cfg(test)]
    fn in_region(&self) -> bool {
        matches!(self.inner, Inner::Carved { .. })
    }
}

impl<T: Copy> From<Vec<T>> for WeightBuf<T> {
    /// A plain allocation, for arrays made at run time (which would only churn regions).
    fn from(v: Vec<T>) -> Self {
        WeightBuf { inner: Inner::Plain(v) }
    }
}

/// `bytes` from the current region (a new one when it is full), or a region of its own
/// for a large matrix: the region and the offset of the range, which no one else gets.
fn carve(bytes: usize) -> Option<(Arc<Region>, usize)> {
    if bytes >= OWN_REGION {
        return Some((Arc::new(Region::new(bytes)?), 0));
    }
    let mut arena = ARENA.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((region, used)) = arena.as_mut() {
        let start = used.next_multiple_of(ALIGN);
        if start.checked_add(bytes).is_some_and(|end| end <= region.layout.size()) {
            *used = start + bytes;
            return Some((Arc::clone(region), start));
        }
    }
    let region = Arc::new(Region::new(REGION)?);
    *arena = Some((Arc::clone(&region), bytes));
    Some((region, 0))
}

impl<T: Copy> Deref for WeightBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.inner {
            Inner::Plain(v) => v,
            // SAFETY: `len` initialized elements at `ptr`, owned by this buffer.
            Inner::Carved { ptr, len, .. } => unsafe { std::slice::from_raw_parts(ptr.as_ptr(), *len) },
        }
    }
}

impl<T: Copy> DerefMut for WeightBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.inner {
            Inner::Plain(v) => v,
            // SAFETY: as in `deref`, and `&mut self` makes the access exclusive.
            Inner::Carved { ptr, len, .. } => unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), *len) },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Buffers carved from one region never overlap, keep their values while others are
    /// written and dropped, and large ones get regions of their own.
    #[test]
    #[cfg_attr(miri, ignore = "fills tens of MiB")]
    fn carved_buffers_are_disjoint_and_keep_their_values() {
        let sizes = [100usize, 70_000, 300_000, 1 << 20, 5 << 20, 17 << 20, 70_001];
        let mut bufs: Vec<(WeightBuf<u32>, u32)> = Vec::new();
        for (i, &n) in sizes.iter().enumerate() {
            let mut b = WeightBuf::filled(n / 4, i as u32);
            assert!(b.iter().all(|&v| v == i as u32));
            b.iter_mut().enumerate().for_each(|(j, v)| *v = ((i as u32) << 24) | (j as u32 & 0xFF_FFFF));
            assert_eq!(b.in_region(), n >= SMALL && cfg!(target_os = "linux") && !cfg!(miri), "{n} bytes");
            assert_eq!(b.as_ptr() as usize % std::mem::align_of::<u32>(), 0);
            bufs.push((b, i as u32));
        }
        bufs.remove(2); // freeing one leaves the others intact
        for (b, i) in &bufs {
            assert!(b.iter().enumerate().all(|(j, &v)| v == ((i << 24) | (j as u32 & 0xFF_FFFF))), "buffer {i}");
        }
        let mut ranges: Vec<(usize, usize)> =
            bufs.iter().map(|(b, _)| (b.as_ptr() as usize, b.as_ptr() as usize + 4 * b.len())).collect();
        ranges.sort();
        assert!(ranges.windows(2).all(|w| w[0].1 <= w[1].0), "overlapping buffers: {ranges:?}");
        let empty = WeightBuf::filled(0, 0u8);
        assert!(empty.is_empty());
    }

    /// Carving past a region's end starts a new one; buffers on both sides keep their
    /// values, start on a cache line and never overlap.
    #[test]
    #[cfg_attr(miri, ignore = "fills tens of MiB")]
    fn a_full_region_is_followed_by_a_new_one() {
        let n = (3 << 20) + 12_345; // 3 MiB and a bit: under OWN_REGION, 22 fill a region
        let bufs: Vec<WeightBuf<u8>> = (0..REGION / n + 2).map(|i| WeightBuf::filled(n, i as u8)).collect();
        for (i, b) in bufs.iter().enumerate() {
            assert!(b.len() == n && b.iter().all(|&v| v == i as u8), "buffer {i}");
            if b.in_region() {
                assert_eq!(b.as_ptr() as usize % ALIGN, 0, "buffer {i}");
            }
        }
        let mut ranges: Vec<(usize, usize)> =
            bufs.iter().map(|b| (b.as_ptr() as usize, b.as_ptr() as usize + b.len())).collect();
        ranges.sort();
        assert!(ranges.windows(2).all(|w| w[0].1 <= w[1].0), "overlapping buffers");
        if cfg!(target_os = "linux") {
            // Every buffer carved, from more than one region: 23 of them overflow the first.
            let mut regions: Vec<*const Region> = bufs
                .iter()
                .map(|b| match &b.inner {
                    Inner::Carved { _region, .. } => Arc::as_ptr(_region),
                    Inner::Plain(_) => panic!("a {n}-byte buffer was not carved"),
                })
                .collect();
            regions.dedup();
            assert!(regions.len() >= 2, "{} regions", regions.len());
        }
    }
}
