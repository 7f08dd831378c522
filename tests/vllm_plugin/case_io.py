"""How the engine-case scripts (vllm_case.py, spec_case.py, tp_case.py) hand their results to
the tests: one ``BIK_RESULT <json>`` line on stdout, read back by :func:`run_case`."""

from __future__ import annotations

import json
import subprocess
import sys

PREFIX = "BIK_RESULT "


def emit(result: dict, *, stats: bool = True) -> None:
    """Print ``result`` (with the plugin's counts where it is importable) as the result line."""
    if stats:
        try:
            from bik.integrations import vllm as plugin

            result["stats"] = plugin.stats()
        except ImportError:
            pass
    print(PREFIX + json.dumps(result), flush=True)


def run_case(script, args: list[str], env: dict, timeout: int = 900) -> dict:
    """Run a case script in its own process (the plugin is process-wide) and return its
    result; a failed run fails the test with the end of its stderr."""
    proc = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(PREFIX)]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1].removeprefix(PREFIX))
