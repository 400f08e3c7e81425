//! Durable file writes shared by everything that writes a directory atomically (model
//! checkpoints, compiled artifacts): write a file and fsync it, fsync a directory;
//! [`write_replacing`], for a file the user named; and [`remove_stale_temps`], for the
//! temporary files a killed write leaves.

use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};

/// Writes `bytes` to `path` and syncs it. Returns the failed action (`create`, `write`,
/// `sync`) with the error, so callers can name it in their own error type.
pub fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), (&'static str, std::io::Error)> {
    let mut f = std::fs::File::create(path).map_err(|e| ("create", e))?;
    f.write_all(bytes).map_err(|e| ("write", e))?;
    f.sync_all().map_err(|e| ("sync", e))
}

/// Syncs a directory's entries (best effort; a no-op where directories cannot be opened).
pub fn sync_dir(dir: &Path) {
    #[cfg(unix)]
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    #[cfg(not(unix))]
    let _ = dir;
}

/// The SHA-256 of `bytes` as 64 lowercase hex digits: what artifacts' manifests and
/// checkpoints' `checksums.sha256` record of each file, and the manifest's own digest.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    let d = sha2::Sha256::digest(bytes);
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// [`sha256_hex`] of the file at `path`, read in parts.
pub fn sha256_file(path: &Path) -> std::io::Result<String> {
    use sha2::Digest as _;
    use std::io::Read as _;
    let mut f = std::fs::File::open(path)?;
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// Whether process `pid` is running (Linux `/proc`; elsewhere assumed gone).
pub fn pid_alive(pid: u32) -> bool {
    pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists()
}

/// Removes, from directory `dir`, the temporary files and directories that writes by
/// processes that are gone left there: entries named `NAME.tmp-PID…` (kiln's temporary
/// names: `ART.tmp-PID`, `ART.tmp-PID-old`, `training.png.tmp-PID-N.png`,
/// `graphs.tmp-PID`) whose `PID` is not running. A `kill -9` during a write leaves one;
/// the next run removes it. Those of running processes, this one included, stay. With
/// `only`, only those of that name (`NAME` above): a directory of the user's holds
/// other files. Returns how many were removed; a `dir` that is not a directory has none.
pub fn remove_stale_temps(dir: &Path, only: Option<&str>) -> std::io::Result<usize> {
    // Not a directory (missing, or a file where one goes): nothing of ours is in it.
    if !dir.is_dir() {
        return Ok(0);
    }
    let entries = std::fs::read_dir(dir)?;
    let mut removed = 0;
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name();
        let Some((stem, rest)) = name.to_str().and_then(|n| n.split_once(".tmp-")) else {
            continue;
        };
        let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
        let Ok(pid) = digits.parse::<u32>() else {
            continue;
        };
        if stem.is_empty() || only.is_some_and(|n| n != stem) || pid_alive(pid) {
            continue;
        }
        let path = entry.path();
        if entry.file_type()?.is_dir() {
            std::fs::remove_dir_all(&path)?;
        } else {
            std::fs::remove_file(&path)?;
        }
        removed += 1;
    }
    Ok(removed)
}

