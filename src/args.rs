//! What several commands' arguments share: the spec and its overrides, the GEMM type,
//! the thread count, and the checks of numeric values.

use kiln_exec::executor::ExecutorKind;
use std::path::PathBuf;

use kiln_decode::search::{DecodeOptions, EarlyStop, LengthPenalty};
use kiln_decode::translate::Batching;
use kiln_dsl::{Error, Mode, Options};

use crate::plain;

/// `--gemm-type`: how the compiled executor runs its large matrix products.
#[derive(clap::Args, Clone)]
pub(crate) struct GemmArgs {
    /// The compiled executor's large matrix products (Marian's --gemm-type): `f32` (the
    /// default), `16bit` (the best 16-bit kernel this CPU has), or one kernel: `amx`
    /// (bf16 on AMX tiles), `dot` (bf16 with AVX-512's VDPBF16PS), `fp16` (AVX512-FP16),
    /// `int16` (AVX2's VPMADDWD); for translating and scoring, `int8` (weights per output
    /// channel and activations per row in int8, exact int32 sums: AVX-512 VNNI, AVX-VNNI
    /// or AVX2).
    #[arg(long, value_name = "TYPE", value_parser = kiln_exec::compiled::GemmType::NAMES)]
    pub gemm_type: Option<String>,
}

/// The search `kiln translate` runs: beam or greedy, the length penalty, the stopping
/// rule, the length limit and whether `<unk>` may be emitted (the validation's are
/// `valid.*` in the training configuration).
#[derive(clap::Args, Clone, Debug)]
pub(crate) struct SearchArgs {
    /// Beam width, 1 to 256.
    #[arg(long, default_value_t = 4, allow_hyphen_values = true, value_parser = beam_width)]
    pub beam: usize,
    /// Length penalty exponent.
    #[arg(long, default_value_t = 0.6, value_parser = finite_f64)]
    pub alpha: f64,
    /// `gnmt` ((5+len)/6)^α, `len_pow` len^α, or `none`.
    #[arg(long, default_value = "gnmt", value_parser = ["gnmt", "len_pow", "none"])]
    pub length_penalty: String,
    /// When beam search is done with a sentence: `k-finished` once `beam` hypotheses
    /// have finished (fairseq's and CTranslate2's rule), `exact` only once no live
    /// hypothesis can still beat them (slower; the search's own best).
    #[arg(long, default_value = "k-finished",
          value_parser = kiln_decode::search::EarlyStop::NAMES)]
    pub early_stop: String,
    /// Maximum output length = a · source length + b (`<eos>` included), capped by the
    /// positions the model takes (its `max_len`).
    #[arg(long, default_value_t = 1.0, value_parser = non_negative_f64)]
    pub max_len_a: f64,
    #[arg(long, default_value_t = 50)]
    pub max_len_b: usize,
    /// Greedy decoding instead of beam search.
    #[arg(long)]
    pub greedy: bool,
    /// Let the search emit `<unk>` (Marian's --allow-unk), written as `<unk>` in the
    /// output; by default it is never emitted and the next best token is taken.
    #[arg(long)]
    pub allow_unk: bool,
}

