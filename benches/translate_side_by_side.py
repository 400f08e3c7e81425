"""#60's translation benchmark: kiln against CTranslate2 on the very same weights,
interleaved, greedy and beam 4: kiln in f32, 16-bit and int8 products (`--gemm-type`),
CTranslate2 in float32 and int8, on 1 or 2 threads, with the BLEU of each output.

    cargo build --release && pip install ctranslate2 tokenizers safetensors numpy
    python3 benches/translate_side_by_side.py --model RUN/checkpoints/step_N \
        --src ../shared/data/multi30k/val.en --ref ../shared/data/multi30k/val.de \
        [--sentences 1000] [--rounds 3] [--threads 2] [--kiln target/release/kiln]

`--model` is a checkpoint directory or the output of `kiln average`. The weights go through
`kiln export --format torch` and `../shared/tools/ct2_convert.py convert` (float32 and
int8), once, into `--work`. Each round runs every configuration once, in the same order:
kiln as `kiln translate --threads T` (its workers share the batches out, one thread
each), CTranslate2 in this process with `inter_threads = T, intra_threads = 1` (its
fastest on 2 cores) and `max_batch_size 32` like kiln's `--batch 32`, `disable_unk` as kiln
bans `<unk>`, its own beam search (stops once 4 hypotheses finished, as kiln's default
`--early-stop k-finished`), one call for all sentences with the longest sentence's length
limit (its outputs then cut at each sentence's own, kiln's src + 50). Times exclude loading: kiln's are the translation time its
summary line reports, CTranslate2's that of `translate_batch`. The table gives the median
and minimum over the rounds, the BLEU (`kiln bleu`, sacreBLEU's 13a), and each row's
speed against CTranslate2 int8 on the same search (>1: kiln faster).
"""
import argparse
import hashlib
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CONVERT = os.path.join(ROOT, "..", "shared", "tools", "ct2_convert.py")
SPECIALS = 4  # <pad> <bos> <eos> <unk> = 0 1 2 3 in every kiln tokenizer


def run(cmd, **kw):
    out = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr}")
    return out


def heads_of(model):
    """The attention heads: `--heads`, else `model.set.h` of the config beside the model."""
    import yaml  # PyYAML comes with the tokenizers stack's dependencies
    for d in (model, os.path.dirname(model), os.path.dirname(os.path.dirname(model))):
        path = os.path.join(d, "config.yaml")
        if os.path.isfile(path):
            with open(path) as f:
                h = ((yaml.safe_load(f) or {}).get("model") or {}).get("set", {}).get("h")
            if h:
                return int(h)
    sys.exit(f"no config.yaml with model.set.h beside {model}: give --heads")


def model_digest(model, heads):
    """What the exported and converted weights depend on: the model's weights (their
    bytes) and the heads, so that a work directory is never reused for another model."""
    h = hashlib.sha256(str(heads).encode())
    for name in ("model.safetensors", "tokenizer.json"):
        path = os.path.join(model, name)
        if not os.path.isfile(path):
            sys.exit(f"{path} not found: --model takes a checkpoint directory or `kiln average`'s output")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def prepare(a, heads):
    """Exports and converts the weights once per model; the CTranslate2 model
    directories."""
    os.makedirs(a.work, exist_ok=True)
    weights = os.path.join(a.work, "weights.safetensors")
    if not os.path.isfile(weights):
        run([a.kiln, "export", "--format", "torch", a.model, "-o", weights])
    dirs = {}
    for q in ("float32", "int8"):
        d = os.path.join(a.work, f"ct2-{q}")
        if not os.path.isfile(os.path.join(d, "model.bin")):
            run([sys.executable, a.convert, "convert", "--weights", weights, "--tokenizer",
                 os.path.join(a.model, "tokenizer.json"), "--heads", str(heads), "-o", d,
                 "--quantization", q])
        dirs[q] = d
    return dirs


def kiln_translate(a, src, out, greedy, gemm):
    cmd = [a.kiln, "translate", "--checkpoint", a.model, "--input", src, "--threads",
           str(a.threads), "--gemm-type", gemm] + (["--greedy"] if greedy else [])
    with open(out, "w") as f:
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr}")
    m = re.search(r"tokens\) in ([0-9.]+) s", p.stderr)
    if not m:
        sys.exit(f"no time in kiln's summary:\n{p.stderr}")
    return float(m.group(1))


