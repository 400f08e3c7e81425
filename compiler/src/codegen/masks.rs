//! The dropout masks of a run of elements, drawn for the CPU kernels by a function they
//! call (`kiln_dropout_masks`) instead of by CLIF of their own.
//!
//! In: a dropout node's seed, step, stream and threshold, the flat index of the first
//! element and a count. Out: one `i32` lane mask per element (all ones where kept, zero
//! where dropped), the same bits as [`crate::rng::dropout_keep`].
//!
//! Why a call: Cranelift's vectors are 128 bits wide, so a kernel drawing its own masks
//! in CLIF (as region kernels did, four counter blocks at a time in `I32X4` lanes) spent
//! about nine cycles an element on Philox's 32×32→64-bit products. With AVX-512F this
//! function draws sixteen counter blocks (64 elements) per pass with 512-bit
//! `vpmuludq`, several times fewer instructions an element; with AVX2 only (AMD Zen 1–3,
//! Intel's client CPUs), eight blocks (32 elements) with 256-bit ones. Region and
//! `embed_pe` kernels call it once per [`MASK_CHUNK`] elements of a row, into a buffer
//! on their stack, and read the masks back as vectors. A run shorter than a group, or
//! starting inside a counter block, draws a whole group into a scratch and copies its
//! part; a run within one block, or a CPU without AVX2, draws with
//! [`crate::rng::dropout_words`].

use cranelift_codegen::ir::{types, AbiParam, Signature};
use cranelift_codegen::isa::CallConv;

use crate::rng::{dropout_words, PHILOX_M0, PHILOX_M1, PHILOX_W0, PHILOX_W1};

/// The symbol a kernel's CLIF calls (`fn0 = %kiln_dropout_masks`); the JIT binds it to
/// [`kiln_dropout_masks`].
pub const SYMBOL: &str = "kiln_dropout_masks";

/// Elements a region kernel draws masks for per call: 4 KB of masks on its stack.
pub const MASK_CHUNK: i64 = 1024;

/// The signature kernels call [`kiln_dropout_masks`] with, in `call_conv` (the host's C
/// ABI: the text says System V, the JIT sets the host's): `(seed i64, step i32, stream
/// i32, threshold i32, index i64, count i64, out i64)`.
pub fn signature(call_conv: CallConv) -> Signature {
    let mut sig = Signature::new(call_conv);
    for t in [
        types::I64,
        types::I32,
        types::I32,
        types::I32,
        types::I64,
        types::I64,
        types::I64,
    ] {
        sig.params.push(AbiParam::new(t));
    }
    sig
}

/// Writes the keep masks of elements `index .. index + count` of the dropout node with
/// `stream` at `step` (threshold as [`crate::rng::dropout_threshold`]) to `out`: `-1`
/// (all bits set) where the element is kept, `0` where it is dropped.
///
/// # Safety
/// `out` must be valid for `count` `i32` writes. (The kernels that call it pass a buffer
/// of [`MASK_CHUNK`] and a count of at most that.)
pub unsafe extern "C" fn kiln_dropout_masks(
    seed: u64,
    step: u32,
    stream: u32,
    threshold: u32,
    index: u64,
    count: u64,
    out: *mut i32,
) {
    // SAFETY: the caller's: `out` holds `count` elements.
    let out = unsafe { std::slice::from_raw_parts_mut(out, count as usize) };
    masks(seed, step, stream, threshold, index, out);
}

/// [`kiln_dropout_masks`] into a slice (element `index + j` into `out[j]`).
pub fn masks(seed: u64, step: u32, stream: u32, threshold: u32, index: u64, out: &mut [i32]) {
    let draw = Draw {
        seed,
        step,
        stream,
        threshold,
    };
    masks_with(Path::best(), draw, index, out);
}

/// What one run of masks draws with: the generator's key (`seed`), its counters' `step` and
/// `stream` words, and the keep threshold ([`crate::rng::dropout_threshold`]).
#[derive(Clone, Copy, Debug)]
struct Draw {
    seed: u64,
    step: u32,
    stream: u32,
    threshold: u32,
}

