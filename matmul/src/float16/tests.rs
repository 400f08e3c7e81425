use super::*;
use crate::testing::on_threads;
use crate::Dst;

/// A `rows × cols` matrix in `v`: row-major, or stored transposed (column-major).
pub(super) fn stored(v: &[f32], rows: usize, cols: usize, transposed: bool) -> Mat {
    let (rs, cs) = if transposed { (1, rows) } else { (cols, 1) };
    Mat {
        ptr: v.as_ptr(),
        rs: rs as isize,
        cs: cs as isize,
    }
}

/// Element `(i, j)` of a matrix of the tests.
pub(super) fn elem(m: Mat, i: usize, j: usize) -> f32 {
    // SAFETY: the tests' matrices address every element they index.
    unsafe { *m.ptr.offset(i as isize * m.rs + j as isize * m.cs) }
}

/// `kernel`'s product `a·b` (`m × k · k × n`) on `threads` threads, into a copy of
/// `c0` (added to it where `read`).
pub(super) fn product(
    kernel: Kernel16,
    (m, k, n): (usize, usize, usize),
    (a, b): (Mat, Mat),
    (c0, read): (&[f32], bool),
    threads: usize,
) -> Vec<f32> {
    let e = Epilogue::default();
    on_threads(threads, || {
        product_here(kernel, (m, k, n), (a, b), (c0, read), e)
    })
}

/// [`product`] on the current threads (the caller's pool), with `epilogue` (whose
/// bias holds `n` values).
pub(super) fn product_here(
    kernel: Kernel16,
    (m, k, n): (usize, usize, usize),
    (a, b): (Mat, Mat),
    (c0, read): (&[f32], bool),
    epilogue: Epilogue,
) -> Vec<f32> {
    let mut c = c0.to_vec();
    // SAFETY: the kernel runs here (the tests ask first); `c` holds `m × n`.
    unsafe {
        let dst = Dst::new(c.as_mut_ptr(), n as isize, read);
        let member = Member {
            epilogue,
            ..Member::plain(n, Rhs::Mat(b), dst)
        };
        gemm(kernel, (m, k), a, member)
    };
    c
}

/// `kernel`'s product of a 32 × 64 matrix of `a`s and a 64 × 32 matrix of `b`s.
pub(super) fn constant_product(kernel: Kernel16, a: f32, b: f32) -> Vec<f32> {
    let (av, bv) = (vec![a; 32 * 64], vec![b; 64 * 32]);
    let (am, bm) = (stored(&av, 32, 64, false), stored(&bv, 64, 32, false));
    product(kernel, (32, 64, 32), (am, bm), (&[0.0; 32 * 32], false), 1)
}

/// Asserts that `got` and `want` hold the same bits, naming the first element that
/// differs.
pub(super) fn assert_same_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    if let Some((q, (x, y))) = got
        .iter()
        .zip(want)
        .enumerate()
        .find(|(_, (x, y))| x.to_bits() != y.to_bits())
    {
        panic!("{what}: element {q} is {x:e}, not {y:e}");
    }
}

