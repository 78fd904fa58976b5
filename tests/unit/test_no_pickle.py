"""No pickle on any path: the source must not import pickle-family modules or deserialize with them.

`torch.load` unpickles (remote code execution on untrusted bytes) unless called with
`weights_only=True`; `torch.save` writes pickle; numpy's `allow_pickle=True` reads it.
The check parses every module of `src/` (docstrings and comments may say "pickle").
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
BANNED_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal", "joblib", "copyreg"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _kw_true(call: ast.Call, name: str) -> bool:
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is True for k in call.keywords)


def problems(source: str, where: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [
                f"{where}:{node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] in BANNED_MODULES
            ]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in BANNED_MODULES:
            out.append(f"{where}:{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name.endswith(("torch.load", "serialization.load")) and not _kw_true(node, "weights_only"):
                out.append(f"{where}:{node.lineno}: {name}(...) without weights_only=True")
            elif name.endswith("torch.save"):
                out.append(f"{where}:{node.lineno}: {name}(...) writes pickle; use safetensors")
            elif name.split(".")[-1] in ("load", "loads") and _kw_true(node, "allow_pickle"):
                out.append(f"{where}:{node.lineno}: {name}(allow_pickle=True)")
            elif name in ("__import__", "importlib.import_module") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and str(arg.value).split(".")[0] in BANNED_MODULES:
                    out.append(f"{where}:{node.lineno}: dynamic import of {arg.value}")
    return out


def test_detector_flags_each_pattern() -> None:
    bad = """
import pickle
from dill import loads
import torch, numpy as np
torch.load(f)
torch.load(f, weights_only=False)
torch.save(x, f)
np.load(f, allow_pickle=True)
__import__("cloudpickle")
"""
    found = problems(bad, "x.py")
    assert len(found) == 7, found
    ok = '"""We never pickle."""\nimport torch\ntorch.load(f, weights_only=True)\n# pickle.loads(x)\n'
    assert problems(ok, "ok.py") == []


def test_no_pickle_anywhere_in_src() -> None:
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 20
    found = [p for f in files for p in problems(f.read_text(encoding="utf-8"), str(f.relative_to(SRC)))]
    assert not found, "pickle on a path:\n" + "\n".join(found)
