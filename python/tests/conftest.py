"""Fixtures of the Python package's tests: a tiny model trained by the `kiln` binary
built from the same workspace (`KILN_BIN`, else `target/release/kiln` or
`target/debug/kiln`), on a generated task."""
import os
import random
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPEC = os.path.join(ROOT, "models", "transformer_base.kiln")
TINY = os.path.join(ROOT, "models", "transformer_tiny.kiln")


def kiln_binary():
    for p in (os.environ.get("KILN_BIN"), os.path.join(ROOT, "target", "debug", "kiln"),
              os.path.join(ROOT, "target", "release", "kiln")):
        if p and os.path.isfile(p):
            return p
    pytest.skip("no kiln binary: run `cargo build` first (or set KILN_BIN)")


def run(*args, cwd):
    out = subprocess.run([kiln_binary(), *args], cwd=cwd, capture_output=True, text=True)
    assert out.returncode == 0, f"kiln {' '.join(args)}:\n{out.stderr}"
    return out


@pytest.fixture(scope="session")
def workspace(tmp_path_factory):
    """A directory with a generated task (the source reversed), a tiny configuration, a
    model trained 10 steps (`run`) and an artifact of its first weights (`art`)."""
    d = tmp_path_factory.mktemp("kiln_py")
    rnd = random.Random(3)
    for name, n in (("train", 400), ("valid", 12)):
        src, tgt = [], []
        for _ in range(n):
            words = [f"s{rnd.randrange(60)}" for _ in range(rnd.randrange(3, 7))]
            src.append(" ".join(words))
            tgt.append(" ".join(f"t{w[1:]}" for w in reversed(words)))
        (d / f"{name}.src").write_text("\n".join(src) + "\n")
        (d / f"{name}.tgt").write_text("\n".join(tgt) + "\n")
    (d / "cfg.yaml").write_text(
        f"model:\n  spec: {SPEC}\n  set: {{d_model: 16, d_ff: 32, h: 2, n: 1, p_drop: 0.1}}\n"
        "data: {train_src: train.src, train_tgt: train.tgt, valid_src: valid.src, "
        "valid_tgt: valid.tgt, vocab_size: 200, byte_fallback: false, max_len: 32}\n"
        "batch: {max_src_tokens: 120, max_tgt_tokens: 120}\n"
        "schedule: {warmup: 50, factor: 1.0}\n"
        "train: {max_steps: 10, executor: compiled, log_every: 5}\n"
        "checkpoint: {dir: run, every: 10, keep: 1}\n")
    run("train", "--config", "cfg.yaml", "--quiet", cwd=d)
    run("compile", "--config", "cfg.yaml", "-o", "art", cwd=d)
    return d