pub(super) fn rng(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// `dy`'s column sums by the generated `sum_rows` kernel (`dy` of shape `[lead…, n]`).
pub(super) fn sum_rows_kernel(dy: &[f32], lead: &[usize], n: usize) -> Vec<f32> {
    use kiln_compiler::codegen::{clif, jit, misc};
    let name = "sum_rows_test";
    let m = jit::compile(&clif::text(&misc::sum_rows(name, lead.len()))).unwrap();
    let shape: Vec<usize> = lead.iter().copied().chain([n]).collect();
    let (dims, items) = misc::sum_rows_dims(&shape);
    let mut y = vec![f32::NAN; n];
    let ptrs = [dy.as_ptr() as *mut u8, y.as_mut_ptr() as *mut u8];
    // SAFETY: the kernel reads `dy` (`shape`) and writes `y` (`n`), as its dims say.
    unsafe { jit::launch(m.get(name).unwrap(), &ptrs, &dims, items, 1) };
    y
}

/// A product asked for its right operand's column sums ([`ColumnSums`], a bias
/// gradient's) writes them with the bits of the `sum_rows` kernel on `dy` of shape
/// `[lead…, n]`, on every path that packs `b` — each thread packing all of it
/// (`local`), one packing shared by the tasks, each task packing its column group —
/// and with no rows of `a`; the product is the one without sums. Values of
/// magnitudes 2⁻²⁰ to 2²⁰ and both signs make the order of the sums show.
#[test]
fn products_write_their_right_operands_column_sums_as_sum_rows_does() {
    let kernels: Vec<Kernel16> = kernels().into_iter().chain(half_kernel()).collect();
    if kernels.is_empty() {
        println!("skipped: this CPU runs none of the 16-bit kernels");
        return;
    }
    let mut seed = 7u64;
    // (rows of `a`, `dy`'s leading axes, columns, threads): the path each takes.
    let cases: [(usize, &[usize], usize, usize); 7] = [
        (512, &[32, 25], 512, 2),   // local: both tasks pack `b`, each sums half
        (530, &[70, 30], 520, 2),   // stream: each task sums its third of the vectors
        (530, &[4, 5, 6], 530, 2),  // local, a column tail of 2
        (96, &[32, 25], 530, 2),    // shared packing (one task of rows)
        (96, &[800], 1100, 2),      // each task packs its column group
        (96, &[3, 2, 2, 5], 70, 3), // shared, four leading axes, three threads
        (0, &[9, 7], 33, 2),        // no rows of `a`
    ];
    for kernel in kernels {
        for &(m, lead, n, threads) in &cases {
            let k: usize = lead.iter().product();
            let a: Vec<f32> = (0..m * k).map(|_| rng(&mut seed)).collect();
            let dy: Vec<f32> = (0..k * n)
                .map(|_| rng(&mut seed) * 2f32.powi((rng(&mut seed) * 20.0) as i32))
                .collect();
            let (am, bm) = (stored(&a, m, k, true), stored(&dy, k, n, false));
            let plain = product(kernel, (m, k, n), (am, bm), (&vec![0.0; m * n], false), 1);
            let mut sums = vec![f32::NAN; n];
            let mut spec = ColumnSums {
                dst: sums.as_mut_ptr(),
                lead: [1; SUM_AXES],
                axes: lead.len(),
            };
            spec.lead[..lead.len()].copy_from_slice(lead);
            let mut c = vec![0f32; m * n];
            on_threads(threads, || unsafe {
                // SAFETY: the kernel runs here; `c` holds `m × n`, `sums` `n`.
                let dst = Dst::new(c.as_mut_ptr(), n as isize, false);
                let member = Member {
                    sums: Some(spec),
                    ..Member::plain(n, Rhs::Mat(bm), dst)
                };
                gemm(kernel, (m, k), am, member)
            });
            let what = format!("{kernel:?}, {m} rows, dy {lead:?} × {n}, {threads} threads");
            assert_same_bits(&sums, &sum_rows_kernel(&dy, lead, n), &what);
            assert_same_bits(&c, &plain, &what);
        }
    }
}

/// The packing's vector conversions (`VCVTNEPS2BF16`, `VCVTNE2PS2BF16`; `VCVTPS2PH`
/// after the scaling for fp16) give the bits of the scalar [`to16`] that packs the
/// operands' edges, on ties, the carry from the largest subnormal, subnormals of both
/// signs, NaNs with payloads, infinities and random bits, and pair them in order.
#[test]
fn vector_conversions_give_the_scalar_bits() {
    if let Err(why) = dot_available() {
        println!("skipped: {why}");
        return;
    }
    let mut seed = 7u64;
    let mut bits: Vec<u32> = vec![
        0x3f80_8000,
        0x3f81_8000,
        0x3f80_7fff,
        0x3f80_8001,
        0x007f_ffff,
        0x007f_8000,
        0x0000_0001,
        0x8040_0000,
        0x807f_ffff,
        0x0080_0000,
        0x7f7f_ffff,
        0xff7f_8000,
        0x7f80_0000,
        0xff80_0000,
        0x7f80_0001,
        0xffc0_1234,
        0x7fbf_ffff,
        0x0000_0000,
        0x8000_0000,
    ];
    while !bits.len().is_multiple_of(32) || bits.len() < 4096 {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        bits.push((seed >> 32) as u32);
    }
    let x: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
    for half in [false, true] {
        let s = 0.25f32;
        let one = |v: f32| {
            if half {
                to16::<true>(v, s)
            } else {
                to16::<false>(v, 1.0)
            }
        };
        for (c, chunk) in x.chunks(32).enumerate() {
            // SAFETY: AVX-512F, BW and BF16 are there (checked); 32 elements each.
            let (lo, hi, pairs) = unsafe {
                let sv = _mm512_set1_ps(s);
                let (a, b) = (
                    _mm512_loadu_ps(chunk.as_ptr()),
                    _mm512_loadu_ps(chunk.as_ptr().add(16)),
                );
                let (lo, hi, pairs) = if half {
                    (
                        to16x16::<true>(a, sv),
                        to16x16::<true>(b, sv),
                        pairs16x16::<true>(a, b, sv),
                    )
                } else {
                    (
                        to16x16::<false>(a, sv),
                        to16x16::<false>(b, sv),
                        pairs16x16::<false>(a, b, sv),
                    )
                };
                let mut out = ([0u16; 16], [0u16; 16], [0u16; 32]);
                _mm256_storeu_si256(out.0.as_mut_ptr() as *mut __m256i, lo);
                _mm256_storeu_si256(out.1.as_mut_ptr() as *mut __m256i, hi);
                _mm512_storeu_si512(out.2.as_mut_ptr() as *mut _, pairs);
                out
            };
            for i in 0..16 {
                let (a, b) = (chunk[i], chunk[16 + i]);
                let what = |v: f32| format!("fp16 {half}, chunk {c}: {:#010x}", v.to_bits());
                assert_eq!(lo[i], one(a), "{}", what(a));
                assert_eq!(hi[i], one(b), "{}", what(b));
                assert_eq!(
                    (pairs[2 * i], pairs[2 * i + 1]),
                    (one(a), one(b)),
                    "pair {i}"
                );
            }
        }
    }
    assert_eq!(bf16_bits(f32::from_bits(0x807f_ffff)), 0x8000);
    assert_eq!(bf16_bits(f32::from_bits(0x007f_ffff)), 0x0000);
    assert_eq!(bf16_bits(f32::from_bits(0xffc0_1234)), 0xffc0);
    assert_eq!(bf16_bits(f32::from_bits(0x7f80_0001)), 0x7fc0);
}

#[test]
fn rounding_to_bf16_is_to_nearest_even() {
    assert_eq!(bf16_bits(1.0), 0x3f80);
    // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to the even 1.
    assert_eq!(bf16_bits(1.0 + 1.0 / 256.0), 0x3f80);
    // 1 + 3·2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to the even upper one.
    assert_eq!(bf16_bits(1.0 + 3.0 / 256.0), 0x3f82);
    assert_eq!(bf16_bits(1.0 + 1.5 / 256.0), 0x3f81);
    assert_eq!(bf16_bits(-2.0), 0xc000);
    assert!(f32::from_bits((bf16_bits(f32::NAN) as u32) << 16).is_nan());
    assert_eq!(bf16_bits(f32::INFINITY), 0x7f80);
    assert_eq!(round_bf16(3.0e38), f32::from_bits(0x7f62 << 16));
}

/// The runs of a thread's share of blocks: the 25 × 16 blocks of an 800 × 512 result
/// halved as 12½ row blocks each; and for shares of several grids, every block once,
/// in order, each run within one row block or whole row blocks.
#[test]
fn block_runs_cover_a_share_in_order() {
    assert_eq!(
        block_runs((0, 200), 16),
        vec![(0..12, 0..16), (12..13, 0..8)]
    );
    assert_eq!(
        block_runs((200, 400), 16),
        vec![(12..13, 8..16), (13..25, 0..16)]
    );
    assert_eq!(block_runs((3, 5), 16), vec![(0..1, 3..5)]);
    assert_eq!(block_runs((5, 5), 16), vec![]);
    for (total, width, parts) in [(34, 2, 2), (170, 10, 2), (400, 16, 3), (7, 1, 4), (9, 4, 5)] {
        let mut seen = Vec::new();
        for task in 0..parts {
            let share = (task * total / parts, (task + 1) * total / parts);
            for (rows, cols) in block_runs(share, width) {
                assert!(rows.len() == 1 || cols == (0..width), "{rows:?} × {cols:?}");
                assert!(!cols.is_empty() && cols.end <= width);
                for r in rows {
                    seen.extend(cols.clone().map(|c| r * width + c));
                }
            }
        }
        assert_eq!(
            seen,
            (0..total).collect::<Vec<_>>(),
            "{total} blocks, {width} wide"
        );
    }
}

/// The kernels this CPU can run, each with its name; a line for each it cannot.
pub(super) fn kernels() -> Vec<Kernel16> {
    let mut v = Vec::new();
    match tiles_available() {
        Ok(()) => v.push(Kernel16::Tiles),
        Err(why) => println!("AMX tiles skipped: {why}"),
    }
    match dot_available() {
        Ok(()) => v.push(Kernel16::Dot),
        Err(why) => println!("VDPBF16PS skipped: {why}"),
    }
    v
}

/// The tiles' product against f64 sums of the bf16-rounded operands: only the f32
/// accumulation differs, so the results agree to a few f32 ulps of the sums'
/// magnitudes, at sizes that are and are not whole tiles, transposed operands and a
/// destination read first.
#[test]
fn bf16_products_equal_the_sums_of_the_rounded_operands() {
    for kernel in kernels() {
        products_equal_the_sums_of_the_rounded_operands(kernel);
    }
}

fn products_equal_the_sums_of_the_rounded_operands(kernel: Kernel16) {
    let mut seed = 7u64;
    for &(m, k, n, ta, tb, read) in &[
        (32, 32, 32, false, false, false),
        (1, 1, 1, false, false, false),
        (45, 70, 33, false, false, true),
        (300, 512, 270, false, true, false),
        (64, 800, 96, true, false, true),
        (300, 70, 40, true, false, false),
        (40, 100, 300, false, false, true),
        (70, 64, 700, false, true, false),
        (17, 2049, 5, true, true, false),
        (530, 70, 45, true, false, true),
        (520, 64, 300, false, true, false),
        // An odd `k`: the last pair row of a row-major `b` half zero.
        (45, 71, 40, false, false, true),
        (530, 33, 45, false, false, false),
    ] {
        let a: Vec<f32> = (0..m * k).map(|_| rng(&mut seed)).collect();
        let b: Vec<f32> = (0..k * n).map(|_| rng(&mut seed)).collect();
        let c0: Vec<f32> = (0..m * n).map(|_| rng(&mut seed)).collect();
        let (am, bm) = (stored(&a, m, k, ta), stored(&b, k, n, tb));
        let (at, bt) = (|i, p| elem(am, i, p), |p, j| elem(bm, p, j));
        // On one thread, a `b` of two column blocks or more is packed by each task; on
        // four, it is packed beforehand and shared: both must give the same bits.
        let run = |threads| product(kernel, (m, k, n), (am, bm), (&c0, read), threads);
        let c = run(1);
        let what = format!("{kernel:?}: {m}×{k}·{k}×{n} (ta {ta}, tb {tb}, read {read})");
        assert_same_bits(&c, &run(4), &format!("{what}: one thread and four"));
        // On two, 256 rows or more a thread: each packs its rows and all of `b`.
        assert_same_bits(&c, &run(2), &format!("{what}: one thread and two"));
        // Against f64 sums of the rounded operands (`worst`) and of the operands as
        // they are (`off`): the first differ only by the f32 accumulation; the second
        // by the operands' rounding, about 2^-9 relative per term, so they must be
        // clearly apart (the operands really are rounded).
        let (mut worst, mut off) = (0f64, 0f64);
        for i in 0..m {
            for j in 0..n {
                let init = if read { c0[i * n + j] as f64 } else { 0.0 };
                let (mut s, mut x, mut mag) = (init, init, 0f64);
                for p in 0..k {
                    let t = round_bf16(at(i, p)) as f64 * round_bf16(bt(p, j)) as f64;
                    s += t;
                    x += at(i, p) as f64 * bt(p, j) as f64;
                    mag += t.abs();
                }
                let got = c[i * n + j] as f64;
                worst = worst.max((got - s).abs() / (mag + init.abs()));
                off = off.max((got - x).abs() / (mag + init.abs()));
            }
        }
        assert!(
            worst < 1e-6,
            "{what}: {worst:e} from the rounded operands' sums"
        );
        if m * n * k > 1 {
            assert!(off > 1e-4, "{what}: only {off:e} from the exact sums");
        }
    }
}

/// Subnormal bf16 operands count as zero (both instructions compute as if DAZ were
/// set, whatever MXCSR says), while the least normal operands multiply as they are
/// and a NaN operand gives a NaN.
#[test]
fn bf16_products_flush_subnormals_and_keep_nans() {
    let tiny = f32::from_bits(0x0040_0000); // 2^-127: subnormal, exact in bf16
    let least = f32::MIN_POSITIVE; // 2^-126: normal
    for kernel in kernels() {
        let run = |a, b| constant_product(kernel, a, b);
        assert!(
            run(tiny, 1.0).iter().all(|&x| x == 0.0),
            "{kernel:?}: a subnormal operand"
        );
        // 2^-126 · 2 summed 64 times: 2^-119, exact.
        assert!(
            run(least, 2.0).iter().all(|&x| x == least * 128.0),
            "{kernel:?}: the least normal operand"
        );
        assert!(
            run(f32::NAN, 1.0).iter().all(|x| x.is_nan()),
            "{kernel:?}: a NaN"
        );
    }
}

/// The fp16 kernel where this CPU has it; else a line saying why not.
pub(super) fn half_kernel() -> Option<Kernel16> {
    half_available()
        .map_err(|why| println!("VFMADD231PH skipped: {why}"))
        .ok()
        .map(|()| Kernel16::Half)
}

/// The packing buffers a thread keeps between products hold what an earlier, larger
/// product left there: a small product after a large one of NaNs (every packed
/// panel, the padding included, full of them) gives the bits it gives on fresh
/// threads, for every kernel, with the operands in each layout.
#[test]
fn products_ignore_what_an_earlier_product_left_in_the_buffers() {
    let all: Vec<Kernel16> = kernels().into_iter().chain(half_kernel()).collect();
    for kernel in all {
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let (m, k, n) = (45, 37, 51);
            let mut seed = 11u64;
            let a: Vec<f32> = (0..m * k).map(|_| rng(&mut seed)).collect();
            let b: Vec<f32> = (0..k * n).map(|_| rng(&mut seed)).collect();
            let ops = (stored(&a, m, k, ta), stored(&b, k, n, tb));
            let small =
                |threads| product(kernel, (m, k, n), ops, (&[0.0; 45 * 51], false), threads);
            let (bm, bk, bn) = (300, 1100, 700);
            let (na, nb) = (vec![f32::NAN; bm * bk], vec![f32::NAN; bk * bn]);
            for threads in [1, 2] {
                let fresh = small(threads);
                // Both products on the same threads, one after the other.
                let after = on_threads(threads, || {
                    let big = product_here(
                        kernel,
                        (bm, bk, bn),
                        (stored(&na, bm, bk, ta), stored(&nb, bk, bn, tb)),
                        (&vec![0.0; bm * bn], false),
                        Epilogue::default(),
                    );
                    assert!(big.iter().all(|x| x.is_nan()));
                    let e = Epilogue::default();
                    product_here(kernel, (m, k, n), ops, (&[0.0; 45 * 51], false), e)
                });
                assert!(fresh.iter().all(|x| x.is_finite()));
                assert_same_bits(&after, &fresh, &format!("{kernel:?} {ta} {tb} {threads}"));
            }
        }
    }
}

