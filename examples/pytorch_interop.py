#!/usr/bin/env python3
r"""The PyTorch model that `kiln export --format torch` weights load into, and back.

kiln's Transformer (models/transformer_base.kiln) is, in PyTorch terms: an nn.Embedding
shared three ways (source, target, pre-softmax projection) scaled by sqrt(d_model),
sinusoidal positions with sin on even and cos on odd features, post-LN
nn.TransformerEncoder/nn.TransformerDecoder layers (ReLU, eps 1e-5) with no final
LayerNorm, source padding masked in the encoder's self-attention and the decoder's
cross-attention, a causal mask in the decoder's self-attention, and the loss
F.cross_entropy(label_smoothing=eps, ignore_index=pad). `KilnTransformer` below is that
model; its state dict has exactly the names `kiln export` writes and `kiln import` reads.

    # kiln -> PyTorch: logits and loss of kiln's weights, on kiln's inputs
    kiln export --format torch runs/multi30k_small/average -o torch.safetensors
    python3 examples/pytorch_interop.py forward --weights torch.safetensors --heads 4 \
        --inputs batch.safetensors -o torch_out.safetensors

    # The paper's recipe (Adam 0.9/0.98/1e-9, warmup schedule, label smoothing) for a
    # few steps on one batch, from the same first weights as a kiln run
    python3 examples/pytorch_interop.py train --weights first.safetensors --heads 8 \
        --inputs batch.safetensors --steps 10 --warmup 4000 -o trained.safetensors

    # PyTorch -> kiln: a model with every weight random, then the same in kiln
    python3 examples/pytorch_interop.py random --vocab 64 --d-model 32 --d-ff 64 \
        --heads 4 --layers 2 -o torch.safetensors
    kiln import --format torch torch.safetensors -o weights.safetensors
    kiln run models/transformer_tiny.kiln --weights weights.safetensors \
        --inputs batch.safetensors -o kiln_out.safetensors

`batch.safetensors` holds `src`, `tgt_in` and (for the loss) `tgt_out`, integer ids
right-padded with `pad`, as `kiln run` reads them. `forward` writes `logits` (and `loss`
when `tgt_out` is given); with `--grads` also the loss's gradient of every weight, under
the PyTorch names (`kiln import` renames those too).

Needs only torch (no numpy, no safetensors package): the safetensors format is read and
written here directly.
"""

import argparse
import ctypes
import json
import math
import os
import struct
import sys
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch  # noqa: E402
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

DTYPES = {
    "F32": torch.float32,
    "F64": torch.float64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "I64": torch.int64,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
NAMES = {v: k for k, v in DTYPES.items()}


def load_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        sys.exit(f"{path}: not a safetensors file (shorter than its 8-byte header size)")
    (n,) = struct.unpack("<Q", data[:8])
    if 8 + n > len(data):
        sys.exit(f"{path}: truncated safetensors header ({n} bytes announced)")
    header = json.loads(data[8 : 8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        if base + end > len(data):
            sys.exit(f"{path}: tensor `{name}` runs past the end of the file (truncated?)")
        dtype = DTYPES[info["dtype"]]
        if end > start:
            t = torch.frombuffer(bytearray(data[base + start : base + end]), dtype=dtype)
        else:
            t = torch.empty(0, dtype=dtype)
        out[name] = t.reshape(info["shape"]).clone()
    return out


def save_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        size = t.numel() * t.element_size()
        blob = ctypes.string_at(t.data_ptr(), size) if size else b""
        header[name] = {
            "dtype": NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        blobs.append(blob)
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)
    os.replace(tmp, path)


def sinusoidal(length, d):
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...), as kiln's prelude."""
    pos = torch.arange(length, dtype=torch.float32).unsqueeze(1)
    rate = torch.exp(torch.arange(d // 2, dtype=torch.float32) * (-2.0 * math.log(10000.0) / d))
    angle = pos * rate
    return torch.stack([torch.sin(angle), torch.cos(angle)], dim=2).reshape(length, d)


class KilnTransformer(nn.Module):
    """kiln's `transformer` model (post-LN, shared embeddings, no final norms)."""

    def __init__(self, vocab, d_model, d_ff, heads, layers, pad=0, eps_ls=0.1, dropout=0.0):
        super().__init__()
        self.d_model, self.pad, self.eps_ls = d_model, pad, eps_ls
        self.embedding = nn.Embedding(vocab, d_model)
        common = dict(
            dim_feedforward=d_ff,
            dropout=dropout,
            activation="relu",
            layer_norm_eps=1e-5,
            batch_first=True,
            norm_first=False,
        )
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d_model, heads, **common),
            layers,
            norm=None,
            enable_nested_tensor=False,
        )
        self.decoder = nn.TransformerDecoder(
            nn.TransformerDecoderLayer(d_model, heads, **common), layers, norm=None
        )
        self.dropout = nn.Dropout(dropout)

    def embed(self, ids):
        x = self.embedding(ids) * math.sqrt(self.d_model)
        return self.dropout(x + sinusoidal(ids.shape[1], self.d_model).to(x.device))

    def forward(self, src, tgt_in):
        src_pad = src == self.pad  # True where a key is padding
        memory = self.encoder(self.embed(src), src_key_padding_mask=src_pad)
        t = tgt_in.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=src.device).triu(1)
        y = self.decoder(
            self.embed(tgt_in),
            memory,
            tgt_mask=causal,
            memory_key_padding_mask=src_pad,
        )
        return y @ self.embedding.weight.t()

    def loss(self, logits, tgt_out):
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            tgt_out.reshape(-1).long(),
            ignore_index=self.pad,
            label_smoothing=self.eps_ls,
        )


