use super::*;
use crate::testing::{on_threads, uniform as rng};
use crate::{Dst, Epilogue};

/// `v` (`rows × cols`, row-major) stored as asked: row-major, or transposed.
fn stored(v: &[f32], (rows, cols): (usize, usize), transposed: bool) -> (Vec<f32>, (isize, isize)) {
    if transposed {
        let mut t = vec![0f32; v.len()];
        for i in 0..rows {
            for j in 0..cols {
                t[j * rows + i] = v[i * cols + j];
            }
        }
        (t, (1, rows as isize))
    } else {
        (v.to_vec(), (cols as isize, 1))
    }
}

/// `dst = (read ? dst : 0) + a·b` by [`gemm`], `a` and `b` given row-major and stored
/// as asked.
fn product(
    (m, k, n): (usize, usize, usize),
    (a, b): (&[f32], &[f32]),
    (ta, tb): (bool, bool),
    dst: &mut [f32],
    read: bool,
) {
    let (sa, (ars, acs)) = stored(a, (m, k), ta);
    let (sb, (brs, bcs)) = stored(b, (k, n), tb);
    let a = Mat {
        ptr: sa.as_ptr(),
        rs: ars,
        cs: acs,
    };
    let b = Mat {
        ptr: sb.as_ptr(),
        rs: brs,
        cs: bcs,
    };
    // SAFETY: the buffers hold the matrices; the CPU has AVX2 (checked by the callers).
    unsafe {
        let dst = Dst::new(dst.as_mut_ptr(), n as isize, read);
        gemm((m, k), a, Member::plain(n, Rhs::Mat(b), dst))
    };
}

/// What [`gemm`] computes, in scalar arithmetic: each row of `a` and column of `b`
/// scaled by `2^exponent(max)` and rounded to even; per element, the exact integer sums
/// of every 64 pairs of a 256-pair part, converted to f32 and added in order; the part
/// unscaled (`× 2^-e_a × 2^-e_b`) and added to the result.
fn reference((m, k, n): (usize, usize, usize), a: &[f32], b: &[f32], c: &mut [f32], read: bool) {
    let max_row = |i: usize| (0..k).map(|p| a[i * k + p].abs()).fold(0f32, f32::max);
    let max_col = |j: usize| (0..k).map(|p| b[p * n + j].abs()).fold(0f32, f32::max);
    let ea: Vec<i32> = (0..m).map(|i| exponent(max_row(i))).collect();
    let eb: Vec<i32> = (0..n).map(|j| exponent(max_col(j))).collect();
    let q = |x: f32, e: i32| (x * pow2(e)).round_ties_even() as i64;
    for i in 0..m {
        for j in 0..n {
            let term = |p: usize| {
                if p < k {
                    q(a[i * k + p], ea[i]) * q(b[p * n + j], eb[j])
                } else {
                    0
                }
            };
            let pairs = k.div_ceil(2);
            for p0 in (0..pairs).step_by(KC) {
                let mut acc = 0f32;
                for b0 in (p0..(p0 + KC).min(pairs)).step_by(BLOCK) {
                    let b1 = (b0 + BLOCK).min((p0 + KC).min(pairs));
                    let s: i64 = (2 * b0..2 * b1).map(term).sum();
                    assert!(s.unsigned_abs() < 1 << 31, "an int32 sum overflows");
                    acc += s as i32 as f32;
                }
                let v = acc * pow2(-ea[i]) * pow2(-eb[j]);
                let d = &mut c[i * n + j];
                *d = if p0 == 0 && !read { v } else { *d + v };
            }
        }
    }
}

/// The f32 kernel's product of row-major `a` and `b`.
fn f32_product((m, k, n): (usize, usize, usize), a: &[f32], b: &[f32]) -> Vec<f32> {
    let mat = |p: &[f32], cols: usize| Mat {
        ptr: p.as_ptr(),
        rs: cols as isize,
        cs: 1,
    };
    let mut c = vec![0f32; m * n];
    // SAFETY: the buffers hold the matrices.
    unsafe {
        let dst = Dst::new(c.as_mut_ptr(), n as isize, false);
        crate::gemm_one(
            (m, k, n),
            mat(a, k),
            mat(b, n),
            dst,
            crate::parallelism(m * k * n),
        )
    };
    c
}

