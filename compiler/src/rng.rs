//! Philox4x32-10, the counter-based random number generator behind dropout and init.
//!
//! In: a 128-bit counter and a 64-bit key. Out: 128 random bits
//! ([`philox4x32_10`], Salmon, Moraes, Dror & Shaw, "Parallel random numbers: as easy as
//! 1, 2, 3", SC 2011). Every random draw in kiln is a pure function of (key, counter), so
//! the reference executor, the Cranelift kernels and the CUDA kernels draw the same bits
//! for the same element without sharing any state.
//!
//! # The dropout mask (integer-only; backends reproduce it bit for bit)
//!
//! For element flat index `i` (row-major, `u64`) of a dropout node with attribute
//! `stream: u32`, at training step `step: u32`, in a run with `seed: u64`:
//!
//! ```text
//! ctr   = [ (i/4) as u32, ((i/4) >> 32) as u32, stream, step ]
//! key   = [ seed as u32, (seed >> 32) as u32 ]
//! w     = philox4x32_10(ctr, key)[i % 4]
//! keep  = (w >> 8) >= dropout_threshold(p)      // threshold = ceil(p * 2^24)
//! y     = keep ? x * (1/(1-p)) : 0
//! ```
//!
//! Only the top 24 bits of `w` are compared, so the threshold is exact in `f32` too. Four
//! consecutive elements share one Philox call. See [`dropout_keep`] and
//! [`dropout_threshold`].
//!
//! # Draws for parameter initialization (host only)
//!
//! A parameter's stream is a 64-bit number (see [`crate::init`]); it fills counter words
//! 2 and 3 (low half first) and the seed is the key, as above.
//!
//! - [`uniform01`]`(seed, stream, i)`: block `b = i/4` in counter words 0..1, word
//!   `i % 4` of the output, `u = (w + 0.5) / 2^32`, strictly inside (0, 1).
//! - [`standard_normal`]`(seed, stream, i)`: block `b = i/2` in counter words 0..1; the
//!   output words `2*(i%2)` and `2*(i%2)+1` give `u1`, `u2` (each mapped like
//!   `uniform01`), and the value is Box–Muller's `sqrt(-2 ln u1) * cos(2π u2)`. Every
//!   element uses its own two words; the sine half of the pair is not used.

/// Philox multipliers (Salmon et al., table 2).
pub(crate) const PHILOX_M0: u32 = 0xD251_1F53;
pub(crate) const PHILOX_M1: u32 = 0xCD9E_8D57;
/// Weyl sequence increments for the key schedule (golden ratio, sqrt(3) - 1).
pub(crate) const PHILOX_W0: u32 = 0x9E37_79B9;
pub(crate) const PHILOX_W1: u32 = 0xBB67_AE85;

/// The high and low 32-bit halves of the 64-bit product `a * b`.
fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let p = u64::from(a) * u64::from(b);
    ((p >> 32) as u32, p as u32)
}

/// One Philox round: two multiplications, a swap and the key mix.
fn round(ctr: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (hi0, lo0) = mulhilo(PHILOX_M0, ctr[0]);
    let (hi1, lo1) = mulhilo(PHILOX_M1, ctr[2]);
    [hi1 ^ ctr[1] ^ key[0], lo1, hi0 ^ ctr[3] ^ key[1], lo0]
}

/// Philox4x32 with 10 rounds: the key is bumped by the Weyl constants between rounds.
pub fn philox4x32_10(ctr: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let mut ctr = ctr;
    let mut key = key;
    for r in 0..10 {
        if r > 0 {
            key = [
                key[0].wrapping_add(PHILOX_W0),
                key[1].wrapping_add(PHILOX_W1),
            ];
        }
        ctr = round(ctr, key);
    }
    ctr
}

/// The 24-bit threshold below which an element is dropped: `ceil(p * 2^24)`.
///
/// `p` is a dropout probability in `[0, 1)` (the IR checks this). `p = 0` gives 0, so
/// every element is kept.
pub fn dropout_threshold(p: f64) -> u32 {
    (p * 16_777_216.0).ceil() as u32
}

/// The key `[seed lo, seed hi]`.
fn seed_key(seed: u64) -> [u32; 2] {
    [seed as u32, (seed >> 32) as u32]
}

/// The four Philox words that decide elements `4*block .. 4*block + 4` of the dropout
/// node with `stream` at `step`: element `i` is kept iff `(words[i % 4] >> 8) >=
/// threshold`. Executors that mask whole blocks at once call this; [`dropout_keep`] is
/// the per-element form.
pub fn dropout_words(seed: u64, step: u32, stream: u32, block: u64) -> [u32; 4] {
    philox4x32_10(
        [block as u32, (block >> 32) as u32, stream, step],
        seed_key(seed),
    )
}