def shape_of(state, heads):
    vocab, d_model = state["embedding.weight"].shape
    layers = 0
    while f"encoder.layers.{layers}.linear1.weight" in state:
        layers += 1
    d_ff = state["encoder.layers.0.linear1.weight"].shape[0]
    if d_model % heads:
        sys.exit(f"--heads {heads} does not divide d_model = {d_model}")
    return dict(vocab=vocab, d_model=d_model, d_ff=d_ff, heads=heads, layers=layers)


def cmd_random(args):
    torch.manual_seed(args.seed)
    model = KilnTransformer(args.vocab, args.d_model, args.d_ff, args.heads, args.layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "embedding.weight":
                p.normal_(0.0, args.d_model**-0.5)
            elif name.endswith("norm1.weight") or name.endswith("norm2.weight") or name.endswith(
                "norm3.weight"
            ):
                p.uniform_(0.7, 1.3)
            elif p.dim() == 1:
                p.uniform_(-0.2, 0.2)
            else:
                bound = math.sqrt(6.0 / sum(p.shape))
                p.uniform_(-bound, bound)
    save_safetensors(args.output, model.state_dict())
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {len(model.state_dict())} tensors ({n} parameters) to {args.output}")


def cmd_forward(args):
    torch.set_num_threads(max(1, args.threads))
    if args.device.startswith("cuda"):
        # fp32 products, as kiln's GPU executor computes a `--precision f32` artifact.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    state = load_safetensors(args.weights)
    dims = shape_of(state, args.heads)
    model = KilnTransformer(**dims, pad=args.pad, eps_ls=args.eps_ls)
    model.load_state_dict(state, strict=True)
    model.to(args.device)
    batch = {k: v.to(args.device) for k, v in load_safetensors(args.inputs).items()}
    src, tgt_in = batch["src"].long(), batch["tgt_in"].long()
    out = {}
    if args.grads:
        model.train()  # dropout is 0: train mode only enables autograd's bookkeeping
        logits = model(src, tgt_in)
    else:
        model.eval()
        with torch.no_grad():
            logits = model(src, tgt_in)
    out["logits"] = logits.detach()
    if "tgt_out" in batch:
        loss = model.loss(logits, batch["tgt_out"])
        out["loss"] = loss.detach().reshape(())
        if args.grads:
            loss.backward()
            for name, p in model.named_parameters():
                out[name] = p.grad
    save_safetensors(args.output, out)
    print(f"logits {list(logits.shape)}" + (f", loss {out['loss'].item():.6f}" if "loss" in out else ""))


def cmd_batch(args):
    """Random ids in 3..vocab, each row right-padded with 0 to a random length."""
    g = torch.Generator().manual_seed(args.seed)
    out = {}
    lens = {}
    for name, width in [("src", args.src_len), ("tgt", args.tgt_len)]:
        ids = torch.randint(3, args.vocab, (args.rows, width), generator=g, dtype=torch.int32)
        n = torch.randint(1, width + 1, (args.rows,), generator=g)
        n[0] = width  # one full row
        for r in range(args.rows):
            ids[r, n[r] :] = 0
        out[name] = ids
        lens[name] = n
    tgt = out.pop("tgt")
    out["tgt_in"] = torch.cat([torch.ones(args.rows, 1, dtype=torch.int32), tgt[:, :-1]], 1)
    for r in range(args.rows):
        out["tgt_in"][r, lens["tgt"][r] :] = 0
    out["tgt_out"] = tgt
    save_safetensors(args.output, out)
    print(f"wrote {args.rows} rows of {args.src_len} source and {args.tgt_len} target ids")


def cmd_compare(args):
    a, b = load_safetensors(args.a), load_safetensors(args.b)
    worst = 0.0
    for name in args.names:
        x, y = a[name].double(), b[name].double()
        if x.shape != y.shape:
            sys.exit(f"`{name}`: shapes {list(x.shape)} and {list(y.shape)} differ")
        rel = ((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item()
        worst = max(worst, rel)
        print(f"{name}: max |a - b| / max |b| = {rel:.3e}")
    if worst > args.tol:
        sys.exit(f"above the tolerance {args.tol:g}")


def noam(step, d_model, warmup, factor):
    """The paper's learning rate (§5.3), as kiln's `schedule`: step counts from 1."""
    return factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def cmd_train(args):
    torch.set_num_threads(max(1, args.threads))
    state = load_safetensors(args.weights)
    dims = shape_of(state, args.heads)
    model = KilnTransformer(**dims, pad=args.pad, eps_ls=args.eps_ls)
    model.load_state_dict(state, strict=True)
    model.train()  # no dropout layers fire: dropout is 0
    batch = load_safetensors(args.inputs)
    src, tgt_in, tgt_out = batch["src"].long(), batch["tgt_in"].long(), batch["tgt_out"]
    opt = torch.optim.Adam(
        model.parameters(), lr=0.0, betas=(args.beta1, args.beta2), eps=args.eps
    )
    losses = []
    for step in range(1, args.steps + 1):
        for group in opt.param_groups:
            group["lr"] = noam(step, dims["d_model"], args.warmup, args.factor)
        opt.zero_grad()
        loss = model.loss(model(src, tgt_in), tgt_out)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    out = dict(model.state_dict())
    out["losses"] = torch.tensor(losses, dtype=torch.float64)
    save_safetensors(args.output, out)
    print("losses " + " ".join(f"{l:.6f}" for l in losses))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("random", help="write a model with every weight random, in PyTorch names")
    r.add_argument("--vocab", type=int, required=True)
    r.add_argument("--d-model", type=int, required=True)
    r.add_argument("--d-ff", type=int, required=True)
    r.add_argument("--heads", type=int, required=True)
    r.add_argument("--layers", type=int, required=True)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("-o", "--output", required=True)
    f = sub.add_parser("forward", help="logits (and loss, gradients) of PyTorch-named weights")
    f.add_argument("--weights", required=True, help="kiln export --format torch output")
    f.add_argument("--heads", type=int, required=True, help="the spec's h (not in the weights)")
    f.add_argument("--inputs", required=True, help="src, tgt_in[, tgt_out] ids")
    f.add_argument("--pad", type=int, default=0)
    f.add_argument("--eps-ls", type=float, default=0.1)
    f.add_argument("--grads", action="store_true", help="also write every weight's gradient")
    f.add_argument("--threads", type=int, default=1)
    f.add_argument("--device", default="cpu", help="cpu or cuda (fp32, TF32 off)")
    f.add_argument("-o", "--output", required=True)
    b = sub.add_parser("batch", help="a random padded batch of ids (src, tgt_in, tgt_out)")
    b.add_argument("--vocab", type=int, required=True)
    b.add_argument("--rows", type=int, required=True)
    b.add_argument("--src-len", type=int, required=True)
    b.add_argument("--tgt-len", type=int, required=True)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("-o", "--output", required=True)
    c = sub.add_parser("compare", help="max relative difference of tensors of two files")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--names", nargs="+", default=["logits"])
    c.add_argument("--tol", type=float, default=1e-5)
    t = sub.add_parser(
        "train",
        help="Adam steps with the paper's warmup schedule on one batch (no dropout)",
    )
    t.add_argument("--weights", required=True, help="first weights, PyTorch names")
    t.add_argument("--heads", type=int, required=True)
    t.add_argument("--inputs", required=True, help="src, tgt_in, tgt_out ids")
    t.add_argument("--steps", type=int, required=True)
    t.add_argument("--warmup", type=int, default=4000)
    t.add_argument("--factor", type=float, default=1.0)
    t.add_argument("--beta1", type=float, default=0.9)
    t.add_argument("--beta2", type=float, default=0.98)
    t.add_argument("--eps", type=float, default=1e-9)
    t.add_argument("--pad", type=int, default=0)
    t.add_argument("--eps-ls", type=float, default=0.1)
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("-o", "--output", required=True, help="the weights after the last step, and `losses`")
    args = p.parse_args()
    commands = {
        "random": cmd_random,
        "forward": cmd_forward,
        "train": cmd_train,
        "batch": cmd_batch,
        "compare": cmd_compare,
    }
    commands[args.cmd](args)


if __name__ == "__main__":
    main()
