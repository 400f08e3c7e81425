//! A pool of large f32 buffers, so big temporaries are not page-faulted in on every node
//! of every run.
//!
//! In: f32 buffers of at least [`POOL_MIN`] elements whose values died (returned by the
//! drop of their storage). Out: buffers for new values — a pooled one whose capacity fits
//! (between `n` and `2n`), else a fresh allocation. A pooled buffer's contents are stale:
//! every kernel that takes one writes all its elements (or fills it first).
//!
//! Freshly allocated memory costs a page fault per 4 KiB page on first touch (the
//! vocab-sized logits of the base model are 118 MB, 29k faults), and the allocator hands
//! large blocks back to the OS on free, so without a pool every run pays that again. The
//! eager executor's pool keeps at most [`POOL_MAX_BYTES`], a compiled program's (for its
//! fallback kernels) [`COMPILED_POOL_MAX_BYTES`]; a pool lives as long as the executor
//! that owns it and the values that point to it.

use std::sync::Mutex;

/// Buffers smaller than this (in elements) are left to the allocator.
pub(crate) const POOL_MIN: usize = 1 << 16;
/// The most memory the pool holds on to.
pub(crate) const POOL_MAX_BYTES: usize = 4 << 30;

#[derive(Debug)]
pub(crate) struct Pool {
    free: Mutex<Vec<Vec<f32>>>,
    /// The most bytes it holds on to.
    max_bytes: usize,
}

impl Default for Pool {
    /// The eager executor's pool: up to [`POOL_MAX_BYTES`].
    fn default() -> Pool {
        Pool::with_limit(POOL_MAX_BYTES)
    }
}

/// What a compiled program's pool holds at most: only its fallback kernels (primitives
/// without generated code) take from it, and their temporaries are small next to the
/// eager executor's every value.
pub(crate) const COMPILED_POOL_MAX_BYTES: usize = 256 << 20;

impl Pool {
    /// A pool that holds at most `max_bytes`.
    pub(crate) fn with_limit(max_bytes: usize) -> Pool {
        Pool {
            free: Mutex::new(Vec::new()),
            max_bytes,
        }
    }

    /// A buffer of `n` elements with unspecified (but initialized) contents.
    pub(crate) fn take(&self, n: usize) -> Vec<f32> {
        if n >= POOL_MIN {
            if let Ok(mut free) = self.free.lock() {
                // The smallest pooled buffer that holds `n` without wasting half of it.
                let best = free
                    .iter()
                    .enumerate()
                    .filter(|(_, v)| v.capacity() >= n && v.capacity() <= 2 * n)
                    .min_by_key(|(_, v)| v.capacity())
                    .map(|(i, _)| i);
                if let Some(i) = best {
                    let mut v = free.swap_remove(i);
                    drop(free);
                    if v.len() >= n {
                        v.truncate(n);
                    } else {
                        v.resize(n, 0.0);
                    }
                    return v;
                }
            }
        }
        vec![0.0; n]
    }

    /// Whether [`Pool::take`] of `n` elements would reuse a pooled buffer.
    pub(crate) fn has_fit(&self, n: usize) -> bool {
        n >= POOL_MIN
            && self.free.lock().is_ok_and(|free| {
                free.iter()
                    .any(|v| v.capacity() >= n && v.capacity() <= 2 * n)
            })
    }

    /// Keeps `v` for reuse if it is large and the pool has room; frees it otherwise.
    pub(crate) fn give(&self, v: Vec<f32>) {
        if v.capacity() < POOL_MIN {
            return;
        }
        if let Ok(mut free) = self.free.lock() {
            let held: usize = free.iter().map(|b| b.capacity()).sum::<usize>() * 4;
            if held + v.capacity() * 4 <= self.max_bytes {
                free.push(v);
            }
        }
    }

    /// How many buffers the pool holds (for tests).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.free.lock().map_or(0, |f| f.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_when_they_fit() {
        let pool = Pool::default();
        let a = pool.take(2 * POOL_MIN);
        let p = a.as_ptr();
        pool.give(a);
        assert_eq!(pool.len(), 1);
        // Too large for it: a fresh buffer.
        let b = pool.take(5 * POOL_MIN);
        assert_ne!(b.as_ptr(), p);
        assert_eq!(pool.len(), 1);
        // A fit (capacity between n and 2n): the pooled one, resized.
        let c = pool.take(POOL_MIN + 5);
        assert_eq!(c.as_ptr(), p);
        assert_eq!(c.len(), POOL_MIN + 5);
        assert_eq!(pool.len(), 0);
        // Small buffers are never pooled.
        pool.give(vec![0.0; 10]);
        assert_eq!(pool.len(), 0);
        pool.give(b);
        pool.give(c);
        assert_eq!(pool.len(), 2);
    }

    /// A pool keeps what fits under its limit and frees the rest.
    #[test]
    fn a_pool_holds_at_most_its_limit() {
        let pool = Pool::with_limit(3 * POOL_MIN * 4);
        pool.give(vec![0.0; 2 * POOL_MIN]);
        pool.give(vec![0.0; 2 * POOL_MIN]);
        assert_eq!(pool.len(), 1);
        pool.give(vec![0.0; POOL_MIN]);
        assert_eq!(pool.len(), 2);
    }
}
