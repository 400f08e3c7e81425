//! Compiled PTX kept on disk between processes, so NVRTC compiles each CUDA unit once.
//!
//! In: a unit's CUDA C, its NVRTC options, the NVRTC version, and the compiler to call
//! on a miss. Out: the PTX text, from `<dir>/<key>.ptx` when a file there was written
//! for exactly this source, these options and this NVRTC version, else freshly compiled
//! and stored (a temporary file renamed into place, so a reader never sees half a file;
//! a cache that cannot be written is skipped, never an error).
//!
//! The directory is the one [`set_dir`] names (the command line's `--ptx-cache DIR`,
//! `off`: none; by default `$XDG_CACHE_HOME/kiln/ptx`, else `$HOME/.cache/kiln/ptx`, as
//! [`dir_from`] gives); a process that names none has no cache. Each file starts with a
//! header line naming its key, the source's length and FNV-1a hash and the NVRTC version;
//! a file whose header does not match (another unit with a colliding name, a truncated
//! write from an older kiln) is compiled again and replaced.

use std::path::{Path, PathBuf};

use kiln_compiler::artifact::fnv1a64;

/// The cache directory for the given settings: `flag` is `--ptx-cache` (`off` or empty:
/// none), `xdg` and `home` the user's cache and home directories.
pub fn dir_from(flag: Option<&str>, xdg: Option<&str>, home: Option<&str>) -> Option<PathBuf> {
    match flag.map(str::trim) {
        Some("") | Some("off") => None,
        Some(d) => Some(PathBuf::from(d)),
        None => match (
            xdg.filter(|x| !x.is_empty()),
            home.filter(|h| !h.is_empty()),
        ) {
            (Some(x), _) => Some(Path::new(x).join("kiln/ptx")),
            (None, Some(h)) => Some(Path::new(h).join(".cache/kiln/ptx")),
            (None, None) => None,
        },
    }
}

static DIR: std::sync::Mutex<Option<PathBuf>> = std::sync::Mutex::new(None);

/// Makes `dir` this process's cache directory (`None`: no cache, the default).
pub fn set_dir(dir: Option<PathBuf>) {
    *DIR.lock().unwrap_or_else(|p| p.into_inner()) = dir;
}

