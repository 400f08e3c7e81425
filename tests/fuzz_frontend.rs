//! The front end under mutated specs (#59): load → parse → elaborate (shape inference
//! included) → optimize, in-process, on mutants of every spec in `models/` and
//! `tests/diagnostics/`. Each case must end in a graph or a diagnostic — never a panic —
//! within a bound ([`CASE_LIMIT`]); a case that panics, or runs past it, is written beside
//! the spec its seed imports, under `target/tmp/fuzz_frontend/specs/`, to reproduce
//! (`kiln check FILE`).
//!
//! `cargo test` runs [`BOUNDED_CASES`] cases from a fixed seed. A long run (the README's
//! testing section) sets the case count, a time budget, the bound per case and the seed:
//! `KILN_FUZZ_CASES=10000000 KILN_FUZZ_SECONDS=3600 KILN_FUZZ_CASE_MS=2000 KILN_FUZZ_SEED=1
//! cargo test --test fuzz_frontend -- --nocapture`.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kiln_dsl::{compile_file, Mode, Options};

/// Cases of a plain `cargo test`.
const BOUNDED_CASES: u64 = 1500;
/// The longest a case may take, from the text to the optimized kernel graph, in a plain
/// `cargo test` (a bound on slowness, not a timing: CI's machines are slow and shared);
/// the long run holds each case to 2 s (`KILN_FUZZ_CASE_MS=2000`).
const CASE_LIMIT: Duration = Duration::from_secs(10);
/// A case still running after this is a hang: the run stops and names it.
const HANG_LIMIT: Duration = Duration::from_secs(20);
/// Graphs above this many nodes are elaborated but not optimized, so that one mutant
/// of a big model does not take the run's budget (the models' own graphs are below it).
const OPTIMIZE_MAX_NODES: usize = 4000;

/// splitmix64: a small deterministic generator, so that a seed names a run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// What a mutation inserts: the language's tokens, extreme numbers, and bytes that are
/// not text.
const TOKENS: &[&str] = &[
    "(",
    ")",
    "{",
    "}",
    "[",
    "]",
    ",",
    "=",
    ":",
    ".",
    "..",
    "...",
    "+",
    "-",
    "*",
    "/",
    "%",
    "**",
    "@",
    "->",
    "<",
    ">",
    "==",
    "!",
    "?",
    "\"",
    "#",
    "\n",
    " ",
    "\t",
    "layer",
    "model",
    "input",
    "output",
    "dims",
    "stage",
    "param",
    "check",
    "repeat",
    "import",
    "let",
    "int",
    "float",
    "f32",
    "i32",
    "true",
    "false",
    "0",
    "1",
    "-1",
    "2",
    "64",
    "0.5",
    "1e308",
    "-1e308",
    "nan",
    "inf",
    "9223372036854775807",
    "-9223372036854775808",
    "4294967296",
    "x",
    "d_model",
    "h",
    "residual",
    "attention",
    "ffn",
    "layer_norm",
    "dropout",
    "embedding",
    "linear",
    "softmax",
    "\u{0}",
    "\u{feff}",
    "\u{fffd}",
    "é",
    "∑",
];

/// One mutation of `text`, which stays valid UTF-8 (the loader's own check of bytes is
/// in the diagnostics catalog).
fn mutate(text: &str, seeds: &[(&str, String)], rng: &mut Rng) -> String {
    let chars: Vec<char> = text.chars().collect();
    let at = rng.below(chars.len() + 1);
    let span = 1 + rng.below(24);
    let end = (at + span).min(chars.len());
    let s = |a: usize, b: usize| chars[a..b].iter().collect::<String>();
    let (head, tail) = (s(0, at), s(at, chars.len()));
    match rng.below(7) {
        // Insert a token.
        0 | 1 => format!("{head}{}{tail}", TOKENS[rng.below(TOKENS.len())]),
        // Delete a span.
        2 => format!("{head}{}", s(end, chars.len())),
        // Duplicate a span.
        3 => format!("{head}{}{tail}", s(at, end)),
        // Replace a span with one of another spec.
        4 => {
            let other: Vec<char> = seeds[rng.below(seeds.len())].1.chars().collect();
            let from = rng.below(other.len() + 1);
            let to = (from + 1 + rng.below(200)).min(other.len());
            let piece: String = other[from..to].iter().collect();
            format!("{head}{piece}{}", s(end, chars.len()))
        }
        // Replace a number with an extreme one.
        5 => {
            let digits: Vec<usize> = (0..chars.len())
                .filter(|&i| chars[i].is_ascii_digit())
                .collect();
            if digits.is_empty() {
                return format!("{head}0{tail}");
            }
            let i = digits[rng.below(digits.len())];
            let mut j = i;
            while j < chars.len() && chars[j].is_ascii_digit() {
                j += 1;
            }
            let pick = ["0", "-1", "9223372036854775807", "4294967297", "65536", "3"];
            format!(
                "{}{}{}",
                s(0, i),
                pick[rng.below(pick.len())],
                s(j, chars.len())
            )
        }
        // Swap two lines.
        _ => {
            let mut lines: Vec<&str> = text.lines().collect();
            if lines.len() > 1 {
                let (a, b) = (rng.below(lines.len()), rng.below(lines.len()));
                lines.swap(a, b);
            }
            lines.join("\n")
        }
    }
}

