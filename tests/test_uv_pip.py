"""tools/uv_pip.py: uv installs from the package sources pip is configured with (Makefile)."""

from __future__ import annotations

import sys

from uv_pip import uv_environment


def test_pips_sources_become_uvs(tmp_path, monkeypatch):
    config = tmp_path / "pip.conf"
    config.write_text("[global]\nextra-index-url = file:///a/simple\n    file:///b/simple\n"
                      "find-links = /wheels/one /wheels/two\nindex-url = https://g/\n"
                      "[install]\nindex-url = https://i/\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(config))
    for name in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT"):
        monkeypatch.delenv(name, raising=False)
    env = uv_environment(sys.executable, {"UV_INDEX_URL": "https://set-by-the-caller/"})
    assert env["UV_EXTRA_INDEX_URL"] == "file:///a/simple file:///b/simple"
    assert env["UV_FIND_LINKS"] == "/wheels/one,/wheels/two"  # uv reads commas here
    assert env["UV_INDEX_URL"] == "https://set-by-the-caller/"  # the caller's wins
    assert uv_environment(sys.executable, {})["UV_INDEX_URL"] == "https://i/"  # [install]
    assert env["UV_INDEX_STRATEGY"] == "unsafe-best-match" and env["UV_COMPILE_BYTECODE"] == "1"
    monkeypatch.setenv("PIP_FIND_LINKS", "/from/the/environment")  # wins over pip's files
    assert uv_environment(sys.executable, {})["UV_FIND_LINKS"] == "/from/the/environment"
