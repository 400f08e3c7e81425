"""Type stubs of `kiln._kiln`, the Rust extension (`python/src`); use `kiln` itself."""
from typing import List, Optional, Tuple

__version__: str

class KilnError(Exception):
    code: str
    help: Optional[str]
    file: Optional[str]
    line: Optional[int]
    column: Optional[int]
    rendered: str

Hyp = Tuple[str, List[str], float, float]
Wire = Tuple[str, bytes, str, List[int]]

class Translator:
    def __init__(self, model: str, threads: Optional[int] = None,
                 precision: Optional[str] = None, executor: str = "compiled") -> None: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def is_artifact(self) -> bool: ...
    def translate(self, texts: List[str], beam: int = 4, alpha: float = 0.6, nbest: int = 1,
                  greedy: bool = False, length_penalty: str = "gnmt",
                  early_stop: str = "k-finished", max_len_a: float = 1.0,
                  max_len_b: int = 50, allow_unk: bool = False,
                  batch: int = 32) -> List[List[Hyp]]: ...
    def score(self, src: List[str], refs: List[str], normalize: bool = False,
              batch: int = 32) -> List[Optional[float]]: ...

class Model:
    def __init__(self, path: str) -> None: ...
    @property
    def entries(self) -> List[str]: ...
    def inputs(self, entry: str) -> List[Tuple[str, str, List[str]]]: ...
    def run(self, entry: str, inputs: List[Wire], weights: Optional[List[Wire]] = None,
            seed: int = 0, step: int = 0) -> List[Wire]: ...

def check(spec: str, overrides: List[str] = ..., model: Optional[str] = None,
          mode: str = "eval") -> str: ...

def compile(spec: str, out: str, overrides: List[str] = ...,
            entries: Optional[List[str]] = None, target: str = "cpu",
            precision: str = "f32", seed: int = 0, validate: bool = False,
            model: Optional[str] = None) -> None: ...

def compile_model(model: str, out: str, entries: Optional[List[str]] = None,
                  target: str = "cpu", precision: str = "f32",
                  validate: bool = False) -> None: ...