/// Whether element `index` of the dropout node with `stream` survives at `step` (see the
/// module documentation for the exact definition).
pub fn dropout_keep(seed: u64, step: u32, stream: u32, index: u64, threshold: u32) -> bool {
    let w = dropout_words(seed, step, stream, index / 4)[(index % 4) as usize];
    (w >> 8) >= threshold
}

/// Four random words for counter block `block` of a 64-bit `stream`.
fn stream_block(seed: u64, stream: u64, block: u64) -> [u32; 4] {
    philox4x32_10(
        [
            block as u32,
            (block >> 32) as u32,
            stream as u32,
            (stream >> 32) as u32,
        ],
        seed_key(seed),
    )
}

/// A 32-bit word mapped to the open interval (0, 1): `(w + 0.5) / 2^32`.
fn word_to_open01(w: u32) -> f64 {
    (f64::from(w) + 0.5) / 4_294_967_296.0
}

/// A uniform draw in the open interval (0, 1) for element `index` of `stream`.
pub fn uniform01(seed: u64, stream: u64, index: u64) -> f64 {
    let out = stream_block(seed, stream, index / 4);
    word_to_open01(out[(index % 4) as usize])
}

/// A standard normal draw (Box–Muller, cosine branch) for element `index` of `stream`.
pub fn standard_normal(seed: u64, stream: u64, index: u64) -> f64 {
    let out = stream_block(seed, stream, index / 2);
    let first = 2 * (index % 2) as usize;
    let u1 = word_to_open01(out[first]);
    let u2 = word_to_open01(out[first + 1]);
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_answers_from_random123() {
        assert_eq!(
            philox4x32_10([0, 0, 0, 0], [0, 0]),
            [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]
        );
        assert_eq!(
            philox4x32_10([0xffffffff; 4], [0xffffffff, 0xffffffff]),
            [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]
        );
        assert_eq!(
            philox4x32_10(
                [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
                [0xa4093822, 0x299f31d0]
            ),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }

    fn mask(seed: u64, step: u32, stream: u32, n: u64, p: f64) -> Vec<bool> {
        let t = dropout_threshold(p);
        (0..n)
            .map(|i| dropout_keep(seed, step, stream, i, t))
            .collect()
    }

    #[test]
    fn keep_fraction_matches_p() {
        let m = mask(42, 7, 3, 100_000, 0.1);
        let kept = m.iter().filter(|&&k| k).count() as f64 / m.len() as f64;
        // Binomial std of the kept fraction is sqrt(0.09/1e5) ~ 0.00095; 0.005 is ~5 sigma.
        assert!((kept - 0.9).abs() <= 0.005, "kept fraction {kept}");
        // p = 0 keeps everything.
        assert!(mask(42, 7, 3, 1000, 0.0).iter().all(|&k| k));
    }

    #[test]
    fn thresholds() {
        assert_eq!(dropout_threshold(0.0), 0);
        assert_eq!(dropout_threshold(0.5), 1 << 23);
        assert_eq!(dropout_threshold(0.1), 1_677_722);
    }

    #[test]
    fn masks_depend_on_every_coordinate_and_nothing_else() {
        let base = mask(1, 0, 0, 4096, 0.5);
        assert_eq!(base, mask(1, 0, 0, 4096, 0.5));
        assert_ne!(base, mask(1, 0, 1, 4096, 0.5), "streams must differ");
        assert_ne!(base, mask(1, 1, 0, 4096, 0.5), "steps must differ");
        assert_ne!(base, mask(2, 0, 0, 4096, 0.5), "seeds must differ");
        assert_ne!(
            base,
            mask(1 << 32, 0, 0, 4096, 0.5),
            "seed high half counts"
        );
    }

    #[test]
    fn uniform_and_normal_draws() {
        let n = 200_000u64;
        let mut sum = 0.0;
        for i in 0..n {
            let u = uniform01(9, 77, i);
            assert!(u > 0.0 && u < 1.0);
            sum += u;
        }
        assert!((sum / n as f64 - 0.5).abs() < 0.005);
        assert_eq!(uniform01(9, 77, 5), uniform01(9, 77, 5));
        assert_ne!(uniform01(9, 77, 5), uniform01(9, 78, 5));
        assert_ne!(uniform01(9, 77, 5), uniform01(9, 77, 6));

        let (mut s1, mut s2) = (0.0, 0.0);
        for i in 0..n {
            let z = standard_normal(3, 1, i);
            assert!(z.is_finite());
            s1 += z;
            s2 += z * z;
        }
        let mean = s1 / n as f64;
        let var = s2 / n as f64 - mean * mean;
        assert!(mean.abs() < 0.02, "mean {mean}");
        assert!((var - 1.0).abs() < 0.02, "variance {var}");
    }
}
