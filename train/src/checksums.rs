//! The SHA-256 record of a checkpoint's or a model directory's files
//! (`checksums.sha256`, in `sha256sum`'s format: `<64 hex digits>  <name>` a line), written
//! last when the directory is saved and verified before anything in it is read. A flipped
//! byte in a weight file, a truncated optimizer state or an edited `state.yaml` is then
//! an error that names the file, not a model that loads and translates.
//!
//! There is no path that skips the check: a directory without the record is refused.

use std::path::{Path, PathBuf};

use kiln_compiler::fsync::sha256_file;

/// The record's file name.
pub const CHECKSUMS_FILE: &str = "checksums.sha256";

/// A directory whose files do not match their record.
#[derive(Debug, thiserror::Error)]
pub enum ChecksumError {
    #[error(
        "{}: no {CHECKSUMS_FILE}: kiln cannot tell whether its files are the ones it wrote \
         (a directory written by kiln before checksums, or not by kiln); save it again with \
         this kiln, or use another checkpoint",
        dir.display()
    )]
    NoRecord { dir: PathBuf },
    #[error("{}: cannot read: {message}", path.display())]
    Unreadable { path: PathBuf, message: String },
    #[error(
        "{}:{line}: not a checksum line (`<64 hex digits>  <file name>`): the record is \
         damaged; restore the directory from a copy, or use another checkpoint",
        path.display()
    )]
    Malformed { path: PathBuf, line: usize },
    #[error(
        "{}: {file} is not in {CHECKSUMS_FILE}: the record is not this directory's; \
         restore the directory from a copy, or use another checkpoint",
        dir.display()
    )]
    Unlisted { dir: PathBuf, file: String },
    #[error(
        "{}: {file} is missing, and {CHECKSUMS_FILE} lists it: restore it, or use another \
         checkpoint",
        dir.display()
    )]
    Missing { dir: PathBuf, file: String },
    #[error(
        "{}: {file} does not match its SHA-256 in {CHECKSUMS_FILE}: the file is damaged or \
         was changed after kiln wrote it; restore it, or use another checkpoint",
        dir.display()
    )]
    Mismatch { dir: PathBuf, file: String },
}

/// The record of `files` (names in `dir`), read back from disk, as the text of
/// [`CHECKSUMS_FILE`].
fn record(dir: &Path, files: &[&str]) -> std::io::Result<String> {
    let mut names: Vec<&str> = files.to_vec();
    names.sort_unstable();
    names.dedup();
    let mut text = String::new();
    for name in names {
        text.push_str(&format!("{}  {name}\n", sha256_file(&dir.join(name))?));
    }
    Ok(text)
}

/// Writes `dir`'s record over `files`, each hashed as it is on disk now, through a
/// temporary file and a rename (durably: the caller has synced the files). Call it after
/// every file is written.
pub fn write(dir: &Path, files: &[&str]) -> std::io::Result<()> {
    let text = record(dir, files)?;
    crate::model::write_atomic(&dir.join(CHECKSUMS_FILE), text.as_bytes())
}

/// Rewrites `dir`'s record over the files it lists now: for a tool (or a test) that
/// changed a file of a checkpoint on purpose.
pub fn rehash(dir: &Path) -> Result<(), ChecksumError> {
    let listed = read(dir)?;
    let names: Vec<&str> = listed.iter().map(|(_, n)| n.as_str()).collect();
    write(dir, &names).map_err(|e| ChecksumError::Unreadable {
        path: dir.to_path_buf(),
        message: e.to_string(),
    })
}

/// The `(digest, name)` lines of `dir`'s record.
fn read(dir: &Path) -> Result<Vec<(String, String)>, ChecksumError> {
    let path = dir.join(CHECKSUMS_FILE);
    if !path.is_file() {
        return Err(ChecksumError::NoRecord {
            dir: dir.to_path_buf(),
        });
    }
    let text = std::fs::read_to_string(&path).map_err(|e| ChecksumError::Unreadable {
        path: path.clone(),
        message: e.to_string(),
    })?;
    let mut lines = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let malformed = || ChecksumError::Malformed {
            path: path.clone(),
            line: i + 1,
        };
        let (digest, name) = line.split_once("  ").ok_or_else(malformed)?;
        let hex = digest.len() == 64 && digest.bytes().all(|b| b.is_ascii_hexdigit());
        // A name is one file of the directory: no separators, nothing that leaves it.
        let plain = !name.is_empty() && !name.contains(['/', '\\']) && name != "..";
        if !hex || !plain {
            return Err(malformed());
        }
        lines.push((digest.to_ascii_lowercase(), name.to_string()));
    }
    Ok(lines)
}

/// Checks every file `dir`'s record lists against its digest, and that each of
/// `required` is listed.
pub fn verify(dir: &Path, required: &[&str]) -> Result<(), ChecksumError> {
    let listed = read(dir)?;
    if let Some(file) = required
        .iter()
        .find(|r| !listed.iter().any(|(_, n)| n == *r))
    {
        return Err(ChecksumError::Unlisted {
            dir: dir.to_path_buf(),
            file: file.to_string(),
        });
    }
    for (digest, name) in &listed {
        let path = dir.join(name);
        if !path.is_file() {
            return Err(ChecksumError::Missing {
                dir: dir.to_path_buf(),
                file: name.clone(),
            });
        }
        let got = sha256_file(&path).map_err(|e| ChecksumError::Unreadable {
            path: path.clone(),
            message: e.to_string(),
        })?;
        if &got != digest {
            return Err(ChecksumError::Mismatch {
                dir: dir.to_path_buf(),
                file: name.clone(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kiln-checksums-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// The record is `sha256sum`'s format, and any changed, missing or unlisted file is
    /// named.
    #[test]
    fn a_changed_missing_or_unlisted_file_is_named() {
        let d = dir("verify");
        std::fs::write(d.join("a.bin"), b"abc").unwrap();
        std::fs::write(d.join("b.txt"), b"hello").unwrap();
        assert!(matches!(
            verify(&d, &[]),
            Err(ChecksumError::NoRecord { .. })
        ));
        write(&d, &["b.txt", "a.bin"]).unwrap();
        let text = std::fs::read_to_string(d.join(CHECKSUMS_FILE)).unwrap();
        assert_eq!(
            text.lines().next().unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad  a.bin"
        );
        verify(&d, &["a.bin", "b.txt"]).unwrap();
        let unlisted = verify(&d, &["c.yaml"]).unwrap_err();
        assert!(unlisted
            .to_string()
            .contains("c.yaml is not in checksums.sha256"));
        std::fs::write(d.join("a.bin"), b"abd").unwrap();
        let changed = verify(&d, &[]).unwrap_err().to_string();
        assert!(
            changed.contains("a.bin does not match its SHA-256"),
            "{changed}"
        );
        rehash(&d).unwrap();
        verify(&d, &[]).unwrap();
        std::fs::remove_file(d.join("b.txt")).unwrap();
        assert!(matches!(
            verify(&d, &[]),
            Err(ChecksumError::Missing { .. })
        ));
        std::fs::write(d.join(CHECKSUMS_FILE), "00  ../x\n").unwrap();
        assert!(matches!(
            verify(&d, &[]),
            Err(ChecksumError::Malformed { line: 1, .. })
        ));
        let _ = std::fs::remove_dir_all(&d);
    }
}
