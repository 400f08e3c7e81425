"""#63's load test of `kiln serve`: 32 concurrent clients send 2,000 requests over
loopback, every answer is checked against `kiln translate` on the same sentences, and the
throughput and latencies are printed beside `kiln translate`'s own time.

    cargo build --release
    python3 benches/serve_load.py --model RUN_OR_ARTIFACT \
        --src ../shared/data/multi30k/val.en [--requests 2000] [--clients 32] \
        [--per-request 1] [--threads 2] [--kiln target/release/kiln] [--beam 4]

The standard library only. The server starts on a free port with `--threads T`; each
client sends its share of the requests one after another (request `i` takes
`--per-request` sentences from line `i · per_request` on, wrapping around), and the
answers are compared, sentence by sentence, with `kiln translate --threads T` over the
same lines. Prints: requests, sentences, failures (must be 0), mismatches (must be 0),
the wall time, sentences/s, and p50/p90/p99/max latency in ms; then `kiln translate`'s
sentences/s over the same sentences (the translation time its summary line reports).
"""
import argparse
import concurrent.futures
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def start_server(a):
    cmd = [a.kiln, "serve", "--model", a.model, "--port", "0", "--threads", str(a.threads),
           "--beam", str(a.beam), "--max-wait-ms", str(a.max_wait_ms)]
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    for line in p.stderr:
        m = re.match(r"kiln serve: listening on http://(\S+)", line)
        if m:
            # Keep reading its standard error so that it never blocks on a full pipe.
            threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()
            return p, m.group(1)
    sys.exit(f"{' '.join(cmd)} did not start: {p.wait()}")


def post(addr, body):
    req = urllib.request.Request(f"http://{addr}/translate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return r.status, json.loads(r.read())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--src", required=True)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--per-request", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--max-wait-ms", type=int, default=10)
    ap.add_argument("--kiln", default=os.path.join(ROOT, "target", "release", "kiln"))
    a = ap.parse_args()

    lines = [l.rstrip("\n") for l in open(a.src, encoding="utf-8")]
    lines = [l for l in lines if l.strip()]
    batches = [[lines[(i * a.per_request + k) % len(lines)] for k in range(a.per_request)]
               for i in range(a.requests)]
    sentences = sorted({s for b in batches for s in b})

    # What `kiln translate` prints for each distinct sentence, and how fast it is.
    src_file = os.path.join("/tmp", f"serve_load_{os.getpid()}.txt")
    with open(src_file, "w", encoding="utf-8") as f:
        f.write("".join(s + "\n" for s in sentences))
    t = subprocess.run([a.kiln, "translate", "--model", a.model, "--input", src_file,
                        "--threads", str(a.threads), "--beam", str(a.beam)],
                       capture_output=True, text=True)
    os.unlink(src_file)
    if t.returncode != 0:
        sys.exit(f"kiln translate failed:\n{t.stderr}")
    want = dict(zip(sentences, t.stdout.split("\n")))
    m = re.search(r"translated (\d+) sentences? .* in ([0-9.]+) s", t.stderr)
    cli_rate = int(m.group(1)) / float(m.group(2)) if m else float("nan")

    server, addr = start_server(a)
    latencies, failures, mismatches = [], [], 0
    lock = threading.Lock()

    def client(c):
        nonlocal mismatches
        for i in range(c, a.requests, a.clients):
            t0 = time.perf_counter()
            try:
                status, answer = post(addr, {"text": batches[i]})
            except (urllib.error.URLError, OSError, ValueError) as e:
                with lock:
                    failures.append(f"request {i}: {e}")
                continue
            dt = time.perf_counter() - t0
            got = [t["text"] for t in answer.get("translations", [])]
            with lock:
                latencies.append(dt)
                if status != 200:
                    failures.append(f"request {i}: status {status}: {answer}")
                elif got != [want[s] for s in batches[i]]:
                    mismatches += 1

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(a.clients) as pool:
        list(pool.map(client, range(a.clients)))
    wall = time.perf_counter() - t0
    server.terminate()
    server.wait()

    n = sum(len(b) for b in batches)
    ms = sorted(1000 * x for x in latencies)
    q = lambda p: ms[min(len(ms) - 1, int(p * len(ms)))] if ms else float("nan")
    print(f"kiln serve: {a.requests} requests × {a.per_request} sentence(s) from "
          f"{a.clients} clients, --threads {a.threads}, beam {a.beam}")
    print(f"  failures {len(failures)}, mismatches against kiln translate {mismatches}")
    for f in failures[:5]:
        print(f"    {f}")
    print(f"  {wall:.2f} s: {n / wall:.1f} sentences/s; latency ms p50 {q(0.5):.1f}, "
          f"p90 {q(0.9):.1f}, p99 {q(0.99):.1f}, max {ms[-1] if ms else float('nan'):.1f}")
    print(f"kiln translate: {len(sentences)} distinct sentences at {cli_rate:.1f} sentences/s "
          f"(its summary line's time)")
    if failures or mismatches:
        sys.exit(1)


if __name__ == "__main__":
    main()
