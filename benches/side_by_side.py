"""#5's side-by-side measurement on the CPU: kiln's compiled executor against PyTorch eager,
interleaved, as the tables of docs/PERFORMANCE.md give it.

Each series runs, one after another, `kiln bench models/transformer_base.kiln --set
vocab=37000 --entry forward --runs 7 --json`, the same with `--entry train_step --runs
5`, and `benches/pytorch_transformer.py --threads 2 --runs 7` (forward and step); with
`--bf16`, the same again with `KILN_CPU_BF16=1` for kiln (its 16-bit products: bf16 on
AMX or AMD, scaled fp16 with AVX512-FP16, scaled int16 with AVX2 where there is no
AVX-512; or the kernel that `KILN_CPU_BF16=amx|dot|fp16|int16` in the environment names) and `--bf16` (autocast) for PyTorch. It prints a table row
for each pairing in a series: median (min) ms and kiln's speed-up; with `--bf16`, kiln's
16-bit products against PyTorch in fp32 (the issue's baseline, PyTorch eager's default)
and against PyTorch's bf16 autocast.

    cargo build --release && pip install torch
    python3 benches/side_by_side.py [--series 3] [--bf16] [--kiln target/release/kiln]

Needs `target/release/kiln` (or `--kiln`) and PyTorch; says which is missing otherwise.
"""
import argparse
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SPEC = ["models/transformer_base.kiln", "--set", "vocab=37000"]


def kiln(exe, entry, runs, bf16):
    env = dict(os.environ)
    kernel = env.pop("KILN_CPU_BF16", None)
    if bf16:
        # `KILN_CPU_BF16=amx`, `=dot`, `=fp16` or `=int16` in the environment names the
        # kernel of the 16-bit rows.
        env["KILN_CPU_BF16"] = kernel if kernel in ("amx", "dot", "fp16", "int16") else "1"
    out = subprocess.run(
        [exe, "bench", *SPEC, "--entry", entry, "--runs", str(runs), "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )
    if out.returncode != 0:
        sys.exit(f"kiln bench --entry {entry} failed ({out.returncode}):\n{out.stderr}")
    d = json.loads(out.stdout)
    executor = d.get("executor", "")
    if bf16 and not any(w in executor for w in ("bf16", "fp16", "int16")):
        sys.exit(f"KILN_CPU_BF16=1 ran no 16-bit products here:\n{out.stderr.strip()}")
    return d["median_ms"], d["min_ms"]


def pytorch(bf16):
    cmd = [sys.executable, os.path.join(HERE, "pytorch_transformer.py"), "--threads", "2",
           "--runs", "7"] + (["--bf16"] if bf16 else [])
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"benches/pytorch_transformer.py failed ({out.returncode}):\n{out.stderr}")
    got = {}
    for name, med, mn in re.findall(
        r"^pytorch \S+ (\w+): median ([\d.]+) ms \(min ([\d.]+)\)", out.stdout, re.M
    ):
        got[name] = (float(med), float(mn))
    if set(got) != {"forward", "train_step"}:
        sys.exit(f"cannot read PyTorch's timings from:\n{out.stdout}")
    return got


def cell(t):
    return f"{t[0]:.1f} ({t[1]:.1f})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--series", type=int, default=3)
    ap.add_argument("--bf16", action="store_true",
                    help="also kiln with KILN_CPU_BF16=1 (16-bit products) and PyTorch with bf16 "
                         "autocast")
    ap.add_argument("--kiln", default=os.path.join(ROOT, "target", "release", "kiln"))
    a = ap.parse_args()
    if not os.path.exists(a.kiln):
        sys.exit(f"no kiln binary at {a.kiln}: run `cargo build --release` first")
    try:
        import torch  # noqa: F401
    except ImportError:
        sys.exit("PyTorch is not installed: `pip install torch`")
    print("| series | kiln | PyTorch | kiln forward | PyTorch forward | ratio "
          "| kiln train_step | PyTorch train_step | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s in range(1, a.series + 1):
        runs = {}
        for bf16 in [False, True] if a.bf16 else [False]:
            runs[bf16] = ({"forward": kiln(a.kiln, "forward", 7, bf16),
                           "train_step": kiln(a.kiln, "train_step", 5, bf16)},
                          pytorch(bf16))
        pairs = [(False, False)] + ([(True, False), (True, True)] if a.bf16 else [])
        for k16, p16 in pairs:
            k, p = runs[k16][0], runs[p16][1]
            print(f"| {s} | {'16-bit' if k16 else 'fp32'} | {'bf16 autocast' if p16 else 'fp32'} "
                  f"| {cell(k['forward'])} | {cell(p['forward'])} "
                  f"| {p['forward'][0] / k['forward'][0]:.2f}× | {cell(k['train_step'])} "
                  f"| {cell(p['train_step'])} | {p['train_step'][0] / k['train_step'][0]:.2f}× |",
                  flush=True)


if __name__ == "__main__":
    main()
