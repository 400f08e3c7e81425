//! `kiln snapshot`: a spec's generated kernels as files a user commits, and the check
//! that they have not changed — the CI gate for projects that do not write Rust tests
//! (those can use `kiln::snapshot::kernels` with insta).
//!
//! Layout of the directory, per entry point `E`: `E.launch.txt` (the kernels in launch
//! order with their functions, then the launch plan's fusions), `E.graph.txt` (the kernel
//! graph), `E.clif` (the CPU program) and, for `--target cuda`, `E.cu` (the CUDA C);
//! `snapshot.txt` says what was snapshotted (spec file name, overrides, entries, options).
//! Every file is deterministic text: the same spec, overrides and options give the same
//! bytes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kiln_compiler::pipeline::compile_entry;
use kiln_dsl::Error;
use kiln_exec::COMPILED_ENTRIES;

use crate::cmd::explain::entry_graph_of;
use crate::compile_flags::CompileFlags;
use crate::plain;

/// The suffixes of the files a snapshot directory holds per entry point.
const SUFFIXES: [&str; 4] = [".launch.txt", ".graph.txt", ".clif", ".cu"];
const HEADER: &str = "snapshot.txt";

#[derive(clap::Args, Clone)]
pub struct SnapshotArgs {
    /// The model spec (a `.kiln` file).
    pub spec: PathBuf,
    /// Override a model parameter: `--set vocab=100` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Which model of the file, when it defines several.
    #[arg(long)]
    pub model: Option<String>,
    /// The entry points to snapshot, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "forward,train_step",
          value_parser = COMPILED_ENTRIES)]
    pub entries: Vec<String>,
    #[command(flatten)]
    pub compile: CompileFlags,
    /// Write a new snapshot into DIR (which must not hold one already).
    #[arg(short = 'o', long = "output", value_name = "DIR",
          required_unless_present_any = ["check", "bless"], conflicts_with_all = ["check", "bless"])]
    pub output: Option<PathBuf>,
    /// Compare with the snapshot in DIR: a unified diff of what changed and exit status
    /// 1, or nothing and 0.
    #[arg(long, value_name = "DIR", conflicts_with = "bless")]
    pub check: Option<PathBuf>,
    /// Rewrite the snapshot in DIR with what the spec gives now.
    #[arg(long, value_name = "DIR")]
    pub bless: Option<PathBuf>,
}

pub fn snapshot(a: SnapshotArgs) -> Result<(), Error> {
    let files = render(&a)?;
    if let Some(dir) = &a.check {
        return check(dir, &files);
    }
    let (dir, fresh) = match (&a.output, &a.bless) {
        (Some(d), _) => (d, true),
        (None, Some(d)) => (d, false),
        (None, None) => unreachable!("clap requires -o, --check or --bless"),
    };
    if fresh && dir.join(HEADER).exists() {
        return Err(plain(
            "kiln::snapshot",
            format!("`{}` already holds a snapshot", dir.display()),
            Some(format!(
                "compare with `--check {0}`, or rewrite it with `--bless {0}`",
                dir.display()
            )),
        ));
    }
    write(dir, &files)?;
    outln!("wrote {} files to {}", files.len(), dir.display());
    Ok(())
}

/// Every file of the snapshot, by name.
fn render(a: &SnapshotArgs) -> Result<BTreeMap<String, String>, Error> {
    let opts = a.compile.options()?;
    let name = a.spec.file_name().map_or_else(
        || a.spec.display().to_string(),
        |n| n.to_string_lossy().into(),
    );
    let mut header = format!("kiln snapshot of {name}\n");
    for s in &a.set {
        header.push_str(&format!("set {s}\n"));
    }
    if let Some(m) = &a.model {
        header.push_str(&format!("model {m}\n"));
    }
    header.push_str(&format!("entries {}\n", a.entries.join(",")));
    for (o, v) in opts.values() {
        header.push_str(&format!("option {} {v}\n", o.name));
    }
    let mut files = BTreeMap::from([(HEADER.to_string(), header)]);
    for entry in &a.entries {
        let g = entry_graph_of(&a.spec, &a.set, &a.model, entry)?;
        let p = compile_entry(&g, &opts, None)
            .map_err(|e| plain("kiln::compile", e.to_string(), None))?;
        files.insert(
            format!("{entry}.launch.txt"),
            kiln::snapshot::launch_text(&p, &g.name, entry),
        );
        files.insert(format!("{entry}.graph.txt"), p.kernel_graph.text());
        files.insert(format!("{entry}.clif"), p.cpu.text());
        if let Some(cuda) = &p.cuda {
            files.insert(format!("{entry}.cu"), cuda.source());
        }
    }
    Ok(files)
}

