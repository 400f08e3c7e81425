use std::collections::BTreeMap;

use super::*;

/// A fixed-table step model: the log-probs of the next token depend only on the
/// previous token, so the best paths can be worked out by hand.
struct Table {
    rows: Vec<i32>,
    table: BTreeMap<i32, Vec<f64>>,
}

impl StepModel for Table {
    fn start(&mut self, src: &Tensor) -> Result<(), DecodeError> {
        self.rows = vec![0; src.shape[0]];
        Ok(())
    }
    fn step(&mut self, tokens: &[i32], _parents: &[usize]) -> Result<Vec<f64>, DecodeError> {
        let mut out = Vec::new();
        for t in tokens {
            out.extend(self.table[t].iter().copied());
        }
        Ok(out)
    }
    fn vocab(&self) -> usize {
        5
    }
}

/// The defaults, but with `<unk>` allowed: id 3 is a word of these tables ("a").
fn table_options() -> DecodeOptions {
    DecodeOptions {
        allow_unk: true,
        ..DecodeOptions::default()
    }
}

fn probs(p: [f64; 5]) -> Vec<f64> {
    p.iter()
        .map(|x| if *x == 0.0 { -1e9 } else { x.ln() })
        .collect()
}

/// Tokens: 0 pad, 1 bos, 2 eos, 3 "a", 4 "b". After bos: a 0.6, b 0.4. After a: eos
/// 0.3, a 0.35, b 0.35. After b: eos 0.9, a 0.05, b 0.05.
fn two_paths() -> Table {
    let mut table = BTreeMap::new();
    table.insert(1, probs([0.0, 0.0, 0.0, 0.6, 0.4]));
    table.insert(3, probs([0.0, 0.0, 0.3, 0.35, 0.35]));
    table.insert(4, probs([0.0, 0.0, 0.9, 0.05, 0.05]));
    Table {
        rows: vec![],
        table,
    }
}

#[test]
fn beam_finds_a_better_path_than_greedy() {
    let mut m = two_paths();
    let src = Tensor::i32(vec![1, 3], vec![5, 6, 7]).unwrap();
    let greedy = DecodeOptions {
        greedy: true,
        beam: 1,
        penalty: LengthPenalty::None,
        ..table_options()
    };
    let g = decode(&mut m, &src, &greedy).unwrap();
    // Greedy: a (0.6), then a (0.35) beats eos (0.3)... follows a forever until the
    // max length of 3 + 50 forces eos; so greedy is long.
    assert_eq!(g[0].tokens[0], 3);
    assert!(g[0].tokens.len() > 2);
    let beam = DecodeOptions {
        beam: 2,
        penalty: LengthPenalty::None,
        ..table_options()
    };
    let r = decode(&mut m, &src, &beam).unwrap();
    // Beam 2: "b eos" = 0.4 * 0.9 = 0.36 beats "a eos" = 0.18 and every longer path.
    assert_eq!(r[0].tokens, vec![4]);
    assert!((r[0].log_prob - (0.36f64).ln()).abs() < 1e-12);
}

/// The two stopping rules where the first hypothesis to finish is not the best once
/// normalized: after `<bos>`, `<eos>` and "a" are even (0.5 each); after "a", `<eos>` is
/// 0.9. With beam 1 and the GNMT penalty at α = 1, `<eos>` at once scores ln 0.5 / 1 =
/// −0.693 and "a `<eos>`" ln 0.45 / (7/6) = −0.684. `k-finished` (the default, as
/// fairseq and CTranslate2) stops at the first finished hypothesis; `exact` goes on and
/// finds the better one.
#[test]
fn the_stopping_rules_differ_where_a_longer_hypothesis_wins() {
    assert_eq!(DecodeOptions::default().early_stop, EarlyStop::KFinished);
    let mut table = BTreeMap::new();
    table.insert(1, probs([0.0, 0.0, 0.5, 0.5, 0.0]));
    table.insert(3, probs([0.0, 0.0, 0.9, 0.05, 0.05]));
    table.insert(4, probs([0.0, 0.0, 0.9, 0.05, 0.05]));
    let src = Tensor::i32(vec![1, 3], vec![5, 6, 7]).unwrap();
    let run = |early_stop| {
        let mut m = Table {
            rows: vec![],
            table: table.clone(),
        };
        let opts = DecodeOptions {
            beam: 1,
            penalty: LengthPenalty::Gnmt(1.0),
            early_stop,
            ..table_options()
        };
        decode(&mut m, &src, &opts).unwrap().remove(0)
    };
    let quick = run(EarlyStop::KFinished);
    assert_eq!(quick.tokens, Vec::<i32>::new());
    assert!((quick.score - 0.5f64.ln()).abs() < 1e-12, "{}", quick.score);
    let exact = run(EarlyStop::Exact);
    assert_eq!(exact.tokens, vec![3]);
    assert!(
        (exact.score - 0.45f64.ln() / (7.0 / 6.0)).abs() < 1e-12,
        "{}",
        exact.score
    );
}

