//! Incremental decoding: the `decode_step` entry point (key/value caches) gives exactly
//! the tokens and scores of recomputing the whole prefix with `forward` at every step —
//! for beam search and for greedy decoding — on the tiny Transformer, through the
//! reference executor (whose per-row arithmetic does not depend on batch or length, so
//! the two paths agree to the bit).

use std::collections::BTreeMap;
use std::path::Path;

use kiln_compiler::init::init_params;
use kiln_compiler::tensor::Tensor;
use kiln_compiler::Graph;
use kiln_decode::search::{decode, CachedStep, DecodeOptions, FullStep, LengthPenalty};
use kiln_decode::translate::{Batching, Schedule, StepModels};
use kiln_dsl::{Mode, Options};
use kiln_exec::executor::{Exec, Reference};
use kiln_exec::{decoder_entries, entry_graph, Entry};

fn graph(mode: Mode) -> Graph {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/transformer_tiny.kiln");
    kiln_dsl::compile_file(
        &path,
        &Options {
            mode,
            ..Options::default()
        },
    )
    .expect("tiny compiles")
}

struct Setup {
    forward: Reference,
    encode: Reference,
    step: Reference,
    params: BTreeMap<String, Tensor>,
}

/// The shipped pair: the step's per-sentence values hoisted into `encode`.
fn setup(seed: u64) -> Setup {
    let eval = graph(Mode::Eval);
    let dec = graph(Mode::Decode);
    let params = init_params(&eval, seed).unwrap().into_iter().collect();
    let (encode, step) = decoder_entries(&eval, &dec).unwrap();
    Setup {
        forward: Reference::new(entry_graph(&eval, Entry::Forward).unwrap()).unwrap(),
        encode: Reference::new(encode).unwrap(),
        step: Reference::new(step).unwrap(),
        params,
    }
}

/// The pair as cut before hoisting (what checkpoints written earlier hold): the step
/// reads the memory and computes everything from it.
fn setup_unhoisted(seed: u64) -> Setup {
    let eval = graph(Mode::Eval);
    let dec = graph(Mode::Decode);
    let params = init_params(&eval, seed).unwrap().into_iter().collect();
    Setup {
        forward: Reference::new(entry_graph(&eval, Entry::Forward).unwrap()).unwrap(),
        encode: Reference::new(entry_graph(&eval, Entry::Encode).unwrap()).unwrap(),
        step: Reference::new(entry_graph(&dec, Entry::DecodeStep).unwrap()).unwrap(),
        params,
    }
}

/// Beam 4 with the paper's length penalty, at most the source length + 4 tokens.
fn beam_four() -> DecodeOptions {
    DecodeOptions {
        beam: 4,
        penalty: LengthPenalty::Gnmt(0.6),
        max_len_a: 1.0,
        max_len_b: 4,
        ..DecodeOptions::default()
    }
}

fn src() -> Tensor {
    // Three sentences, two of them padded.
    Tensor::i32(
        vec![3, 5],
        vec![5, 6, 7, 0, 0, 8, 9, 10, 11, 12, 13, 14, 0, 0, 0],
    )
    .unwrap()
}