/// A product with an [`Epilogue`] gives the bits of the product without one, its
/// bias then added and its ReLU applied element by element: on every kernel, at sizes
/// with partial blocks and with `k` in three parts (2100), on 1 and 3 threads, with a
/// row of NaNs (kept by the ReLU).
#[test]
fn products_add_the_bias_and_apply_the_relu_as_a_pass_after_them_would() {
    let all: Vec<Kernel16> = kernels().into_iter().chain(half_kernel()).collect();
    for kernel in all {
        for (m, k, n) in [
            (45, 37, 51),
            (64, 2100, 70),
            (530, 40, 70),
            (530, 2100, 520),
        ] {
            let mut seed = 5u64;
            let mut a: Vec<f32> = (0..m * k).map(|_| rng(&mut seed)).collect();
            a[3 * k] = f32::NAN;
            let b: Vec<f32> = (0..k * n).map(|_| rng(&mut seed)).collect();
            let bias: Vec<f32> = (0..n).map(|_| rng(&mut seed) * 4.0).collect();
            let ops = (stored(&a, m, k, false), stored(&b, k, n, false));
            let zero = vec![0.0; m * n];
            for relu in [false, true] {
                for threads in [1, 2, 3] {
                    let plain = product(kernel, (m, k, n), ops, (&zero, false), threads);
                    let want: Vec<f32> = plain
                        .iter()
                        .enumerate()
                        .map(|(q, &x)| {
                            let v = x + bias[q % n];
                            if relu && !(v > 0.0 || v.is_nan()) {
                                0.0
                            } else {
                                v
                            }
                        })
                        .collect();
                    let e = Epilogue {
                        bias: Some(bias.as_ptr()),
                        relu,
                    };
                    let got = on_threads(threads, || {
                        product_here(kernel, (m, k, n), ops, (&zero, false), e)
                    });
                    assert!(got[3 * n..4 * n].iter().all(|x| x.is_nan()));
                    let what = format!("{kernel:?} {m}×{k}·{k}×{n} relu {relu}");
                    assert_same_bits(&got, &want, &what);
                }
            }
        }
    }
}