/// `<unk>` (id 3) is never emitted unless allowed: the search takes the next best token,
/// greedy or beam, and with `allow_unk` the `<unk>` path wins as its probability says.
#[test]
fn unknown_tokens_are_banned_unless_allowed() {
    let mut table = BTreeMap::new();
    table.insert(1, probs([0.0, 0.0, 0.0, 0.6, 0.4]));
    table.insert(3, probs([0.0, 0.0, 0.9, 0.05, 0.05]));
    table.insert(4, probs([0.0, 0.0, 0.9, 0.05, 0.05]));
    let src = Tensor::i32(vec![1, 3], vec![5, 6, 7]).unwrap();
    for greedy in [true, false] {
        let run = |allow_unk| {
            let mut m = Table {
                rows: vec![],
                table: table.clone(),
            };
            let opts = DecodeOptions {
                greedy,
                beam: if greedy { 1 } else { 2 },
                penalty: LengthPenalty::None,
                allow_unk,
                ..DecodeOptions::default()
            };
            decode(&mut m, &src, &opts).unwrap().remove(0)
        };
        assert_eq!(DecodeOptions::default().unk, 3);
        let banned = run(false);
        assert_eq!(banned.tokens, vec![4], "greedy {greedy}");
        assert!((banned.score - (0.4f64 * 0.9).ln()).abs() < 1e-9);
        assert_eq!(run(true).tokens, vec![3], "greedy {greedy}");
    }
}

/// A model's maximum positions cap the output, even when `max_len_a` is so large
/// that the search could never prove it is done: the step at position
/// `max_positions − 1` forces `<eos>`, and no later position is read.
#[test]
fn max_positions_cap_the_output_length() {
    struct Counting(Table, usize);
    impl StepModel for Counting {
        fn start(&mut self, src: &Tensor) -> Result<(), DecodeError> {
            self.1 = 0;
            self.0.start(src)
        }
        fn step(&mut self, tokens: &[i32], parents: &[usize]) -> Result<Vec<f64>, DecodeError> {
            self.1 += 1;
            self.0.step(tokens, parents)
        }
        fn vocab(&self) -> usize {
            self.0.vocab()
        }
    }
    let src = Tensor::i32(vec![1, 3], vec![5, 6, 7]).unwrap();
    for (greedy, beam) in [(true, 1), (false, 2)] {
        let mut m = Counting(two_paths(), 0);
        let opts = DecodeOptions {
            greedy,
            beam,
            // Greedy follows "a" (0.35 against <eos>'s 0.3) to the cap. The beam
            // with a strong length penalty keeps looking for longer paths.
            penalty: if greedy {
                LengthPenalty::None
            } else {
                LengthPenalty::Gnmt(5.0)
            },
            max_len_a: 1e300,
            max_positions: Some(6),
            ..table_options()
        };
        let r = decode(&mut m, &src, &opts).unwrap();
        // Positions 0 (<bos>) to 5 were read: six steps, at most five tokens.
        assert!(m.1 <= 6, "greedy {greedy}: {} steps", m.1);
        assert!(r[0].tokens.len() <= 5, "greedy {greedy}: {:?}", r[0].tokens);
        if greedy {
            assert_eq!(r[0].tokens, vec![3; 5]);
            assert_eq!(m.1, 6);
        }
    }
}

