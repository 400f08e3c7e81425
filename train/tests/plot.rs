//! The training plot: a PNG of the right size, that changes with the data, that copes
//! with empty, single-point and NaN series, and that leaves nothing behind on error.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use kiln_train::plot::{plot_training, PlotError, SIZE};

/// A fresh, empty directory under the system temp dir.
fn scratch_dir(name: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "kiln-plot-{name}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Width and height from a PNG's IHDR chunk, after checking the signature.
fn png_size(bytes: &[u8]) -> (u32, u32) {
    assert!(
        bytes.len() > 24,
        "too short for a PNG: {} bytes",
        bytes.len()
    );
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "PNG signature");
    assert_eq!(&bytes[12..16], b"IHDR", "first chunk");
    let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    (be(&bytes[16..20]), be(&bytes[20..24]))
}

fn curve(n: u64, scale: f64) -> Vec<(u64, f64)> {
    (0..n)
        .map(|i| (i * 100, scale * (8.0 / (1.0 + i as f64 * 0.3) + 1.5)))
        .collect()
}

#[test]
fn writes_a_png_of_the_declared_size() {
    let dir = scratch_dir("png");
    let path = dir.join("training.png");
    let bleu: Vec<(u64, f64)> = (0..10).map(|i| (i * 500, 3.0 * i as f64)).collect();
    plot_training(
        &path,
        &curve(50, 1.0),
        &curve(10, 1.1),
        &bleu,
        "kiln — base",
    )
    .unwrap();
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(png_size(&bytes), SIZE);
    assert_eq!(SIZE, (1000, 700));
    assert_eq!(entries(&dir), ["training.png"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_image_changes_with_the_data_and_the_title() {
    let dir = scratch_dir("differs");
    let (a, b, c) = (dir.join("a.png"), dir.join("b.png"), dir.join("c.png"));
    let bleu = [(0, 1.0), (1000, 10.0)];
    plot_training(&a, &curve(20, 1.0), &curve(5, 1.0), &bleu, "run").unwrap();
    plot_training(&b, &curve(20, 1.3), &curve(5, 1.0), &bleu, "run").unwrap();
    plot_training(&c, &curve(20, 1.0), &curve(5, 1.0), &bleu, "other run").unwrap();
    let (a, b, c) = (
        std::fs::read(a).unwrap(),
        std::fs::read(b).unwrap(),
        std::fs::read(c).unwrap(),
    );
    assert_ne!(a, b, "different losses, same image");
    assert_ne!(a, c, "different titles, same image");

    // The same inputs give the same bytes.
    let again = dir.join("again.png");
    plot_training(&again, &curve(20, 1.0), &curve(5, 1.0), &bleu, "run").unwrap();
    assert_eq!(std::fs::read(again).unwrap(), a);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn empty_single_point_and_nan_series_plot() {
    let dir = scratch_dir("edge");
    let path = dir.join("p.png");
    plot_training(&path, &[], &[], &[], "").unwrap();
    assert_eq!(png_size(&std::fs::read(&path).unwrap()), SIZE);

    plot_training(&path, &[(0, 9.5)], &[(0, 9.0)], &[(0, 0.0)], "one point").unwrap();
    plot_training(
        &path,
        &[(7, 2.0)],
        &[],
        &[(7, 5.0)],
        "one point, no validation",
    )
    .unwrap();
    let with_nan = [(0, 5.0), (100, f64::NAN), (200, 3.0), (300, f64::INFINITY)];
    plot_training(
        &path,
        &with_nan,
        &[(100, f64::NAN)],
        &[(100, f64::NAN)],
        "nan",
    )
    .unwrap();
    let huge = [(0, 1e300), (1, -1e300), (u64::MAX, 2.0)];
    plot_training(&path, &huge, &huge, &huge, "extremes").unwrap();
    assert_eq!(png_size(&std::fs::read(&path).unwrap()), SIZE);

    // NaN points are skipped: the same as leaving them out.
    let skipped = dir.join("skipped.png");
    let nan = dir.join("nan.png");
    plot_training(&skipped, &[(0, 5.0), (200, 3.0)], &[], &[], "t").unwrap();
    plot_training(
        &nan,
        &[(0, 5.0), (100, f64::NAN), (200, 3.0)],
        &[],
        &[],
        "t",
    )
    .unwrap();
    assert_eq!(std::fs::read(skipped).unwrap(), std::fs::read(nan).unwrap());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn replaces_an_existing_plot() {
    let dir = scratch_dir("replace");
    let path = dir.join("p.png");
    std::fs::write(&path, b"old").unwrap();
    plot_training(&path, &curve(3, 1.0), &[], &[], "t").unwrap();
    png_size(&std::fs::read(&path).unwrap());
    assert_eq!(entries(&dir), ["p.png"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn nothing_is_left_behind_on_error() {
    let dir = scratch_dir("error");

    // The parent is a file, not a directory.
    std::fs::write(dir.join("file"), b"x").unwrap();
    let err = plot_training(&dir.join("file/p.png"), &curve(3, 1.0), &[], &[], "t").unwrap_err();
    assert!(matches!(err, PlotError::Draw { .. }), "{err}");
    assert!(err.to_string().contains("file/p.png"), "{err}");

    // The parent does not exist.
    let err = plot_training(&dir.join("missing/p.png"), &[], &[], &[], "t").unwrap_err();
    assert!(err.to_string().contains("missing/p.png"), "{err}");

    // The target is a directory: drawing succeeds, the rename fails, and the temporary
    // file is removed.
    std::fs::create_dir(dir.join("taken.png")).unwrap();
    std::fs::write(dir.join("taken.png/keep"), b"k").unwrap();
    let err = plot_training(&dir.join("taken.png"), &curve(3, 1.0), &[], &[], "t").unwrap_err();
    assert!(matches!(err, PlotError::Io { .. }), "{err}");
    assert_eq!(entries(&dir), ["file", "taken.png"]);
    assert_eq!(entries(&dir.join("taken.png")), ["keep"]);

    // A read-only directory (meaningless for root, who may write anyway).
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let ro = dir.join("ro");
        std::fs::create_dir(&ro).unwrap();
        std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
        let probe = ro.join("probe");
        if std::fs::write(&probe, b"").is_ok() {
            let _ = std::fs::remove_file(&probe);
            println!("skipped the read-only directory case: this user can write there");
        } else {
            assert!(plot_training(&ro.join("p.png"), &[], &[], &[], "t").is_err());
            assert!(entries(&ro).is_empty());
        }
        std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
