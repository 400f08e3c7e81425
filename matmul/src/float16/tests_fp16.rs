//! The fp16 kernel's tests (`VFMADD231PH`): its products against a scalar emulation of
//! its steps, and its scaling of rows and columns.

use super::tests::*;
use super::*;

/// `x` (a sum of a few fp16 values and products, exact in f64) rounded to fp16 once,
/// to nearest, ties to even (the `half` crate may round f64 through f32: twice); an
/// infinity past fp16's largest value.
fn round_f16(x: f64) -> f64 {
    if x == 0.0 {
        return x;
    }
    let e = ((x.abs().to_bits() >> 52) as i32) - 1023;
    // The unit in the last place, a power of two (so both operations are exact).
    let ulp = f64::from_bits((((e - 10).max(-24) + 1023) as u64) << 52);
    let r = (x * (1.0 / ulp)).round_ties_even() * ulp;
    if r.abs() >= 65536.0 {
        r.signum() * f64::INFINITY
    } else {
        r
    }
}

/// What [`Kernel16::Half`] computes, step by step in scalar arithmetic: the scaled
/// operands rounded to fp16, each column's even and odd `k` summed in fp16 (one
/// rounding a term, as an FMA), `FLUSH_TILES · 32` values of `k` at a time, those
/// sums added in f32, the two f32 sums added and unscaled, by parts of `K_TILES · 32`
/// values of `k`.
#[allow(clippy::too_many_arguments)]
fn half_reference(
    (m, k, n): (usize, usize, usize),
    at: impl Fn(usize, usize) -> f32,
    bt: impl Fn(usize, usize) -> f32,
    c0: &[f32],
    read: bool,
) -> Vec<f32> {
    let bits = |x: f32| x.to_bits() & 0x7fff_ffff;
    let row_max: Vec<u32> = (0..m)
        .map(|i| (0..k).map(|p| bits(at(i, p))).max().unwrap_or(0))
        .collect();
    let col_max: Vec<u32> = (0..n)
        .map(|j| (0..k).map(|p| bits(bt(p, j))).max().unwrap_or(0))
        .collect();
    let (sa, ua): (Vec<f32>, Vec<f32>) = row_max.iter().map(|&x| fp16_scale(x, TOP_A)).unzip();
    let (sb, ub): (Vec<f32>, Vec<f32>) = col_max.iter().map(|&x| fp16_scale(x, TOP_B)).unzip();
    let h = |x: f32| half::f16::from_f32(x).to_f64();
    let kp = k.div_ceil(TK).max(1) * TK;
    // `b`'s scaled fp16 values by column, each rounded once.
    let bc: Vec<f64> = (0..n * kp)
        .map(|q| {
            let (j, p) = (q / kp, q % kp);
            if p < k {
                h(bt(p, j) * sb[j])
            } else {
                0.0
            }
        })
        .collect();
    let mut c = vec![0f32; m * n];
    for i in 0..m {
        let ar: Vec<f64> = (0..kp)
            .map(|p| if p < k { h(at(i, p) * sa[i]) } else { 0.0 })
            .collect();
        for j in 0..n {
            let mut out = if read { c0[i * n + j] } else { 0.0 };
            // The driver's parts of `k` (`K_TILES` tiles), each added to the result
            // (stored, where it is the first and the result is not read).
            for (part, k0) in (0..kp).step_by(K_TILES * TK).enumerate() {
                let k1 = (k0 + K_TILES * TK).min(kp);
                let mut wide = [0f32; 2];
                for chunk in (k0..k1).step_by(FLUSH_TILES * TK) {
                    // fp16 values, held in f64.
                    let mut acc = [0f64; 2];
                    for p in chunk..(chunk + FLUSH_TILES * TK).min(k1) {
                        acc[p % 2] = round_f16(acc[p % 2] + ar[p] * bc[j * kp + p]);
                    }
                    wide[0] += acc[0] as f32;
                    wide[1] += acc[1] as f32;
                }
                let v = (wide[0] + wide[1]) * ua[i] * ub[j];
                out = if part == 0 && !read { v } else { out + v };
            }
            c[i * n + j] = out;
        }
    }
    c
}

