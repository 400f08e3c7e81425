//! What the kernels' tests share: their random values and their thread pools.

/// The next value of a linear congruential sequence at `seed`, uniform in `[-0.5, 0.5)`
/// with 24 bits.
pub(crate) fn uniform(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (*seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
}

/// `f` on a pool of `threads` threads.
pub(crate) fn on_threads<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
        .install(f)
}
