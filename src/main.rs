//! The `kiln` command line: parses arguments and calls the crates. No algorithms here.

use std::io::{IsTerminal, Write as _};
use std::path::PathBuf;
use std::process::ExitCode;

use std::collections::BTreeMap;

use clap::{Parser, Subcommand};
use kiln_compiler::init::init_params;
use kiln_compiler::printer::print_graph;
use kiln_compiler::reference::{Precision, RunOptions};
use kiln_compiler::summary::{group_digits, Summary};
use kiln_compiler::tensor::{load_safetensors, save_safetensors, Tensor, TensorFileError};
use kiln_dsl::{Error, Mode, Options};
use kiln_runtime::bleu::{corpus_bleu, BleuOptions, Smooth, Tokenize};
use kiln_runtime::{check_inputs, check_weights, Entry, GraphKind, RuntimeError};
use outputs::Output;

/// `println!` for a command's output (a graph, a summary, a report): a reader that went
/// away (`kiln graph … | head`) ends the command quietly, as `grep` would end, instead of a
/// panic; any other write error is an error exit.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout().lock(), $($arg)*) {
            $crate::stdout_failed(e)
        }
    }};
}

/// `print!` with [`outln!`]'s handling of a closed standard output.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = write!(std::io::stdout().lock(), $($arg)*) {
            $crate::stdout_failed(e)
        }
    }};
}

/// Ends the process after a failed write to standard output: quietly (status 0) when the
/// reader closed the pipe, else with the error (status 1).
fn stdout_failed(e: std::io::Error) -> ! {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(0);
    }
    let _ = writeln!(
        std::io::stderr(),
        "kiln: cannot write to standard output: {e}"
    );
    std::process::exit(1);
}

mod bench_cmd;
mod compile_cmds;
mod compile_flags;
mod demo;
mod outputs;
mod train_cmds;

#[derive(Parser)]
#[command(name = "kiln", version, about = "kiln: a declarative model compiler")]
struct Cli {
    /// Skip the check that a large allocation fits in the memory the system leaves this
    /// process (before 256 MiB or more, kiln compares with the available memory and swap,
    /// the cgroup's limit and `ulimit -v`).
    #[arg(long, global = true)]
    no_memory_check: bool,
    /// Where the CUDA executor keeps the PTX NVRTC compiled, between processes (`off`:
    /// nowhere). Default: `$XDG_CACHE_HOME/kiln/ptx`, else `$HOME/.cache/kiln/ptx`.
    #[arg(long, global = true, value_name = "DIR")]
    ptx_cache: Option<String>,
    #[command(subcommand)]
    command: Command,
}

/// `--gemm-type`: how the compiled executor runs its large matrix products.
#[derive(clap::Args, Clone)]
pub(crate) struct GemmArgs {
    /// The compiled executor's large matrix products (Marian's --gemm-type): `f32` (the
    /// default), `16bit` (the best 16-bit kernel this CPU has), or one kernel: `amx`
    /// (bf16 on AMX tiles), `dot` (bf16 with AVX-512's VDPBF16PS), `fp16` (AVX512-FP16),
    /// `int16` (AVX2's VPMADDWD). Without it, KILN_CPU_BF16 decides.
    #[arg(long, value_name = "TYPE", value_parser = kiln_runtime::compiled::GemmType::NAMES)]
    pub gemm_type: Option<String>,
}