/// The front end on the spec at `path`, as `kiln explain` runs it: the graph in `mode`,
/// and its optimization when it elaborated. Whether it elaborated.
fn front_end(path: &Path, mode: Mode) -> bool {
    let opts = Options {
        overrides: Vec::new(),
        mode,
        model: None,
    };
    let Ok(graph) = compile_file(path, &opts) else {
        return false;
    };
    if graph.nodes.len() <= OPTIMIZE_MAX_NODES {
        let _ = kiln_compiler::optimize::optimize(&graph, &Default::default());
    }
    true
}

/// The seed specs with the folder each was read from, the models' first, and how many
/// are the models'.
fn seeds(root: &Path) -> (Vec<(&'static str, String)>, usize) {
    let mut out = Vec::new();
    let mut models = 0;
    for dir in SEED_DIRS {
        let mut files: Vec<PathBuf> = std::fs::read_dir(root.join(dir))
            .unwrap_or_else(|e| panic!("{dir}: {e}"))
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "kiln"))
            .collect();
        files.sort();
        out.extend(
            files
                .iter()
                .filter_map(|p| std::fs::read_to_string(p).ok().map(|t| (dir, t))),
        );
        if dir.starts_with("models") {
            models = out.len();
        }
    }
    (out, models)
}

/// Where the seeds are read from; a mutant is written into the same folder of a scratch
/// copy, beside the spec the models import.
const SEED_DIRS: [&str; 4] = [
    "models",
    "models/table3",
    "models/gallery",
    "tests/diagnostics",
];

/// The scratch folders, each with `transformer_base.kiln` where the seeds import it.
fn scratch(root: &Path) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fuzz_frontend/specs");
    for sub in SEED_DIRS {
        std::fs::create_dir_all(dir.join(sub)).unwrap();
    }
    let base = std::fs::read(root.join("models/transformer_base.kiln")).unwrap();
    std::fs::write(dir.join("models/transformer_base.kiln"), base).unwrap();
    dir
}

fn env_u64(key: &str) -> Option<u64> {
    std::env::var(key).ok().and_then(|v| v.parse().ok())
}

/// Writes the case that failed where a person can run it again: beside the spec its
/// seed imports, in the scratch folder `dir` of its seed.
fn keep(dir: &Path, text: &str, case: u64, why: &str) -> String {
    let path = dir.join(format!("kept_{case}.kiln"));
    std::fs::write(&path, text).unwrap();
    format!(
        "case {case} {why}: reproduce with `kiln check {}`",
        path.display()
    )
}

#[test]
fn mutated_specs_end_in_a_graph_or_a_diagnostic_quickly() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let (seeds, models) = seeds(root);
    let specs = scratch(root);
    assert!(
        seeds.len() >= 20 && models >= 4,
        "only {} seed specs",
        seeds.len()
    );
    let cases = env_u64("KILN_FUZZ_CASES").unwrap_or(BOUNDED_CASES);
    let budget = env_u64("KILN_FUZZ_SECONDS").map(Duration::from_secs);
    let limit = env_u64("KILN_FUZZ_CASE_MS").map_or(CASE_LIMIT, Duration::from_millis);
    let mut rng = Rng(env_u64("KILN_FUZZ_SEED").unwrap_or(59));
    // Panics are caught and reported with their case; the default hook's message per
    // panic would only repeat them.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let start = Instant::now();
    let (mut ran, mut graphs, mut slowest) = (0u64, 0u64, (Duration::ZERO, 0u64));
    let mut failures = Vec::new();
    for case in 0..cases {
        if budget.is_some_and(|b| start.elapsed() >= b) {
            break;
        }
        // The models first (their mutants reach elaboration and the optimizer), then
        // the diagnostics' specs; mostly one mutation, which keeps most of the text.
        let seed = if rng.below(4) > 0 {
            rng.below(models)
        } else {
            rng.below(seeds.len())
        };
        let (dir, mut text) = seeds[seed].clone();
        let times = if rng.below(3) > 0 {
            1
        } else {
            2 + rng.below(3)
        };
        for _ in 0..times {
            text = mutate(&text, &seeds, &mut rng);
        }
        let mode = [Mode::Eval, Mode::Train, Mode::Decode][rng.below(3)];
        let path = specs.join(dir).join(format!("case_{case}.kiln"));
        std::fs::write(&path, &text).unwrap();
        let (tx, rx) = mpsc::channel();
        let input = path.clone();
        std::thread::spawn(move || {
            let t0 = Instant::now();
            let done = std::panic::catch_unwind(|| front_end(&input, mode));
            let _ = tx.send((done, t0.elapsed()));
        });
        match rx.recv_timeout(HANG_LIMIT) {
            Ok((Ok(elaborated), took)) => {
                graphs += u64::from(elaborated);
                if took > slowest.0 {
                    slowest = (took, case);
                }
                if took > limit {
                    failures.push(keep(
                        &specs.join(dir),
                        &text,
                        case,
                        &format!("took {took:.1?}"),
                    ));
                }
            }
            Ok((Err(_), _)) => failures.push(keep(&specs.join(dir), &text, case, "panicked")),
            Err(_) => {
                failures.push(keep(
                    &specs.join(dir),
                    &text,
                    case,
                    &format!("ran past {HANG_LIMIT:?}"),
                ));
                break;
            }
        }
        let _ = std::fs::remove_file(&path);
        ran += 1;
    }
    std::panic::set_hook(hook);
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{ran} cases in {secs:.1} s ({:.0} a second), {graphs} elaborated; slowest: case {} \
         in {:.2?}",
        ran as f64 / secs,
        slowest.1,
        slowest.0
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
