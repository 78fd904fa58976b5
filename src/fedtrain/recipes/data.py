"""Offline data of the built-in recipe: byte-level tokens from real text already on disk.

Owns the corpus (the CPython standard library's own sources, present on every Python
install, so nothing is ever downloaded), its deterministic non-IID split into shards by
package, a fixed held-out set for the global model, loading files as UTF-8 byte tokens
(vocab 256), the resumable random-window batch stream of one participant, and the
held-out evaluation.

Data specs (`parse_data_spec`): a file or directory path, `stdlib:K/N` (shard K of N,
0-based) or `stdlib:heldout`.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import sysconfig
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedtrain.errors import ConfigError

__all__ = [
    "TEXT_SUFFIXES",
    "TokenStream",
    "evaluate",
    "heldout_paths",
    "load_tokens",
    "parse_data_spec",
    "stdlib_root",
    "stdlib_shards",
]

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")
"""File suffixes read when `load_tokens` is given a directory."""

_MAX_FILE_BYTES = 1_000_000
_MIN_SHARD_BYTES = 64 * 1024
# Directories never part of the corpus: tests, caches, third-party packages, and the
# platform build directory (config-3.x-<platform>) whose contents differ by machine.
_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "__pycache__", "site-packages"})
# Fixed held-out modules (about 400 KB), present in every CPython from 3.10 on.
_HELDOUT_MODULES = (
    "argparse.py",
    "csv.py",
    "dataclasses.py",
    "difflib.py",
    "fractions.py",
    "heapq.py",
    "shlex.py",
    "statistics.py",
    "string.py",
    "textwrap.py",
)


# ----------------------------------------------------------------------------- corpus


def stdlib_root() -> Path:
    """The directory of the running Python's standard library sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not (root / "os.py").is_file() or not _units(str(root)):
        raise ConfigError(
            f"the Python standard library at {root} has no .py sources "
            "(a stripped install?); pass a data directory of text files instead"
        )
    return root


def _skip_dir(name: str) -> bool:
    return name in _SKIP_DIRS or name.startswith("config-")


def _walk_py(directory: Path) -> list[Path]:
    """Every corpus .py file under `directory`, sorted, without following symlinks."""
    found: list[Path] = []
    for here, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not _skip_dir(d))
        for f in sorted(files):
            p = Path(here, f)
            if f.endswith(".py") and p.is_file() and p.stat().st_size <= _MAX_FILE_BYTES:
                found.append(p)
    return found


@functools.lru_cache(maxsize=4)
def _units(root_str: str) -> tuple[tuple[str, tuple[Path, ...], int], ...]:
    """The indivisible pieces of the stdlib corpus: (name, files, bytes), sorted by name.

    A package is one piece (this is what makes the split non-IID); each top-level module is
    its own piece. Held-out modules and machine-specific `_sysconfigdata_*` are left out.
    """
    root = Path(root_str)
    units: list[tuple[str, tuple[Path, ...], int]] = []
    for entry in sorted(os.listdir(root)):
        p = root / entry
        if p.is_dir() and not p.is_symlink() and not _skip_dir(entry):
            files = tuple(_walk_py(p))
        elif (
            entry.endswith(".py")
            and p.is_file()
            and entry not in _HELDOUT_MODULES
            and not entry.startswith("_sysconfigdata")
            and p.stat().st_size <= _MAX_FILE_BYTES
        ):
            files = (p,)
        else:
            continue
        size = sum(f.stat().st_size for f in files)
        if size > 0:
            units.append((entry, files, size))
    return tuple(units)


def stdlib_shards(n: int) -> list[list[Path]]:
    """Split the stdlib into `n` disjoint shards of whole packages/modules, balanced by bytes.

    Longest-processing-time greedy: pieces in decreasing size (ties by name) each go to the
    currently smallest shard (ties by index). Deterministic for a given Python install.
    """
    units = _units(str(stdlib_root()))
    if n < 1:
        raise ConfigError(f"the number of stdlib shards must be at least 1, got {n}")
    if n > len(units):
        raise ConfigError(f"cannot split the stdlib into {n} shards: it has only {len(units)} pieces")
    shards: list[list[Path]] = [[] for _ in range(n)]
    sizes = [0] * n
    for _, files, size in sorted(units, key=lambda u: (-u[2], u[0])):
        k = min(range(n), key=lambda i: (sizes[i], i))
        shards[k].extend(files)
        sizes[k] += size
    if min(sizes) < _MIN_SHARD_BYTES:
        raise ConfigError(
            f"cannot split the stdlib into {n} shards: the smallest would hold {min(sizes)} bytes "
            f"(at least {_MIN_SHARD_BYTES} needed); use fewer shards"
        )
    return [sorted(s) for s in shards]


