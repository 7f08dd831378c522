"""device_check.sh's summary: one JSON from a directory of stage outputs.

    python tools/device_check_summary.py RAW_DIR OUT_JSON

RAW_DIR holds env.json, stages.jsonl (a line per stage: name, rc, seconds) and each pytest
stage's junit XML (<stage>.xml) and log (<stage>.log). The summary has the environment, every
stage with its rc, and for pytest stages the counts (tests, failures, errors, skipped) and the
ids of the tests that failed; a stage that failed also carries the last lines of its log. So a
device run that returns only this file still says what passed, what failed and what skipped.
Standard library only (it runs on the device machine before anything else is trusted).
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

LOG_TAIL = 3000  # characters of a failed stage's log kept in the summary


def junit_counts(path: Path) -> dict:
    """Totals over the XML's test suites, and the ids of the failed / errored tests."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites)
              for k in ("tests", "failures", "errors", "skipped")}
    counts["failed"] = [f"{case.get('classname')}::{case.get('name')}"
                        for case in root.iter("testcase")
                        if case.find("failure") is not None or case.find("error") is not None]
    return counts


def _json(path: Path):
    """A file's JSON; None when absent; what it holds when it is not JSON (a stage that died
    mid-write must not stop the summary)."""
    if not path.exists():
        return None
    text = path.read_text(errors="replace")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {"unreadable": text[-LOG_TAIL:]}


def summary(raw: Path) -> dict:
    env = _json(raw / "env.json")
    stages = []
    lines = (raw / "stages.jsonl").read_text().splitlines() if (raw / "stages.jsonl").exists() \
        else []
    for line in lines:
        try:
            stage = json.loads(line)
        except json.JSONDecodeError:
            stages.append({"unreadable": line})
            continue
        xml = raw / f"{stage['stage']}.xml"
        if xml.exists():
            try:
                stage["pytest"] = junit_counts(xml)
            except ET.ParseError as exc:  # a stage cut off while writing it
                stage["pytest"] = {"unreadable": str(exc)}
        log = raw / f"{stage['stage']}.log"
        if stage.get("rc") not in (0, None) and log.exists():
            stage["log_tail"] = log.read_text(errors="replace")[-LOG_TAIL:]
        stages.append(stage)
    return {"env": env, "stages": stages,
            "files": sorted(p.name for p in raw.iterdir() if p.is_file())}


def main() -> None:
    raw, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.write_text(json.dumps(summary(raw), indent=2) + "\n")


if __name__ == "__main__":
    main()
