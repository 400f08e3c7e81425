"""PyTorch eager CPU baseline for `kiln bench`: the paper's base Transformer.

Same shapes as `kiln bench models/transformer_base.kiln --set vocab=37000 --batch 32
--src-len 25 --tgt-len 25`: post-LN nn.Transformer (d_model 512, 8 heads, d_ff 2048,
6+6 layers, dropout 0.1), shared embeddings ×√d_model, sinusoidal positions, tied output
projection, label-smoothed cross-entropy (0.1), Adam(0.9, 0.98, 1e-9).

    python3 benches/pytorch_transformer.py [--threads 2] [--runs 5]
    python3 benches/pytorch_transformer.py --device cuda --batch 1000   # ~25k tokens/side

On `--device cuda` the timings wait for the GPU (`torch.cuda.synchronize`) and fp32
matmuls do not use TF32 unless `--tf32`. `--bf16` runs the forward and the loss under
`torch.autocast(dtype=torch.bfloat16)` (bf16 matmuls with fp32 accumulation, fp32
weights and Adam): the comparison for kiln's `--precision mixed`.
"""
import contextlib
import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, vocab=37000, d=512, h=8, ff=2048, n=6, p=0.1):
        super().__init__()
        self.d = d
        self.emb = nn.Embedding(vocab, d)
        nn.init.normal_(self.emb.weight, 0, d ** -0.5)
        self.tf = nn.Transformer(d, h, n, n, ff, p, batch_first=True)
        pos = torch.arange(512).unsqueeze(1)
        div = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
        pe = torch.zeros(512, d)
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)
        self.register_buffer("pe", pe)
        self.drop = nn.Dropout(p)

    def embed(self, x):
        return self.drop(self.emb(x) * math.sqrt(self.d) + self.pe[: x.shape[1]])

    def forward(self, src, tgt):
        mask = self.tf.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device)
        y = self.tf(self.embed(src), self.embed(tgt), tgt_mask=mask,
                    src_key_padding_mask=src == 0, memory_key_padding_mask=src == 0)
        return y @ self.emb.weight.t()


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--len", type=int, default=25)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tf32", action="store_true")
    ap.add_argument("--bf16", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    dev = torch.device(a.device)
    gpu = dev.type == "cuda"
    if gpu:
        torch.backends.cuda.matmul.allow_tf32 = a.tf32
        torch.backends.cudnn.allow_tf32 = a.tf32
    if a.bf16 and not gpu:
        # The CPU's fused inference path (`_transformer_encoder_layer_fwd`) refuses bf16
        # activations under autocast ("expected scalar type Float"): the layers run
        # op by op, as in training.
        torch.backends.mha.set_fastpath_enabled(False)
    m = Model().to(dev)
    opt = torch.optim.Adam(m.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    src = torch.randint(1, 37000, (a.batch, a.len), device=dev)
    tgt = torch.randint(1, 37000, (a.batch, a.len), device=dev)
    out = torch.randint(1, 37000, (a.batch, a.len), device=dev)

    def autocast():
        if a.bf16:
            return torch.autocast(device_type=dev.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def sync():
        if gpu:
            torch.cuda.synchronize()

    def step():
        opt.zero_grad()
        with autocast():
            logits = m(src, tgt)
            loss = F.cross_entropy(logits.reshape(-1, 37000), out.reshape(-1),
                                   label_smoothing=0.1, ignore_index=0)
        loss.backward()
        opt.step()

    def fwd():
        with torch.no_grad(), autocast():
            m(src, tgt)

    for name, f in [("train_step", step), ("forward", fwd)]:
        m.train(name == "train_step")
        f()
        sync()
        ts = []
        for _ in range(a.runs):
            t = time.perf_counter()
            f()
            sync()
            ts.append(time.perf_counter() - t)
        where = torch.cuda.get_device_name(dev) if gpu else f"threads={a.threads}"
        if a.bf16:
            where += " bf16 autocast"
        elif a.tf32:
            where += " tf32"
        print(f"pytorch {torch.__version__} {name}: median {median(ts)*1e3:.1f} ms "
              f"(min {min(ts)*1e3:.1f}) {where}")


if __name__ == "__main__":
    main()