def heldout_paths() -> list[Path]:
    """The fixed held-out stdlib modules (disjoint from every shard) for global evaluation."""
    root = stdlib_root()
    paths = [root / m for m in _HELDOUT_MODULES if (root / m).is_file()]
    if not paths:
        raise ConfigError(f"none of the held-out modules {_HELDOUT_MODULES} exist under {root}")
    return paths


# ----------------------------------------------------------------------------- tokens


def _expand(path: Path) -> list[Path]:
    if not path.exists():
        raise ConfigError(f"data path {path} does not exist")
    if path.is_file():
        return [path]
    files: list[Path] = []
    for here, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        files.extend(Path(here, f) for f in sorted(names) if f.endswith(TEXT_SUFFIXES))
    if not files:
        raise ConfigError(f"data directory {path} holds no {'/'.join(TEXT_SUFFIXES)} files")
    return files


def load_tokens(paths: Sequence[Path] | Path | str) -> torch.Tensor:
    """Read files (or directories, recursively) as UTF-8 bytes: a 1-D uint8 token tensor.

    Files are joined with a newline. Tokens stay uint8 (one byte each) until batching.
    """
    items = [Path(paths)] if isinstance(paths, (str, os.PathLike)) else [Path(p) for p in paths]
    if not items:
        raise ConfigError("no data paths given")
    buf = bytearray()
    for item in items:
        for f in _expand(item):
            try:
                data = f.read_bytes()
            except OSError as e:
                raise ConfigError(f"data file {f} cannot be read: {e}") from None
            if data:
                buf += data
                if not data.endswith(b"\n"):
                    buf += b"\n"
    if not buf:
        raise ConfigError(f"data {', '.join(str(p) for p in items)} is empty")
    return torch.frombuffer(buf, dtype=torch.uint8)


# ----------------------------------------------------------------------------- batches