impl SearchArgs {
    /// The search these flags ask for, checked; `nbest` (`--nbest`) must not ask for
    /// more hypotheses than the search keeps.
    pub(crate) fn decode_options(&self, nbest: Option<usize>) -> Result<DecodeOptions, Error> {
        let a = self;
        let penalty = LengthPenalty::parse(&a.length_penalty, a.alpha).ok_or_else(|| {
            plain(
                "kiln::translate",
                format!("unknown length penalty `{}`", a.length_penalty),
                Some("use gnmt, len_pow or none".to_string()),
            )
        })?;
        let early_stop = EarlyStop::parse(&a.early_stop).ok_or_else(|| {
            plain(
                "kiln::translate",
                format!("unknown stopping rule `{}`", a.early_stop),
                Some(format!("use {}", EarlyStop::NAMES.join(" or "))),
            )
        })?;
        let opts = DecodeOptions {
            beam: a.beam,
            greedy: a.greedy,
            allow_unk: a.allow_unk,
            penalty,
            early_stop,
            max_len_a: a.max_len_a,
            max_len_b: a.max_len_b,
            ..DecodeOptions::default()
        };
        if let Some(n) = nbest {
            let keep = if opts.greedy { 1 } else { opts.beam };
            if n > keep {
                return Err(plain(
                    "kiln::translate",
                    format!(
                        "--nbest {n} asks for more hypotheses than the search keeps ({keep}, {})",
                        if opts.greedy {
                            "greedy".to_string()
                        } else {
                            format!("--beam {}", opts.beam)
                        }
                    ),
                    Some(if opts.greedy {
                        "drop --greedy, or ask for --nbest 1".to_string()
                    } else {
                        format!("use --beam {n} or more, or --nbest {keep} or fewer")
                    }),
                ));
            }
        }
        Ok(opts)
    }
}

/// How `kiln translate` and `kiln score` run: their batches (`--batch`, `--max-tokens`:
/// [`Batching`]), executor, products, threads and workers.
#[derive(clap::Args, Clone)]
pub(crate) struct DecodeRunArgs {
    /// Sentences (or sentence pairs) decoded together, sorted by length first; each takes
    /// `beam` rows. 32 is fastest on 2 CPU cores; a GPU wants more.
    #[arg(long, default_value_t = kiln_decode::translate::TRANSLATE_BATCH,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub batch: usize,
    /// Also cap each batch at N source tokens, padding included (its sentences times the
    /// longest), as fairseq's --max-tokens; a sentence longer than N is a batch alone.
    #[arg(long, value_name = "N",
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_tokens: Option<usize>,
    /// `compiled` (generated kernels), `eager`, `reference`, or `cuda` (a `--target
    /// cuda` artifact's kernels on the GPU).
    #[arg(long, default_value = "compiled",
          value_parser = executor_kind(&["compiled", "eager", "reference", "cuda"]))]
    pub executor: ExecutorKind,
    #[command(flatten)]
    pub gemm: GemmArgs,
    /// Worker threads (default: one per core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Batches decoded at once, each by one worker on one thread (default: one per
    /// thread on the CPU, as Marian's --cpu-threads; 1 on the GPU). 1 decodes the
    /// batches one after another, each on every thread. The output is the same.
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub workers: Option<usize>,
}

impl DecodeRunArgs {
    pub(crate) fn batching(&self) -> Batching {
        Batching {
            sentences: self.batch,
            max_tokens: self.max_tokens,
        }
    }

    /// Sets the thread count and the products for the command's executor.
    pub(crate) fn apply(&self) -> Result<(), Error> {
        set_threads(self.threads)?;
        self.gemm.apply(self.executor)
    }
}

/// `--executor`'s parser: one of `names` (each an [`ExecutorKind`]'s name), typed.
pub(crate) fn executor_kind(
    names: &'static [&'static str],
) -> impl clap::builder::TypedValueParser<Value = ExecutorKind> {
    use clap::builder::TypedValueParser as _;
    clap::builder::PossibleValuesParser::new(names)
        .map(|s| ExecutorKind::parse(&s).expect("`names` lists executor kinds only"))
}

impl GemmArgs {
    /// Makes the process's compiled executors run their products as asked, for a command
    /// that runs `executor`; an error where the CPU has no such kernel, or where a 16-bit
    /// type is asked of another executor.
    pub(crate) fn apply(&self, executor: ExecutorKind) -> Result<(), Error> {
        let Some(name) = &self.gemm_type else {
            return Ok(());
        };
        use kiln_exec::compiled::GemmType;
        let Some(t) = GemmType::parse(name) else {
            return Err(plain(
                "kiln::gemm",
                format!("--gemm-type {name} is not a GEMM type"),
                Some(format!("use one of {}", GemmType::NAMES.join(", "))),
            ));
        };
        if t != GemmType::F32 && executor != ExecutorKind::Compiled {
            return Err(plain(
                "kiln::gemm",
                format!(
                    "--gemm-type {name} chooses the compiled executor's matrix products, \
                     but this runs the {executor} executor"
                ),
                Some("add `--executor compiled`, or leave --gemm-type out".to_string()),
            ));
        }
        kiln_exec::compiled::set_process_gemm_type(t)
            .map(|_| ())
            .map_err(|why| {
                plain(
                    "kiln::gemm",
                    format!("--gemm-type {name}: {why}"),
                    Some(
                        "use --gemm-type f32, or 16bit for the best 16-bit kernel this CPU has"
                            .to_string(),
                    ),
                )
            })
    }
}

