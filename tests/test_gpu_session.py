"""scripts/gpu_session.sh: every A/B job edits a constant of this tree with sed; an expression that
no longer matches makes decode_ab.sh / decode_variants.sh stop on the device ("changed nothing"),
after the machine has started. Checked here, where it costs nothing."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_sed_edit_in_the_gpu_jobs_matches_its_file():
    script = (ROOT / "scripts" / "gpu_session.sh").read_text()
    edits = set(re.findall(r"([\w/]+\.py):s/\^([^/]*)/", script))
    assert edits, "no sed edits found: the pattern above no longer reads gpu_session.sh"
    for file, pattern in sorted(edits):
        assert re.search("^" + pattern, (ROOT / file).read_text(), re.M), f"{file}: nothing matches ^{pattern}"