def _batch_seed(seed: int, index: int) -> int:
    """A well-mixed 63-bit seed for batch `index` of stream `seed`."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class TokenStream:
    """One participant's batches: random training windows and fixed held-out windows.

    The last `heldout_fraction` of `tokens` is the participant's held-out slice. Batch i is
    drawn from a torch.Generator seeded by (seed, i), so the stream's whole state is
    `{"seed", "batches"}`: restoring it resumes exactly, in O(1), even after a change of
    batch size.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        *,
        batch_size: int,
        seq_len: int,
        seed: int,
        heldout_fraction: float = 0.05,
    ) -> None:
        if tokens.dim() != 1:
            raise ConfigError(f"tokens must be a 1-D tensor, got shape {tuple(tokens.shape)}")
        if batch_size < 1 or seq_len < 1:
            raise ConfigError(f"batch_size ({batch_size}) and seq_len ({seq_len}) must be >= 1")
        if not 0.0 <= heldout_fraction < 1.0:
            raise ConfigError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
        n, window = tokens.numel(), seq_len + 1
        if n < window:
            raise ConfigError(f"corpus of {n} tokens is shorter than seq_len+1 = {window}")
        held = 0 if heldout_fraction == 0 else max(math.ceil(n * heldout_fraction), window)
        if n - held < window:
            raise ConfigError(
                f"corpus of {n} tokens is too short for a training part and a held-out slice "
                f"of {window} tokens each; use more data, a shorter seq_len or heldout_fraction=0"
            )
        self.batch_size = batch_size
        self.seq_len = seq_len
        self._seed = int(seed)
        self._batches = 0
        # unfold gives (num_windows, seq_len + 1) views: indexing copies only the batch.
        self._train = tokens[: n - held].unfold(0, window, 1)
        self._heldout = tokens[n - held :].unfold(0, window, 1) if held else None

    @property
    def position(self) -> int:
        """Training batches drawn so far."""
        return self._batches

    @property
    def train_tokens(self) -> int:
        """Tokens in the training part (everything before the held-out slice)."""
        return self._train.size(0) + self.seq_len

    def _split(self, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = windows.to(torch.int64)
        return w[:, :-1], w[:, 1:]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y): LongTensor[batch_size, seq_len] random windows, y shifted by one."""
        g = torch.Generator().manual_seed(_batch_seed(self._seed, self._batches))
        starts = torch.randint(self._train.size(0), (self.batch_size,), generator=g)
        self._batches += 1
        return self._split(self._train[starts])

    def eval_batches(self, n: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """`n` fixed held-out batches, evenly spread over the held-out slice."""
        if self._heldout is None:
            raise ConfigError("this stream has no held-out slice (heldout_fraction=0)")
        if n < 1:
            raise ConfigError(f"the number of eval batches must be at least 1, got {n}")
        total, last = n * self.batch_size, self._heldout.size(0) - 1
        starts = torch.tensor([k * last // max(total - 1, 1) for k in range(total)])
        for b in range(n):
            yield self._split(self._heldout[starts[b * self.batch_size : (b + 1) * self.batch_size]])

    def state_dict(self) -> dict[str, Any]:
        """JSON-able position of the stream."""
        return {"seed": self._seed, "batches": self._batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()` output (possibly round-tripped through JSON)."""
        try:
            seed, batches = state["seed"], state["batches"]
        except (KeyError, TypeError):
            raise ConfigError(f"data stream state needs 'seed' and 'batches', got {state!r}") from None
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (seed, batches)):
            raise ConfigError(f"data stream state values must be integers, got {state!r}")
        if batches < 0:
            raise ConfigError(f"data stream state has negative 'batches': {batches}")
        self._seed, self._batches = seed, batches


def evaluate(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> float:
    """Mean loss of `model` over `batches`, without gradients; restores the training mode.

    `loss_fn(model, x, y)` computes a batch's loss (see `recipes.loss_fn`); without it
    `model(x, y)` may return `(logits, loss)` like `GPT` or just logits.
    """
    was_training = model.training
    device = next(model.parameters()).device
    total, count = 0.0, 0
    model.eval()
    try:
        with torch.no_grad():
            for x, y in batches:
                x, y = x.to(device), y.to(device)
                if loss_fn is not None:
                    total += float(loss_fn(model, x, y))
                    count += 1
                    continue
                out = model(x, y)
                logits, loss = out if isinstance(out, tuple) else (out, None)
                if loss is None:
                    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
                total += float(loss)
                count += 1
    finally:
        model.train(was_training)
    if count == 0:
        raise ConfigError("evaluate() got no batches")
    return total / count


# ----------------------------------------------------------------------------- specs


def parse_data_spec(spec: str) -> list[Path]:
    """`PATH` (file or directory), `stdlib:K/N` (shard K of N, 0-based) or `stdlib:heldout`."""
    spec = spec.strip()
    if spec.startswith("stdlib:"):
        rest = spec[len("stdlib:") :]
        if rest == "heldout":
            return heldout_paths()
        k_str, sep, n_str = rest.partition("/")
        if not (sep and k_str.isdigit() and n_str.isdigit()):
            raise ConfigError(f"data spec {spec!r}: expected stdlib:K/N (e.g. stdlib:0/4) or stdlib:heldout")
        k, n = int(k_str), int(n_str)
        if n < 1:
            raise ConfigError(f"data spec {spec!r}: the number of shards N must be at least 1 (e.g. stdlib:0/4)")
        if k >= n:
            raise ConfigError(f"data spec {spec!r}: shard K must be in 0..{n - 1} (K counts from 0)")
        return stdlib_shards(n)[k]
    if not spec:
        raise ConfigError("empty data spec: give a path, stdlib:K/N or stdlib:heldout")
    path = Path(spec).expanduser()
    if not path.exists():
        raise ConfigError(
            f"data spec {spec!r}: path {path} does not exist (use a file or directory, stdlib:K/N or stdlib:heldout)"
        )
    return [path]
