//! Transposed copies in 64 × 64 tiles: 8 × 8 AVX blocks where the CPU has AVX2.

use gemm::Parallelism;
use rayon::prelude::*;

/// `dst[p·n + j] = src[p + j·cs]` for `p < k`, `j < n`: a transposed copy in 64×64 tiles
/// (8×8 AVX blocks where the CPU has AVX2), row blocks in parallel when `par` is.
///
/// # Safety
/// `src` must address every `p + j·cs` (`cs ≥ 0`); `dst` must hold `k·n` floats and not
/// overlap it.
pub(crate) unsafe fn transpose_into(
    src: *const f32,
    cs: isize,
    k: usize,
    n: usize,
    dst: *mut f32,
    par: &Parallelism,
) {
    let copy = Transposed {
        src,
        cs: cs as usize,
        dst,
        n,
    };
    #[cfg(target_arch = "x86_64")]
    let avx2 = std::arch::is_x86_feature_detected!("avx2");
    let block = |pb: usize| {
        let copy = &copy;
        let (p0, p1) = (pb * TILE, (pb * TILE + TILE).min(k));
        for j0 in (0..n).step_by(TILE) {
            let j1 = (j0 + TILE).min(n);
            // SAFETY: in bounds by the caller's contract; row block `pb` writes only its
            // own rows of `dst`.
            unsafe {
                #[cfg(target_arch = "x86_64")]
                if avx2 {
                    x86::tile(copy, (p0, p1), (j0, j1));
                    continue;
                }
                tile_scalar(copy, (p0, p1), (j0, j1));
            }
        }
    };
    let blocks = k.div_ceil(TILE);
    if matches!(par, Parallelism::Rayon(_)) {
        (0..blocks).into_par_iter().for_each(block);
    } else {
        (0..blocks).for_each(block);
    }
}

/// Rows and columns of `transpose_into`'s tiles.
const TILE: usize = 64;

/// `transpose_into`'s operands: `dst[p·n + j] = src[p + j·cs]`.
#[derive(Clone, Copy)]
struct Transposed {
    src: *const f32,
    cs: usize,
    dst: *mut f32,
    n: usize,
}

unsafe impl Send for Transposed {}
unsafe impl Sync for Transposed {}

/// One tile of `transpose_into`, element by element.
///
/// # Safety
/// As `transpose_into`, for rows `p0..p1` and columns `j0..j1` of `dst`.
unsafe fn tile_scalar(c: &Transposed, (p0, p1): (usize, usize), (j0, j1): (usize, usize)) {
    let Transposed { src, cs, dst, n } = *c;
    for p in p0..p1 {
        for j in j0..j1 {
            unsafe { *dst.add(p * n + j) = *src.add(p + j * cs) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    /// One tile of `transpose_into` in 8×8 blocks, the edges element by element.
    ///
    /// # Safety
    /// As `super::tile_scalar`, on a CPU with AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn tile(
        c: &super::Transposed,
        (p0, p1): (usize, usize),
        (j0, j1): (usize, usize),
    ) {
        let super::Transposed { src, cs, dst, n } = *c;
        let mut p = p0;
        while p + 8 <= p1 {
            let mut j = j0;
            while j + 8 <= j1 {
                unsafe { block8(src.add(p + j * cs), cs, dst.add(p * n + j), n) };
                j += 8;
            }
            unsafe { super::tile_scalar(c, (p, p + 8), (j, j1)) };
            p += 8;
        }
        unsafe { super::tile_scalar(c, (p, p1), (j0, j1)) };
    }

    /// `dst[r·n + c] = src[r + c·cs]` for `r, c < 8`.
    #[target_feature(enable = "avx2")]
    unsafe fn block8(src: *const f32, cs: usize, dst: *mut f32, n: usize) {
        unsafe {
            let rows = std::array::from_fn(|i| _mm256_loadu_ps(src.add(i * cs)));
            for (i, v) in transpose8(rows).into_iter().enumerate() {
                _mm256_storeu_ps(dst.add(i * n), v);
            }
        }
    }

    /// The 8 × 8 transpose of `r`: lane `c` of result `i` is lane `i` of `r[c]`.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(crate) fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
        // Rows 2i and 2i + 1 interleaved: their low and their high pairs of each half.
        let [(t0, t1), (t2, t3), (t4, t5), (t6, t7)]: [(__m256, __m256); 4] =
            std::array::from_fn(|i| {
                let (a, b) = (r[2 * i], r[2 * i + 1]);
                (_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b))
            });
        let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        [
            _mm256_permute2f128_ps::<0x20>(u0, u4),
            _mm256_permute2f128_ps::<0x20>(u1, u5),
            _mm256_permute2f128_ps::<0x20>(u2, u6),
            _mm256_permute2f128_ps::<0x20>(u3, u7),
            _mm256_permute2f128_ps::<0x31>(u0, u4),
            _mm256_permute2f128_ps::<0x31>(u1, u5),
            _mm256_permute2f128_ps::<0x31>(u2, u6),
            _mm256_permute2f128_ps::<0x31>(u3, u7),
        ]
    }
}
