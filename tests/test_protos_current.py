"""The committed pd.v1 stubs in gen/ must be exactly what scripts/gen_protos.py generates from protos/."""

import filecmp
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_stubs_are_current(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)], check=True)
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    committed = sorted(p.relative_to(ROOT / "gen") for p in (ROOT / "gen").rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    assert fresh == committed
    stale = [str(p) for p in fresh if not filecmp.cmp(tmp_path / p, ROOT / "gen" / p, shallow=False)]
    assert not stale, f"regenerate with `python scripts/gen_protos.py`: {stale}"