/// The fp16 kernel gives the bits of [`half_reference`] at sizes that are and are not
/// whole tiles, transposed operands, a destination read first, and operands whose
/// magnitudes span 2^30 (small ones become fp16 subnormals after scaling); and it is
/// within the expected error of the exact sums (fp16 operands and sums: about 2⁻¹¹
/// relative), clearly closer than bf16 operands would be.
#[test]
fn fp16_products_equal_their_scalar_steps() {
    let Some(kernel) = half_kernel() else { return };
    let mut seed = 11u64;
    for &(m, k, n, ta, tb, read, wide) in &[
        (32, 32, 32, false, false, false, false),
        (1, 1, 1, false, false, false, false),
        (45, 70, 33, false, false, true, false),
        (300, 512, 270, false, true, false, false),
        (64, 800, 96, true, false, true, false),
        (40, 100, 300, false, false, true, true),
        (70, 64, 700, false, true, false, true),
        (17, 2049, 5, true, true, false, true),
        (530, 70, 45, true, false, true, false),
        (520, 64, 300, false, true, false, false),
    ] {
        let mut x = || {
            let v = rng(&mut seed);
            if wide {
                v * (2f32).powi(-((rng(&mut seed).abs() * 30.0) as i32))
            } else {
                v * 3.0e-3
            }
        };
        let a: Vec<f32> = (0..m * k).map(|_| x()).collect();
        let b: Vec<f32> = (0..k * n).map(|_| x()).collect();
        let c0: Vec<f32> = (0..m * n).map(|_| rng(&mut seed)).collect();
        let (am, bm) = (stored(&a, m, k, ta), stored(&b, k, n, tb));
        let (at, bt) = (|i, p| elem(am, i, p), |p, j| elem(bm, p, j));
        let run = |threads| product(kernel, (m, k, n), (am, bm), (&c0, read), threads);
        let what = format!("{m}×{k}·{k}×{n} (ta {ta}, tb {tb}, read {read}, wide {wide})");
        let c = run(1);
        let want = half_reference((m, k, n), at, bt, &c0, read);
        assert_same_bits(&c, &want, &format!("{what}: against the scalar steps"));
        assert_same_bits(&c, &run(4), &format!("{what}: one thread and four"));
        assert_same_bits(&c, &run(2), &format!("{what}: one thread and two"));
        // Against the exact sums, relative to the terms' magnitudes.
        let (mut off, mut off_bf16) = (0f64, 0f64);
        for i in 0..m {
            for j in 0..n {
                let (mut s, mut s_bf16, mut mag) = (0f64, 0f64, 0f64);
                for p in 0..k {
                    let t = at(i, p) as f64 * bt(p, j) as f64;
                    s += t;
                    s_bf16 += round_bf16(at(i, p)) as f64 * round_bf16(bt(p, j)) as f64;
                    mag += t.abs();
                }
                let init = if read { c0[i * n + j] as f64 } else { 0.0 };
                let got = c[i * n + j] as f64 - init;
                off = off.max((got - s).abs() / (mag + init.abs() * 1e-7));
                off_bf16 = off_bf16.max((s_bf16 - s).abs() / mag);
            }
        }
        // An fp16 sum rounds 64 times, each by at most 2⁻¹² of the terms'
        // magnitudes, and much less on the whole (measured: 2.2e-4 to 2.3e-3, where
        // bf16 operands are 1.5e-4 to 6.2e-3 off).
        assert!(off < 4e-3, "{what}: {off:e} from the exact sums");
        if m * n * k > 1 {
            assert!(
                off < off_bf16,
                "{what}: {off:e} from the exact sums, bf16 {off_bf16:e}"
            );
        }
    }
}

