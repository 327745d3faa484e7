"""The training corpus: the .py files of the standard library and site-packages, deduplicated by content and pinned
by a manifest (root folders, each file's path, sha256 and byte count, and the manifest's own hash).

A file belongs to the held-out split when its sha256, read as a number, is 0 modulo `held_out_mod` (100: 1 %, by
content alone, so the same file is held out on every machine). A manifest rebuilds the same corpus from the same
or relocated roots.
"""

from __future__ import annotations

import hashlib
import json
import os
import site
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

MANIFEST_VERSION = 1
HELD_OUT_MOD = 100  # by default 1 file in 100 (by hash) is held out
MAX_FILE_BYTES = 1 << 19  # larger .py files are mostly generated tables and data


@dataclass(frozen=True)
class SourceFile:
    root: int  # index into the manifest's roots
    path: str  # relative to the root, '/'-separated
    sha256: str
    bytes: int

    def held_out(self, mod: int = HELD_OUT_MOD) -> bool:
        return int(self.sha256[:16], 16) % mod == 0


def default_roots() -> list[str]:
    """The standard library and every site-packages folder of this interpreter (existing, distinct)."""
    roots = [sysconfig.get_paths()["stdlib"], *site.getsitepackages()]
    out = []
    for r in roots:
        r = os.path.realpath(r)
        if os.path.isdir(r) and r not in out:
            out.append(r)
    return out


def _walk(root: str) -> list[str]:
    """Relative paths of the .py files under root, sorted; a site-packages folder inside the stdlib folder is a
    root of its own, so it is skipped here."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        out += [os.path.relpath(os.path.join(dirpath, f), root) for f in filenames if f.endswith(".py")]
    return sorted(p.replace(os.sep, "/") for p in out)


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _text(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def scan(roots: list[str], max_bytes: int | None = None, workers: int = 16) -> list[SourceFile]:
    """Every readable UTF-8 .py file under roots (1 .. MAX_FILE_BYTES bytes), one per distinct content (the first
    path in root order wins), sorted by hash. max_bytes keeps the files of lowest hash up to that total."""
    paths = [(i, rel) for i, root in enumerate(roots) for rel in _walk(root)]

    def load(item):
        i, rel = item
        data = _read(os.path.join(roots[i], rel))
        if data is None or not 0 < len(data) <= MAX_FILE_BYTES or _text(data) is None:
            return None
        return SourceFile(i, rel, hashlib.sha256(data).hexdigest(), len(data))

    with ThreadPoolExecutor(workers) as ex:
        found = [f for f in ex.map(load, paths, chunksize=64) if f is not None]
    seen: dict[str, SourceFile] = {}
    for f in found:
        seen.setdefault(f.sha256, f)
    files = sorted(seen.values(), key=lambda f: f.sha256)
    if max_bytes is not None:
        kept, total = [], 0
        for f in files:
            if total + f.bytes > max_bytes:
                continue
            kept.append(f)
            total += f.bytes
        files = kept
    return files


def manifest_hash(roots_named: list[str], files: list[SourceFile], held_out_mod: int) -> str:
    """sha256 of the canonical file list (hash, byte count and path of each, in hash order), the root names and
    the held-out rule."""
    h = hashlib.sha256(json.dumps([roots_named, held_out_mod]).encode())
    for f in sorted(files, key=lambda f: f.sha256):
        h.update(f"{f.sha256} {f.bytes} {f.root} {f.path}\n".encode())
    return h.hexdigest()


def write_manifest(path: str, roots: list[str], files: list[SourceFile], settings: dict) -> dict:
    """settings["held_out_mod"] (default HELD_OUT_MOD) decides the split and is recorded."""
    names = [os.path.basename(r.rstrip("/")) for r in roots]
    mod = settings.setdefault("held_out_mod", HELD_OUT_MOD)
    m = {
        "version": MANIFEST_VERSION,
        "sha256": manifest_hash(names, files, mod),
        "roots": roots,
        "root_names": names,
        "settings": {**settings, "held_out": f"int(sha256[:16], 16) % {mod} == 0"},
        "num_files": len(files),
        "bytes": sum(f.bytes for f in files),
        "held_out_files": sum(f.held_out(mod) for f in files),
        "held_out_bytes": sum(f.bytes for f in files if f.held_out(mod)),
        "files": [[f.sha256, f.bytes, f.root, f.path] for f in files],
    }
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(m, fh, indent=0)
    os.replace(tmp, path)
    return m


def read_manifest(path: str, roots: list[str] | None = None) -> tuple[dict, list[SourceFile]]:
    """The manifest and its files; `roots` replaces the recorded root folders (same count, same order)."""
    try:
        with open(path) as fh:
            m = json.load(fh)
    except (OSError, ValueError) as e:
        raise ValueError(f"--manifest: cannot read {path} ({e})") from e
    if m.get("version") != MANIFEST_VERSION:
        raise ValueError(f"--manifest: {path} has version {m.get('version')!r}, expected {MANIFEST_VERSION}")
    if roots:
        if len(roots) != len(m["roots"]):
            raise ValueError(f"--roots: the manifest has {len(m['roots'])} roots ({m['root_names']}), got {len(roots)}")
        m["roots"] = [os.path.realpath(r) for r in roots]
    files = [SourceFile(root, p, h, n) for h, n, root, p in m["files"]]
    if manifest_hash(m["root_names"], files, m["settings"]["held_out_mod"]) != m["sha256"]:
        raise ValueError(f"--manifest: {path}'s file list does not match its own sha256 (edited by hand?)")
    return m, files


def read_texts(roots: list[str], files: list[SourceFile], workers: int = 16) -> list[str]:
    """The files' text, each checked against its recorded hash and size (one error lists what differs)."""

    def load(f: SourceFile):
        data = _read(os.path.join(roots[f.root], f.path))
        ok = data is not None and len(data) == f.bytes and hashlib.sha256(data).hexdigest() == f.sha256
        return _text(data) if ok else None

    with ThreadPoolExecutor(workers) as ex:
        texts = list(ex.map(load, files, chunksize=64))
    bad = [f"{roots[f.root]}/{f.path}" for f, t in zip(files, texts) if t is None]
    if bad:
        raise ValueError(
            f"corpus: {len(bad)} of {len(files)} manifest files are missing or changed (e.g. {', '.join(bad[:3])}); "
            "pass the roots that hold them (--roots) or build a new manifest"
        )
    return texts
