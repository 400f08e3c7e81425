use super::*;
use crate::testing::{on_threads, uniform as rng};
use crate::{Dst, Epilogue};

fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..len).map(|_| rng(&mut s) * 3.0).collect()
}

/// The instructions this CPU runs, or none (the test then says why it checks nothing).
fn isas() -> Vec<Isa> {
    let v: Vec<Isa> = [Isa::Amx, Isa::Vnni512, Isa::AvxVnni, Isa::Avx2]
        .into_iter()
        .filter(|i| i.runs_here())
        .collect();
    if v.is_empty() {
        eprintln!("skipped: this CPU has no AVX2, which the int8 products need");
    }
    v
}

/// How one product is asked: `b` transposed in memory, a bias, a ReLU, `dst` read.
#[derive(Clone, Copy, Default)]
struct Ask {
    tb: bool,
    bias: bool,
    relu: bool,
    read: bool,
    packed: bool,
}

/// `c` by `isa`'s products, `a` (`m × k`) and `b` (`k × n`) given row-major.
fn product(
    isa: Isa,
    (m, k, n): (usize, usize, usize),
    a: &[f32],
    b: &[f32],
    ask: Ask,
    c: &mut [f32],
) {
    let bt: Vec<f32> = if ask.tb {
        (0..n * k).map(|i| b[(i % k) * n + i / k]).collect()
    } else {
        b.to_vec()
    };
    let bm = Mat {
        ptr: bt.as_ptr(),
        rs: if ask.tb { 1 } else { n as isize },
        cs: if ask.tb { k as isize } else { 1 },
    };
    let am = Mat {
        ptr: a.as_ptr(),
        rs: k as isize,
        cs: 1,
    };
    let bias = values(n, 99);
    // SAFETY: `bt` holds the matrix; the CPU has AVX2.
    let packed = ask
        .packed
        .then(|| unsafe { crate::float16::PackedRhs::new(crate::Kernel16::Int8, (k, n), bm) });
    let member = Member {
        n,
        dst: Dst::new(c.as_mut_ptr(), n as isize, ask.read),
        b: match &packed {
            Some(p) => Rhs::Packed(p, bm),
            None => Rhs::Mat(bm),
        },
        epilogue: Epilogue {
            bias: ask.bias.then_some(bias.as_ptr()),
            relu: ask.relu,
        },
        sums: None,
    };
    // SAFETY: the buffers hold the matrices; `c` overlaps neither; the CPU runs `isa`.
    unsafe { gemm_group_with(isa, (m, k), am, &[member]) };
}

/// What the products compute, from scratch: each row of `a` and column of `b` scaled by
/// `127 / max` and rounded to even; per element, the f64 sum of the quantized operands'
/// products (exact: integers below 2⁵³), then `f32(S) · inv_a · inv_b`, the destination
/// read, the bias, the ReLU. Returns the results and the largest `|S|`.
fn reference(
    (m, k, n): (usize, usize, usize),
    a: &[f32],
    b: &[f32],
    ask: Ask,
    c: &mut [f32],
) -> f64 {
    let max_row = |i: usize| (0..k).map(|p| a[i * k + p].abs()).fold(0f32, f32::max);
    let max_col = |j: usize| (0..k).map(|p| b[p * n + j].abs()).fold(0f32, f32::max);
    let q = |x: f32, max: f32| {
        if max < 1e-30 {
            0.0
        } else {
            (x * (127.0 / max)).round_ties_even() as f64
        }
    };
    let inv = |max: f32| if max < 1e-30 { 0.0 } else { max / 127.0 };
    let bias = values(n, 99);
    let mut largest = 0f64;
    for i in 0..m {
        let ma = max_row(i);
        for j in 0..n {
            let mb = max_col(j);
            let s: f64 = (0..k)
                .map(|p| q(a[i * k + p], ma) * q(b[p * n + j], mb))
                .sum();
            largest = largest.max(s.abs());
            let mut x = s as f32 * inv(ma) * inv(mb);
            if ask.read {
                x += c[i * n + j];
            }
            if ask.bias {
                x += bias[j];
            }
            if ask.relu {
                x = relu(x);
            }
            c[i * n + j] = x;
        }
    }
    largest
}