/// Writes a file the user named (`-o FILE`) whole, so that a failure leaves what was there.
///
/// A regular file (or a new one) gets `bytes` through a temporary sibling
/// (`<file>.tmp-<pid>`), synced and renamed over it. A symbolic link is followed: the file it
/// points to is replaced and the link is kept. A file that cannot be replaced — a device
/// such as `/dev/null` or `/dev/stdout`, a FIFO — is written in place. Errors return the
/// failed action with an error that never names the temporary file: a missing directory is
/// reported as such.
pub fn write_replacing(path: &Path, bytes: &[u8]) -> Result<(), (&'static str, std::io::Error)> {
    let linked = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
    let target = match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => {
            return Err((
                "write",
                std::io::Error::new(ErrorKind::IsADirectory, "it is a directory"),
            ))
        }
        Ok(m) if !m.is_file() => {
            // Nothing to replace: the kernel follows the path (even `/proc/self/fd/1`).
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .open(path)
                .map_err(|e| ("open", e))?;
            return f.write_all(bytes).map_err(|e| ("write", e));
        }
        Ok(_) if linked => std::fs::canonicalize(path).map_err(|e| ("resolve the link", e))?,
        Ok(_) => path.to_path_buf(),
        Err(e) if e.kind() == ErrorKind::NotFound && linked => {
            dangling_target(path).map_err(|e| ("resolve the link", e))?
        }
        Err(e) if e.kind() == ErrorKind::NotFound => path.to_path_buf(),
        Err(e) => return Err(("read", e)),
    };
    let dir = match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        let why = if dir.exists() {
            format!("`{}` is not a directory", dir.display())
        } else {
            format!(
                "the directory `{}` does not exist; create it first",
                dir.display()
            )
        };
        return Err(("write", std::io::Error::new(ErrorKind::NotFound, why)));
    }
    let mut name = target.as_os_str().to_os_string();
    name.push(format!(".tmp-{}", std::process::id()));
    let tmp = PathBuf::from(name);
    let written = write_synced(&tmp, bytes)
        .and_then(|()| std::fs::rename(&tmp, &target).map_err(|e| ("replace", e)));
    match written {
        Ok(()) => {
            sync_dir(dir);
            Ok(())
        }
        Err(e) => {
            // Best effort: the error that matters is the one in hand.
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// Where a symbolic link whose target does not exist (yet) points, links followed.
fn dangling_target(path: &Path) -> std::io::Result<PathBuf> {
    let mut p = path.to_path_buf();
    for _ in 0..40 {
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_symlink() => {
                let to = std::fs::read_link(&p)?;
                p = match p.parent() {
                    Some(dir) if to.is_relative() => dir.join(to),
                    _ => to,
                };
            }
            _ => return Ok(p),
        }
    }
    Err(std::io::Error::other("too many levels of symbolic links"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kiln-fsync-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_file_is_replaced_whole_and_nothing_is_left_beside_it() {
        let d = dir("plain");
        let f = d.join("out.bin");
        write_replacing(&f, b"one").unwrap();
        write_replacing(&f, b"two").unwrap();
        assert_eq!(std::fs::read(&f).unwrap(), b"two");
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 1);
        // A directory in the way: refused, untouched.
        let sub = d.join("sub");
        std::fs::create_dir(&sub).unwrap();
        let (_, e) = write_replacing(&sub, b"x").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::IsADirectory);
        assert!(sub.is_dir());
        // A missing directory is named, not the temporary file.
        let (action, e) = write_replacing(&d.join("nodir/out.bin"), b"x").unwrap_err();
        assert_eq!(action, "write");
        let text = e.to_string();
        assert!(
            text.contains("nodir` does not exist; create it first"),
            "{text}"
        );
        assert!(!text.contains(".tmp-"), "{text}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn links_are_followed_and_special_files_written_in_place() {
        use std::os::unix::fs::{symlink, FileTypeExt};
        let d = dir("special");
        // A link to a file: the file gets the bytes, the link stays a link.
        std::fs::write(d.join("target.bin"), b"old").unwrap();
        symlink("target.bin", d.join("latest")).unwrap();
        write_replacing(&d.join("latest"), b"new").unwrap();
        assert!(std::fs::symlink_metadata(d.join("latest"))
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(std::fs::read(d.join("target.bin")).unwrap(), b"new");
        // A dangling link: its target is created.
        symlink("made.bin", d.join("dangling")).unwrap();
        write_replacing(&d.join("dangling"), b"made").unwrap();
        assert_eq!(std::fs::read(d.join("made.bin")).unwrap(), b"made");
        assert!(std::fs::symlink_metadata(d.join("dangling"))
            .unwrap()
            .file_type()
            .is_symlink());
        // A device stays a device.
        write_replacing(Path::new("/dev/null"), b"gone").unwrap();
        assert!(std::fs::metadata("/dev/null")
            .unwrap()
            .file_type()
            .is_char_device());
        // A FIFO: its reader gets the bytes; it stays a FIFO.
        let fifo = d.join("fifo");
        if std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .is_ok_and(|s| s.success())
        {
            let reader = {
                let fifo = fifo.clone();
                std::thread::spawn(move || std::fs::read(fifo).unwrap())
            };
            write_replacing(&fifo, b"piped").unwrap();
            assert_eq!(reader.join().unwrap(), b"piped");
            assert!(std::fs::symlink_metadata(&fifo)
                .unwrap()
                .file_type()
                .is_fifo());
        }
        // A link to a device (as `/dev/stdout` is) is written through.
        symlink("/dev/null", d.join("null")).unwrap();
        write_replacing(&d.join("null"), b"gone").unwrap();
        assert!(std::fs::symlink_metadata(d.join("null"))
            .unwrap()
            .file_type()
            .is_symlink());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn temporaries_of_dead_processes_are_removed_and_others_kept() {
        let dir = std::env::temp_dir().join(format!("kiln-stale-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("art.tmp-4294967294-old")).unwrap();
        let own = format!("graphs.tmp-{}", std::process::id());
        for f in [
            "training.png.tmp-4294967294-3.png",
            "art.tmp-4294967293",
            &own,
            "notes.txt",
        ] {
            std::fs::write(dir.join(f), b"x").unwrap();
        }
        std::fs::write(dir.join("data.tmp-x"), b"not a pid").unwrap();
        assert_eq!(remove_stale_temps(&dir, Some("art")).unwrap(), 2);
        assert_eq!(remove_stale_temps(&dir, None).unwrap(), 1);
        let mut left: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(
            left,
            ["data.tmp-x".to_string(), own, "notes.txt".to_string()]
        );
        assert_eq!(remove_stale_temps(&dir.join("absent"), None).unwrap(), 0);
        assert_eq!(remove_stale_temps(&dir.join("notes.txt"), None).unwrap(), 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn sha256_is_the_standard_digest() {
        // FIPS 180-2's test vector.
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let p = std::env::temp_dir().join(format!("kiln-sha-{}", std::process::id()));
        std::fs::write(&p, vec![7u8; 3 << 20]).unwrap();
        assert_eq!(sha256_file(&p).unwrap(), sha256_hex(&vec![7u8; 3 << 20]));
        std::fs::remove_file(&p).unwrap();
    }
}