fn skip() -> bool {
    match available() {
        Ok(()) => false,
        Err(why) => {
            println!("skipped: {why}");
            true
        }
    }
}

#[test]
fn exponents_bring_the_largest_magnitude_into_2048_to_4095() {
    for max in [
        1.0f32,
        3.0,
        4095.0,
        4095.5,
        2047.5,
        0.1,
        1e-30,
        7.5e20,
        f32::MAX,
    ] {
        let e = exponent(max);
        let scaled = max as f64 * 2f64.powi(e);
        assert!(
            scaled > 2047.5 && scaled <= 4095.0,
            "{max:e}: 2^{e} gives {scaled}"
        );
    }
    assert_eq!(exponent(1.0), 11);
    assert_eq!(exponent(4095.0), 0);
    assert_eq!(exponent(4095.5), -1);
    assert_eq!(exponent(0.0), 0);
    // Below 2⁻¹¹⁵ the exponent stops at 127, so that `2^e` is an f32.
    assert_eq!(exponent(1e-40), 127);
    assert_eq!(pow2(127), 2f32.powi(127));
    for e in -149..=127 {
        assert_eq!(pow2(e).to_bits(), (2f64.powi(e) as f32).to_bits(), "2^{e}");
    }
    assert_eq!(pow2(-127), f32::from_bits(1 << 22));
}

/// The kernel against [`reference`], bit for bit: sizes that are and are not whole
/// tiles, panels, blocks of 64 pairs and parts of 256 pairs (odd `k`, `m` past the
/// 240 rows the threads share), operands stored transposed, a destination read first,
/// and rows and columns of zeros and of tiny values.
#[test]
fn int16_products_equal_their_scalar_steps() {
    if skip() {
        return;
    }
    let mut seed = 3u64;
    for &(m, k, n, ta, tb, read) in &[
        (1, 1, 1, false, false, false),
        (7, 3, 5, false, false, true),
        (13, 129, 33, true, false, false),
        (6, 1030, 16, false, true, true),
        (250, 70, 40, true, true, false),
        (12, 513, 17, false, false, false),
        // Operands read along their rows in more than one chunk of columns: `b`'s
        // 530 columns, `a`'s 520 rows stored transposed (the last panels of both
        // narrower than a whole one).
        (7, 67, 530, false, false, true),
        (520, 20, 9, true, false, false),
    ] {
        let mut a: Vec<f32> = (0..m * k).map(|_| rng(&mut seed)).collect();
        let mut b: Vec<f32> = (0..k * n).map(|_| rng(&mut seed) * 300.0).collect();
        if m > 2 {
            // A row of zeros, and one of tiny values.
            a[k..2 * k].fill(0.0);
            a[2 * k..3 * k].iter_mut().for_each(|x| *x *= 1e-38);
        }
        if n > 1 {
            (0..k).for_each(|p| b[p * n + 1] *= 1e-20);
        }
        let init: Vec<f32> = (0..m * n).map(|_| rng(&mut seed)).collect();
        let mut got = init.clone();
        product((m, k, n), (&a, &b), (ta, tb), &mut got, read);
        let mut want = init.clone();
        reference((m, k, n), &a, &b, &mut want, read);
        for (x, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "{m}×{k}·{k}×{n} (ta {ta}, tb {tb}, read {read}) [{x}]: {g:e} against {w:e}"
            );
        }
    }
}