#[test]
fn decode_step_graph_has_caches_and_the_hoisted_inputs() {
    let s = setup(1);
    let g = s.step.graph().clone();
    let inputs: Vec<&str> = g
        .inputs
        .iter()
        .map(|&i| g.source_name(i).unwrap())
        .collect();
    // The cross-attention's keys and values of each layer come from `encode`: the step
    // no longer reads the memory (the source still gives it the padding mask).
    assert_eq!(
        inputs,
        [
            "src",
            "tgt_in",
            "cache.decoder.layers.0.self_attn.k",
            "cache.decoder.layers.0.self_attn.v",
            "static.decoder.layers.0.cross_attn.0",
            "static.decoder.layers.0.cross_attn.1",
            "cache.decoder.layers.1.self_attn.k",
            "cache.decoder.layers.1.self_attn.v",
            "static.decoder.layers.1.cross_attn.0",
            "static.decoder.layers.1.cross_attn.1",
        ]
    );
    // The keys, which the step reads only transposed (`q·kᵀ`), stored as each head's `kᵀ`;
    // the values as the projection wrote them.
    let ty = |name: &str| g.ty(g.input(name).unwrap()).to_string();
    assert_eq!(
        ty("static.decoder.layers.1.cross_attn.0"),
        "f32[batch, 4, 8, src_len]"
    );
    assert_eq!(
        ty("static.decoder.layers.1.cross_attn.1"),
        "f32[batch, src_len, 32]"
    );
    let caches = g.cache_outputs();
    assert_eq!(
        caches.len(),
        4,
        "k and v for each of 2 decoder layers: {caches:?}"
    );
    assert!(caches.contains(&"cache.decoder.layers.1.self_attn.v".to_string()));
    // Neither the encoder nor the cross-attention's key and value projections are part
    // of the step; `encode` runs them once per sentence.
    assert!(g.param("encoder.layers.0.self_attn.w_q").is_none());
    assert!(g.param("decoder.layers.0.cross_attn.w_k").is_none());
    assert!(g.param("decoder.layers.0.cross_attn.w_q").is_some());
    let enc = s.encode.graph();
    let outs: Vec<&str> = enc.outputs.iter().map(|o| o.name.as_str()).collect();
    assert_eq!(outs.len(), 5, "{outs:?}");
    assert_eq!(outs[0], "memory");
    assert!(
        outs.iter().skip(1).all(|o| g.input(o).is_some()),
        "{outs:?}"
    );
    assert!(enc.param("decoder.layers.0.cross_attn.w_k").is_some());
    assert!(enc.param("decoder.layers.0.self_attn.w_q").is_none());

    // Cut without hoisting, the step reads the memory and the source.
    let plain = setup_unhoisted(1);
    let g = plain.step.graph();
    assert!(g.input("memory").is_some() && g.input("src").is_some());
    assert!(g
        .inputs
        .iter()
        .all(|&i| !g.source_name(i).unwrap().starts_with("static.")));
    assert_eq!(plain.encode.graph().outputs.len(), 1);
}

/// Graphs cut before hoisting (a checkpoint written by an earlier kiln) decode as before:
/// the same hypotheses as the hoisted pair, to the bit.
#[test]
fn unhoisted_steps_decode_as_the_hoisted_ones() {
    let opts = beam_four();
    let (s, p) = (setup(2), setup_unhoisted(2));
    let mut hoisted = CachedStep::new(&s.encode, &s.step, &s.params, 64);
    let mut plain = CachedStep::new(&p.encode, &p.step, &p.params, 64);
    let a = decode(&mut hoisted, &src(), &opts).unwrap();
    let b = decode(&mut plain, &src(), &opts).unwrap();
    assert_eq!(a, b);
}

#[test]
fn beam_search_with_the_cache_equals_full_recomputation() {
    for seed in [1, 2] {
        let s = setup(seed);
        let opts = beam_four();
        let mut cached = CachedStep::new(&s.encode, &s.step, &s.params, 64);
        let mut full = FullStep::new(&s.forward, &s.params, 64);
        let a = decode(&mut cached, &src(), &opts).unwrap();
        let b = decode(&mut full, &src(), &opts).unwrap();
        assert_eq!(a, b, "seed {seed}: cached and full decoding differ");
        for h in &a {
            assert!(h.score.is_finite() && h.score < 0.0);
            assert!(h.tokens.len() <= 9);
        }
    }
}

#[test]
fn greedy_with_the_cache_equals_full_recomputation() {
    let s = setup(3);
    let opts = DecodeOptions {
        greedy: true,
        beam: 1,
        penalty: LengthPenalty::None,
        max_len_b: 6,
        ..DecodeOptions::default()
    };
    let mut cached = CachedStep::new(&s.encode, &s.step, &s.params, 64);
    let mut full = FullStep::new(&s.forward, &s.params, 64);
    let a = decode(&mut cached, &src(), &opts).unwrap();
    let b = decode(&mut full, &src(), &opts).unwrap();
    assert_eq!(a, b);
    // An untrained model rarely stops early: the maximum length is reached.
    assert!(a.iter().any(|h| !h.tokens.is_empty()));
}

#[test]
fn beam_one_is_at_least_as_good_as_greedy_and_beam_four_at_least_as_beam_one() {
    let s = setup(4);
    let base = DecodeOptions {
        penalty: LengthPenalty::None,
        max_len_b: 5,
        ..DecodeOptions::default()
    };
    let run = |beam: usize| {
        let mut cached = CachedStep::new(&s.encode, &s.step, &s.params, 64);
        decode(
            &mut cached,
            &src(),
            &DecodeOptions {
                beam,
                ..base.clone()
            },
        )
        .unwrap()
    };
    let (one, four) = (run(1), run(4));
    for (x, y) in one.iter().zip(&four) {
        assert!(
            y.log_prob >= x.log_prob - 1e-9,
            "beam 4 found a worse hypothesis: {y:?} vs {x:?}"
        );
    }
}