impl GemmArgs {
    /// Makes the process's compiled executors run their products as asked, for a command
    /// that runs `executor`; an error where the CPU has no such kernel, or where a 16-bit
    /// type is asked of another executor.
    pub(crate) fn apply(&self, executor: &str) -> Result<(), Error> {
        let Some(name) = &self.gemm_type else {
            return Ok(());
        };
        use kiln_runtime::compiled::GemmType;
        let Some(t) = GemmType::parse(name) else {
            return Err(plain(
                "kiln::gemm",
                format!("--gemm-type {name} is not a GEMM type"),
                Some(format!("use one of {}", GemmType::NAMES.join(", "))),
            ));
        };
        if t != GemmType::F32 && executor != "compiled" {
            return Err(plain(
                "kiln::gemm",
                format!(
                    "--gemm-type {name} chooses the compiled executor's matrix products, \
                     but this runs the {executor} executor"
                ),
                Some("add `--executor compiled`, or leave --gemm-type out".to_string()),
            ));
        }
        kiln_runtime::compiled::set_process_gemm_type(t)
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
struct SpecArgs {
    /// The model spec (a `.kiln` file).
    spec: PathBuf,
    /// Override a model parameter: `--set d_model=256` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Which model of the file, when it defines several.
    #[arg(long)]
    model: Option<String>,
    /// Which graph to elaborate: `eval` (inference), `train` (with dropout) or `decode`
    /// (one incremental decoder step with key/value caches).
    #[arg(long, default_value = "eval", value_parser = ["eval", "train", "decode"])]
    mode: String,
}

impl SpecArgs {
    fn options(&self) -> Options {
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

#[derive(Subcommand)]
enum Command {
    /// Check a spec: parameters, dims, inputs, outputs, node count.
    Check {
        #[command(flatten)]
        spec: SpecArgs,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Print the IR graph of a spec in its deterministic text form.
    Graph {
        #[command(flatten)]
        spec: SpecArgs,
    },
    /// Optimize an entry point and explain it: rules fired, e-graph sizes and stop
    /// reasons per phase, kernels per kind before and after, bytes moved, time spent.
    Explain {
        #[command(flatten)]
        args: compile_cmds::OptArgs,
        /// Also print the kernel graph and each fusion.
        #[arg(long)]
        kernels: bool,
        #[command(flatten)]
        fusions: compile_flags::FusionFlags,
    },
    /// Compile a spec into an artifact directory (`-o DIR`: kernel graphs, memory plans,
    /// CLIF code, weights) that runs without the spec — every entry point, or those of
    /// `--entries` — or, with `--entry` (or without `-o`), one entry point into its kernel
    /// graph (fused kernels, deterministic text). With
    /// `--config` the artifact is what `kiln train` needs (tokenizer included); with
    /// `--from-model` it is a trained model ready for `kiln translate`.
    Compile {
        /// The model spec (a `.kiln` file); not with `--config` or `--from-model`.
        #[arg(required_unless_present_any = ["config", "from_model"])]
        spec: Option<PathBuf>,
        /// Override a model parameter: `--set d_model=256` (repeatable).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        /// Which model of the file, when it defines several.
        #[arg(long)]
        model: Option<String>,
        /// Compile this one entry point into its kernel graph (text, to `-o FILE` or
        /// standard output; `forward` when neither `--entry` nor `-o` is given): forward,
        /// loss, encode, decode_step, train_step, or adam_update.
        #[arg(long, value_parser = kiln_runtime::COMPILED_ENTRIES, conflicts_with = "entries")]
        entry: Option<String>,
        #[command(flatten)]
        flags: compile_flags::CompileFlags,
        /// Compile the spec of this training configuration, at its BPE vocabulary's size,
        /// with its first weights (`train.seed`) and its tokenizer, into the artifact
        /// `kiln train --artifact DIR` starts from (entries: train_step, loss, encode,
        /// decode_step).
        #[arg(long, conflicts_with_all = ["spec", "from_model", "set", "model"])]
        config: Option<PathBuf>,
        /// Compile a trained model (checkpoint, run directory or `kiln average` output)
        /// with its weights and tokenizer, for `kiln translate --model DIR` (entries:
        /// encode, decode_step).
        #[arg(long = "from-model", conflicts_with_all = ["spec", "set", "model"])]
        from_model: Option<PathBuf>,
        /// The entry points of the artifact directory (`-o DIR`), e.g.
        /// `--entries train_step,encode,decode_step` (default: all of forward, loss,
        /// encode, decode_step and train_step).
        #[arg(long, value_delimiter = ',', value_parser = kiln_runtime::COMPILED_ENTRIES)]
        entries: Vec<String>,
        /// The artifact directory to write, or with `--entry` the kernel graph's file
        /// (default: the kernel graph on standard output).
        #[arg(short = 'o', long = "output")]
        output: Option<PathBuf>,
        /// Run the program and the unoptimized graph on random inputs (reference
        /// executor) and fail unless they agree.
        #[arg(long)]
        validate: bool,
        /// Seed of the validation's inputs and weights (and an artifact's weights).
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Describe a compiled artifact (format, model, kernels, code size, memory plan and
    /// arena bytes at given dims) or a model directory (a checkpoint, a run's newest
    /// checkpoint or `kiln average`'s output: model, parameters, vocabulary, training
    /// state, the run's last logged losses), after checking it.
    Inspect {
        /// The artifact directory (`kiln compile --entries … -o DIR`), or a checkpoint,
        /// run or averaged model directory.
        dir: PathBuf,
        /// Batch size for the arena sizes.
        #[arg(long, default_value_t = 32)]
        batch: i64,
        /// Source length for the arena sizes.
        #[arg(long = "src-len", default_value_t = 25)]
        src_len: i64,
        /// Target length for the arena sizes.
        #[arg(long = "tgt-len", default_value_t = 25)]
        tgt_len: i64,
        /// Cached positions (decode_step) for the arena sizes.
        #[arg(long, default_value_t = 0)]
        past: i64,
        /// Also print each memory plan (slots and their buffers).
        #[arg(long)]
        plan: bool,
        /// Compile a `--target cuda` artifact's CUDA C with NVRTC here (it needs no GPU,
        /// only libnvrtc) and print the assembler's registers, shared memory and spills;
        /// fails if NVRTC rejects it.
        #[arg(long)]
        nvrtc: bool,
    },
    /// Time an entry point (median ms/step, tokens/s, peak RSS).
    Bench {
        #[command(flatten)]
        args: bench_cmd::BenchArgs,
    },
    /// Initialize a spec's parameters (seeded, deterministic) into a safetensors file.
    Init {
        #[command(flatten)]
        spec: SpecArgs,
        /// The seed; the same spec and seed give the same bits.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Where to write the weights.
        #[arg(short = 'o', long = "output")]
        output: PathBuf,
    },
    /// Run an entry point of a spec (reference executor by default), or of a compiled
    /// artifact directory given in place of the spec (its generated kernels by default,
    /// its own weights unless `--weights`).
    Run {
        #[command(flatten)]
        spec: SpecArgs,
        /// The entry point: `forward`, `loss`, `encode`, `decode_step` or `train_step`.
        #[arg(long, default_value = "forward")]
        entry: String,
        /// A safetensors file with one tensor per input, named as in the spec.
        #[arg(long)]
        inputs: PathBuf,
        /// Weights (from `kiln init` or training); without it, weights are initialized
        /// from `--seed`.
        #[arg(long)]
        weights: Option<PathBuf>,
        /// Seed for weight initialization (without `--weights`) and dropout.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Working precision of the reference executor.
        #[arg(long, default_value = "f32", value_parser = ["f32", "f64"])]
        precision: String,
        /// The training step the dropout masks are drawn for (`train_step`).
        #[arg(long, default_value_t = 0)]
        step: u32,
        /// `reference` (plain loops, the oracle; the default for a spec), `eager` (op by
        /// op, fast GEMM), `compiled` (the optimized program as generated code; the
        /// default for an artifact) or `cuda` (a `--target cuda` artifact's CUDA C on the
        /// GPU).
        #[arg(long, value_parser = ["reference", "eager", "compiled", "cuda"])]
        executor: Option<String>,
        #[command(flatten)]
        gemm: GemmArgs,
        /// Where to write the outputs.
        #[arg(short = 'o', long = "output")]
        output: PathBuf,
    },
    /// Corpus BLEU with sacreBLEU's semantics (13a tokens, no smoothing by default).
    Bleu {
        /// Reference file(s), one segment per line (repeat for several references).
        #[arg(long = "ref", required = true)]
        refs: Vec<PathBuf>,
        /// Hypothesis file; standard input when absent.
        hyp: Option<PathBuf>,
        /// Lowercase before tokenizing.
        #[arg(long)]
        lowercase: bool,
        /// Tokenizer: `13a` or `none`.
        #[arg(long, default_value = "13a", value_parser = ["13a", "none"])]
        tokenize: String,
        /// Smoothing: `none`, `exp`, `floor` or `add-k`.
        #[arg(long, default_value = "none", value_parser = ["none", "exp", "floor", "add-k"])]
        smooth: String,
        /// The value for `floor` (default 0.1) or `add-k` (default 1).
        #[arg(long)]
        smooth_value: Option<f64>,
        /// Print only the score.
        #[arg(long)]
        score_only: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Train a model with the paper's recipe (a YAML configuration).
    Train {
        /// The configuration of a new run.
        #[arg(long, conflicts_with = "resume")]
        config: Option<PathBuf>,
        /// Continue the run in this directory from its newest checkpoint.
        #[arg(long)]
        resume: Option<PathBuf>,
        /// Override `train.max_steps`.
        #[arg(long)]
        max_steps: Option<u64>,
        /// Override `train.max_seconds` (stop after this long, with a checkpoint).
        #[arg(long)]
        max_seconds: Option<u64>,
        /// Override `checkpoint.dir` (the run directory).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Start from this compiled artifact (`kiln compile --config CONFIG.yaml -o DIR`)
        /// instead of compiling the spec: sets `model.artifact`.
        #[arg(long, conflicts_with = "resume")]
        artifact: Option<PathBuf>,
        /// Worker threads (default: one per core).
        #[arg(long)]
        threads: Option<usize>,
        /// Override `train.gemm_type` (see `kiln run --help`; a resumed run keeps its own).
        #[arg(long, value_name = "TYPE", conflicts_with = "resume",
              value_parser = kiln_runtime::compiled::GemmType::NAMES)]
        gemm_type: Option<String>,
        /// No progress output.
        #[arg(long)]
        quiet: bool,
    },
    /// Translate lines of text (standard input, or --input) with a trained model.
    Translate {
        /// A checkpoint directory, a run directory (its newest checkpoint), the output of
        /// `kiln average`, or a compiled artifact (`kiln compile --from-model`).
        #[arg(long, visible_alias = "model")]
        checkpoint: PathBuf,
        /// Read sentences from this file instead of standard input.
        #[arg(long)]
        input: Option<PathBuf>,
        /// Beam width, 1 to 256.
        #[arg(long, default_value_t = 4, allow_hyphen_values = true, value_parser = beam_width)]
        beam: usize,
        /// Length penalty exponent.
        #[arg(long, default_value_t = 0.6, value_parser = finite_f64)]
        alpha: f64,
        /// `gnmt` ((5+len)/6)^α, `len_pow` len^α, or `none`.
        #[arg(long, default_value = "gnmt", value_parser = ["gnmt", "len_pow", "none"])]
        length_penalty: String,
        /// Maximum output length = a · source length + b (`<eos>` included), capped by the
        /// positions the model takes (its `max_len`).
        #[arg(long, default_value_t = 1.0, value_parser = non_negative_f64)]
        max_len_a: f64,
        #[arg(long, default_value_t = 50)]
        max_len_b: usize,
        /// Greedy decoding instead of beam search.
        #[arg(long)]
        greedy: bool,
        /// Print each sentence's N best hypotheses (N ≤ beam), best first, in the Moses
        /// n-best format that Marian writes: `LINE ||| TEXT ||| log_prob= LP ||| SCORE`,
        /// LINE counting input lines from 0, LP the sum of the token log-probabilities
        /// (`<eos>` included) and SCORE that divided by the length penalty.
        #[arg(long, value_name = "N",
              value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
        nbest: Option<usize>,
        /// Sentences decoded together (sorted by length first), each with `beam` rows.
        /// 32 is fastest on 2 CPU cores; a GPU wants more.
        #[arg(long, default_value_t = kiln_runtime::train::TRANSLATE_BATCH,
              value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
        batch: usize,
        /// `compiled` (generated kernels), `eager`, `reference`, or `cuda` (a `--target
        /// cuda` artifact's kernels on the GPU).
        #[arg(long, default_value = "compiled", value_parser = ["compiled", "eager", "reference", "cuda"])]
        executor: String,
        #[command(flatten)]
        gemm: GemmArgs,
        /// Worker threads (default: one per core).
        #[arg(long)]
        threads: Option<usize>,
        /// Batches decoded at once, each by one worker on one thread (default: one per
        /// thread on the CPU, as Marian's --cpu-threads; 1 on the GPU). 1 decodes the
        /// batches one after another, each on every thread. The output is the same.
        #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
        workers: Option<usize>,
    },
    /// Score reference translations with a trained model (teacher forcing, as fairseq's
    /// --score-reference and marian-scorer): each pair's log-probability, one per line,
    /// and the corpus cross-entropy and perplexity.
    Score {
        /// A checkpoint directory, a run directory (its newest checkpoint), the output of
        /// `kiln average`, or a compiled artifact (`kiln compile --from-model`).
        #[arg(long, visible_alias = "model")]
        checkpoint: PathBuf,
        /// Source sentences, one per line.
        #[arg(long)]
        src: PathBuf,
        /// Their translations, one per line, as many lines as --src.
        #[arg(long = "ref")]
        reference: PathBuf,
        /// Print each log-probability divided by the translation's length in tokens
        /// (`<eos>` included) instead of the sum.
        #[arg(long)]
        normalize: bool,
        /// Sentence pairs scored together (sorted by length first).
        #[arg(long, default_value_t = kiln_runtime::train::TRANSLATE_BATCH,
              value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
        batch: usize,
        /// `compiled` (generated kernels), `eager`, `reference`, or `cuda` (a `--target
        /// cuda` artifact's kernels on the GPU).
        #[arg(long, default_value = "compiled", value_parser = ["compiled", "eager", "reference", "cuda"])]
        executor: String,
        #[command(flatten)]
        gemm: GemmArgs,
        /// Worker threads (default: one per core).
        #[arg(long)]
        threads: Option<usize>,
        /// Batches decoded at once, each by one worker on one thread (default: one per
        /// thread on the CPU, as Marian's --cpu-threads; 1 on the GPU). 1 decodes the
        /// batches one after another, each on every thread. The output is the same.
        #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
        workers: Option<usize>,
    },
    /// Average the weights of checkpoints (the paper averages the last 5 or 20).
    Average {
        /// Checkpoint directories or safetensors weight files; with `--last`, one run
        /// directory.
        #[arg(required = true)]
        inputs: Vec<PathBuf>,
        /// Average the run's last N checkpoints (fairseq's --num-update-checkpoints).
        #[arg(long, value_name = "N",
              value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
        last: Option<usize>,
        /// A directory (a model directory for `kiln translate`) or a `.safetensors` file.
        #[arg(short = 'o', long = "output")]
        output: PathBuf,
    },
    /// Write a model's weights under another framework's names.
    Export {
        #[arg(long, default_value = "torch")]
        format: String,
        /// A model/checkpoint directory or a safetensors weights file.
        input: PathBuf,
        #[arg(short = 'o', long = "output")]
        output: PathBuf,
    },
    /// Read weights written under another framework's names.
    Import {
        #[arg(long, default_value = "torch")]
        format: String,
        input: PathBuf,
        #[arg(short = 'o', long = "output")]
        output: PathBuf,
    },
    /// Run the main job on an embedded default: generate a task, train, translate, score.
    Demo {
        /// Training time in seconds.
        #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
        seconds: u64,
        /// Train for exactly this many steps instead (deterministic; overrides --seconds).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        steps: Option<u64>,
        /// Where to write the generated data and the run (default: a temporary folder).
        #[arg(long)]
        dir: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let color = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
            // Not `eprint!`: a closed standard error must not turn the failure into a panic.
            let _ = write!(std::io::stderr(), "{}", e.render(color));
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<(), Error> {
    kiln_compiler::memory::set_enabled(!cli.no_memory_check);
    // The environment is read here, at the command line's edge: the user's directories,
    // and the tests' switch for the emulated CUDA device (with the C++ compiler it uses).
    let var = |k: &str| std::env::var(k).ok();
    use kiln_runtime::cuda::emulate;
    emulate::configure(
        var(emulate::EMULATE_ENV).as_deref(),
        var(emulate::REFUSE_BIAS_GRAD_ENV).is_some(),
        var("CXX"),
    );
    kiln_runtime::cuda::ptx_cache::set_dir(kiln_runtime::cuda::ptx_cache::dir_from(
        cli.ptx_cache.as_deref(),
        var("XDG_CACHE_HOME").as_deref(),
        var("HOME").as_deref(),
    ));
    match cli.command {
        Command::Check { spec, json } => {
            let g = kiln_dsl::compile_file(&spec.spec, &spec.options())?;
            let s = Summary::of(&g);
            if json {
                outln!(
                    "{}",
                    serde_json::to_string_pretty(&s).expect("summary serializes")
                );
            } else {
                out!("{}", s.to_text());
            }
            Ok(())
        }
        Command::Explain {
            args,
            kernels,
            fusions,
        } => compile_cmds::explain(&args, kernels, &fusions),
        Command::Compile {
            spec,
            set,
            model,
            entry,
            flags,
            config,
            from_model,
            entries,
            output,
            validate,
            seed,
        } => {
            if let Some(out) = &output {
                let inputs: Vec<&std::path::Path> = [&spec, &config, &from_model]
                    .into_iter()
                    .flatten()
                    .map(|p| p.as_path())
                    .collect();
                let text = entry.is_some() && entries.is_empty() && config.is_none();
                let kind = if text && from_model.is_none() {
                    Output::File
                } else {
                    Output::Artifact
                };
                outputs::check("kiln::compile", out, &inputs, kind)?;
            }
            if let Some(cfg) = config {
                return compile_cmds::compile_artifact_from_config(
                    &cfg,
                    &entries,
                    output.as_deref(),
                    validate,
                    &flags.options()?,
                );
            }
            if let Some(m) = from_model {
                return compile_cmds::compile_artifact_from_model(
                    &m,
                    &entries,
                    output.as_deref(),
                    validate,
                    &flags.options()?,
                );
            }
            let Some(spec) = spec else {
                return Err(plain(
                    "kiln::compile",
                    "nothing to compile".to_string(),
                    Some("give a spec, `--config CONFIG.yaml` or `--from-model DIR`".to_string()),
                ));
            };
            // `-o DIR` alone writes an artifact, as a compiler's `-o` writes its program;
            // `--entry` asks for one kernel graph's text.
            let artifact = !entries.is_empty() || (output.is_some() && entry.is_none());
            let args = compile_cmds::OptArgs {
                spec,
                set,
                model,
                entry: entry.unwrap_or_else(|| "forward".to_string()),
                target: flags.target.clone(),
            };
            if !artifact {
                compile_cmds::compile(&args, output.as_deref(), validate, seed)
            } else {
                let entries = if entries.is_empty() {
                    compile_cmds::SPEC_ENTRIES
                        .iter()
                        .map(|s| s.to_string())
                        .collect()
                } else {
                    entries
                };
                compile_cmds::compile_artifact(
                    &args,
                    &entries,
                    output.as_deref(),
                    validate,
                    seed,
                    &flags.options()?,
                )
            }
        }
        Command::Inspect {
            dir,
            batch,
            src_len,
            tgt_len,
            past,
            plan,
            nvrtc,
        } => compile_cmds::inspect(
            &dir,
            &[
                ("batch", batch),
                ("src_len", src_len),
                ("tgt_len", tgt_len),
                ("past", past),
            ],
            plan,
            nvrtc,
        ),
        Command::Bench { args } => bench_cmd::bench(&args),
        Command::Graph { spec } => {
            let g = kiln_dsl::compile_file(&spec.spec, &spec.options())?;
            out!("{}", print_graph(&g));
            Ok(())
        }
        Command::Init { spec, seed, output } => {
            outputs::check("kiln::init", &output, &[&spec.spec], Output::File)?;
            let g = kiln_dsl::compile_file(&spec.spec, &spec.options())?;
            let weights =
                init_params(&g, seed).map_err(|e| plain("kiln::init", e.to_string(), None))?;
            let mut meta = BTreeMap::new();
            meta.insert("kiln.model".to_string(), g.name.clone());
            meta.insert("kiln.seed".to_string(), seed.to_string());
            save_safetensors(&output, &weights, Some(&meta)).map_err(file_error)?;
            outln!(
                "wrote {} parameters in {} tensors of model `{}` to {}",
                group_digits(g.num_parameters()),
                weights.len(),
                g.name,
                output.display()
            );
            Ok(())
        }
        Command::Run {
            spec,
            entry,
            inputs,
            weights,
            seed,
            precision,
            output,
            step,
            executor,
            gemm,
        } => {
            let given: Vec<&std::path::Path> = [Some(&spec.spec), Some(&inputs), weights.as_ref()]
                .into_iter()
                .flatten()
                .map(|p| p.as_path())
                .collect();
            outputs::check("kiln::run", &output, &given, Output::File)?;
            let entry = Entry::parse(&entry).map_err(runtime_error)?;
            // An artifact runs its generated kernels by default, a spec the reference.
            let default = if spec.spec.is_dir() {
                "compiled"
            } else {
                "reference"
            };
            gemm.apply(executor.as_deref().unwrap_or(default))?;
            let run_opts = RunOptions {
                precision: if precision == "f64" {
                    Precision::F64
                } else {
                    Precision::F32
                },
                seed,
                step,
                ..RunOptions::default()
            };
            // A directory can only be an artifact: one without a manifest is named as such.
            if spec.spec.is_dir() {
                return compile_cmds::run_artifact(
                    &spec.spec,
                    entry.name(),
                    &inputs,
                    weights.as_deref(),
                    &run_opts,
                    executor.as_deref().unwrap_or("compiled"),
                    &output,
                );
            }
            let executor = executor.unwrap_or_else(|| "reference".to_string());
            if executor == "cuda" {
                return Err(plain(
                    "kiln::run",
                    "`--executor cuda` runs a compiled CUDA artifact, not a spec".to_string(),
                    Some(format!(
                        "compile one first: `kiln compile {} --entries {} --target cuda -o DIR`, \
                         then `kiln run DIR --executor cuda …`",
                        spec.spec.display(),
                        entry.name()
                    )),
                ));
            }
            let elaborate = |kind: GraphKind| -> Result<kiln_compiler::Graph, Error> {
                let mut opts = spec.options();
                opts.mode = kiln::dsl_mode(kind);
                kiln_dsl::compile_file(&spec.spec, &opts)
            };
            let g = elaborate(entry.graph_kind())?;
            let eg =
                kiln_runtime::compiled_entry_graph_with(entry.name(), elaborate, runtime_error)?;
            let feeds = load_safetensors(&inputs).map_err(file_error)?;
            // A decoder step reads what `encode` hoisted out of it (`static.…`): the
            // step's own inputs are the ones to check.
            let check = if entry == Entry::DecodeStep { &eg } else { &g };
            check_inputs(check, &inputs.display().to_string(), &feeds).map_err(runtime_error)?;
            let params: BTreeMap<String, Tensor> = match &weights {
                Some(path) => {
                    let w = load_safetensors(path).map_err(file_error)?;
                    check_weights(&g, &path.display().to_string(), &w).map_err(runtime_error)?;
                    w
                }
                None => init_params(&g, seed)
                    .map_err(|e| plain("kiln::init", e.to_string(), None))?
                    .into_iter()
                    .collect(),
            };
            let opts = run_opts;
            let exec = kiln_runtime::exec::executor(
                kiln_runtime::exec::ExecutorKind::parse(&executor)
                    .unwrap_or(kiln_runtime::exec::ExecutorKind::Reference),
                eg.clone(),
            )
            .map_err(|e| plain("kiln::run", e.to_string(), None))?;
            let outs = exec.run(&feeds, &params, &opts).map_err(|e| {
                plain(
                    "kiln::run",
                    e.to_string(),
                    Some(format!(
                        "the entry's inputs are: {}",
                        eg.inputs
                            .iter()
                            .map(|&i| format!("{} {}", eg.source_name(i).unwrap_or("?"), eg.ty(i)))
                            .collect::<Vec<_>>()
                            .join(", ")
                    )),
                )
            })?;
            write_outputs(&g.name, &outs, &output)
        }
        Command::Bleu {
            refs,
            hyp,
            lowercase,
            tokenize,
            smooth,
            smooth_value,
            score_only,
            json,
        } => {
            if smooth_value.is_some() && !matches!(smooth.as_str(), "floor" | "add-k") {
                return Err(plain(
                    "kiln::usage",
                    format!("--smooth-value sets the value of `floor` or `add-k` smoothing, not of `{smooth}`"),
                    Some("add `--smooth floor` or `--smooth add-k`, or drop --smooth-value".to_string()),
                ));
            }
            let read = |p: &PathBuf| -> Result<Vec<String>, Error> {
                kiln_runtime::data::read_lines(p)
                    .map_err(|e| plain("kiln::io", e.to_string(), None))
            };
            let hyps = match &hyp {
                Some(p) => read(p)?,
                None => {
                    let mut t = String::new();
                    std::io::Read::read_to_string(&mut std::io::stdin(), &mut t).map_err(|e| {
                        plain("kiln::io", format!("cannot read standard input: {e}"), None)
                    })?;
                    lines(&t)
                }
            };
            let refs = refs.iter().map(read).collect::<Result<Vec<_>, _>>()?;
            let opts = BleuOptions {
                lowercase,
                tokenize: if tokenize == "none" {
                    Tokenize::None
                } else {
                    Tokenize::V13a
                },
                smooth: match smooth.as_str() {
                    "exp" => Smooth::Exp,
                    "floor" => Smooth::Floor(smooth_value.unwrap_or(0.1)),
                    "add-k" => Smooth::AddK(smooth_value.unwrap_or(1.0)),
                    _ => Smooth::None,
                },
            };
            let b = corpus_bleu(&hyps, &refs, &opts)
                .map_err(|e| plain("kiln::bleu", e.to_string(), None))?;
            if json {
                outln!(
                    "{}",
                    serde_json::to_string_pretty(&b).expect("BLEU serializes")
                );
            } else if score_only {
                outln!("{:.2}", b.score);
            } else {
                outln!("{b}");
            }
            Ok(())
        }
        Command::Train {
            config,
            resume,
            max_steps,
            max_seconds,
            dir,
            artifact,
            threads,
            gemm_type,
            quiet,
        } => train_cmds::train(train_cmds::TrainArgs {
            config,
            resume,
            max_steps,
            max_seconds,
            dir,
            artifact,
            threads,
            gemm_type,
            quiet,
        }),
        Command::Translate {
            checkpoint,
            input,
            beam,
            alpha,
            length_penalty,
            max_len_a,
            max_len_b,
            greedy,
            nbest,
            batch,
            executor,
            gemm,
            threads,
            workers,
        } => {
            set_threads(threads)?;
            gemm.apply(&executor)?;
            train_cmds::translate(train_cmds::TranslateArgs {
                checkpoint,
                input,
                beam,
                alpha,
                length_penalty,
                max_len_a,
                max_len_b,
                greedy,
                nbest,
                batch,
                executor,
                workers,
            })
        }
        Command::Score {
            checkpoint,
            src,
            reference,
            normalize,
            batch,
            executor,
            gemm,
            threads,
            workers,
        } => {
            set_threads(threads)?;
            gemm.apply(&executor)?;
            train_cmds::score(train_cmds::ScoreArgs {
                checkpoint,
                src,
                reference,
                normalize,
                batch,
                executor,
                workers,
            })
        }
        Command::Average {
            inputs,
            last,
            output,
        } => {
            let inputs = match last {
                Some(n) => train_cmds::last_checkpoints(&inputs, n)?,
                None => inputs,
            };
            train_cmds::average(&inputs, &output)
        }
        Command::Export {
            format,
            input,
            output,
        } => train_cmds::export(&format, &input, &output),
        Command::Import {
            format,
            input,
            output,
        } => train_cmds::import(&format, &input, &output),
        Command::Demo {
            seconds,
            steps,
            dir,
        } => demo::demo(demo::DemoArgs {
            seconds,
            steps,
            dir,
        }),
    }
}

/// Writes the outputs of `kiln run` and prints one line per output.
pub(crate) fn write_outputs(
    model: &str,
    outs: &[(String, Tensor)],
    output: &std::path::Path,
) -> Result<(), Error> {
    let mut meta = BTreeMap::new();
    meta.insert("kiln.model".to_string(), model.to_string());
    save_safetensors(output, outs, Some(&meta)).map_err(file_error)?;
    for (name, t) in outs {
        let value = match (t.shape.is_empty(), t.to_f64_vec()) {
            (true, Some(v)) => format!(" = {}", v[0]),
            _ => String::new(),
        };
        outln!("{name}: {} {:?}{value}", t.dtype_name(), t.shape);
    }
    outln!("wrote {} output(s) to {}", outs.len(), output.display());
    Ok(())
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

/// A `--beam` value: a whole number from 1 to [`kiln_runtime::decode::MAX_BEAM`].
fn beam_width(s: &str) -> Result<usize, String> {
    let max = kiln_runtime::decode::MAX_BEAM;
    match s.parse::<usize>() {
        Ok(n) if (1..=max).contains(&n) => Ok(n),
        _ => Err(format!(
            "`{s}` is not a beam width: give a whole number from 1 to {max}"
        )),
    }
}

/// A `--flag` value that must be a finite number.
fn finite_f64(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() => Ok(v),
        Ok(_) => Err(format!("`{s}` is not a finite number")),
        Err(e) => Err(format!("`{s}`: {e}")),
    }
}

/// A `--flag` value that must be a finite number, 0 or more.
fn non_negative_f64(s: &str) -> Result<f64, String> {
    let v = finite_f64(s)?;
    if v < 0.0 {
        return Err(format!("`{s}` is negative; give 0 or more"));
    }
    Ok(v)
}

/// Lines of a text, without line terminators (a final newline ends the last line).
fn lines(text: &str) -> Vec<String> {
    text.lines()
        .map(|l| l.trim_end_matches('\r').to_string())
        .collect()
}

pub(crate) fn plain(code: &'static str, message: String, help: Option<String>) -> Error {
    Error::plain(code, message, help)
}

pub(crate) fn file_error(e: TensorFileError) -> Error {
    plain("kiln::file", e.to_string(), None)
}

pub(crate) fn runtime_error(e: RuntimeError) -> Error {
    plain("kiln::run", e.message, Some(e.help))
}
