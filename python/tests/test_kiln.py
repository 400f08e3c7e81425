"""The Python package against the command line on the same model: translate, score,
check, compile, run, and the errors."""
import json
import struct
import threading

import numpy as np
import pytest

import kiln
from conftest import SPEC, TINY, run


def write_safetensors(path, tensors):
    """The safetensors format by hand (8-byte header length, JSON header, data)."""
    names = {np.dtype("int32"): "I32", np.dtype("float32"): "F32"}
    header, data = {}, b""
    for k, a in tensors.items():
        b = np.ascontiguousarray(a).tobytes()
        header[k] = {"dtype": names[a.dtype], "shape": list(a.shape),
                     "data_offsets": [len(data), len(data) + len(b)]}
        data += b
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def read_safetensors(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    kinds = {"F32": np.float32, "I32": np.int32, "F64": np.float64, "I64": np.int64}
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        out[k] = np.frombuffer(raw[8 + n + a:8 + n + b], dtype=kinds[v["dtype"]]).reshape(v["shape"])
    return out


def lines(path):
    return path.read_text().splitlines()


def test_translate_equals_kiln_translate(workspace):
    src = lines(workspace / "valid.src")
    for model in ("art", "run"):
        want = run("translate", "--model", model, "--input", "valid.src",
                   cwd=workspace).stdout.splitlines()
        t = kiln.Translator(workspace / model)
        got = t.translate(src + [""])
        assert [g.text for g in got] == want + [""], model
        assert got[-1].tokens == [] and got[-1].score == 0.0
        greedy = run("translate", "--model", model, "--input", "valid.src", "--greedy",
                     cwd=workspace).stdout.splitlines()
        assert [g.text for g in t.translate(src, greedy=True)] == greedy


def test_compile_model_then_translate(workspace, tmp_path):
    """A trained run compiled into an int8 artifact translates as `kiln translate` does
    with the same artifact."""
    art = tmp_path / "run.int8.art"
    kiln.compile_model(workspace / "run", art, precision="int8")
    want = run("translate", "--model", str(art), "--input", "valid.src",
               cwd=workspace).stdout.splitlines()
    got = kiln.Translator(art).translate(lines(workspace / "valid.src"))
    assert [g.text for g in got] == want
    with pytest.raises(kiln.KilnError, match="is a compiled artifact, not a model"):
        kiln.compile_model(art, tmp_path / "again.art")


def test_nbest_tokens_and_scores(workspace):
    t = kiln.Translator(workspace / "art")
    src = lines(workspace / "valid.src")[:3]
    best = t.translate(src)
    three = t.translate(src, nbest=3)
    for b, n in zip(best, three):
        assert n.text == b.text and len(n.nbest) == 3
        assert n.nbest[0].text == b.text
        scores = [h.score for h in n.nbest]
        assert scores == sorted(scores, reverse=True)
        # This vocabulary's pieces are whole words: one per word of the text.
        assert len(b.tokens) == len(b.text.split())
        assert b.log_prob <= 0.0


def test_score_equals_kiln_score(workspace):
    src = lines(workspace / "valid.src")
    ref = lines(workspace / "valid.tgt")
    want = run("score", "--model", "run", "--src", "valid.src", "--ref", "valid.tgt",
               cwd=workspace).stdout.splitlines()
    got = kiln.Translator(workspace / "run").score(src, ref)
    # kiln score prints f32; the package returns the f64 it rounded.
    assert [np.float32(w) for w in want] == [np.float32(g) for g in got]
    per_token = kiln.Translator(workspace / "run").score(src[:1], ref[:1], normalize=True)
    assert per_token[0] == pytest.approx(got[0] / (len(ref[0].split()) + 1))
    assert kiln.Translator(workspace / "run").score(["", src[0]], ["x", ref[0]])[0] is None


def test_threads_translate_at_once(workspace):
    """The GIL is released while kiln translates: four Python threads at once get the
    answers one thread gets."""
    t = kiln.Translator(workspace / "art")
    src = lines(workspace / "valid.src")
    want = [x.text for x in t.translate(src)]
    out = [None] * 4

    def work(i):
        out[i] = [x.text for x in t.translate(src)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert out == [want] * 4


def test_check_and_compile_and_run(workspace, tmp_path):
    s = kiln.check(SPEC, vocab=37000)
    assert s["parameters"] == 63_082_496
    art = tmp_path / "tiny.art"
    kiln.compile(TINY, art, entries=["forward"], seed=7)
    m = kiln.Model(art)
    assert m.entries == ["forward"]
    inputs = {}
    spec = kiln.check(TINY)
    for i in m.inputs("forward"):
        assert i["dtype"] == "i32"
        shape = [2 if d == "batch" else 5 for d in i["shape"]]
        inputs[i["name"]] = np.ones(shape, dtype=np.int32)
    assert [i["name"] for i in m.inputs("forward")] == ["src", "tgt_in"]
    outs = m.run("forward", inputs)
    assert list(outs) == ["logits"]
    logits = outs["logits"]
    assert logits.dtype == np.float32 and logits.shape[:2] == (2, 5)
    assert np.isfinite(logits).all()
    # The command line's kiln run on the same artifact and inputs gives the same bits.
    write_safetensors(tmp_path / "in.safetensors", inputs)
    run("run", str(art), "--entry", "forward", "--inputs", "in.safetensors", "-o", "out.safetensors",
        cwd=tmp_path)
    cli = read_safetensors(tmp_path / "out.safetensors")
    assert cli["logits"].tobytes() == logits.tobytes()
    with pytest.raises(kiln.KilnError, match="exists"):
        kiln.compile(TINY, art, entries=["forward"])


def test_errors_carry_the_place_and_the_fix(tmp_path):
    bad = tmp_path / "bad.kiln"
    bad.write_text("model m(d: int = 4) {\n  input x: f32[d]\n  output y = relu(x) +* 2\n}\n")
    with pytest.raises(kiln.KilnError) as e:
        kiln.check(bad)
    assert e.value.file.endswith("bad.kiln")
    assert e.value.line == 3
    assert e.value.column > 1
    assert e.value.code
    assert "bad.kiln:3" in e.value.rendered
    with pytest.raises(kiln.KilnError) as e:
        kiln.check(SPEC, vocab=0)
    assert "vocab" in str(e.value)
    with pytest.raises(kiln.KilnError, match="is not a kiln model"):
        kiln.Translator(tmp_path / "missing")
    with pytest.raises(TypeError):
        kiln.Translator.translate(None, "one string")  # type: ignore[arg-type]


def test_bad_options_are_refused(workspace):
    t = kiln.Translator(workspace / "art")
    for kwargs, want in [({"beam": 0}, "beam is 0"), ({"nbest": 5}, "nbest is 5"),
                         ({"length_penalty": "x"}, "unknown length penalty"),
                         ({"early_stop": "never"}, "unknown stopping rule")]:
        with pytest.raises(kiln.KilnError, match=want):
            t.translate(["s1 s2"], **kwargs)
    with pytest.raises(kiln.KilnError, match="precision `fast`"):
        kiln.Translator(workspace / "art", precision="fast")