/// Against f64 sums of the f32 operands, every result is within the rounding the
/// scales allow: half a unit of each operand's row or column, `Σ_p (u_a·|b_pj| +
/// |a_ip|·u_b + u_a·u_b)`, plus f32 sums (2⁻²⁰ of `Σ|a·b|`).
#[test]
fn int16_products_are_within_half_a_unit_of_each_operand() {
    if skip() {
        return;
    }
    let (m, k, n) = (37, 700, 45);
    let mut seed = 9u64;
    // Rows and columns of very different magnitudes.
    let a: Vec<f32> = (0..m * k)
        .map(|x| rng(&mut seed) * 10f32.powi((x / k) as i32 % 7 - 3))
        .collect();
    let b: Vec<f32> = (0..k * n)
        .map(|x| rng(&mut seed) * 10f32.powi((x % n) as i32 % 5 - 2))
        .collect();
    let mut c = vec![0f32; m * n];
    product((m, k, n), (&a, &b), (false, false), &mut c, false);
    let ua: Vec<f64> = (0..m)
        .map(|i| {
            let max = (0..k).map(|p| a[i * k + p].abs()).fold(0f32, f32::max);
            0.5 * 2f64.powi(-exponent(max))
        })
        .collect();
    let ub: Vec<f64> = (0..n)
        .map(|j| {
            let max = (0..k).map(|p| b[p * n + j].abs()).fold(0f32, f32::max);
            0.5 * 2f64.powi(-exponent(max))
        })
        .collect();
    let mut worst = 0f64;
    for i in 0..m {
        for j in 0..n {
            let (mut exact, mut bound, mut abs) = (0f64, 0f64, 0f64);
            for p in 0..k {
                let (x, y) = (a[i * k + p] as f64, b[p * n + j] as f64);
                exact += x * y;
                abs += (x * y).abs();
                bound += ua[i] * y.abs() + x.abs() * ub[j] + ua[i] * ub[j];
            }
            let err = (c[i * n + j] as f64 - exact).abs();
            assert!(
                err <= bound + abs * 2f64.powi(-20),
                "[{i}, {j}]: {:e} against {exact:e}, beyond {bound:e}",
                c[i * n + j]
            );
            worst = worst.max(err / bound);
        }
    }
    // The bound is reached in part: the rounding is real.
    assert!(worst > 0.01, "worst error {worst} of the bound");
}

/// The same bits on 1, 2 and 3 threads.
#[test]
fn int16_products_give_the_same_bits_on_any_number_of_threads() {
    if skip() {
        return;
    }
    let (m, k, n) = (300, 520, 70);
    let mut seed = 5u64;
    let a: Vec<f32> = (0..m * k).map(|_| rng(&mut seed)).collect();
    let b: Vec<f32> = (0..k * n).map(|_| rng(&mut seed)).collect();
    let run = |threads| {
        on_threads(threads, || {
            let mut c = vec![0f32; m * n];
            product((m, k, n), (&a, &b), (false, true), &mut c, false);
            c.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        })
    };
    let one = run(1);
    assert!(run(2) == one && run(3) == one);
}

/// An infinity or a NaN in an operand sends the product to the f32 kernel: the
/// result is the f32 product's, bit for bit, infinities and NaNs included.
#[test]
fn int16_products_of_infinities_and_nans_are_the_f32_products() {
    if skip() {
        return;
    }
    let (m, k, n) = (9, 40, 20);
    let mut seed = 2u64;
    for (what, at_a, v) in [
        ("inf in a", true, f32::INFINITY),
        ("NaN in b", false, f32::NAN),
    ] {
        let mut a: Vec<f32> = (0..m * k).map(|_| rng(&mut seed)).collect();
        let mut b: Vec<f32> = (0..k * n).map(|_| rng(&mut seed)).collect();
        if at_a {
            a[3 * k + 5] = v;
        } else {
            b[7 * n + 2] = v;
        }
        let mut got = vec![0f32; m * n];
        product((m, k, n), (&a, &b), (false, false), &mut got, false);
        let want = f32_product((m, k, n), &a, &b);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(bits(&got) == bits(&want), "{what}");
        assert!(
            got.iter().any(|x| !x.is_finite()),
            "{what}: no infinity or NaN"
        );
    }
}

