//! How much memory this process may still take, and a check before a large allocation.
//!
//! A run that asks for more memory than the machine has would otherwise end without a
//! word: an allocation larger than RAM and swap aborts the process ("memory allocation
//! of N bytes failed"), and a smaller one that still does not fit gets it killed by the
//! kernel part way through. [`ensure`] compares what a step is about to allocate with
//! the tightest of the limits Linux reports and returns an [`OutOfMemory`] error that
//! names the step, the bytes and what to change instead.
//!
//! The limits read (each where present; the smallest wins):
//! - `MemAvailable` + `SwapFree` from `/proc/meminfo`;
//! - the cgroup's limit less its usage (`memory.max` / `memory.current` for cgroup v2,
//!   `memory.limit_in_bytes` / `memory.usage_in_bytes` for v1);
//! - the address-space limit (`ulimit -v`, `/proc/self/limits`) less the process's
//!   address space (`VmSize` in `/proc/self/status`).
//!
//! Only allocations of at least [`CHECK_MIN`] bytes are checked (reading the limits
//! costs tens of microseconds). [`set_enabled`] turns the check off for the process
//! (`kiln --no-memory-check`); elsewhere than Linux there is nothing to read and nothing
//! is checked.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};

static ENABLED: AtomicBool = AtomicBool::new(true);

/// Turns the check of [`ensure`] on or off for this process (on unless turned off).
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Allocations smaller than this are not checked.
pub const CHECK_MIN: u64 = 256 << 20;

/// Bytes this process may still allocate, and the limit that sets it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Headroom {
    pub bytes: u64,
    /// The limit, in words: "available memory (MemAvailable + SwapFree)", ….
    pub limit: String,
}

/// An allocation that does not fit: what needed it, how much, and what to change.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "{what} would allocate {need}, but {limit} leaves {have}; {fix} \
     (`kiln --no-memory-check` skips this check)",
    need = size(*.need),
    have = size(.headroom.bytes),
    limit = .headroom.limit
)]
pub struct OutOfMemory {
    pub what: String,
    pub need: u64,
    pub headroom: Headroom,
    pub fix: String,
}

/// The fix an executor's message gives for a run too large for the machine.
pub const SMALLER_RUN: &str =
    "run smaller batches (fewer sentences or tokens per batch) or shorter sequences";

/// [`ensure`] for the result of one graph node, computed by `executor` ("the eager
/// executor"): the message names the op, the layer it came from, its dtype, shape and
/// the dims of the run.
pub fn ensure_node(
    need: u64,
    executor: &str,
    node: &crate::ir::Node,
    shape: &[usize],
    dims: &std::collections::BTreeMap<String, i64>,
) -> Result<(), OutOfMemory> {
    ensure(
        need,
        || {
            let at: Vec<String> = dims.iter().map(|(k, v)| format!("{k}={v}")).collect();
            let scope = if node.scope.is_empty() {
                String::new()
            } else {
                format!(" in `{}`", node.scope)
            };
            let at = if at.is_empty() {
                String::new()
            } else {
                format!(" at {}", at.join(", "))
            };
            format!(
                "{executor}'s `{}`{scope} ({} {shape:?}){at}",
                node.op.name(),
                node.ty.dtype,
            )
        },
        || SMALLER_RUN.into(),
    )
}

/// `Err` when `need` bytes (about to be allocated for `what`) exceed what the system
/// leaves this process. `what` and `fix` are only built when the check fails.
pub fn ensure(
    need: u64,
    what: impl FnOnce() -> String,
    fix: impl FnOnce() -> String,
) -> Result<(), OutOfMemory> {
    if need < CHECK_MIN || !ENABLED.load(Ordering::Relaxed) {
        return Ok(());
    }
    match headroom() {
        Some(h) => check(need, h, what, fix),
        None => Ok(()),
    }
}

/// [`ensure`] against a given headroom.
pub fn check(
    need: u64,
    headroom: Headroom,
    what: impl FnOnce() -> String,
    fix: impl FnOnce() -> String,
) -> Result<(), OutOfMemory> {
    if need <= headroom.bytes {
        return Ok(());
    }
    Err(OutOfMemory {
        what: what(),
        need,
        headroom,
        fix: fix(),
    })
}

/// The tightest of the limits this system reports, or `None` where none can be read.
pub fn headroom() -> Option<Headroom> {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let mut found: Vec<Headroom> = Vec::new();
    if let Some(h) = read("/proc/meminfo").and_then(|t| meminfo_headroom(&t)) {
        found.push(h);
    }
    if let Some(h) = cgroup_headroom(&read) {
        found.push(h);
    }
    if let (Some(limits), Some(status)) = (read("/proc/self/limits"), read("/proc/self/status")) {
        if let Some(h) = address_space_headroom(&limits, &status) {
            found.push(h);
        }
    }
    found.into_iter().min_by_key(|h| h.bytes)
}

