"""scripts/gpu_session.sh: every A/B job edits a constant of this tree with sed; an expression that
no longer matches makes decode_ab.sh / decode_variants.sh stop on the device ("changed nothing"),
after the machine has started. Checked here, where it costs nothing, with sed itself (its basic
regular expressions read parentheses literally, as Python's do not)."""
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_sed_edit_in_the_gpu_jobs_matches_its_file():
    script = (ROOT / "scripts" / "gpu_session.sh").read_text()
    edits = set(re.findall(r"([\w/]+\.py):(s/\^[^/]*/[^/]*/)", script))
    assert edits, "no sed edits found: the pattern above no longer reads gpu_session.sh"
    for file, expression in sorted(edits):
        changed = subprocess.run(["sed", "-n", expression + "p", str(ROOT / file)], capture_output=True, text=True,
                                 check=True).stdout
        assert changed, f"{file}: {expression} changes nothing"