/// A group of products of one left operand ([`gemm_group`]) gives each member the
/// bits of its own [`gemm`]: results with their own row strides, a bias and ReLU, a
/// result added to, column sums, a right operand stored transposed and one packed
/// beforehand; with `a` row-major and transposed, a long `k` (parts of `K_TILES`
/// tiles), few rows, and groups too narrow for their tasks to pack their own columns
/// (then each member's `b` is packed once and shared).
#[test]
fn grouped_products_give_each_member_the_bits_of_its_own_product() {
    let all: Vec<Kernel16> = kernels().into_iter().chain(half_kernel()).collect();
    for kernel in all {
        for ((m, k), widths) in [
            ((800, 512), &[512, 300, 512][..]),
            ((97, 2100), &[70, 33, 40][..]),
            ((530, 40), &[256, 17, 600][..]),
        ] {
            let mut seed = 17u64;
            for a_transposed in [false, true] {
                let av: Vec<f32> = (0..m * k).map(|_| rng(&mut seed)).collect();
                let a = stored(&av, m, k, a_transposed);
                // Member `q`: `b` transposed for 1, packed beforehand for 2 (else
                // row-major); bias and ReLU for 0, bias for 2; `c` added to for 1;
                // column sums for 0.
                let bs: Vec<Vec<f32>> = widths
                    .iter()
                    .map(|&n| (0..k * n).map(|_| rng(&mut seed) * 8.0).collect())
                    .collect();
                let bm: Vec<Mat> = bs
                    .iter()
                    .zip(widths)
                    .enumerate()
                    .map(|(q, (b, &n))| stored(b, k, n, q == 1))
                    .collect();
                // SAFETY: the kernel runs here; `bm[2]` addresses `k × n`.
                let packed = unsafe { PackedRhs::new(kernel, (k, widths[2]), bm[2]) };
                let biases: Vec<Vec<f32>> = widths
                    .iter()
                    .map(|&n| (0..n).map(|_| rng(&mut seed)).collect())
                    .collect();
                let c0: Vec<Vec<f32>> = widths
                    .iter()
                    .map(|&n| (0..m * (n + 3)).map(|_| rng(&mut seed)).collect())
                    .collect();
                let lead = {
                    let mut l = [1; SUM_AXES];
                    l[0] = k;
                    l
                };
                for threads in [1, 2, 3] {
                    let mut got = c0.clone();
                    let mut want = c0.clone();
                    let mut sums = [vec![f32::NAN; widths[0]], vec![f32::NAN; widths[0]]];
                    let members = |cs: &mut [Vec<f32>], sums: &mut Vec<f32>| -> Vec<Member<'_>> {
                        cs.iter_mut()
                            .enumerate()
                            .map(|(q, c)| Member {
                                n: widths[q],
                                dst: Dst::new(c.as_mut_ptr(), widths[q] as isize + 3, q == 1),
                                b: if q == 2 {
                                    Rhs::Packed(&packed, bm[2])
                                } else {
                                    Rhs::Mat(bm[q])
                                },
                                epilogue: Epilogue {
                                    bias: (q != 1).then(|| biases[q].as_ptr()),
                                    relu: q == 0,
                                },
                                sums: (q == 0).then_some(ColumnSums {
                                    dst: sums.as_mut_ptr(),
                                    lead,
                                    axes: 1,
                                }),
                            })
                            .collect()
                    };
                    let [sums_got, sums_want] = &mut sums;
                    let group = members(&mut got, sums_got);
                    // SAFETY: the kernel runs here; every result holds `m` rows of
                    // its `ld`; nothing overlaps.
                    on_threads(threads, || unsafe { gemm_group(kernel, (m, k), a, &group) });
                    for one in members(&mut want, sums_want) {
                        // SAFETY: as above.
                        on_threads(threads, || unsafe {
                            gemm_group(kernel, (m, k), a, std::slice::from_ref(&one))
                        });
                    }
                    let what = format!(
                        "{kernel:?} {m}×{k} ({}) by {widths:?} on {threads} threads",
                        if a_transposed {
                            "transposed"
                        } else {
                            "row-major"
                        }
                    );
                    for q in 0..widths.len() {
                        assert_same_bits(&got[q], &want[q], &format!("{what}: member {q}"));
                    }
                    assert_same_bits(sums_got, sums_want, &format!("{what}: sums"));
                    assert!(
                        sums_got.iter().all(|x| x.is_finite()),
                        "{what}: sums written"
                    );
                }
            }
        }
    }
}