/// How [`masks`] draws: a group of counter blocks at a time in 512-bit or 256-bit
/// vectors, or one block at a time in scalar code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    /// Sixteen blocks (64 elements) per pass, with AVX-512F.
    Avx512,
    /// Eight blocks (32 elements) per pass, with AVX2 (AMD Zen 1–3, Intel client CPUs).
    Avx2,
    /// [`dropout_words`], one block at a time.
    Scalar,
}

impl Path {
    /// The widest path this CPU has.
    fn best() -> Path {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Path::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Path::Avx2;
            }
        }
        Path::Scalar
    }

    /// Elements a pass draws: four per counter block.
    fn group(self) -> usize {
        match self {
            Path::Avx512 => 64,
            Path::Avx2 => 32,
            Path::Scalar => 4,
        }
    }
}

/// [`masks`] by `path`, which the CPU must have.
fn masks_with(path: Path, draw: Draw, index: u64, out: &mut [i32]) {
    let group = path.group();
    let mut i = index;
    let mut rest = &mut out[..];
    while !rest.is_empty() {
        let skip = (i % 4) as usize;
        // A group of blocks at once wherever the run spans two blocks or more (a short or
        // unaligned run through a scratch group, the words it needs copied out).
        if path != Path::Scalar && skip + rest.len() >= 8 {
            let take = (group - skip).min(rest.len());
            let (now, later) = rest.split_at_mut(take);
            let mut scratch = [0i32; 64];
            let whole = take == group;
            let dst: &mut [i32] = if whole { now } else { &mut scratch[..group] };
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Path::best` detected the path's features; `dst` holds a group.
            unsafe {
                match path {
                    Path::Avx512 => avx512::sixteen_blocks(draw, i / 4, dst),
                    Path::Avx2 => avx2::eight_blocks(draw, i / 4, dst),
                    Path::Scalar => unreachable!(),
                }
            };
            if !whole {
                now.copy_from_slice(&scratch[skip..skip + take]);
            }
            rest = later;
            i += take as u64;
            continue;
        }
        let words = dropout_words(draw.seed, draw.step, draw.stream, i / 4);
        let take = (4 - skip).min(rest.len());
        let (now, later) = rest.split_at_mut(take);
        for (j, m) in now.iter_mut().enumerate() {
            let w = words[skip + j];
            *m = if (w >> 8) >= draw.threshold { -1 } else { 0 };
        }
        rest = later;
        i += take as u64;
    }
}

/// A register of `u32` lanes and the operations Philox's rounds take on it.
#[cfg(target_arch = "x86_64")]
trait Lanes: Copy {
    /// Every lane `x`.
    unsafe fn splat(x: u32) -> Self;
    /// `a ^ b ^ c`.
    unsafe fn xor3(a: Self, b: Self, c: Self) -> Self;
    /// The high and low words of `m · c` in each lane.
    unsafe fn mulhilo(m: Self, c: Self) -> (Self, Self);
    /// Within each 128-bit lane, the 32-bit words of `a` and `b` interleaved: from their
    /// low halves, then from their high halves.
    unsafe fn unpack32(a: Self, b: Self) -> (Self, Self);
    /// [`Lanes::unpack32`] for 64-bit words.
    unsafe fn unpack64(a: Self, b: Self) -> (Self, Self);
}

/// The first step of turning Philox's counters inside out: lane j of `c[w]` is word w of
/// block j, and the output's order is element 4j + w, a 4 × lanes transpose. Within each
/// 128-bit lane g, `u[q]` comes back holding the four words of block 4g + q; the caller
/// transposes the 128-bit lanes.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn transpose_within_lanes<V: Lanes>(c: [V; 4]) -> [V; 4] {
    let (t0, t1) = V::unpack32(c[0], c[1]);
    let (t2, t3) = V::unpack32(c[2], c[3]);
    let (u0, u1) = V::unpack64(t0, t2);
    let (u2, u3) = V::unpack64(t1, t3);
    [u0, u1, u2, u3]
}

/// Philox4x32's ten rounds on the counters `c` (lane j of `c[w]`: word w of block j)
/// with the key of `seed`, [`crate::rng::dropout_words`] lane by lane.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn philox_rounds<V: Lanes>(mut c: [V; 4], seed: u64) -> [V; 4] {
    let (m0, m1) = (V::splat(PHILOX_M0), V::splat(PHILOX_M1));
    let mut key = [seed as u32, (seed >> 32) as u32];
    for r in 0..10 {
        if r > 0 {
            key = [
                key[0].wrapping_add(PHILOX_W0),
                key[1].wrapping_add(PHILOX_W1),
            ];
        }
        let (hi0, lo0) = V::mulhilo(m0, c[0]);
        let (hi1, lo1) = V::mulhilo(m1, c[2]);
        let (k0, k1) = (V::splat(key[0]), V::splat(key[1]));
        c = [V::xor3(hi1, c[1], k0), lo1, V::xor3(hi0, c[3], k1), lo0];
    }
    c
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;
    use std::arch::x86_64::*;

    impl Lanes for __m512i {
        #[inline(always)]
        unsafe fn splat(x: u32) -> Self {
            _mm512_set1_epi32(x as i32)
        }

        #[inline(always)]
        unsafe fn xor3(a: Self, b: Self, c: Self) -> Self {
            // 0x96: the exclusive or of the three operands.
            _mm512_ternarylogic_epi32::<0x96>(a, b, c)
        }

        #[inline(always)]
        unsafe fn mulhilo(m: Self, c: Self) -> (Self, Self) {
            let even = _mm512_mul_epu32(c, m);
            let odd = _mm512_mul_epu32(_mm512_srli_epi64::<32>(c), m);
            // Lane 2j: the even product's low word; lane 2j + 1: the odd product's low word
            // (moved up), and the other way round for the high words.
            let lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64::<32>(odd));
            let hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64::<32>(even), odd);
            (hi, lo)
        }

        #[inline(always)]
        unsafe fn unpack32(a: Self, b: Self) -> (Self, Self) {
            (_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b))
        }

        #[inline(always)]
        unsafe fn unpack64(a: Self, b: Self) -> (Self, Self) {
            (_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b))
        }
    }

    /// The masks of the 64 elements of counter blocks `block .. block + 16` into `out`.
    ///
    /// # Safety
    /// The CPU must have AVX-512F; `out` holds 64 elements.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn sixteen_blocks(draw: Draw, block: u64, out: &mut [i32]) {
        assert!(out.len() >= 64);
        let lo = block as u32;
        let c0 = _mm512_add_epi32(
            _mm512_set1_epi32(lo as i32),
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        );
        // A lane whose low word wrapped past 2^32 carries into the high word.
        let wrapped = _mm512_cmplt_epu32_mask(c0, _mm512_set1_epi32(lo as i32));
        let hi = _mm512_set1_epi32((block >> 32) as u32 as i32);
        let c1 = _mm512_mask_add_epi32(hi, wrapped, hi, _mm512_set1_epi32(1));
        let (s, t) = (__m512i::splat(draw.stream), __m512i::splat(draw.step));
        let c = philox_rounds([c0, c1, s, t], draw.seed);
        // A 4 × 16 transpose: within the 128-bit lanes, then of the lanes.
        let u = transpose_within_lanes(c);
        let v0 = _mm512_shuffle_i32x4::<0b0100_0100>(u[0], u[1]);
        let v1 = _mm512_shuffle_i32x4::<0b0100_0100>(u[2], u[3]);
        let v2 = _mm512_shuffle_i32x4::<0b1110_1110>(u[0], u[1]);
        let v3 = _mm512_shuffle_i32x4::<0b1110_1110>(u[2], u[3]);
        let words = [
            _mm512_shuffle_i32x4::<0b1000_1000>(v0, v1),
            _mm512_shuffle_i32x4::<0b1101_1101>(v0, v1),
            _mm512_shuffle_i32x4::<0b1000_1000>(v2, v3),
            _mm512_shuffle_i32x4::<0b1101_1101>(v2, v3),
        ];
        let t = _mm512_set1_epi32(draw.threshold as i32);
        for (g, w) in words.into_iter().enumerate() {
            let keep = _mm512_cmpge_epu32_mask(_mm512_srli_epi32::<8>(w), t);
            let m = _mm512_maskz_mov_epi32(keep, _mm512_set1_epi32(-1));
            // SAFETY: `out` holds 64 elements; 16 at `16g`.
            unsafe { _mm512_storeu_si512(out.as_mut_ptr().add(16 * g) as *mut _, m) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    impl Lanes for __m256i {
        #[inline(always)]
        unsafe fn splat(x: u32) -> Self {
            _mm256_set1_epi32(x as i32)
        }

        #[inline(always)]
        unsafe fn xor3(a: Self, b: Self, c: Self) -> Self {
            _mm256_xor_si256(_mm256_xor_si256(a, b), c)
        }

        #[inline(always)]
        unsafe fn mulhilo(m: Self, c: Self) -> (Self, Self) {
            let even = _mm256_mul_epu32(c, m);
            let odd = _mm256_mul_epu32(_mm256_srli_epi64::<32>(c), m);
            // Lane 2j: the even product's low word; lane 2j + 1: the odd product's low word
            // (moved up), and the other way round for the high words.
            let lo = _mm256_blend_epi32::<0xAA>(even, _mm256_slli_epi64::<32>(odd));
            let hi = _mm256_blend_epi32::<0xAA>(_mm256_srli_epi64::<32>(even), odd);
            (hi, lo)
        }

        #[inline(always)]
        unsafe fn unpack32(a: Self, b: Self) -> (Self, Self) {
            (_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b))
        }

        #[inline(always)]
        unsafe fn unpack64(a: Self, b: Self) -> (Self, Self) {
            (_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b))
        }
    }

    /// The masks of the 32 elements of counter blocks `block .. block + 8` into `out`.
    ///
    /// # Safety
    /// The CPU must have AVX2; `out` holds 32 elements.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn eight_blocks(draw: Draw, block: u64, out: &mut [i32]) {
        assert!(out.len() >= 32);
        // The counters' low and high words, lane j for block `block + j` (a low word that
        // wraps past 2^32 carries into the high one).
        let counter = |j: u64| block.wrapping_add(j);
        let word = |j: u64, shift: u32| (counter(j) >> shift) as u32 as i32;
        let c0 = _mm256_setr_epi32(
            word(0, 0),
            word(1, 0),
            word(2, 0),
            word(3, 0),
            word(4, 0),
            word(5, 0),
            word(6, 0),
            word(7, 0),
        );
        let c1 = _mm256_setr_epi32(
            word(0, 32),
            word(1, 32),
            word(2, 32),
            word(3, 32),
            word(4, 32),
            word(5, 32),
            word(6, 32),
            word(7, 32),
        );
        let (s, t) = (__m256i::splat(draw.stream), __m256i::splat(draw.step));
        let c = philox_rounds([c0, c1, s, t], draw.seed);
        // A 4 × 8 transpose: within the 128-bit lanes, then of the lanes.
        let u = transpose_within_lanes(c);
        let words = [
            _mm256_permute2x128_si256::<0x20>(u[0], u[1]),
            _mm256_permute2x128_si256::<0x20>(u[2], u[3]),
            _mm256_permute2x128_si256::<0x31>(u[0], u[1]),
            _mm256_permute2x128_si256::<0x31>(u[2], u[3]),
        ];
        // Kept where `w >> 8 >= threshold`, as a signed comparison: both sides are below
        // 2^31 once a threshold above 2^24 (which drops every element) is taken as 2^24.
        let t = _mm256_set1_epi32(draw.threshold.min(1 << 24) as i32);
        let ones = _mm256_set1_epi32(-1);
        for (g, w) in words.into_iter().enumerate() {
            let dropped = _mm256_cmpgt_epi32(t, _mm256_srli_epi32::<8>(w));
            let m = _mm256_xor_si256(dropped, ones);
            // SAFETY: `out` holds 32 elements; 8 at `8g`.
            unsafe { _mm256_storeu_si256(out.as_mut_ptr().add(8 * g) as *mut _, m) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::{dropout_keep, dropout_threshold};

    fn want(seed: u64, step: u32, stream: u32, t: u32, index: u64, n: usize) -> Vec<i32> {
        (0..n as u64)
            .map(|j| -i32::from(dropout_keep(seed, step, stream, index + j, t)))
            .collect()
    }

    /// Every path this CPU can run.
    fn paths() -> Vec<Path> {
        let mut v = vec![Path::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                v.push(Path::Avx2);
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                v.push(Path::Avx512);
            }
        }
        v
    }

    #[test]
    fn masks_are_the_dropout_keep_decisions() {
        let paths = paths();
        println!("paths: {paths:?}");
        for path in paths {
            masks_of_path_are_the_dropout_keep_decisions(path);
        }
    }

    fn masks_of_path_are_the_dropout_keep_decisions(path: Path) {
        let masks = |seed, step, stream, t, index, out: &mut [i32]| {
            let draw = Draw {
                seed,
                step,
                stream,
                threshold: t,
            };
            masks_with(path, draw, index, out)
        };
        let t = dropout_threshold(0.1);
        // Aligned and unaligned starts, runs shorter and longer than a group (64 or 32),
        // and groups whose blocks carry from the low counter word into the high one.
        for &(seed, step, stream, index, n) in &[
            (1u64, 0u32, 0u32, 0u64, 64usize),
            (0x0123_4567_89ab_cdef, 7, 5, 0, 1000),
            (42, 3, 9, 1, 300),
            (42, 3, 9, 6, 131),
            (42, 3, 9, 800 * 512, 512),
            (9, 1, 2, (1u64 << 34) - 40, 200),
            (u64::MAX, u32::MAX, u32::MAX, 13, 77),
            (5, 6, 7, 0, 48),
            (5, 6, 7, 5, 3),
            (5, 6, 7, 2, 10),
            (5, 6, 7, 61, 70),
            (5, 6, 7, 0, 32),
            (5, 6, 7, 3, 33),
            (9, 1, 2, (1u64 << 34) - 12, 40),
        ] {
            let mut got = vec![7i32; n];
            masks(seed, step, stream, t, index, &mut got);
            assert_eq!(
                got,
                want(seed, step, stream, t, index, n),
                "{path:?}: seed {seed} step {step} stream {stream} from {index}"
            );
        }
        // A threshold equal to an element's top 24 bits keeps it (`>=`), inside a group.
        let w = dropout_words(11, 2, 3, 21)[1] >> 8;
        let mut got = vec![0i32; 128];
        masks(11, 2, 3, w, 0, &mut got);
        assert_eq!(
            got[4 * 21 + 1],
            -1,
            "{path:?}: the element at the threshold is kept"
        );
        assert_eq!(got, want(11, 2, 3, w, 0, 128));
        // A dropout probability of zero keeps all; of 0.5 drops about half.
        let mut got = vec![0i32; 4096];
        masks(3, 1, 2, 0, 0, &mut got);
        assert!(got.iter().all(|&m| m == -1));
        masks(3, 1, 2, dropout_threshold(0.5), 0, &mut got);
        let kept = got.iter().filter(|&&m| m == -1).count();
        assert!(
            (1900..2200).contains(&kept),
            "{path:?}: {kept} of 4096 kept at p = 0.5"
        );
        assert_eq!(got, want(3, 1, 2, dropout_threshold(0.5), 0, 4096));
        // Thresholds above every element's 24 bits drop all, whatever their top bit.
        for t in [1 << 24, (1 << 31) + 5, u32::MAX] {
            masks(3, 1, 2, t, 1, &mut got);
            assert!(got.iter().all(|&m| m == 0), "{path:?}: threshold {t}");
        }
    }
}
