"""kiln from Python: translate and score with a trained model, check and compile specs,
and run a compiled artifact's entry points on NumPy arrays.

    import kiln
    t = kiln.Translator("runs/multi30k_small/average")
    print(t.translate(["A man is sleeping."])[0].text)

Every error kiln reports is raised as `kiln.KilnError`, with `code`, `help`, and for a
spec's diagnostics `file`, `line` and `column`. kiln releases the GIL while it computes,
so Python threads can translate at once.
"""
from dataclasses import dataclass, field
import json
import os
from typing import Dict, List, Mapping, Optional, Sequence, Union

import numpy as np

from . import _kiln
from ._kiln import KilnError

__version__ = _kiln.__version__
__all__ = ["Translator", "Translation", "Model", "KilnError", "check", "compile",
           "compile_model"]

PathLike = Union[str, "os.PathLike[str]"]


@dataclass
class Translation:
    """One hypothesis: its text, its tokens (the vocabulary's pieces), its score (the
    log-probability over the length penalty) and its log-probability; `nbest` holds all
    the hypotheses asked for (`nbest=` > 1), best first, this one included."""

    text: str
    tokens: List[str]
    score: float
    log_prob: float
    nbest: List["Translation"] = field(default_factory=list)


class Translator:
    """A trained model loaded for translating: a checkpoint, a run (its newest
    checkpoint), the output of `kiln average`, or a compiled artifact.

    `threads` sizes kiln's thread pool (once per process; default one per core),
    `precision` the matrix products of the compiled executor (`f32`, `16bit`, `int8`, …,
    process-wide), `executor` is `compiled`, `eager`, `reference` or `cuda`.
    """

    def __init__(self, model: PathLike, threads: Optional[int] = None,
                 precision: Optional[str] = None, executor: str = "compiled"):
        self._t = _kiln.Translator(os.fspath(model), threads, precision, executor)

    @property
    def vocab_size(self) -> int:
        return self._t.vocab_size

    def translate(self, texts: Sequence[str], beam: int = 4, alpha: float = 0.6,
                  nbest: int = 1, greedy: bool = False, length_penalty: str = "gnmt",
                  early_stop: str = "k-finished", max_len_a: float = 1.0,
                  max_len_b: int = 50, allow_unk: bool = False,
                  batch: int = 32) -> List[Translation]:
        """The best translation of each sentence (as `kiln translate` prints it for the
        same options); with `nbest` > 1 each also lists its `nbest` hypotheses."""
        if isinstance(texts, str):
            raise TypeError("translate takes a list of sentences, not one string")
        out = self._t.translate(list(texts), beam, alpha, nbest, greedy, length_penalty,
                                early_stop, max_len_a, max_len_b, allow_unk, batch)
        result = []
        for hyps in out:
            all_ = [Translation(text, list(tokens), score, lp)
                    for text, tokens, score, lp in hyps]
            best = all_[0]
            if nbest > 1:
                best = Translation(best.text, best.tokens, best.score, best.log_prob, all_)
            result.append(best)
        return result

    def score(self, src: Sequence[str], ref: Sequence[str], normalize: bool = False,
              batch: int = 32) -> List[Optional[float]]:
        """Teacher-forced log-probability of each reference given its source (`<eos>`
        included), as `kiln score`; None where the source is empty. `normalize`: per
        token."""
        return self._t.score(list(src), list(ref), normalize, batch)


def check(spec: PathLike, model: Optional[str] = None, mode: str = "eval",
          **overrides: Union[int, float, str]) -> dict:
    """A spec's summary, as `kiln check --json`: parameters, dims, inputs, outputs and
    node count; keyword arguments override model parameters (`d_model=256`)."""
    sets = [f"{k}={v}" for k, v in overrides.items()]
    return json.loads(_kiln.check(os.fspath(spec), sets, model, mode))


def compile(spec: PathLike, out: PathLike, entries: Optional[Sequence[str]] = None,
            target: str = "cpu", precision: str = "f32", seed: int = 0,
            validate: bool = False, model: Optional[str] = None,
            **overrides: Union[int, float, str]) -> None:
    """Compiles `spec` into the artifact directory `out` (which must not exist), as
    `kiln compile SPEC -o OUT`; keyword arguments override model parameters."""
    sets = [f"{k}={v}" for k, v in overrides.items()]
    _kiln.compile(os.fspath(spec), os.fspath(out), sets,
                  None if entries is None else list(entries), target, precision, seed,
                  validate, model)


def compile_model(model: PathLike, out: PathLike, entries: Optional[Sequence[str]] = None,
                  target: str = "cpu", precision: str = "f32", validate: bool = False) -> None:
    """Compiles a trained model (a checkpoint, a run or `kiln average`'s output) with its
    weights and tokenizer into the artifact directory `out`, as `kiln compile
    --from-model MODEL -o OUT`; `Translator(out)` then loads it. `precision="int8"`:
    the weights' products in int8 wherever it runs."""
    _kiln.compile_model(os.fspath(model), os.fspath(out),
                        None if entries is None else list(entries), target, precision, validate)


_DTYPES = {"float32", "float64", "int32", "int64", "bool"}


def _wire(name: str, a) -> tuple:
    a = np.asarray(a)
    if a.dtype.name not in _DTYPES:
        raise TypeError(f"`{name}` is {a.dtype}: give float32, float64, int32, int64 or bool")
    a = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
    return (name, a.tobytes(), a.dtype.name, list(a.shape))


class Model:
    """A compiled artifact (`kiln compile … -o DIR`) whose entry points run on NumPy
    arrays, with the artifact's weights or others of the same names and shapes."""

    def __init__(self, artifact: PathLike):
        self._m = _kiln.Model(os.fspath(artifact))

    @property
    def entries(self) -> List[str]:
        return self._m.entries

    def inputs(self, entry: str) -> List[dict]:
        """The inputs `entry` takes, in order: `{"name", "dtype", "shape"}`, the shape's
        dims by name (`batch`) or size."""
        return [{"name": n, "dtype": d, "shape": s} for n, d, s in self._m.inputs(entry)]

    def run(self, entry: str, inputs: Mapping[str, np.ndarray],
            weights: Optional[Mapping[str, np.ndarray]] = None, seed: int = 0,
            step: int = 0) -> Dict[str, np.ndarray]:
        """Runs `entry` (`forward`, `loss`, `train_step`, `encode`, `decode_step`) and
        returns its outputs by name, in the graph's order."""
        ins = [_wire(k, v) for k, v in inputs.items()]
        ws = None if weights is None else [_wire(k, v) for k, v in weights.items()]
        outs = self._m.run(entry, ins, ws, seed, step)
        return {name: np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<"))
                .reshape(shape).copy() for name, data, dtype, shape in outs}