/// The n best of a beam, worked out by hand on the table of [`two_paths`]: with beam
/// 2, "b eos" (0.4 · 0.9 = 0.36) finishes at step 2 and "a b eos" (0.6 · 0.35 · 0.9
/// = 0.189) at step 3, when no live hypothesis (at most 0.6 · 0.35 · 0.35 = 0.0735)
/// can beat either.
#[test]
fn nbest_keeps_the_finished_hypotheses_best_first() {
    let mut m = two_paths();
    let src = Tensor::i32(vec![2, 3], vec![5, 6, 7, 5, 0, 0]).unwrap();
    let beam = DecodeOptions {
        beam: 2,
        penalty: LengthPenalty::None,
        ..table_options()
    };
    let all = decode_nbest(&mut m, &src, &beam, 2).unwrap();
    assert_eq!(all.len(), 2);
    for hyps in &all {
        let got: Vec<(Vec<i32>, f64)> = hyps
            .iter()
            .map(|h| (h.tokens.clone(), h.log_prob))
            .collect();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].0, vec![4]);
        assert!((got[0].1 - 0.36f64.ln()).abs() < 1e-12);
        assert_eq!(got[1].0, vec![3, 4]);
        assert!((got[1].1 - 0.189f64.ln()).abs() < 1e-12);
    }
    // The first of the n best is decode's hypothesis, score and all.
    let one = decode(&mut m, &src, &beam).unwrap();
    assert_eq!(one[0], all[0][0]);
    let first = decode_nbest(&mut m, &src, &beam, 1).unwrap();
    assert_eq!(first[1], vec![all[1][0].clone()]);
    // With the GNMT penalty each score is its log-probability divided by
    // ((5 + len) / 6)^0.6, len counting <eos>, and the list is sorted by score.
    let gnmt = DecodeOptions {
        beam: 2,
        ..table_options()
    };
    let g = decode_nbest(&mut m, &src, &gnmt, 2).unwrap();
    let div = |len: f64| ((5.0 + len) / 6.0f64).powf(0.6);
    assert!(g[0][0].score >= g[0][1].score);
    for h in &g[0] {
        let len = h.tokens.len() as f64 + 1.0;
        assert!((h.score - h.log_prob / div(len)).abs() < 1e-12);
    }

    for (opts, n, want) in [
        (&beam, 3, "cannot keep the 3 best hypotheses of a beam of 2: it finds at most 2; ask for 1 to 2, or widen the beam"),
        (&beam, 0, "cannot keep the 0 best hypotheses of a beam of 2"),
        (
            &DecodeOptions {
                greedy: true,
                ..table_options()
            },
            2,
            "cannot keep the 2 best hypotheses of a greedy search: it finds at most 1; ask for 1 to 1",
        ),
    ] {
        let err = decode_nbest(&mut m, &src, opts, n).unwrap_err().to_string();
        assert!(err.contains(want), "{err}");
    }
}

/// Teacher-forced scores, by hand on the table of [`two_paths`]; a hypothesis of beam search scores the
/// log-probability the search reported.
#[test]
fn score_sums_the_log_probabilities_of_the_reference_and_eos() {
    let mut m = two_paths();
    let src = Tensor::i32(vec![3, 2], vec![5, 6, 5, 0, 7, 8]).unwrap();
    let opts = DecodeOptions::default();
    let refs = vec![vec![3, 3, 4], vec![], vec![4]];
    let got = score(&mut m, &src, &refs, &opts).unwrap();
    assert!(
        (got[0] - (0.6f64 * 0.35 * 0.35 * 0.9).ln()).abs() < 1e-12,
        "{got:?}"
    );
    // <eos> straight after <bos> has probability 0 in the table (log -1e9).
    assert_eq!(got[1], -1e9);
    assert!((got[2] - (0.4f64 * 0.9).ln()).abs() < 1e-12, "{got:?}");
    let beam = DecodeOptions {
        beam: 2,
        ..table_options()
    };
    let best = decode_nbest(&mut m, &src, &beam, 2).unwrap();
    for (i, hyps) in best.iter().enumerate() {
        for h in hyps {
            let mut one = src.clone();
            one.shape = vec![1, 2];
            let row = match &src.data {
                TensorData::I32(v) => v[2 * i..2 * i + 2].to_vec(),
                _ => unreachable!(),
            };
            one.data = TensorData::I32(row);
            let s = score(&mut m, &one, std::slice::from_ref(&h.tokens), &opts).unwrap();
            assert!((s[0] - h.log_prob).abs() < 1e-12);
        }
    }
    let err = score(&mut m, &src, &refs[..2], &opts).unwrap_err();
    assert!(err
        .to_string()
        .contains("2 references for 3 source sentences"));
    let bad = vec![vec![3], vec![9], vec![]];
    let err = score(&mut m, &src, &bad, &opts).unwrap_err();
    assert!(
        err.to_string()
            .contains("reference 1 has token id 9 at position 0, outside the vocabulary of 5"),
        "{err}"
    );
}

#[test]
fn length_penalties() {
    assert_eq!(LengthPenalty::None.divisor(7), 1.0);
    assert!((LengthPenalty::Gnmt(0.6).divisor(1) - 1.0).abs() < 1e-15);
    assert!((LengthPenalty::Gnmt(0.6).divisor(7) - 2.0f64.powf(0.6)).abs() < 1e-15);
    assert!((LengthPenalty::LenPow(0.5).divisor(9) - 3.0).abs() < 1e-15);
}