#[derive(clap::Args, Clone)]
pub(crate) struct SpecArgs {
    /// The model spec (a `.kiln` file).
    pub spec: PathBuf,
    /// Override a model parameter: `--set d_model=256` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Which model of the file, when it defines several.
    #[arg(long)]
    pub model: Option<String>,
    /// Which graph to elaborate: `eval` (inference), `train` (with dropout) or `decode`
    /// (one incremental decoder step with key/value caches).
    #[arg(long, default_value = "eval", value_parser = ["eval", "train", "decode"])]
    pub mode: String,
}

impl SpecArgs {
    pub fn options(&self) -> Options {
        Options {
            overrides: self.set.clone(),
            mode: match self.mode.as_str() {
                "train" => Mode::Train,
                "decode" => Mode::Decode,
                _ => Mode::Eval,
            },
            model: self.model.clone(),
        }
    }
}

/// More worker threads than this many per core only slow a run down (100,000 of them
/// hung it), so they are refused.
const THREADS_PER_CORE_MAX: usize = 4;

/// Sizes the global thread pool (before any parallel work); 0 is one thread per core.
pub(crate) fn set_threads(threads: Option<usize>) -> Result<(), Error> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let max = cores * THREADS_PER_CORE_MAX;
    if let Some(n) = threads.filter(|&n| n > max) {
        return Err(plain(
            "kiln::threads",
            format!(
                "{n} threads is more than {THREADS_PER_CORE_MAX} per core ({cores} core(s) here)"
            ),
            Some(format!(
                "use at most {max} (--threads, or train.threads in the configuration), or 0 \
                 for one per core"
            )),
        ));
    }
    if let Some(n) = threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .map_err(|e| {
                plain(
                    "kiln::threads",
                    format!("cannot start {n} threads: {e}"),
                    None,
                )
            })?;
    }
    Ok(())
}

/// A `--beam` value: a whole number from 1 to [`kiln_decode::search::MAX_BEAM`].
pub(crate) fn beam_width(s: &str) -> Result<usize, String> {
    let max = kiln_decode::search::MAX_BEAM;
    match s.parse::<usize>() {
        Ok(n) if (1..=max).contains(&n) => Ok(n),
        _ => Err(format!(
            "`{s}` is not a beam width: give a whole number from 1 to {max}"
        )),
    }
}

/// A `--flag` value that must be a finite number.
pub(crate) fn finite_f64(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() => Ok(v),
        Ok(_) => Err(format!("`{s}` is not a finite number")),
        Err(e) => Err(format!("`{s}`: {e}")),
    }
}

/// A `--flag` value that must be a finite number, 0 or more.
pub(crate) fn non_negative_f64(s: &str) -> Result<f64, String> {
    let v = finite_f64(s)?;
    if v < 0.0 {
        return Err(format!("`{s}` is negative; give 0 or more"));
    }
    Ok(v)
}

/// A `--max-steps` value: a whole number of steps from the run's start. `+N` reads as
/// `N` to a number parser but means "N more" to a person, so it is refused.
pub(crate) fn total_steps(s: &str) -> Result<u64, String> {
    if let Some(more) = s.strip_prefix('+') {
        return Err(format!(
            "`{s}` reads as a number of steps more, but --max-steps is the step the run \
             trains to, counted from its start: give that total (the run's step plus {more})"
        ));
    }
    s.parse::<u64>()
        .map_err(|_| format!("`{s}` is not a whole number of steps"))
}