/// An infinity or a NaN in an operand whose lines are its columns (read along its
/// rows, in chunks of columns) also sends the product to the f32 kernel: a NaN in `a`
/// stored transposed, an infinity in `b`, each past the first chunk of 512 columns.
#[test]
fn int16_products_find_infinities_and_nans_in_every_chunk_of_columns() {
    if skip() {
        return;
    }
    let (m, k, n) = (530, 70, 530);
    let mut seed = 4u64;
    for (what, at_a) in [("NaN in a stored transposed", true), ("-inf in b", false)] {
        let mut a: Vec<f32> = (0..m * k).map(|_| rng(&mut seed)).collect();
        let mut b: Vec<f32> = (0..k * n).map(|_| rng(&mut seed)).collect();
        // Row 515 of `a` (a column of the stored matrix), column 521 of `b`.
        if at_a {
            a[515 * k + 33] = f32::NAN;
        } else {
            b[41 * n + 521] = f32::NEG_INFINITY;
        }
        let mut got = vec![0f32; m * n];
        product((m, k, n), (&a, &b), (at_a, false), &mut got, false);
        let want = f32_product((m, k, n), &a, &b);
        for i in 0..m {
            for j in 0..n {
                let (g, w) = (got[i * n + j], want[i * n + j]);
                if w.is_finite() {
                    // The f32 kernel's rounding, not the 2⁻¹² of int16 operands.
                    assert!(
                        (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                        "{what} ({i}, {j}): {g} against {w}"
                    );
                } else {
                    assert!(
                        g.is_nan() == w.is_nan() && (g.is_nan() || g == w),
                        "{what} ({i}, {j}): {g} against {w}"
                    );
                }
            }
        }
        let bad = if at_a {
            (0..n).map(|j| got[515 * n + j]).collect::<Vec<_>>()
        } else {
            (0..m).map(|i| got[i * n + 521]).collect()
        };
        assert!(
            bad.iter().all(|x| !x.is_finite()),
            "{what}: a finite result where the operand was not"
        );
    }
}

/// `b`'s column sums as the `sum_rows` kernel computes them (scalar): `b` (`k × n`,
/// row-major) seen as `[lead[0], …, lead[axes − 1], n]`, one sum an axis from `0.0`
/// in index order, the last axis's loop outermost.
fn nested_sums(b: &[f32], n: usize, lead: &[usize]) -> Vec<f32> {
    fn level(
        b: &[f32],
        n: usize,
        lead: &[usize],
        stride: &[usize],
        l: usize,
        row: usize,
        j: usize,
    ) -> f32 {
        if l == 0 {
            return b[row * n + j];
        }
        let mut s = 0f32;
        for i in 0..lead[l - 1] {
            s += level(b, n, lead, stride, l - 1, row + i * stride[l - 1], j);
        }
        s
    }
    let mut stride = vec![1usize; lead.len()];
    for a in (0..lead.len() - 1).rev() {
        stride[a] = stride[a + 1] * lead[a + 1];
    }
    (0..n)
        .map(|j| level(b, n, lead, &stride, lead.len(), 0, j))
        .collect()
}

fn assert_same_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    if let Some(q) = (0..got.len()).find(|&q| got[q].to_bits() != want[q].to_bits()) {
        panic!("{what}: element {q} is {:e}, not {:e}", got[q], want[q]);
    }
}

/// A product with an [`Epilogue`] gives the bits of the product without one, its bias
/// then added and its ReLU applied as a pass: with partial tiles and `k` in three
/// parts (1100), a result added to, on 1 and 2 threads, NaNs in the bias (kept by the
/// ReLU); with a row of NaNs (the f32 kernel's product, the pass after it).
#[test]
fn int16_products_add_the_bias_and_apply_the_relu_as_a_pass_after_them_would() {
    if skip() {
        return;
    }
    for ((m, k, n), nan) in [
        ((45, 37, 51), false),
        ((250, 1100, 70), false),
        ((13, 40, 20), true),
    ] {
        let mut seed = 9u64;
        let mut a: Vec<f32> = (0..m * k).map(|_| rng(&mut seed)).collect();
        if nan {
            a[3 * k] = f32::NAN;
        }
        let b: Vec<f32> = (0..k * n).map(|_| rng(&mut seed)).collect();
        let mut bias: Vec<f32> = (0..n).map(|_| rng(&mut seed) * 4.0).collect();
        // A NaN bias in a whole tile's columns and in a partial tile's: kept by the
        // ReLU.
        bias[1] = f32::NAN;
        bias[n - 1] = f32::NAN;
        let c0: Vec<f32> = (0..m * n).map(|_| rng(&mut seed)).collect();
        let (am, bm) = (stored(&a, (m, k), false), stored(&b, (k, n), false));
        let mat = |(v, (rs, cs)): &(Vec<f32>, (isize, isize))| Mat {
            ptr: v.as_ptr(),
            rs: *rs,
            cs: *cs,
        };
        for read in [false, true] {
            for relu_on in [false, true] {
                for threads in [1, 2] {
                    let run = |e: Epilogue| {
                        on_threads(threads, || {
                            let mut c = c0.clone();
                            // SAFETY: the CPU has AVX2; the buffers hold the matrices
                            // and the bias `n` values.
                            unsafe {
                                let dst = Dst::new(c.as_mut_ptr(), n as isize, read);
                                let member = Member {
                                    epilogue: e,
                                    ..Member::plain(n, Rhs::Mat(mat(&bm)), dst)
                                };
                                gemm((m, k), mat(&am), member)
                            };
                            c
                        })
                    };
                    let want: Vec<f32> = run(Epilogue::default())
                        .iter()
                        .enumerate()
                        .map(|(q, &x)| {
                            let v = x + bias[q % n];
                            if relu_on {
                                relu(v)
                            } else {
                                v
                            }
                        })
                        .collect();
                    let got = run(Epilogue {
                        bias: Some(bias.as_ptr()),
                        relu: relu_on,
                    });
                    let what = format!("{m}×{k}·{k}×{n} read {read} relu {relu_on} on {threads}");
                    assert_same_bits(&got, &want, &what);
                    assert!(
                        (0..m).all(|i| got[i * n + 1].is_nan() && got[i * n + n - 1].is_nan()),
                        "{what}"
                    );
                    if nan {
                        assert!(got[3 * n..4 * n].iter().all(|x| x.is_nan()), "{what}");
                    } else if relu_on {
                        assert!(got.contains(&0.0), "{what}: a ReLU zero");
                    }
                }
            }
        }
    }
    assert_eq!(relu(-0.0).to_bits(), 0f32.to_bits());
    assert!(relu(f32::NAN).is_nan());
    assert_eq!(relu(-3.0), 0.0);
    assert_eq!(relu(2.5), 2.5);
}