#[test]
fn int8_products_are_the_exact_sums_of_the_quantized_operands() {
    let shapes = [
        (1, 1, 1),
        (1, 4, 32),
        (3, 7, 5),
        (12, 32, 32),
        (13, 33, 33),
        (5, 64, 70),
        (24, 256, 64),
        (29, 100, 97),
        (40, 513, 40),
    ];
    for isa in isas() {
        for (s, &(m, k, n)) in shapes.iter().enumerate() {
            let a = values(m * k, 2 * s as u64 + 1);
            let b = values(k * n, 2 * s as u64 + 2);
            let asks = [
                Ask::default(),
                Ask {
                    tb: true,
                    ..Ask::default()
                },
                Ask {
                    bias: true,
                    relu: true,
                    ..Ask::default()
                },
                Ask {
                    read: true,
                    packed: true,
                    ..Ask::default()
                },
                Ask {
                    tb: true,
                    packed: true,
                    bias: true,
                    ..Ask::default()
                },
            ];
            for ask in asks {
                let start = values(m * n, 7);
                let (mut got, mut want) = (start.clone(), start);
                product(isa, (m, k, n), &a, &b, ask, &mut got);
                reference((m, k, n), &a, &b, ask, &mut want);
                let differ = got
                    .iter()
                    .zip(&want)
                    .position(|(x, y)| x.to_bits() != y.to_bits());
                if let Some(e) = differ {
                    panic!(
                        "{isa:?} {m}×{k}·{k}×{n} (b transposed {}, bias {}, relu {}, read {}, \
                         packed {}): element {e} is {} where the quantized sums give {}",
                        ask.tb, ask.bias, ask.relu, ask.read, ask.packed, got[e], want[e]
                    );
                }
            }
        }
    }
}

#[test]
fn int8_sums_reach_the_largest_magnitudes_without_overflow() {
    // Every value at ±max: each product is ±127², the sums the largest the kernel meets
    // for this `k` (and the VNNI sums of the offset operand, `k · 255 · 127`, the largest
    // of all where `b` is all +127).
    let (m, k, n) = (12, 4096, 32);
    let a: Vec<f32> = (0..m * k)
        .map(|i| if i % 3 == 0 { -2.0 } else { 2.0 })
        .collect();
    let b = vec![0.5f32; k * n];
    for isa in isas() {
        let mut got = vec![0f32; m * n];
        let mut want = vec![0f32; m * n];
        product(isa, (m, k, n), &a, &b, Ask::default(), &mut got);
        let largest = reference((m, k, n), &a, &b, Ask::default(), &mut want);
        assert!(largest > 1.0e7, "{largest}");
        assert_eq!(got, want, "{isa:?}");
    }
}

#[test]
fn int8_products_give_the_same_bits_on_every_isa_and_thread_count() {
    let (m, k, n) = (37, 300, 130);
    let a = values(m * k, 11);
    let b = values(k * n, 12);
    let mut results = Vec::new();
    for isa in isas() {
        for threads in [1, 2, 3] {
            let mut c = vec![0f32; m * n];
            on_threads(threads, || {
                product(isa, (m, k, n), &a, &b, Ask::default(), &mut c)
            });
            results.push((isa, threads, c));
        }
    }
    for (isa, threads, c) in &results {
        assert!(
            c.iter()
                .zip(&results[0].2)
                .all(|(x, y)| x.to_bits() == y.to_bits()),
            "{isa:?} on {threads} threads differs from {:?} on {}",
            results[0].0,
            results[0].1
        );
    }
}

