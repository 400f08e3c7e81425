//! `kiln preprocess` and `data.binarized` (#62): the training corpus encoded once into token
//! ids read mapped from disk trains the very same run as the text it came from, resumes
//! bit for bit, and is refused where its ids would mean something else.

mod train_common;

use train_common::*;

/// The workspace with `data.binarized: corpus`.
fn binarized(name: &str) -> std::path::PathBuf {
    let dir = workspace(name, "");
    edit_cfg(&dir, "max_len: 32}", "max_len: 32, binarized: corpus}");
    dir
}

#[test]
fn a_binarized_corpus_trains_and_resumes_the_same_run_as_its_text() {
    let text = workspace("binarized_text", "");
    train_ok(&text, &[]);
    let bin = binarized("binarized_bin");
    // Not made yet: the error names the command that makes it.
    says(&train_fails(&bin), "kiln preprocess");
    let out = kiln(&bin, &["preprocess", "--config", "cfg.yaml"]);
    let err = unwrapped(&out.stderr);
    assert!(out.status.success(), "{err}");
    says(&err, "encoded 600 lines into 600 pairs");
    train_ok(&bin, &[]);
    let (a, sa) = final_state(&text, 20);
    let (b, sb) = final_state(&bin, 20);
    same_bits(&a, &b, "trained from the binarized corpus");
    assert_eq!((sa.step, sa.epoch), (sb.step, sb.epoch));
    // 10 steps, a resume, 10 more: the same bits again.
    let resumed = binarized("binarized_resumed");
    ok(&resumed, &["preprocess", "--config", "cfg.yaml"]);
    train_ok(&resumed, &["--max-steps", "10"]);
    ok(
        &resumed,
        &["train", "--resume", "run", "--quiet", "--max-steps", "20"],
    );
    same_bits(
        &a,
        &final_state(&resumed, 20).0,
        "resumed from the binarized corpus",
    );
}

#[test]
fn a_corpus_of_another_length_limit_or_vocabulary_is_refused() {
    let dir = binarized("binarized_refused");
    ok(&dir, &["preprocess", "--config", "cfg.yaml"]);
    edit_cfg(&dir, "max_len: 32,", "max_len: 30,");
    says(&train_fails(&dir), "data.max_len");
    edit_cfg(&dir, "max_len: 30,", "max_len: 32,");
    // Another vocabulary (a new run directory trains its own, of another size).
    edit_cfg(&dir, "vocab_size: 220", "vocab_size: 200");
    edit_cfg(&dir, "dir: run,", "dir: run2,");
    says(&train_fails(&dir), "another tokenizer");
}
