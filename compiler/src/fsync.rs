//! Durable file writes shared by everything that writes a directory atomically (model
//! checkpoints, compiled artifacts): write a file and fsync it, fsync a directory.

use std::io::Write;
use std::path::Path;

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
