"""Imports flow one way: a module imports only modules of its own layer or of the layers below it.

Every import of every module under mlaserve/ counts, the lazy ones inside functions too (they are how a module
avoids loading triton or the server until it runs, not a licence to reach upwards). LAYERS is the order, top first;
a module belongs to the layer of the longest prefix that names it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "mlaserve"

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("command line", ("mlaserve.__main__", "mlaserve.cli")),
    ("HTTP server, benchmark client, draft training", ("mlaserve.server", "mlaserve.bench", "mlaserve.train")),
    ("offline API", ("mlaserve", "mlaserve.llm")),  # "mlaserve": the package's __init__ (exports LLM)
    # `mlaserve make-random`'s module (add_cli_args, cli_main): --plan reads the shared parallelism flags
    ("make-random command", ("mlaserve.models.make_random_cli",)),
    ("shared command-line flags", ("mlaserve.args",)),
    (
        "rank processes",
        ("mlaserve.distributed.launch", "mlaserve.distributed.worker", "mlaserve.distributed.engine_ranks"),
    ),
    ("engine", ("mlaserve.engine",)),
    ("speculative decoding", ("mlaserve.spec",)),
    ("models", ("mlaserve.models",)),
    ("attention backends", ("mlaserve.attention",)),
    ("layers", ("mlaserve.layers",)),
    # tp.py, rendezvous.py, allreduce.py, heartbeat.py (the launch modules sit above the engine)
    ("collectives", ("mlaserve.distributed",)),
    ("kernels", ("mlaserve.kernels",)),
    ("tokenizers", ("mlaserve.tokenizer", "mlaserve.tokenizer_tiktoken", "mlaserve.detokenizer")),
    (
        "bottom",
        (
            "mlaserve.config",
            "mlaserve.kernel_config",
            "mlaserve.quantization",
            "mlaserve.types",
            "mlaserve.paths",
            "mlaserve.capture",
            "mlaserve.presets",
        ),
    ),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (PKG.parent / rel).with_suffix(".py").is_file() or (PKG.parent / rel / "__init__.py").is_file()


def layer_of(name: str) -> int | None:
    best, depth = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and p.count(".") > depth:
                best, depth = i, p.count(".")
    return best


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every mlaserve module `path` imports, relative and lazy imports included."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:  # `from ..distributed import tp` imports the module mlaserve.distributed.tp
                sub = f"{target}.{a.name}"
                found.append((node.lineno, sub if is_module(sub) else target))
    return [(line, m) for line, m in found if m == "mlaserve" or m.startswith("mlaserve.")]


def violations() -> list[str]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        src = module_name(path)
        i = layer_of(src)
        rel = path.relative_to(PKG.parent)
        if i is None:
            out.append(f"{rel}: {src} belongs to no layer; add it to LAYERS in {Path(__file__).name}")
            continue
        for line, dst in imports(path):
            j = layer_of(dst)
            if j is None:
                out.append(f"{rel}:{line}: {src} imports {dst}, which belongs to no layer")
            elif j < i:
                out.append(
                    f"{rel}:{line}: {src} ({LAYERS[i][0]}, layer {i}) imports {dst} ({LAYERS[j][0]}, layer {j}): "
                    "a module may import only its own layer and the layers below it"
                )
    return out


def test_imports_flow_one_way():
    bad = violations()
    order = "\n".join(f"  {i:2d} {name}: {', '.join(p)}" for i, (name, p) in enumerate(LAYERS))
    assert not bad, "imports against the layer order:\n" + "\n".join(bad) + "\n\nthe order, top first:\n" + order


def test_every_layer_names_real_modules():
    """A layer's prefixes name modules that exist (a renamed module must not leave its rule behind)."""
    for name, prefixes in LAYERS:
        for p in prefixes:
            assert is_module(p), f"layer {name!r}: {p} is not a module"