/// The compiled step as an executor that reads no input with gathered rows: the decoder
/// copies the caches with `take_rows` before every step, as it does for the other
/// executors.
struct CopyFirst<'a>(&'a kiln_exec::compiled::Compiled);

impl Exec for CopyFirst<'_> {
    fn graph(&self) -> &Graph {
        self.0.graph()
    }
    fn run(
        &self,
        inputs: &BTreeMap<String, Tensor>,
        params: &BTreeMap<String, Tensor>,
        opts: &kiln_compiler::reference::RunOptions,
    ) -> Result<Vec<(String, Tensor)>, kiln_compiler::reference::ExecError> {
        self.0.run(inputs, params, opts)
    }
}

/// Beam search through the compiled step, whose concatenations read the caches with the
/// beams' rows gathered (`Exec::run_map_gathered`), gives the tokens and scores of the
/// same step fed caches that `take_rows` copied, to the bit — beams reordered, repeated
/// and finished sentences dropped along the way.
#[test]
fn beam_search_reading_gathered_caches_equals_copying_them() {
    use kiln_exec::compiled::Compiled;
    let s = setup(5);
    let encode = Compiled::from_graph(s.encode.graph().clone()).unwrap();
    let step = Compiled::from_graph(s.step.graph().clone()).unwrap();
    let caches: Vec<String> = step
        .graph()
        .inputs
        .iter()
        .filter_map(|&i| step.graph().source_name(i))
        .filter(|n| n.starts_with(kiln_compiler::ir::CACHE_PREFIX))
        .map(str::to_string)
        .collect();
    assert!(!caches.is_empty() && caches.iter().all(|c| step.folds_row_gather(c)));
    assert!(!step.folds_row_gather("tgt_in"));
    let opts = DecodeOptions {
        max_len_b: 8,
        ..beam_four()
    };
    let copy_first = CopyFirst(&step);
    let a = decode(
        &mut CachedStep::new(&encode, &step, &s.params, 64),
        &src(),
        &opts,
    )
    .unwrap();
    let b = decode(
        &mut CachedStep::new(&encode, &copy_first, &s.params, 64),
        &src(),
        &opts,
    )
    .unwrap();
    assert_eq!(a, b);
    assert!(a.iter().any(|h| h.tokens.len() > 2), "{a:?}");
}

/// Sentences of lengths 1 to 9 made of ids 4..63 (a deterministic mix), some repeated.
fn sentences(n: usize) -> Vec<Vec<i32>> {
    (0..n)
        .map(|i| {
            let len = 1 + (i * 7) % 9;
            (0..len)
                .map(|j| 4 + ((i * 31 + j * 17) % 60) as i32)
                .collect()
        })
        .collect()
}

