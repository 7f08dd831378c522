"""Every repository file a comment, docstring or document names exists.

Comments and docs name files to send the reader there (``csrc/cpu/contract.h``,
``tests/attention/test_attention.py``, ``mode/_masks.py``); when a file moves, the names go
stale silently. Scanned: the comments and docstrings of python/bik, tests and tools' Python
files, and the whole text of csrc, tests' C++ shims, tools' scripts, the Makefile, docs/*.md
and README.md.

What counts as a path: a token of path characters with a ``/`` and a source or data file
extension (``.py``, ``.md``, ``.h``, ``.cu``, ...) whose first directory is one of the
directories the path is resolved against: the repository root (``csrc/...``), python/
(``bik/...``) and python/bik/ (``ops/...``, ``mode/...``). A path that starts with ``../`` is
resolved against its file's folder and must stay inside the repository (house rule: comments
cite no file outside it). Not paths: globs and placeholders (``ops/*/op.py``,
``ops/<op>/op.py``, ``$RAW/check.json``, ``bench/results/NAME.json``: a segment with ``*?<>{}$~``
or an all-capitals word), absolute paths and URLs (they start with ``/`` once the scheme's
``:`` ends the token).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASES = (ROOT, ROOT / "python", ROOT / "python" / "bik")
EXTENSIONS = {"py", "md", "h", "hpp", "c", "cc", "cpp", "cu", "cuh", "sh", "toml", "txt",
              "json", "jsonl", "cfg", "in"}
_TOKEN = re.compile(r"[\w./*<>{}?~$-]+")
_PLACEHOLDER = re.compile(r"[*?<>{}$~]|(?<![A-Za-z])[A-Z]{2,}(?![A-Za-z])")


def _python_prose(text: str) -> list[str]:
    """A Python file's comments and docstrings (string statements), not its other strings:
    code builds file names that need not exist (a test's tmp_path files)."""
    found = [tok.string for tok in tokenize.generate_tokens(io.StringIO(text).readline)
             if tok.type == tokenize.COMMENT]
    found += [node.value.value for node in ast.walk(ast.parse(text))
              if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
              and isinstance(node.value.value, str)]
    return found


def _roots() -> set[str]:
    return {p.name for base in BASES for p in base.iterdir() if p.is_dir()}


def named_paths(text: str, roots: set[str]) -> set[str]:
    """The repository paths ``text`` names (see the module docstring for the rule)."""
    found = set()
    for match in _TOKEN.finditer(text):
        token = match.group(0).rstrip(".")
        head, _, last = token.partition("/")
        ext = token.rsplit(".", 1)[-1] if "." in token.rsplit("/", 1)[-1] else ""
        if not last or ext not in EXTENSIONS or _PLACEHOLDER.search(token):
            continue
        if head == ".." or head in roots:
            found.add(token)
    return found


def missing_path(path: str, source: Path) -> str | None:
    """Why ``path`` (named in ``source``) does not resolve, or None when it does."""
    if path.startswith("../"):
        target = (source.parent / path).resolve()
        if ROOT not in target.parents:
            return "outside the repository"
        return None if target.exists() else "missing"
    return None if any((base / path).exists() for base in BASES) else "missing"


def _scanned_files() -> list[Path]:
    def files(folder: str, pattern: str) -> list[Path]:
        return sorted(p for p in (ROOT / folder).rglob(pattern) if p.is_file()
                      and "__pycache__" not in p.parts)

    return [*files("python/bik", "*.py"), *files("csrc", "*"), *files("tools", "*"),
            *files("tests", "*.py"), *files("tests", "*.cpp"), *files("tests", "*.h"),
            ROOT / "Makefile", *sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]


def _prose(path: Path) -> list[str]:
    text = path.read_text()
    return _python_prose(text) if path.suffix == ".py" else [text]


def test_every_named_path_exists():
    roots = _roots()
    bad = sorted({f"{source.relative_to(ROOT)}: {path} ({why})"
                  for source in _scanned_files() for chunk in _prose(source)
                  for path in named_paths(chunk, roots)
                  if (why := missing_path(path, source)) is not None})
    assert not bad, "named files that do not exist:\n" + "\n".join(bad)


def test_the_rule_on_examples():
    roots = _roots()
    text = ("see csrc/cpu/contract.h, mode/_masks.py and bik/configs.py. Not: ops/*/op.py, "
            "ops/<op>/op.py, $RAW/check.json, bench/results/NAME.json, "
            "https://example.com/docs/x.md, bf16/fp16, ../outside/notes.md")
    assert named_paths(text, roots) == {"csrc/cpu/contract.h", "mode/_masks.py",
                                        "bik/configs.py", "../outside/notes.md"}
    here = ROOT / "tests" / "test_doc_paths.py"
    assert missing_path("mode/_masks.py", here) is None
    assert missing_path("../outside/notes.md", here) == "missing"
    assert missing_path("../../outside/notes.md", here) == "outside the repository"
    assert missing_path("ops/no_such_op/op.py", here) == "missing"
