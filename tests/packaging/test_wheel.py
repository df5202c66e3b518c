"""The distribution as a user installs it: build the wheel (``python -m build``), install it
alone in a fresh virtual environment, and use it. Catches a package-data file left out, an
import of ``tools/`` or ``tests/`` from the package, a dependency not declared, and a
version said in two places. Needs the package index (CI reaches it)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from spool.version import __version__

ROOT = Path(__file__).resolve().parents[2]
ROUND_TRIP = """
import sys
from spool import Spool
with Spool.open(sys.argv[1]) as sp:
    attempt = sp.claim(timeout=5)
    assert attempt is not None, "nothing to claim"
    with attempt:
        assert attempt.read_data() == b"Subject: hi\\r\\n\\r\\nhello\\r\\n"
        attempt.delivered(attempt.envelope.recipients, "250 2.0.0 ok")
"""


# The fresh environment sees only itself: no PYTHONPATH leading back to the source tree.
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def run(*args: str | Path, cwd: Path | None = None, stdin: bytes = b"") -> str:
    done = subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        input=stdin,
        capture_output=True,
        timeout=600,
        env=CLEAN_ENV,
    )
    assert done.returncode == 0, (args, done.stdout.decode()[-2000:], done.stderr.decode()[-3000:])
    return done.stdout.decode()


@pytest.mark.slow
def test_the_wheel_installs_alone_and_works(tmp_path: Path) -> None:
    # Build from the sources git keeps (as a clean checkout would), not from build debris.
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
    )
    if listed.returncode != 0:
        pytest.skip("not a git checkout: the sources to build are the ones git keeps")
    files = listed.stdout.decode().split("\0")
    source = tmp_path / "source"
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            (source / name).write_bytes((ROOT / name).read_bytes())
    run(sys.executable, "-m", "build", "--wheel", "--outdir", tmp_path / "dist", source)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    assert wheel.name == f"mailspool-{__version__}-py3-none-any.whl"
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"spool", f"mailspool-{__version__}.dist-info"}
    for data in ("spool/py.typed", "spool/analytics/bounce_rules.json"):
        assert data in names, data
    metadata = zipfile.ZipFile(wheel).read(f"mailspool-{__version__}.dist-info/METADATA")
    for extra in (b"serve", b"analytics", b"mx"):
        assert b"Provides-Extra: " + extra in metadata

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv)
    run(venv / "bin" / "pip", "install", "--quiet", wheel)
    spool = venv / "bin" / "spool"
    assert run(spool, "--version", cwd=tmp_path) == f"spool, version {__version__}\n"
    assert "Commands:" in run(spool, "--help")
    directory = tmp_path / "spool"
    message = b"Subject: hi\r\n\r\nhello\r\n"
    msg_id = run(spool, "accept", directory, "-f", "a@example.org", "b@example.net", stdin=message)
    assert run(spool, "list", "-c", directory) == "1\n"
    python = venv / "bin" / "python"
    run(python, "-c", ROUND_TRIP, directory, cwd=tmp_path)  # not the source tree's spool/
    assert run(spool, "list", "-c", directory) == "0\n"
    assert "finish" in run(spool, "show", directory, msg_id.strip())
    # The serve extra's absence is named, not a traceback.
    done = subprocess.run(
        [spool, "serve", directory, "--metrics", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        env=CLEAN_ENV,
        cwd=tmp_path,
    )
    assert done.returncode == 1 and "pip install 'mailspool[serve]'" in done.stderr
    assert not any(p.name == "prometheus_client" for p in venv.glob("lib/*/site-packages/*"))
    done = subprocess.run(  # and the mx extra's
        [spool, "serve", directory, "--agent", "mx"],
        capture_output=True,
        text=True,
        env=CLEAN_ENV,
        cwd=tmp_path,
    )
    assert done.returncode != 0 and "pip install 'mailspool[mx]'" in done.stderr, done.stderr
    assert os.path.exists(venv / "bin" / "spool")