/// `translate_nbest_ids` and `score_ids` give the same bits whether their batches run one
/// after another (each on every thread) or on 2 or 3 workers at once (each on one
/// thread), with more batches than workers, and in input order either way.
#[test]
fn decoding_workers_give_the_bits_of_one_worker() {
    use kiln_decode::translate::{score_ids, translate_nbest_ids};
    use kiln_exec::compiled::Compiled;
    let s = setup(7);
    let encode = Compiled::from_graph(s.encode.graph().clone()).unwrap();
    let step = Compiled::from_graph(s.step.graph().clone()).unwrap();
    let srcs = sentences(23);
    let refs: Vec<Vec<i32>> = srcs.iter().rev().cloned().collect();
    let opts = beam_four();
    // The 2 best of each sentence, in batches of 4, and the progress calls: how many and
    // the last count.
    let nbest = |workers: usize| {
        let (mut calls, mut last) = (0, 0);
        let hyps = translate_nbest_ids(
            StepModels {
                encode: &encode,
                step: &step,
                params: &s.params,
                vocab: 64,
            },
            &srcs,
            &opts,
            2,
            Schedule {
                batching: Batching::sentences(4),
                workers,
            },
            &mut |n| {
                calls += 1;
                last = n;
            },
        )
        .unwrap();
        (hyps, calls, last)
    };
    let scores = |workers: usize| {
        score_ids(
            StepModels {
                encode: &encode,
                step: &step,
                params: &s.params,
                vocab: 64,
            },
            (&srcs, &refs),
            &opts,
            Schedule {
                batching: Batching::sentences(4),
                workers,
            },
            &mut |_| {},
        )
        .unwrap()
    };
    let (one, calls, last) = nbest(1);
    assert_eq!((calls, last), (6, 23), "a progress call per batch of 4");
    assert!(one.iter().all(|h| h.len() == 2));
    assert!(one.iter().any(|h| h[0].tokens.len() > 1), "{one:?}");
    let scores_one = scores(1);
    for workers in [2, 3] {
        let (many, calls, last) = nbest(workers);
        assert_eq!((calls, last), (6, 23), "{workers} workers");
        for (a, b) in one.iter().zip(&many) {
            assert_eq!(a.len(), b.len());
            for (x, y) in a.iter().zip(b) {
                assert_eq!(x.tokens, y.tokens, "{workers} workers");
                assert_eq!(x.score.to_bits(), y.score.to_bits(), "{workers} workers");
                assert_eq!(
                    x.log_prob.to_bits(),
                    y.log_prob.to_bits(),
                    "{workers} workers"
                );
            }
        }
        let got = scores(workers);
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&scores_one), "{workers} workers");
    }
    // Against the reference executor, one sentence at a time: the same tokens.
    let reference = translate_nbest_ids(
        StepModels {
            encode: &s.encode,
            step: &s.step,
            params: &s.params,
            vocab: 64,
        },
        &srcs,
        &opts,
        1,
        Schedule {
            batching: Batching::sentences(1),
            workers: 2,
        },
        &mut |_| {},
    )
    .unwrap();
    for (a, b) in one.iter().zip(&reference) {
        assert_eq!(a[0].tokens, b[0].tokens);
    }
}

/// A batch that fails on a worker (an id outside the vocabulary) stops the decoding with
/// that error, not a hang or a panic, and later calls still decode.
#[test]
fn a_failing_batch_on_a_worker_is_an_error() {
    use kiln_decode::translate::translate_ids;
    use kiln_exec::compiled::Compiled;
    let s = setup(7);
    let encode = Compiled::from_graph(s.encode.graph().clone()).unwrap();
    let step = Compiled::from_graph(s.step.graph().clone()).unwrap();
    let translate = |srcs: &[Vec<i32>]| {
        translate_ids(
            StepModels {
                encode: &encode,
                step: &step,
                params: &s.params,
                vocab: 64,
            },
            srcs,
            &beam_four(),
            Schedule {
                batching: Batching::sentences(2),
                workers: 2,
            },
            &mut |_| {},
        )
        .map_err(|e| e.to_string())
    };
    let mut srcs = sentences(12);
    srcs[9] = vec![5, 900, 6];
    let err = translate(&srcs).unwrap_err();
    assert!(err.contains("900"), "{err}");
    srcs[9] = vec![5, 6];
    let ok = translate(&srcs).unwrap();
    assert_eq!(ok.len(), 12);
}

/// A decoder gives the same bits for a batch whether it is its first or a later one, and
/// so does a second decoder: every step reads the same transposed copy of the tied
/// embedding (before, a decoder's first step read the view in place, which the GEMM
/// crate rounds differently).
#[test]
fn a_decoders_first_batch_gives_the_bits_of_its_later_ones() {
    use kiln_decode::search::{decode_nbest, Hypothesis};
    use kiln_exec::compiled::Compiled;
    let s = setup(7);
    let encode = Compiled::from_graph(s.encode.graph().clone()).unwrap();
    let step = Compiled::from_graph(s.step.graph().clone()).unwrap();
    let bits = |h: &[Vec<Hypothesis>]| -> Vec<(Vec<i32>, u64, u64)> {
        h.iter()
            .flatten()
            .map(|x| (x.tokens.clone(), x.score.to_bits(), x.log_prob.to_bits()))
            .collect()
    };
    let mut m = CachedStep::new(&encode, &step, &s.params, 64);
    let first = bits(&decode_nbest(&mut m, &src(), &beam_four(), 2).unwrap());
    let again = bits(&decode_nbest(&mut m, &src(), &beam_four(), 2).unwrap());
    assert_eq!(first, again);
    assert_eq!(step.weight_copies(), 1, "the tied embedding, copied once");
    let mut other = CachedStep::new(&encode, &step, &s.params, 64);
    assert_eq!(
        first,
        bits(&decode_nbest(&mut other, &src(), &beam_four(), 2).unwrap())
    );
}