#[test]
fn int8_products_are_within_the_rounding_of_their_operands() {
    // `|ab − âb̂| ≤ |a|·|b − b̂| + |b̂|·|a − â|`, each rounding at most half a unit.
    let (m, k, n) = (16, 512, 48);
    let a = values(m * k, 21);
    let b = values(k * n, 22);
    let Some(isa) = isas().first().copied() else {
        return;
    };
    let mut c = vec![0f32; m * n];
    product(isa, (m, k, n), &a, &b, Ask::default(), &mut c);
    let max_row = |i: usize| (0..k).map(|p| a[i * k + p].abs()).fold(0f32, f32::max);
    let max_col = |j: usize| (0..k).map(|p| b[p * n + j].abs()).fold(0f32, f32::max);
    let mut worst = 0f64;
    for i in 0..m {
        for j in 0..n {
            let (ua, ub) = (max_row(i) as f64 / 254.0, max_col(j) as f64 / 254.0);
            let exact: f64 = (0..k)
                .map(|p| a[i * k + p] as f64 * b[p * n + j] as f64)
                .sum();
            let bound: f64 = (0..k)
                .map(|p| (a[i * k + p] as f64).abs() * ub + ((b[p * n + j] as f64).abs() + ub) * ua)
                .sum();
            let err = (c[i * n + j] as f64 - exact).abs();
            assert!(err <= bound * 1.001 + 1e-5, "({i}, {j}): {err} > {bound}");
            worst = worst.max(err / bound);
        }
    }
    // Random rounding errors cancel: far below the bound (which adds them all up).
    assert!(worst < 0.25, "{worst}");
}

#[test]
fn int8_products_send_infinities_and_nans_to_f32_and_tiny_rows_to_zero() {
    let (m, k, n) = (3, 8, 4);
    let mut a = values(m * k, 31);
    let b = values(k * n, 32);
    a[k + 2] = f32::NAN;
    a[2 * k] = f32::INFINITY;
    let Some(isa) = isas().first().copied() else {
        return;
    };
    let mut c = vec![0f32; m * n];
    product(isa, (m, k, n), &a, &b, Ask::default(), &mut c);
    let exact = |i: usize, j: usize| (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum::<f32>();
    assert!(
        c[n..].iter().all(|v| v.is_nan() || v.is_infinite()),
        "{c:?}"
    );
    assert!(
        (c[0] - exact(0, 0)).abs() < 1e-4,
        "{} {}",
        c[0],
        exact(0, 0)
    );
    // A row of magnitudes below 1e-30 is taken as zeros.
    let tiny: Vec<f32> = (0..k).map(|p| 1e-38 * (p as f32 + 1.0)).collect();
    let mut c = vec![1f32; n];
    product(isa, (1, k, n), &tiny, &b, Ask::default(), &mut c);
    assert_eq!(c, vec![0.0; n]);
}

#[test]
fn int8_rows_quantize_as_the_scalar_rounding_does() {
    // The vector rounding (`VCVTPS2DQ` after a product) against `round`, on values
    // halfway between integers after scaling, and a long row with a scalar tail.
    let k = 77;
    let mut row: Vec<f32> = (0..k).map(|p| (p as f32 - 38.0) + 0.5).collect();
    row[5] = 127.0 * 0.5;
    let a = Mat {
        ptr: row.as_ptr(),
        rs: k as isize,
        cs: 1,
    };
    let Some(_) = isas().first() else {
        return;
    };
    // SAFETY: one row of `k` values; the CPU has AVX2.
    let q = unsafe { quantize_rows(a, (1, k), false, Vec::new()) }.unwrap();
    let max = row.iter().fold(0f32, |m, v| m.max(v.abs()));
    let (_, s) = scales(max);
    for (p, &v) in row.iter().enumerate() {
        let stored = q.q[MR * QUAD * (p / QUAD) + p % QUAD];
        assert_eq!(stored ^ 0x80, round(v, s) as u8, "value {p}: {v}");
    }
}
