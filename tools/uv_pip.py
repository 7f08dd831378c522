"""``uv pip`` in a venv, installing from where pip is configured to install from (Makefile).

The venvs are built with uv (it unpacks wheels from its cache in seconds; pip took ~80 s for
.venv and ~150 s for .venv-vllm on the 2-core machine), but a machine's package sources are
configured for pip: its config files and ``PIP_*`` variables (``pip config list``). uv reads
neither, so this translates them: index-url, extra-index-url, find-links and constraint become
``UV_INDEX_URL`` / ``UV_EXTRA_INDEX_URL`` / ``UV_FIND_LINKS`` / ``UV_CONSTRAINT``. uv's default
index strategy takes each package from the first index that has it; pip picks the best version
across every index, so ``UV_INDEX_STRATEGY=unsafe-best-match`` keeps pip's choices; and like
pip it compiles what it installs to bytecode (``UV_COMPILE_BYTECODE=1``).

    python tools/uv_pip.py VENV install -q ...   # VENV: a venv holding pip and uv

runs ``VENV/bin/uv pip install -q ... --python VENV/bin/python`` with those variables set (a uv
variable the caller set wins).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

# pip's option name -> (uv's variable, the separator uv reads between several values)
OPTIONS = {"index-url": ("UV_INDEX_URL", " "), "extra-index-url": ("UV_EXTRA_INDEX_URL", " "),
           "find-links": ("UV_FIND_LINKS", ","), "constraint": ("UV_CONSTRAINT", " ")}


def _rank(key: str) -> int:
    """pip's precedence of a ``pip config list`` key (``global.find-links``, ``:env:.cert``):
    its files global < user < site (the variant ``pip config list -v`` shows, read here from
    the order they are listed in), then the ``install`` section over ``global``, the
    environment over everything."""
    if key.startswith(":env:"):
        return 2
    return 1 if key.startswith("install.") else 0


def pip_options(python: str) -> dict[str, list[str]]:
    """pip's configured values of OPTIONS (whitespace-separated there), as pip would use them
    for ``pip install``."""
    listed = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True,
                            text=True, check=False).stdout
    found: dict[str, tuple[int, list[str]]] = {}
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        name = key.rpartition(".")[2]
        if name not in OPTIONS:
            continue
        rank = _rank(key)
        if name not in found or rank >= found[name][0]:
            found[name] = (rank, str(ast.literal_eval(value)).split())
    return {name: values for name, (_, values) in found.items()}


def uv_environment(python: str, environ=os.environ) -> dict[str, str]:
    """``environ`` with uv's variables set from pip's configuration (those already set win)."""
    env = dict(environ)
    env.setdefault("UV_INDEX_STRATEGY", "unsafe-best-match")
    # pip compiles every installed module to bytecode, uv only when asked: without it each
    # process compiles torch's Python again (and where PYTHONDONTWRITEBYTECODE is set, every
    # process, every time).
    env.setdefault("UV_COMPILE_BYTECODE", "1")
    for name, values in pip_options(python).items():
        variable, separator = OPTIONS[name]
        env.setdefault(variable, separator.join(values))
    return env


def main() -> None:
    venv, args = sys.argv[1], sys.argv[2:]
    python = os.path.join(venv, "bin", "python")
    uv = os.path.join(venv, "bin", "uv")
    os.execve(uv, [uv, "pip", *args, "--python", python], uv_environment(python))


if __name__ == "__main__":
    main()