/// A group of products of one left operand ([`gemm_group`]) gives each member the
/// bits of its own [`gemm`]: results with their own row strides, a bias and ReLU, a
/// result added to, column sums (the `sum_rows` kernel's bits, over one axis and over
/// two), a right operand stored transposed and one packed beforehand (the bits of one
/// quantized for the product); `a` row-major and transposed, `k` in one part and in
/// two, on 1 and 2 threads.
#[test]
fn grouped_int16_products_give_each_member_the_bits_of_its_own_product() {
    if skip() {
        return;
    }
    for ((m, k), widths) in [((100, 512), [64, 300, 40]), ((37, 600), [70, 17, 33])] {
        let mut seed = 17u64;
        for a_transposed in [false, true] {
            let av: Vec<f32> = (0..m * k).map(|_| rng(&mut seed)).collect();
            let sa = stored(&av, (m, k), a_transposed);
            let a = Mat {
                ptr: sa.0.as_ptr(),
                rs: sa.1 .0,
                cs: sa.1 .1,
            };
            // Member `q`: `b` transposed for 1, packed beforehand for 2 (else
            // row-major); bias and ReLU for 0, bias for 2; `c` added to for 1; column
            // sums for 0, over `[4, k / 4]`.
            let bs: Vec<Vec<f32>> = widths
                .iter()
                .map(|&n| (0..k * n).map(|_| rng(&mut seed) * 8.0).collect())
                .collect();
            let sb: Vec<(Vec<f32>, (isize, isize))> = bs
                .iter()
                .zip(widths)
                .enumerate()
                .map(|(q, (b, n))| stored(b, (k, n), q == 1))
                .collect();
            let bm: Vec<Mat> = sb
                .iter()
                .map(|(v, (rs, cs))| Mat {
                    ptr: v.as_ptr(),
                    rs: *rs,
                    cs: *cs,
                })
                .collect();
            let biases: Vec<Vec<f32>> = widths
                .iter()
                .map(|&n| (0..n).map(|_| rng(&mut seed)).collect())
                .collect();
            let c0: Vec<Vec<f32>> = widths
                .iter()
                .map(|&n| (0..m * (n + 3)).map(|_| rng(&mut seed)).collect())
                .collect();
            let lead = [4, k / 4, 1, 1];
            let int16 = crate::Kernel16::Int16;
            // SAFETY (both): the CPU has AVX2 and `bm[2]` addresses `k × n`.
            let packed = unsafe { crate::float16::PackedRhs::new(int16, (k, widths[2]), bm[2]) };
            let quantized = unsafe { Panels::new(bm[2], (k, widths[2])) }.expect("finite");
            assert!(packed.is(int16, (k, widths[2])));
            assert_eq!(packed.bytes(), quantized.bytes());
            for threads in [1, 2] {
                let mut got = c0.clone();
                let mut want = c0.clone();
                let mut sums = [vec![f32::NAN; widths[0]], vec![f32::NAN; widths[0]]];
                let members =
                    |cs: &mut [Vec<f32>], sums: &mut Vec<f32>, pack: bool| -> Vec<Member<'_>> {
                        cs.iter_mut()
                            .enumerate()
                            .map(|(q, c)| Member {
                                n: widths[q],
                                dst: Dst::new(c.as_mut_ptr(), widths[q] as isize + 3, q == 1),
                                b: if q == 2 && pack {
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
                                    axes: 2,
                                }),
                            })
                            .collect()
                    };
                let [sums_got, sums_want] = &mut sums;
                let group = members(&mut got, sums_got, true);
                // SAFETY: the CPU has AVX2; every result holds `m` rows of its `ld`;
                // nothing overlaps.
                on_threads(threads, || unsafe { gemm_group((m, k), a, &group) });
                for one in members(&mut want, sums_want, false) {
                    // SAFETY: as above.
                    on_threads(threads, || unsafe {
                        gemm_group((m, k), a, std::slice::from_ref(&one))
                    });
                }
                let what =
                    format!("{m}×{k} (transposed {a_transposed}) by {widths:?} on {threads}");
                for q in 0..widths.len() {
                    assert_same_bits(&got[q], &want[q], &format!("{what}: member {q}"));
                    assert!(got[q] != c0[q], "{what}: member {q} written");
                }
                assert_same_bits(
                    sums_got,
                    &nested_sums(&bs[0], widths[0], &lead[..2]),
                    &format!("{what}: sums"),
                );
                assert_same_bits(sums_want, sums_got, &format!("{what}: sums alone"));
            }
        }
    }
}