/// `MemAvailable + SwapFree` of a `/proc/meminfo` text.
pub fn meminfo_headroom(meminfo: &str) -> Option<Headroom> {
    let available = meminfo_kib(meminfo, "MemAvailable")?;
    let swap = meminfo_kib(meminfo, "SwapFree").unwrap_or(0);
    Some(Headroom {
        bytes: (available + swap).saturating_mul(1024),
        limit: if swap > 0 {
            "the available memory and swap (MemAvailable + SwapFree)".to_string()
        } else {
            "the available memory (MemAvailable; no swap)".to_string()
        },
    })
}

fn meminfo_kib(meminfo: &str, key: &str) -> Option<u64> {
    meminfo.lines().find_map(|l| {
        let rest = l.strip_prefix(key)?.strip_prefix(':')?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

/// The soft address-space limit of a `/proc/self/limits` text less the `VmSize` of a
/// `/proc/self/status` text; `None` when the limit is unlimited.
pub fn address_space_headroom(limits: &str, status: &str) -> Option<Headroom> {
    let soft: u64 = limits
        .lines()
        .find_map(|l| l.strip_prefix("Max address space"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    let used = meminfo_kib(status, "VmSize")?.saturating_mul(1024);
    Some(Headroom {
        bytes: soft.saturating_sub(used),
        limit: format!("the address-space limit (ulimit -v, {})", size(soft)),
    })
}

/// The tightest memory limit of this process's cgroups (v2, or v1's memory controller),
/// less what the cgroup uses; `None` without a limit. Every ancestor up to the mounted
/// root is read, since a parent's limit holds for its children too. Page cache counts
/// as free (the kernel reclaims it before it refuses memory).
fn cgroup_headroom(read: &dyn Fn(&str) -> Option<String>) -> Option<Headroom> {
    let cgroups = read("/proc/self/cgroup")?;
    let mut best: Option<Headroom> = None;
    for line in cgroups.lines() {
        // v2: `0::/path`; v1 memory controller: `N:memory:/path` (or `N:…,memory,…:/path`).
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let (root, max_file, current_file, cache_keys): (&str, &str, &str, &[&str]) =
            if controllers.is_empty() {
                ("/sys/fs/cgroup", "memory.max", "memory.current", &["file"])
            } else if controllers.split(',').any(|c| c == "memory") {
                (
                    "/sys/fs/cgroup/memory",
                    "memory.limit_in_bytes",
                    "memory.usage_in_bytes",
                    &["total_cache", "cache"],
                )
            } else {
                continue;
            };
        // The cgroup and each ancestor. In a cgroup namespace the process's own cgroup is
        // the mount's root, and the deeper paths simply do not exist.
        let mut p = path.trim_end_matches('/');
        loop {
            let dir = format!("{root}{p}");
            let file = |name: &str| read(&format!("{dir}/{name}"));
            if let (Some(max), Some(current)) = (file(max_file), file(current_file)) {
                let cache = file("memory.stat")
                    .and_then(|stat| {
                        cache_keys.iter().find_map(|k| {
                            stat.lines().find_map(|l| {
                                let (key, v) = l.split_once(' ')?;
                                (key == *k).then(|| v.trim().parse::<u64>().ok()).flatten()
                            })
                        })
                    })
                    .unwrap_or(0);
                if let Some(h) = cgroup_limit(&max, &current, cache) {
                    if best.as_ref().is_none_or(|b| h.bytes < b.bytes) {
                        best = Some(h);
                    }
                }
            }
            match p.rfind('/') {
                Some(i) => p = &p[..i],
                None => break,
            }
        }
    }
    best
}

/// A cgroup's limit (`max` or a byte count; v1's "no limit" is a huge count) less its
/// usage, not counting `cache` bytes of page cache in it.
pub fn cgroup_limit(max: &str, current: &str, cache: u64) -> Option<Headroom> {
    let max: u64 = max.trim().parse().ok()?;
    if max >= 1 << 62 {
        return None;
    }
    let current: u64 = current.trim().parse().ok()?;
    Some(Headroom {
        bytes: max.saturating_sub(current.saturating_sub(cache)),
        limit: format!("the cgroup's memory limit ({})", size(max)),
    })
}

/// Bytes for people: `512 B`, `3.4 MiB`, `20.7 GiB`, `5.6 TiB`.
pub fn size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

impl fmt::Display for Headroom {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", size(self.bytes), self.limit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MEMINFO: &str = "MemTotal:       24600000 kB\nMemFree:        20000000 kB\n\
                           MemAvailable:   22000000 kB\nBuffers:          100000 kB\n\
                           SwapTotal:       2000000 kB\nSwapFree:        1000000 kB\n";

    #[test]
    fn meminfo_counts_available_memory_and_free_swap() {
        let h = meminfo_headroom(MEMINFO).unwrap();
        assert_eq!(h.bytes, 23_000_000 * 1024);
        assert!(h.limit.contains("SwapFree"), "{}", h.limit);
        let no_swap = MEMINFO.replace("SwapFree:        1000000", "SwapFree:              0");
        let h = meminfo_headroom(&no_swap).unwrap();
        assert_eq!(h.bytes, 22_000_000 * 1024);
        assert!(h.limit.contains("no swap"), "{}", h.limit);
        assert_eq!(meminfo_headroom("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn an_address_space_limit_counts_what_the_process_already_maps() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units\n\
                      Max cpu time              unlimited            unlimited            seconds\n\
                      Max address space         8192000000           unlimited            bytes\n";
        let status = "Name:\tkiln\nVmPeak:\t  300000 kB\nVmSize:\t  200000 kB\n";
        let h = address_space_headroom(limits, status).unwrap();
        assert_eq!(h.bytes, 8_192_000_000 - 200_000 * 1024);
        assert!(h.limit.contains("ulimit -v, 7.6 GiB"), "{}", h.limit);
        let unlimited = limits.replace("8192000000          ", "unlimited           ");
        assert_eq!(address_space_headroom(&unlimited, status), None);
    }

    #[test]
    fn a_cgroup_limit_less_its_usage_but_not_its_page_cache() {
        let h = cgroup_limit("4294967296\n", "1073741824\n", 0).unwrap();
        assert_eq!(h.bytes, 3 << 30);
        assert_eq!(h.limit, "the cgroup's memory limit (4.0 GiB)");
        let h = cgroup_limit("4294967296\n", "4000000000\n", 3_000_000_000).unwrap();
        assert_eq!(h.bytes, 4_294_967_296 - 1_000_000_000);
        assert_eq!(cgroup_limit("max\n", "1000\n", 0), None);
        assert_eq!(cgroup_limit("9223372036854771712\n", "1000\n", 0), None);
    }

    #[test]
    fn the_tightest_cgroup_on_the_path_to_the_root_wins() {
        let files: std::collections::BTreeMap<&str, &str> = [
            ("/proc/self/cgroup", "0::/a/b\n"),
            ("/sys/fs/cgroup/a/b/memory.max", "max\n"),
            ("/sys/fs/cgroup/a/b/memory.current", "100\n"),
            ("/sys/fs/cgroup/a/memory.max", "8589934592\n"),
            ("/sys/fs/cgroup/a/memory.current", "5368709120\n"),
            (
                "/sys/fs/cgroup/a/memory.stat",
                "anon 1073741824\nfile 4294967296\n",
            ),
            ("/sys/fs/cgroup/memory.max", "17179869184\n"),
            ("/sys/fs/cgroup/memory.current", "1073741824\n"),
        ]
        .into_iter()
        .collect();
        let read = |p: &str| files.get(p).map(|s| s.to_string());
        let h = cgroup_headroom(&read).unwrap();
        // `a`: 8 GiB less (5 GiB used − 4 GiB of page cache).
        assert_eq!(h.bytes, 7 << 30);
        assert_eq!(h.limit, "the cgroup's memory limit (8.0 GiB)");
        // v1: the memory controller's hierarchy, its cache not counted.
        let v1: std::collections::BTreeMap<&str, &str> = [
            ("/proc/self/cgroup", "5:cpu:/x\n4:memory:/job/7\n"),
            (
                "/sys/fs/cgroup/memory/job/7/memory.limit_in_bytes",
                "2147483648\n",
            ),
            (
                "/sys/fs/cgroup/memory/job/7/memory.usage_in_bytes",
                "2000000000\n",
            ),
            (
                "/sys/fs/cgroup/memory/job/7/memory.stat",
                "cache 1500000000\nrss 5\ntotal_cache 1500000000\n",
            ),
            (
                "/sys/fs/cgroup/memory/memory.limit_in_bytes",
                "9223372036854771712\n",
            ),
            (
                "/sys/fs/cgroup/memory/memory.usage_in_bytes",
                "3000000000\n",
            ),
        ]
        .into_iter()
        .collect();
        let read = |p: &str| v1.get(p).map(|s| s.to_string());
        assert_eq!(
            cgroup_headroom(&read).unwrap().bytes,
            2_147_483_648 - 500_000_000
        );
        // No limit anywhere.
        let none = |p: &str| (p == "/proc/self/cgroup").then(|| "0::/\n".to_string());
        assert_eq!(cgroup_headroom(&none), None);
    }

    #[test]
    fn a_need_above_the_headroom_is_an_error_that_names_the_step_and_the_fix() {
        let h = Headroom {
            bytes: 20 << 30,
            limit: "the available memory (MemAvailable; no swap)".into(),
        };
        assert_eq!(
            check(20 << 30, h.clone(), || unreachable!(), || unreachable!()),
            Ok(())
        );
        let e = check(
            22_200_000_000,
            h,
            || "entry `forward` at batch=6000".into(),
            || "lower the batch".into(),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "entry `forward` at batch=6000 would allocate 20.7 GiB, but the available \
             memory (MemAvailable; no swap) leaves 20.0 GiB; lower the batch \
             (`kiln --no-memory-check` skips this check)"
        );
    }

    #[test]
    fn sizes_read_in_binary_units() {
        assert_eq!(size(512), "512 B");
        assert_eq!(size(3 << 20), "3.0 MiB");
        assert_eq!(size(6_144_000_000_000), "5.6 TiB");
    }

    #[test]
    fn small_allocations_are_not_checked() {
        assert_eq!(
            ensure(CHECK_MIN - 1, || unreachable!(), || unreachable!()),
            Ok(())
        );
    }
}