class Ct2:
    """One CTranslate2 translator, loaded once, and the tokenized input."""

    def __init__(self, a, model_dir, lines):
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        import ctranslate2
        from tokenizers import Tokenizer
        self.tok = Tokenizer.from_file(os.path.join(a.model, "tokenizer.json"))
        self.tok.encode_special_tokens = True
        self.srcs = [self.tok.encode(l, add_special_tokens=False).tokens for l in lines]
        self.tr = ctranslate2.Translator(model_dir, device="cpu", intra_threads=1,
                                         inter_threads=a.threads)
        self.vocab = self.tok.get_vocab_size(with_added_tokens=True)

    def translate(self, out, beam):
        longest = max(len(s) for s in self.srcs)
        t = time.perf_counter()
        res = self.tr.translate_batch(
            self.srcs, beam_size=beam, max_batch_size=32, num_hypotheses=1,
            length_penalty=0.6, max_decoding_length=longest + 50, disable_unk=True)
        secs = time.perf_counter() - t
        with open(out, "w", encoding="utf-8") as f:
            for src, r in zip(self.srcs, res):
                ids = [self.tok.token_to_id(x) for x in r.hypotheses[0]]
                ids = [i for i in ids if i is not None and SPECIALS <= i < self.vocab]
                # kiln's limit is each sentence's own (src + 50 with <eos>); one call has
                # one limit, the longest's, so a longer output is cut where kiln's ends.
                ids = ids[: len(src) + 49]
                f.write(self.tok.decode(ids, skip_special_tokens=True) + "\n")
        return secs


def bleu(a, hyp, ref):
    return float(run([a.kiln, "bleu", "--ref", ref, "--score-only", hyp]).stdout.strip())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a checkpoint directory or `kiln average`'s output")
    ap.add_argument("--src", required=True)
    ap.add_argument("--ref", required=True)
    ap.add_argument("--sentences", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--heads", type=int, help="attention heads (default: the model's config)")
    ap.add_argument("--kiln", default=os.path.join(ROOT, "target", "release", "kiln"))
    ap.add_argument("--convert", default=CONVERT, help="ct2_convert.py")
    ap.add_argument("--work", help="where the exported and converted weights are kept "
                    "(default: /tmp/kiln-translate-bench/<digest of the model's weights>)")
    a = ap.parse_args()
    for path, what in ((a.kiln, "cargo build --release"), (a.convert, "the shared tools")):
        if not os.path.isfile(path):
            sys.exit(f"{path} not found ({what})")
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        sys.exit("CTranslate2 is not installed: pip install ctranslate2 tokenizers safetensors numpy")

    heads = a.heads or heads_of(a.model)
    if a.work is None:
        a.work = os.path.join("/tmp", "kiln-translate-bench", model_digest(a.model, heads))
    dirs = prepare(a, heads)
    with open(a.src, encoding="utf-8") as f:
        src_lines = [l.rstrip("\n") for l in f]
    with open(a.ref, encoding="utf-8") as f:
        ref_lines = [l.rstrip("\n") for l in f]
    keep = [i for i, l in enumerate(src_lines) if l.strip()][: a.sentences]
    src = os.path.join(a.work, "src.txt")
    ref = os.path.join(a.work, "ref.txt")
    with open(src, "w", encoding="utf-8") as f:
        f.writelines(src_lines[i] + "\n" for i in keep)
    with open(ref, "w", encoding="utf-8") as f:
        f.writelines(ref_lines[i] + "\n" for i in keep)
    lines = [src_lines[i] for i in keep]
    ct2 = {q: Ct2(a, d, lines) for q, d in dirs.items()}

    configs = []
    for search, beam in (("greedy", 1), ("beam 4", 4)):
        configs.append((f"kiln {search}, f32", search,
                        lambda o, g=beam == 1: kiln_translate(a, src, o, g, "f32")))
        configs.append((f"kiln {search}, 16-bit", search,
                        lambda o, g=beam == 1: kiln_translate(a, src, o, g, "16bit")))
        configs.append((f"kiln {search}, int8", search,
                        lambda o, g=beam == 1: kiln_translate(a, src, o, g, "int8")))
        for q in ("float32", "int8"):
            configs.append((f"CTranslate2 {search}, {q}", search,
                            lambda o, q=q, b=beam: ct2[q].translate(o, b)))
    times = {name: [] for name, _, _ in configs}
    scores = {}
    for r in range(a.rounds):
        for k, (name, _, go) in enumerate(configs):
            out = os.path.join(a.work, f"out-{k}.txt")
            times[name].append(go(out))
            if r == 0:
                scores[name] = bleu(a, out, ref)
        print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)

    print(f"{len(lines)} sentences, {a.threads} thread(s), {a.rounds} rounds; "
          f"model {a.model}")
    print("| | median s | min s | sentences/s | BLEU | vs CTranslate2 int8 |")
    print("|---|---|---|---|---|---|")
    for name, search, _ in configs:
        med, mn = statistics.median(times[name]), min(times[name])
        base = statistics.median(times[f"CTranslate2 {search}, int8"])
        print(f"| {name} | {med:.2f} | {mn:.2f} | {len(lines) / med:.0f} | "
              f"{scores[name]:.2f} | {base / med:.2f}× |")


if __name__ == "__main__":
    main()
