"""The report on a Spark standalone cluster (a master and a worker on loopback), through
``spark-submit`` with the package shipped as ``--py-files``: what docs/analytics.md tells
an operator to run on a real cluster."""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import spool
from tools.spark_cluster import SPARK_HOME, standalone_cluster


@pytest.mark.slow
@pytest.mark.timeout(900)  # two Spark applications on one small cluster
def test_the_report_runs_on_a_standalone_cluster(fleet: tuple[Path, Any], tmp_path: Path) -> None:
    out, truth = fleet
    package = Path(spool.__file__).parent
    shipped = shutil.make_archive(str(tmp_path / "spool"), "zip", package.parent, package.name)
    job = package / "analytics" / "submit.py"
    with standalone_cluster(log_dir=str(tmp_path)) as master:
        proc = subprocess.run(
            [os.path.join(SPARK_HOME, "bin", "spark-submit"), "--master", master,
             "--py-files", shipped, "--conf", "spark.ui.enabled=false",
             "--conf", "spark.driver.host=127.0.0.1",
             str(job), str(out / "mx1"), str(out / "mx2"), "--out", str(tmp_path / "r")],
            capture_output=True, text=True, timeout=600,
            env={**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"},
        )  # fmt: skip
        # The same cluster from the command line (`spool report --master`), with Spark's
        # own log shown (--verbose).
        cli = subprocess.run(
            [sys.executable, "-m", "spool.cli", "report", str(out / "mx1"),
             "--master", master, "--verbose", "--json", "--out", str(tmp_path / "r1")],
            capture_output=True, text=True, timeout=600,
            env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"},
        )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert cli.returncode == 0, cli.stderr[-3000:]
    mx1 = [t for t in truth if t["server"] == "mx1"]
    assert json.loads(cli.stdout)["recipients"] == len(mx1)
    assert f"report: starting Spark ({master})" in cli.stderr
    assert "log4j" in cli.stderr  # Spark's own log, which is quiet by default
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    status = collections.Counter(t["status"] for t in truth)
    assert summary["recipients"] == len(truth)
    assert summary["delivered"] == status["delivered"]
    assert summary["expired"] == status["expired"]
    assert summary["accountability_violations"] == []
    assert (tmp_path / "r" / "index.html").is_file()