/// A right operand that cannot be quantized is not packed (its products read it as it
/// is); a packed one read with a left operand holding a NaN gives the f32 product of
/// the matrix it was packed from, and its column sums where asked.
#[test]
fn int16_packed_operands_of_infinities_and_nans() {
    if skip() {
        return;
    }
    let (m, k, n) = (20, 64, 40);
    let mut seed = 4u64;
    let mut a: Vec<f32> = (0..m * k).map(|_| rng(&mut seed)).collect();
    let mut b: Vec<f32> = (0..k * n).map(|_| rng(&mut seed)).collect();
    let mat = |p: &[f32], cols: usize| Mat {
        ptr: p.as_ptr(),
        rs: cols as isize,
        cs: 1,
    };
    let int16 = crate::Kernel16::Int16;
    b[5 * n + 1] = f32::INFINITY;
    // SAFETY (both): the CPU has AVX2; `b` holds `k × n`.
    let unpackable = unsafe { crate::float16::PackedRhs::new(int16, (k, n), mat(&b, n)) };
    assert!(!unpackable.is(int16, (k, n)) && unpackable.bytes() == 0);
    b[5 * n + 1] = 0.5;
    a[2 * k + 7] = f32::NAN;
    let packed = unsafe { crate::float16::PackedRhs::new(int16, (k, n), mat(&b, n)) };
    assert!(packed.is(int16, (k, n)) && packed.bytes() > 2 * k * n);
    let mut sums = vec![0f32; n];
    let mut got = vec![0f32; m * n];
    // SAFETY: the CPU has AVX2; the buffers hold the matrices.
    unsafe {
        let dst = Dst::new(got.as_mut_ptr(), n as isize, false);
        let member = Member {
            sums: Some(ColumnSums {
                dst: sums.as_mut_ptr(),
                lead: [k, 1, 1, 1],
                axes: 1,
            }),
            ..Member::plain(n, Rhs::Packed(&packed, mat(&b, n)), dst)
        };
        gemm((m, k), mat(&a, k), member)
    };
    let want = f32_product((m, k, n), &a, &b);
    assert_same_bits(&got, &want, "a NaN in a");
    assert!(got[2 * n..3 * n].iter().all(|x| x.is_nan()));
    assert_same_bits(&sums, &nested_sums(&b, n, &[k]), "sums");
}