/// The epilogue's ReLU is the `relu` kernel's: `+0.0` for `-0.0` and negatives, a NaN
/// kept; a bias only where given; nothing past the block's width.
#[test]
fn the_epilogue_relu_keeps_nans_and_gives_positive_zero() {
    if !std::arch::is_x86_feature_detected!("avx512f") {
        println!("skipped: no AVX-512F");
        return;
    }
    let mut c = [-0.0f32, f32::NAN, -3.0, 2.5, 7.0, -1.0];
    let e = Epilogue {
        bias: None,
        relu: true,
    };
    // SAFETY: AVX-512F is here; the block is 2 rows of 2 columns, row stride 3.
    unsafe { finish_block(c.as_mut_ptr(), 3, (2, 2), 0, e) };
    let bits: Vec<u32> = c.iter().map(|x| x.to_bits()).collect();
    assert_eq!(bits[0], 0.0f32.to_bits());
    assert!(c[1].is_nan());
    // Column 2 is past the block's width: untouched.
    assert_eq!((c[2], c[3], c[4], c[5]), (-3.0, 2.5, 7.0, -1.0));
    let bias = [1.0f32, -10.0, 100.0];
    let e = Epilogue {
        bias: Some(bias.as_ptr()),
        relu: false,
    };
    let mut c = [1.0f32, 2.0, 3.0];
    // SAFETY: as above; the block's column 0 is column 1 of the bias.
    unsafe { finish_block(c.as_mut_ptr(), 3, (1, 2), 1, e) };
    assert_eq!(c, [-9.0, 102.0, 3.0]);
}