/// This process's cache directory ([`set_dir`]).
pub fn dir() -> Option<PathBuf> {
    DIR.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// The header line of a cache file: everything the PTX depends on, hashed, plus the
/// source's length (a second check against collisions).
fn header(source: &str, options: &[String], version: &str) -> (String, String) {
    let mut keyed = Vec::new();
    for part in [
        version.as_bytes(),
        options.join("\u{1f}").as_bytes(),
        source.as_bytes(),
    ] {
        keyed.extend_from_slice(part);
        keyed.push(0);
    }
    let key = format!("{:016x}", fnv1a64(&keyed));
    let line = format!(
        "// kiln ptx cache v1 key {key} source {} bytes fnv1a64 {:016x} nvrtc {version}\n",
        source.len(),
        fnv1a64(source.as_bytes())
    );
    (key, line)
}

/// The PTX of `source` compiled with `options` by NVRTC `version`: from `dir` when it
/// holds it, else `compile()` (then stored in `dir`). Returns the PTX and whether it
/// came from the cache. Only `compile`'s error is an error.
pub fn compile_cached(
    dir: Option<&Path>,
    source: &str,
    options: &[String],
    version: &str,
    compile: impl FnOnce() -> Result<String, String>,
) -> Result<(String, bool), String> {
    let Some(dir) = dir else {
        return compile().map(|p| (p, false));
    };
    let (key, line) = header(source, options, version);
    let path = dir.join(format!("{key}.ptx"));
    if let Ok(text) = std::fs::read_to_string(&path) {
        if let Some(ptx) = text.strip_prefix(line.as_str()) {
            return Ok((ptx.to_string(), true));
        }
    }
    let ptx = compile()?;
    let _ = store(dir, &path, &format!("{line}{ptx}"));
    Ok((ptx, false))
}

/// Writes `text` to `path` through a temporary file in `dir`.
fn store(dir: &Path, path: &Path, text: &str) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("ptx"),
        std::process::id()
    ));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kiln-ptx-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_unit_compiles_once_then_comes_from_the_cache() {
        let dir = tmp("hit");
        let calls = Cell::new(0);
        let opts = vec!["--gpu-architecture=sm_90".to_string()];
        let compile = || {
            calls.set(calls.get() + 1);
            Ok::<_, String>(format!(".version 8.8\n// ptx {}\n", calls.get()))
        };
        let first = compile_cached(Some(&dir), "kernel A", &opts, "13.0", compile).unwrap();
        assert_eq!(first, (".version 8.8\n// ptx 1\n".to_string(), false));
        let again = compile_cached(Some(&dir), "kernel A", &opts, "13.0", compile).unwrap();
        assert_eq!(again, (first.0.clone(), true));
        assert_eq!(calls.get(), 1);
        // Another source, other options or another NVRTC: compiled anew.
        for (src, o, v) in [
            ("kernel B", opts.clone(), "13.0"),
            (
                "kernel A",
                vec!["--gpu-architecture=sm_80".to_string()],
                "13.0",
            ),
            ("kernel A", opts.clone(), "12.8"),
        ] {
            let got = compile_cached(Some(&dir), src, &o, v, compile).unwrap();
            assert!(!got.1, "{src} {o:?} {v}");
        }
        assert_eq!(calls.get(), 4);
        // No temporary files are left behind.
        let names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names.len(), 4, "{names:?}");
        assert!(names
            .iter()
            .all(|n| n.ends_with(".ptx") && !n.starts_with('.')));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_damaged_or_foreign_file_is_compiled_again_and_replaced() {
        let dir = tmp("damaged");
        let opts: Vec<String> = Vec::new();
        let good = || Ok::<_, String>("PTX".to_string());
        compile_cached(Some(&dir), "src", &opts, "13.0", good).unwrap();
        let file = std::fs::read_dir(&dir)
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path();
        let text = std::fs::read_to_string(&file).unwrap();
        assert!(text.starts_with("// kiln ptx cache v1 key ") && text.ends_with("\nPTX"));
        for damaged in [&text[..20], "garbage", ""] {
            std::fs::write(&file, damaged).unwrap();
            let got =
                compile_cached(Some(&dir), "src", &opts, "13.0", || Ok("NEW".to_string())).unwrap();
            assert_eq!(got, ("NEW".to_string(), false));
            assert!(std::fs::read_to_string(&file).unwrap().ends_with("\nNEW"));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn no_cache_or_an_unwritable_one_still_compiles_and_errors_pass_through() {
        let got = compile_cached(None, "s", &[], "13.0", || Ok("P".to_string())).unwrap();
        assert_eq!(got, ("P".to_string(), false));
        // A file where the directory should be: nothing can be stored, nothing fails.
        let blocker = tmp("blocker");
        std::fs::write(&blocker, "not a directory").unwrap();
        let got = compile_cached(Some(&blocker), "s", &[], "13.0", || Ok("P".to_string()));
        assert_eq!(got.unwrap(), ("P".to_string(), false));
        let _ = std::fs::remove_file(&blocker);
        let err = compile_cached(None, "s", &[], "13.0", || Err("NVRTC log".to_string()));
        assert_eq!(err.unwrap_err(), "NVRTC log");
    }

    #[test]
    fn the_directory_follows_the_environment() {
        let p = |s: &str| Some(PathBuf::from(s));
        assert_eq!(dir_from(Some("/c"), Some("/x"), Some("/h")), p("/c"));
        assert_eq!(dir_from(Some("off"), Some("/x"), Some("/h")), None);
        assert_eq!(dir_from(Some(""), Some("/x"), Some("/h")), None);
        assert_eq!(dir_from(None, Some("/x"), Some("/h")), p("/x/kiln/ptx"));
        assert_eq!(
            dir_from(None, Some(""), Some("/h")),
            p("/h/.cache/kiln/ptx")
        );
        assert_eq!(dir_from(None, None, None), None);
    }
}