/// Batch invariance (#60): a sentence's translation and its scores are the same bits
/// whatever else is in its batch and however many sentences a batch holds, on the
/// compiled executor: shuffled inputs in batches of 2 to 9 (lengths 1 to 9), and 40
/// sentences of lengths 4 to 40 in one batch, against each sentence alone. (The softmax
/// sums its row in an order fixed by the element's index, so the masked keys a padded
/// batch adds change no bit.)
#[test]
fn a_sentences_translation_does_not_depend_on_its_batch() {
    batch_invariance(None);
}

/// The same with the weights' products in int8 (`--gemm-type int8`): each row of an
/// activation is quantized on its own and every sum is exact, so nothing of a batch's
/// other rows reaches a sentence's bits.
#[test]
fn a_sentences_int8_translation_does_not_depend_on_its_batch() {
    let int8 = kiln_exec::compiled::Kernel16::Int8;
    if let Err(why) = int8.available() {
        eprintln!("skipped: {why}");
        return;
    }
    batch_invariance(Some(int8));
}

fn batch_invariance(kernel: Option<kiln_exec::compiled::Kernel16>) {
    use kiln_decode::translate::translate_nbest_ids;
    use kiln_exec::compiled::Compiled;
    let s = setup(7);
    let mut encode = Compiled::from_graph(s.encode.graph().clone()).unwrap();
    let mut step = Compiled::from_graph(s.step.graph().clone()).unwrap();
    encode.set_bf16_kernel(kernel).unwrap();
    step.set_bf16_kernel(kernel).unwrap();
    let srcs = sentences(17);
    let opts = beam_four();
    let run = |srcs: &[Vec<i32>], batch: usize| {
        let hyps = translate_nbest_ids(
            StepModels {
                encode: &encode,
                step: &step,
                params: &s.params,
                vocab: 64,
            },
            srcs,
            &opts,
            1,
            Schedule {
                batching: Batching::sentences(batch),
                workers: 1,
            },
            &mut |_| {},
        )
        .unwrap();
        hyps.into_iter()
            .map(|mut h| {
                let h = h.remove(0);
                (h.tokens, h.score, h.log_prob)
            })
            .collect::<Vec<_>>()
    };
    let alone: Vec<_> = srcs
        .iter()
        .map(|x| run(std::slice::from_ref(x), 1).remove(0))
        .collect();
    let mut seed = 12345u64;
    let mut next = || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) as usize
    };
    for _ in 0..6 {
        let mut order: Vec<usize> = (0..srcs.len()).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, next() % (i + 1));
        }
        let batch = 2 + next() % 8;
        let shuffled: Vec<Vec<i32>> = order.iter().map(|&i| srcs[i].clone()).collect();
        let got = run(&shuffled, batch);
        for (k, &i) in order.iter().enumerate() {
            let ((t, score, lp), (want_t, want_score, want_lp)) = (&got[k], &alone[i]);
            assert_eq!(t, want_t, "sentence {i} in batches of {batch}");
            for (x, want) in [(score, want_score), (lp, want_lp)] {
                assert_eq!(
                    x.to_bits(),
                    want.to_bits(),
                    "sentence {i} in batches of {batch}: {x} against {want} alone"
                );
            }
        }
    }
    if kernel.is_some() {
        assert!(
            step.packed_weights().0 > 0,
            "the step packed no weight for its products"
        );
    }
    let long: Vec<Vec<i32>> = (0..40)
        .map(|i| vec![4 + (i % 50) as i32; 4 + (i * 7) % 37])
        .collect();
    let together = run(&long, 40);
    for (i, x) in long.iter().enumerate() {
        let want = run(std::slice::from_ref(x), 1).remove(0);
        assert_eq!(together[i].0, want.0, "sentence {i} of length {}", x.len());
        assert_eq!(
            (together[i].1.to_bits(), together[i].2.to_bits()),
            (want.1.to_bits(), want.2.to_bits()),
            "sentence {i} of length {}",
            x.len()
        );
    }
}
