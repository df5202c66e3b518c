"""A Spark standalone cluster on loopback (one master, one worker), for proving that the
report runs on a cluster unchanged: ``with standalone_cluster() as url: ...``.

Uses the ``spark-class`` launcher that ships with PySpark; binds to 127.0.0.1 on free
ports; the worker's Python is this interpreter. Stops both on exit.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pyspark

SPARK_HOME = os.path.dirname(pyspark.__file__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait_for_port(port: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port}")


@contextlib.contextmanager
def standalone_cluster(cores: int = 2, log_dir: str | None = None) -> Iterator[str]:
    """Start a master and a worker; yield the master URL."""
    env = {
        **os.environ,
        "SPARK_HOME": SPARK_HOME,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
    }
    port, ui, worker_ui = free_port(), free_port(), free_port()
    url = f"spark://127.0.0.1:{port}"
    spark_class = os.path.join(SPARK_HOME, "bin", "spark-class")
    log = open(os.path.join(log_dir or ".", "spark-cluster.log"), "ab")  # noqa: SIM115
    master = subprocess.Popen(
        [spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
         "--port", str(port), "--webui-port", str(ui)],
        env=env, stdout=log, stderr=log,
    )  # fmt: skip
    worker = None
    try:
        _wait_for_port(port, time.monotonic() + 60)
        worker = subprocess.Popen(
            [spark_class, "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
             "--cores", str(cores), "--memory", "1g", "--webui-port", str(worker_ui), url],
            env=env, stdout=log, stderr=log,
        )  # fmt: skip
        yield url
    finally:
        for proc in (worker, master):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        log.close()
