//! The metrics log: one JSON object per line, read back tolerating a crash mid-write,
//! truncated on resume atomically.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use kiln_train::metrics::{
    read_metrics, truncate_after, Kind, MetricsError, MetricsWriter, Record,
};

fn scratch_dir(name: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "kiln-metrics-{name}-{}-{}",
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

fn train(step: u64, loss: f64) -> Record {
    Record {
        loss: Some(loss),
        lr: Some(7e-4),
        tokens_per_s: Some(51234.5),
        ..Record::new(step, Kind::Train)
    }
}

fn valid(step: u64, loss: f64, bleu: f64) -> Record {
    Record {
        loss: Some(loss),
        bleu: Some(bleu),
        ..Record::new(step, Kind::Valid)
    }
}

fn write_all(path: &Path, records: &[Record]) {
    let mut w = MetricsWriter::open(path).unwrap();
    for r in records {
        w.write(r).unwrap();
    }
}

#[test]
fn one_json_object_per_line_with_absent_fields_omitted() {
    let dir = scratch_dir("format");
    let path = dir.join("metrics.jsonl");
    write_all(&path, &[train(100, 4.25), valid(100, 4.0, 12.5)]);
    let text = std::fs::read_to_string(&path).unwrap();
    assert_eq!(
        text,
        "{\"step\":100,\"kind\":\"train\",\"loss\":4.25,\"lr\":0.0007,\"tokens_per_s\":51234.5}\n\
         {\"step\":100,\"kind\":\"valid\",\"loss\":4.0,\"bleu\":12.5}\n"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn records_round_trip_and_writers_append() {
    let dir = scratch_dir("roundtrip");
    let path = dir.join("metrics.jsonl");
    let first = vec![train(1, 9.0), train(2, 8.5), valid(2, 8.7, 0.5)];
    write_all(&path, &first);
    // Each line is on disk as soon as it is written.
    let mut w = MetricsWriter::open(&path).unwrap();
    w.write(&train(3, 8.0)).unwrap();
    assert_eq!(read_metrics(&path).unwrap().len(), 4);
    drop(w);

    let mut all = first.clone();
    all.push(train(3, 8.0));
    assert_eq!(read_metrics(&path).unwrap(), all);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn non_finite_values_read_back_as_absent() {
    let dir = scratch_dir("nan");
    let path = dir.join("metrics.jsonl");
    write_all(&path, &[train(5, f64::NAN)]);
    assert!(std::fs::read_to_string(&path)
        .unwrap()
        .contains("\"loss\":null"));
    let back = read_metrics(&path).unwrap();
    assert_eq!(back[0].loss, None);
    assert_eq!(back[0].lr, Some(7e-4));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_truncated_last_line_is_ignored_then_repaired_by_the_writer() {
    let dir = scratch_dir("truncated");
    let path = dir.join("metrics.jsonl");
    write_all(&path, &[train(1, 9.0), train(2, 8.0)]);
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap();
    f.write_all(b"{\"step\":3,\"kind\":\"tr").unwrap();
    drop(f);
    assert_eq!(read_metrics(&path).unwrap(), [train(1, 9.0), train(2, 8.0)]);

    // Reopening cuts the partial line, so the next record is not glued to it.
    write_all(&path, &[train(3, 7.0)]);
    assert_eq!(
        read_metrics(&path).unwrap(),
        [train(1, 9.0), train(2, 8.0), train(3, 7.0)]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_whole_record_missing_only_its_newline_is_kept() {
    let dir = scratch_dir("no-newline");
    let path = dir.join("metrics.jsonl");
    write_all(&path, &[train(1, 9.0), train(2, 8.0)]);
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, text.trim_end_matches('\n')).unwrap();
    assert_eq!(read_metrics(&path).unwrap().len(), 2);
    write_all(&path, &[train(3, 7.0)]);
    assert_eq!(
        read_metrics(&path).unwrap(),
        [train(1, 9.0), train(2, 8.0), train(3, 7.0)]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_cut_multibyte_character_in_the_last_line_is_tolerated() {
    let dir = scratch_dir("utf8");
    let path = dir.join("metrics.jsonl");
    write_all(&path, &[train(1, 9.0)]);
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap();
    f.write_all(b"{\"step\":2,\"note\":\"\xc3").unwrap();
    drop(f);
    assert_eq!(read_metrics(&path).unwrap(), [train(1, 9.0)]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_bad_line_in_the_middle_is_an_error_naming_the_line() {
    let dir = scratch_dir("bad");
    let path = dir.join("metrics.jsonl");
    std::fs::write(
        &path,
        "{\"step\":1,\"kind\":\"train\",\"loss\":3.0}\n\n{\"step\":2,\"kind\":\"test\"}\n\
         {\"step\":3,\"kind\":\"train\"}\n",
    )
    .unwrap();
    let err = read_metrics(&path).unwrap_err();
    assert!(matches!(err, MetricsError::Parse { line: 3, .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("metrics.jsonl") && msg.contains("line 3"),
        "{msg}"
    );
    assert!(msg.contains("delete that line"), "{msg}");
    // truncate_after refuses too, and leaves the file alone.
    let before = std::fs::read(&path).unwrap();
    assert!(truncate_after(&path, 1).is_err());
    assert_eq!(std::fs::read(&path).unwrap(), before);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn unknown_fields_are_ignored_and_kept() {
    let dir = scratch_dir("unknown");
    let path = dir.join("metrics.jsonl");
    let line = "{\"step\":1,\"kind\":\"valid\",\"bleu\":3.5,\"chrf\":20.0}\n";
    std::fs::write(&path, format!("{line}{{\"step\":2,\"kind\":\"train\"}}\n")).unwrap();
    assert_eq!(
        read_metrics(&path).unwrap()[0],
        Record {
            bleu: Some(3.5),
            ..Record::new(1, Kind::Valid)
        }
    );
    assert_eq!(truncate_after(&path, 1).unwrap(), 1);
    assert_eq!(std::fs::read_to_string(&path).unwrap(), line);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn truncate_after_drops_later_steps_atomically() {
    let dir = scratch_dir("resume");
    let path = dir.join("metrics.jsonl");
    let records = vec![
        train(100, 5.0),
        valid(100, 5.1, 1.0),
        train(200, 4.0),
        valid(200, 4.2, 5.0),
        train(300, 3.5),
    ];
    write_all(&path, &records);
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap();
    f.write_all(b"{\"step\":400,").unwrap();
    drop(f);

    assert_eq!(truncate_after(&path, 200).unwrap(), 1);
    assert_eq!(read_metrics(&path).unwrap(), records[..4]);
    assert!(std::fs::read_to_string(&path).unwrap().ends_with("}\n"));
    assert_eq!(entries(&dir), ["metrics.jsonl"], "no temporary file left");

    // Nothing to drop: the file is untouched; a missing file has nothing to drop.
    assert_eq!(truncate_after(&path, 1000).unwrap(), 0);
    assert_eq!(read_metrics(&path).unwrap(), records[..4]);
    assert_eq!(truncate_after(&dir.join("absent.jsonl"), 0).unwrap(), 0);
    assert!(!dir.join("absent.jsonl").exists());

    // Everything after step 0 goes; a resumed run appends after what is left.
    assert_eq!(truncate_after(&path, 0).unwrap(), 4);
    assert_eq!(std::fs::read(&path).unwrap(), b"");
    write_all(&path, &[train(1, 2.0)]);
    assert_eq!(read_metrics(&path).unwrap(), [train(1, 2.0)]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn truncate_after_leaves_the_log_alone_when_it_cannot_rewrite() {
    let dir = scratch_dir("rewrite-fails");
    let path = dir.join("metrics.jsonl");
    write_all(&path, &[train(1, 2.0), train(2, 1.0)]);
    // A read-only directory: the temporary file cannot be created there.
    #[cfg(unix)]
    {
        let before = std::fs::read(&path).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o555)).unwrap();
        let probe = dir.join("probe");
        let writable = std::fs::write(&probe, b"").is_ok();
        let _ = std::fs::remove_file(&probe);
        if writable {
            println!("skipped the read-only directory case: this user can write there");
        } else {
            let err = truncate_after(&path, 1).unwrap_err();
            assert!(err.to_string().contains("temporary"), "{err}");
            assert_eq!(std::fs::read(&path).unwrap(), before);
            assert_eq!(entries(&dir), ["metrics.jsonl"]);
        }
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn io_errors_name_the_file() {
    let dir = scratch_dir("io");
    let err = read_metrics(&dir.join("none.jsonl")).unwrap_err();
    assert!(matches!(err, MetricsError::Io { .. }));
    assert!(err.to_string().contains("none.jsonl"), "{err}");
    let err = MetricsWriter::open(&dir.join("no/such/dir/metrics.jsonl")).unwrap_err();
    assert!(
        err.to_string().contains("no/such/dir/metrics.jsonl"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