/// `row_top` is the prefix of the full ranking (larger first, ties to the smaller
/// token) without NaN and banned tokens, whatever `k`.
#[test]
fn row_top_is_the_prefix_of_the_full_ranking() {
    let row = [
        -1.0,
        -0.5,
        f64::NAN,
        -0.5,
        -3.0,
        f64::NEG_INFINITY,
        -0.25,
        -0.5,
    ];
    let spec = |k| TopSpec {
        k,
        banned: &[6],
        eos: 4,
    };
    let full: Vec<(f64, i32)> = vec![
        (-0.5, 1),
        (-0.5, 3),
        (-0.5, 7),
        (-1.0, 0),
        (-3.0, 4),
        (f64::NEG_INFINITY, 5),
    ];
    for k in 0..9 {
        let t = row_top(&row, &spec(k));
        assert_eq!(t.best, full[..k.min(full.len())], "k = {k}");
        assert_eq!(t.eos, -3.0);
    }
    let outside = TopSpec {
        k: 1,
        banned: &[],
        eos: 99,
    };
    assert_eq!(row_top(&row, &outside).eos, f64::NEG_INFINITY);
    // A NaN logit leaves the other log-probabilities finite.
    let lp = log_softmax_rows(&[0.0, f32::NAN, 0.0], 3);
    assert!(
        (lp[0] - (0.5f64).ln()).abs() < 1e-15 && lp[1].is_nan(),
        "{lp:?}"
    );
}

/// Beam search over each row's best `2·beam` tokens decodes exactly as over every
/// token: a model reporting whole rows (`k` ignored) gives the same hypotheses on
/// random tables, every beam size, greedy included.
#[test]
fn the_best_two_beam_tokens_of_each_row_decode_as_all_tokens() {
    struct Whole(Random);
    impl StepModel for Whole {
        fn start(&mut self, src: &Tensor) -> Result<(), DecodeError> {
            self.0.start(src)
        }
        fn step(&mut self, t: &[i32], p: &[usize]) -> Result<Vec<f64>, DecodeError> {
            self.0.step(t, p)
        }
        fn vocab(&self) -> usize {
            self.0.vocab()
        }
        fn step_top(
            &mut self,
            t: &[i32],
            p: &[usize],
            spec: &TopSpec<'_>,
        ) -> Result<Vec<RowTop>, DecodeError> {
            let all = TopSpec {
                k: self.vocab(),
                ..*spec
            };
            let logp = self.step(t, p)?;
            Ok(logp
                .chunks(self.vocab())
                .map(|r| row_top(r, &all))
                .collect())
        }
    }
    /// Log-probabilities that depend on the previous token and the step.
    struct Random {
        v: usize,
        seed: u64,
        calls: u64,
    }
    impl StepModel for Random {
        fn start(&mut self, _src: &Tensor) -> Result<(), DecodeError> {
            self.calls = 0;
            Ok(())
        }
        fn step(&mut self, tokens: &[i32], _p: &[usize]) -> Result<Vec<f64>, DecodeError> {
            self.calls += 1;
            let mut out = Vec::new();
            for &t in tokens {
                let mut x = (t as u64 + 1) * 0x9e37_79b9
                    + self.calls * 0x85eb_ca6b
                    + self.seed * 0xc2b2_ae35;
                let mut logits: Vec<f32> = (0..self.v)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        // Coarse values: ties happen.
                        ((x % 16) as f32) / 4.0
                    })
                    .collect();
                // The end of sentence grows likelier step by step (and with the token).
                logits[2] = self.calls as f32 * 0.75 - 1.5 + (t % 3) as f32 * 0.5;
                out.extend(log_softmax_rows(&logits, self.v));
            }
            Ok(out)
        }
        fn vocab(&self) -> usize {
            self.v
        }
    }
    let src = Tensor::i32(vec![3, 4], vec![5, 6, 7, 8, 9, 10, 0, 0, 11, 0, 0, 0]).unwrap();
    for seed in 0..40 {
        for v in [5usize, 12, 40] {
            for (beam, greedy) in [(1, true), (1, false), (2, false), (4, false), (6, false)] {
                let opts = DecodeOptions {
                    beam,
                    greedy,
                    max_len_b: 6,
                    ..table_options()
                };
                let mut top = Random { v, seed, calls: 0 };
                let mut whole = Whole(Random { v, seed, calls: 0 });
                let a = decode(&mut top, &src, &opts).unwrap();
                let b = decode(&mut whole, &src, &opts).unwrap();
                assert_eq!(a, b, "seed {seed}, vocab {v}, beam {beam}, greedy {greedy}");
            }
        }
    }
}