/// The same operands give the same bits with one thread and with several (on two,
/// each thread takes 161 or 162 of the 19 × 17 blocks: the 10th row block's columns
/// are split between the threads, the second's from column 256 on, and the first
/// thread packs its 9 whole row blocks in two parts, 256 rows and 32). Rows and
/// columns of magnitudes 2⁻³ to 2³, so that their fp16 scales differ.
#[test]
fn bf16_products_give_the_same_bits_on_any_number_of_threads() {
    for kernel in kernels().into_iter().chain(half_kernel()) {
        same_bits_on_any_number_of_threads(kernel);
    }
}

fn same_bits_on_any_number_of_threads(kernel: Kernel16) {
    // The second: a long `k` and a narrow `b`, which `stream` takes on 2 and 3
    // threads (the shared path on 1).
    for (m, k, n) in [(600, 300, 530), (530, 2100, 520)] {
        same_bits_at(kernel, (m, k, n));
    }
}

fn same_bits_at(kernel: Kernel16, (m, k, n): (usize, usize, usize)) {
    let mut seed = 3u64;
    let magnitude = |i: usize| (2f32).powi((i % 7) as i32 - 3);
    let a: Vec<f32> = (0..m * k)
        .map(|i| rng(&mut seed) * magnitude(i / k))
        .collect();
    let b: Vec<f32> = (0..k * n)
        .map(|i| rng(&mut seed) * magnitude(i % n))
        .collect();
    let ops = (stored(&a, m, k, false), stored(&b, k, n, false));
    let run = |threads: usize| {
        let c = product(kernel, (m, k, n), ops, (&vec![0f32; m * n], false), threads);
        c.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    };
    let one = run(1);
    assert!(one == run(2), "{kernel:?}: one thread and two");
    assert!(one == run(3), "{kernel:?}: one thread and three");
}
