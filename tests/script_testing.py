"""Running a script as a user would, and the one-line error every CLI gives on bad input."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_script(script, *args, env=None):
    return subprocess.run([sys.executable, str(REPO / "scripts" / script), *map(str, args)],
                          capture_output=True, text=True, env=env, cwd=REPO)


def assert_one_line_error(done, *fragments):
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") or ": error: " in last, last
    for fragment in fragments:
        assert fragment in last, last
