"""Runs the tests marked `interpreted` in one TRITON_INTERPRET=1 subprocess and reports each of
them in this session as it ran there: passed, failed (with its output) or skipped (with its reason).

Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when sparse/ is first imported, so
the kernels cannot run interpreted in the process that imported them compiled. Every interpreted
test of the session goes to one subprocess, started as soon as collection ends, so it works on the
second core while this process runs the other tests; the interpreted tests are moved to the end of
the run, where each waits for that subprocess and takes its own result. A test therefore counts
once, where it ran. tests/conftest.py registers the hooks below.
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

RESULTS_ENV = "SPARSE_INTERPRETED_RESULTS"  # set in the subprocess: the JSON file its results go to


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class InterpreterRun:
    """The subprocess running the session's interpreted tests, and their results once it ended."""

    def __init__(self, nodeids: list, rootdir: Path):
        self.folder = tempfile.TemporaryDirectory(prefix="interpreted-tests-")
        self.results_path = Path(self.folder.name) / "results.json"
        self.log_path = Path(self.folder.name) / "output.txt"
        env = dict(os.environ, TRITON_INTERPRET="1", **{RESULTS_ENV: str(self.results_path)})
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *nodeids],
                cwd=rootdir, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.results = None

    def result(self, nodeid: str) -> dict:
        if self.results is None:
            self.process.wait()  # no time limit: a slow machine is no failure
            self.results = json.loads(self.results_path.read_text()) if self.results_path.is_file() else {}
        if nodeid in self.results:
            return self.results[nodeid]
        output = self.log_path.read_text()[-3000:]
        return {"outcome": "failed", "text": f"did not run in the TRITON_INTERPRET=1 subprocess (exit code "
                                             f"{self.process.returncode}); its output ends:\n{output}"}

    def close(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.folder.cleanup()


_run = None


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: only the interpreted tests that will run
def pytest_collection_modifyitems(session, config, items):
    global _run
    if interpreting() or config.option.collectonly:
        return
    interpreted = [item for item in items if item.get_closest_marker("interpreted")]
    if not interpreted:
        return
    items[:] = [item for item in items if not item.get_closest_marker("interpreted")] + interpreted
    _run = InterpreterRun([item.nodeid for item in interpreted], config.rootpath)


def pytest_pyfunc_call(pyfuncitem):
    """In this process an interpreted test takes its outcome from the subprocess instead of running."""
    if _run is None or not pyfuncitem.get_closest_marker("interpreted"):
        return None
    result = _run.result(pyfuncitem.nodeid)
    if result["outcome"] == "skipped":
        pytest.skip(result["text"])
    if result["outcome"] == "failed":
        pytest.fail(f"under TRITON_INTERPRET=1:\n{result['text']}", pytrace=False)
    return True


_results = {}


def pytest_runtest_logreport(report):
    """In the subprocess: each test's outcome, its failure text or its skip reason."""
    if RESULTS_ENV not in os.environ:
        return
    entry = _results.setdefault(report.nodeid, {"outcome": "passed", "text": ""})
    if report.failed:
        entry.update(outcome="failed", text=(entry["text"] + "\n" + report.longreprtext).strip())
    elif report.skipped and entry["outcome"] != "failed":
        if isinstance(report.longrepr, tuple):  # (file, line, reason): the reason names where it was skipped
            path, line, reason = report.longrepr
            reason = f"{reason.removeprefix('Skipped: ')} ({Path(path).name}:{line}, under TRITON_INTERPRET=1)"
        else:
            reason = str(report.longrepr)
        entry.update(outcome="skipped", text=reason)


def pytest_sessionfinish(session):
    if RESULTS_ENV in os.environ:
        path = Path(os.environ[RESULTS_ENV])
        path.with_suffix(".tmp").write_text(json.dumps(_results))
        path.with_suffix(".tmp").replace(path)
    elif _run is not None:
        _run.close()
