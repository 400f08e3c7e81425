"""#5's side-by-side measurement on the CPU: kiln's compiled executor against PyTorch eager,
interleaved, as the tables of docs/PERFORMANCE.md give it.

Each series runs, one after another, `kiln bench models/transformer_base.kiln --set
vocab=37000 --entry forward --runs 7 --json`, the same with `--entry train_step --runs
5`, and `benches/pytorch_transformer.py --threads 2 --runs 7` (forward and step); with
`--bf16`, the same again with `--gemm-type 16bit` for kiln (its 16-bit products: bf16 on
AMX or AMD, scaled fp16 with AVX512-FP16, scaled int16 with AVX2 where there is no
AVX-512; `--gemm-type amx|dot|fp16|int16` here names the kernel) and `--bf16` (autocast)
for PyTorch. The fp32 rows pass `--gemm-type f32`. It prints a table row
for each pairing in a series: median (min) ms and kiln's speed-up; with `--bf16`, kiln's
16-bit products against PyTorch in fp32 (the issue's baseline, PyTorch eager's default)
and against PyTorch's bf16 autocast.

    cargo build --release && pip install torch
    python3 benches/side_by_side.py [--series 3] [--bf16 [--gemm-type int16]]
                                    [--kiln target/release/kiln]

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


KERNELS = ("amx", "dot", "fp16", "int16")


def kiln(exe, entry, runs, gemm):
    """`kiln bench` of `entry` with `--gemm-type gemm`: (median, min) ms."""
    out = subprocess.run(
        [exe, "bench", *SPEC, "--entry", entry, "--runs", str(runs), "--json",
         "--gemm-type", gemm],
        cwd=ROOT, capture_output=True, text=True,
    )
    if out.returncode != 0:
        sys.exit(f"kiln bench --entry {entry} --gemm-type {gemm} failed ({out.returncode}):"
                 f"\n{out.stderr}")
    d = json.loads(out.stdout)
    executor = d.get("executor", "")
    if gemm != "f32" and not any(w in executor for w in ("bf16", "fp16", "int16")):
        sys.exit(f"--gemm-type {gemm} ran no 16-bit products here:\n{out.stderr.strip()}")
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


def native_bf16():
    """Whether this CPU has bf16 instructions (AVX512-BF16 or AMX): without them PyTorch
    emulates bf16, its autocast is far slower than its fp32, and so no baseline."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((l.split(":", 1)[1].split() for l in f if l.startswith("flags")), [])
    except OSError:
        return True
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cell(t):
    return f"{t[0]:.1f} ({t[1]:.1f})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--series", type=int, default=3)
    ap.add_argument("--bf16", action="store_true",
                    help="also kiln with 16-bit products (--gemm-type) and PyTorch with bf16 "
                         "autocast")
    ap.add_argument("--gemm-type", choices=("16bit",) + KERNELS, default="16bit",
                    help="kiln's 16-bit products with --bf16 (default: 16bit, the best "
                         "this CPU has)")
    ap.add_argument("--kiln", default=os.path.join(ROOT, "target", "release", "kiln"))
    a = ap.parse_args()
    autocast = a.bf16 and native_bf16()
    if a.bf16 and not autocast:
        print("this CPU has no bf16 instructions (AVX512-BF16 or AMX), so PyTorch would emulate "
              "its bf16 autocast: kiln's 16-bit products are compared with PyTorch fp32 only",
              file=sys.stderr)
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
            gemm = a.gemm_type if bf16 else "f32"
            runs[bf16] = ({"forward": kiln(a.kiln, "forward", 7, gemm),
                           "train_step": kiln(a.kiln, "train_step", 5, gemm)},
                          pytorch(bf16) if not bf16 or autocast else None)
        pairs = [(False, False)] + ([(True, False)] if a.bf16 else []) + (
            [(True, True)] if autocast else [])
        for k16, p16 in pairs:
            k, p = runs[k16][0], runs[p16][1]
            print(f"| {s} | {'16-bit' if k16 else 'fp32'} | {'bf16 autocast' if p16 else 'fp32'} "
                  f"| {cell(k['forward'])} | {cell(p['forward'])} "
                  f"| {p['forward'][0] / k['forward'][0]:.2f}× | {cell(k['train_step'])} "
                  f"| {cell(p['train_step'])} | {p['train_step'][0] / k['train_step'][0]:.2f}× |",
                  flush=True)


if __name__ == "__main__":
    main()