/// With a long `k` (three parts of it) and a narrow `b`, each task of `stream`
/// packing its parts of `k` one at a time, the fp16 scales are still the whole
/// rows' and columns': rows and columns whose magnitudes fall from 2⁰ to 2⁻²⁰ along
/// `k`, or rise, give the bits of [`half_reference`] on two threads, with the
/// operands stored either way, and the result read first (a scale from part of a row
/// would overflow its largest values, or flush its smallest). Every 9th row is
/// checked (the reference is slow; each row's scale is its own).
#[test]
fn fp16_products_scale_whole_rows_and_columns_when_k_is_long() {
    let Some(kernel) = half_kernel() else { return };
    let (m, k, n) = (530, 2100, 520);
    let mut seed = 17u64;
    // Magnitudes along `k`: falling in even rows and columns, rising in odd ones.
    let along = |line: usize, p: usize| {
        let f = p as f32 / k as f32;
        2f32.powf(-20.0 * if line.is_multiple_of(2) { f } else { 1.0 - f })
    };
    let a: Vec<f32> = (0..m * k)
        .map(|q| rng(&mut seed) * 60.0 * along(q / k, q % k))
        .collect();
    let b: Vec<f32> = (0..k * n)
        .map(|q| rng(&mut seed) * 0.01 * along(q % n, q / n))
        .collect();
    let c0: Vec<f32> = (0..m * n).map(|_| rng(&mut seed)).collect();
    let rows: Vec<usize> = (0..m).step_by(9).collect();
    for (transposed, read) in [(false, false), (true, true)] {
        // The same matrices, stored transposed (`a` by columns, `b` by rows).
        let store = |v: &[f32], r: usize, c: usize| -> Vec<f32> {
            if !transposed {
                return v.to_vec();
            }
            (0..r * c).map(|q| v[(q % r) * c + q / r]).collect()
        };
        let (at, bt) = (store(&a, m, k), store(&b, k, n));
        let (am, bm) = (stored(&at, m, k, transposed), stored(&bt, k, n, transposed));
        let c = product(kernel, (m, k, n), (am, bm), (&c0, read), 2);
        let c0_rows: Vec<f32> = rows
            .iter()
            .flat_map(|&i| &c0[i * n..][..n])
            .copied()
            .collect();
        let want = half_reference(
            (rows.len(), k, n),
            |r, p| elem(am, rows[r], p),
            |p, j| elem(bm, p, j),
            &c0_rows,
            read,
        );
        let got: Vec<f32> = rows
            .iter()
            .flat_map(|&i| &c[i * n..][..n])
            .copied()
            .collect();
        assert_same_bits(
            &got,
            &want,
            &format!("transposed {transposed}, read {read}"),
        );
    }
}

/// An operand far past fp16's range (1e30, 1e-30) is scaled into it; an infinity or a
/// NaN reaches the results, as in f32.
#[test]
fn fp16_products_scale_any_magnitude_and_keep_infinities() {
    let Some(kernel) = half_kernel() else { return };
    let run = |a, b| constant_product(kernel, a, b);
    // E.g. 1e30 · 3e-30 summed 64 times: 192, to fp16's precision of the operands
    // (2⁻¹¹ relative each at most).
    for (a, b) in [(1e30f32, 3e-30f32), (3e-30, 1e30), (1e-15, 3e-15)] {
        let want = 64.0 * a as f64 * b as f64;
        assert!(
            run(a, b)
                .iter()
                .all(|&x| ((x as f64 - want) / want).abs() < 3e-3),
            "{a:e}·{b:e}: {:e}, not {want:e}",
            run(a, b)[0]
        );
    }
    assert!(run(f32::INFINITY, 1.0).iter().all(|&x| x == f32::INFINITY));
    assert!(run(f32::NAN, 1.0).iter().all(|x| x.is_nan()));
}