#[test]
fn rows_top_is_row_top_of_the_log_softmax_bit_for_bit() {
    // Ties, NaN, infinities, banned tokens, k of 0, k past the vocabulary, and rows
    // of one value.
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for case in 0..300 {
        // Every third row past the blocks of sixteen that the pass can skip whole.
        let v = if case % 3 == 0 {
            100 + (next() % 400) as usize
        } else {
            1 + (next() % 40) as usize
        };
        let rows = 1 + (next() % 5) as usize;
        let logits: Vec<f32> = (0..rows * v)
            .map(|_| match next() % 23 {
                0 => f32::NAN,
                1 if case % 7 == 0 => f32::INFINITY,
                2 => f32::NEG_INFINITY,
                3..=6 => 0.5, // ties
                r => (r as f32 - 12.0) * 0.37 + (next() % 1000) as f32 * 1e-3,
            })
            .collect();
        let banned = [(next() % v as u64) as i32, 0];
        let spec = TopSpec {
            k: if case % 3 == 0 {
                (next() % 9) as usize
            } else {
                (next() % (v as u64 + 3)) as usize
            },
            banned: &banned,
            eos: (next() % (v as u64 + 2)) as i32 - 1,
        };
        let want: Vec<RowTop> = log_softmax_rows(&logits, v)
            .chunks(v)
            .map(|r| row_top(r, &spec))
            .collect();
        let got = rows_top(&logits, v, &spec);
        assert_eq!(got.len(), want.len(), "case {case}");
        for (g, w) in got.iter().zip(&want) {
            let bits = |r: &RowTop| {
                let best: Vec<(u64, i32)> =
                    r.best.iter().map(|&(lp, t)| (lp.to_bits(), t)).collect();
                (best, r.eos.to_bits())
            };
            assert_eq!(bits(g), bits(w), "case {case}: {logits:?} {spec:?}");
        }
    }
    assert!(rows_top(
        &[],
        0,
        &TopSpec {
            k: 2,
            banned: &[],
            eos: 0
        }
    )
    .is_empty());
}

#[test]
fn exp_without_libm_is_within_a_few_ulp_of_libm() {
    let mut worst = 0.0f64;
    for i in 0..=200_000 {
        let d = -708.0 * (i as f64 / 200_000.0).powi(3);
        let (got, want) = (exp_nonpositive(d), d.exp());
        worst = worst.max(((got - want) / want).abs());
    }
    assert!(worst < 4.0 * f64::EPSILON, "relative error {worst:e}");
    assert_eq!(exp_nonpositive(0.0), 1.0);
    assert_eq!(exp_nonpositive(-0.0), 1.0);
    assert!(exp_nonpositive(f64::NAN).is_nan());
    let tiny = exp_nonpositive(f64::NEG_INFINITY);
    assert!(tiny > 0.0 && tiny < 1e-307, "{tiny:e}");
    // A row's log-sum-exp against the libm one, and a NaN logit left out.
    let row: Vec<f32> = (0..1000)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.3)
        .collect();
    let m = row.iter().fold(f64::NEG_INFINITY, |a, &x| a.max(x as f64));
    let want = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
    assert!(
        (row_lse(&row) - want).abs() < 1e-13,
        "{} vs {want}",
        row_lse(&row)
    );
    // Every instruction set gives the same bits (fused multiply-adds on each: the
    // plain loop's are libm's `fma`).
    for len in [1, 7, 8, 9, 1000] {
        let r = &row[..len];
        let plain = row_lse_lanes(r).to_bits();
        assert_eq!(row_lse(r).to_bits(), plain, "length {len}");
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX2 and FMA.
            assert_eq!(unsafe { row_lse_avx2(r) }.to_bits(), plain, "length {len}");
        }
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX-512F and FMA.
            assert_eq!(
                unsafe { row_lse_avx512(r) }.to_bits(),
                plain,
                "length {len}"
            );
        }
    }
    let mut with_nan = row.clone();
    with_nan.push(f32::NAN);
    assert_eq!(row_lse(&with_nan).to_bits(), row_lse(&row).to_bits());
}

#[test]
fn take_rows_reorders_and_repeats() {
    let t = Tensor::f32(vec![3, 2], vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]).unwrap();
    let r = take_rows(&t, &[2, 0, 2]);
    assert_eq!(r.shape, vec![3, 2]);
    assert_eq!(r.as_f32().unwrap(), &[4.0, 5.0, 0.0, 1.0, 4.0, 5.0]);
    let empty = Tensor::f32(vec![2, 0], vec![]).unwrap();
    assert_eq!(take_rows(&empty, &[1, 1, 0]).shape, vec![3, 0]);
}