/// The snapshot files in `dir` now (the header and those with a snapshot's suffixes).
fn existing(dir: &Path) -> Result<BTreeMap<String, String>, Error> {
    let read_err = |e: std::io::Error| {
        plain(
            "kiln::snapshot",
            format!("cannot read the snapshot `{}`: {e}", dir.display()),
            Some(format!("write one first with `-o {}`", dir.display())),
        )
    };
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir).map_err(read_err)? {
        let name = e
            .map_err(read_err)?
            .file_name()
            .to_string_lossy()
            .into_owned();
        if name == HEADER || SUFFIXES.iter().any(|s| name.ends_with(s)) {
            let text = std::fs::read_to_string(dir.join(&name)).map_err(read_err)?;
            out.insert(name, text);
        }
    }
    Ok(out)
}

/// Prints a unified diff of every file that differs, and fails if any does.
fn check(dir: &Path, files: &BTreeMap<String, String>) -> Result<(), Error> {
    let old = existing(dir)?;
    let mut changed = Vec::new();
    let names: std::collections::BTreeSet<&String> = old.keys().chain(files.keys()).collect();
    for name in names {
        let (was, now) = (old.get(name), files.get(name));
        if was == now {
            continue;
        }
        let (a, b) = (
            was.map_or("", String::as_str),
            now.map_or("", String::as_str),
        );
        let shown = dir.join(name).display().to_string();
        let diff = similar::TextDiff::from_lines(a, b);
        out!(
            "{}",
            diff.unified_diff()
                .context_radius(3)
                .header(&format!("{shown} (snapshot)"), &format!("{shown} (now)"))
        );
        changed.push(match (was, now) {
            (None, _) => format!("{name} (new)"),
            (_, None) => format!("{name} (gone)"),
            _ => name.clone(),
        });
    }
    if changed.is_empty() {
        outln!("snapshot {} matches ({} files)", dir.display(), files.len());
        return Ok(());
    }
    Err(plain(
        "kiln::snapshot",
        format!(
            "the kernels differ from the snapshot in `{}`: {}",
            dir.display(),
            changed.join(", ")
        ),
        Some(format!(
            "if the change is intended, rewrite the snapshot with `--bless {}`",
            dir.display()
        )),
    ))
}

/// Writes `files` into `dir` (each through a temporary file and a rename) and removes the
/// snapshot files of entry points no longer asked for.
fn write(dir: &Path, files: &BTreeMap<String, String>) -> Result<(), Error> {
    let write_err = |path: &Path, e: std::io::Error| {
        plain(
            "kiln::snapshot",
            format!("cannot write `{}`: {e}", path.display()),
            None,
        )
    };
    std::fs::create_dir_all(dir).map_err(|e| write_err(dir, e))?;
    let stale: Vec<String> = existing(dir)?
        .into_keys()
        .filter(|n| !files.contains_key(n))
        .collect();
    for (name, text) in files {
        let path = dir.join(name);
        kiln_train::model::write_atomic(&path, text.as_bytes()).map_err(|e| write_err(&path, e))?;
    }
    for name in stale {
        let path = dir.join(&name);
        std::fs::remove_file(&path).map_err(|e| write_err(&path, e))?;
    }
    Ok(())
}
