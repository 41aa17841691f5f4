"""A real Prometheus server for tests: temp config and data dir, 127.0.0.1 only, always stopped.

CI installs Debian's ``prometheus`` package (``.ci/run``). A missing binary skips the tests that
need it with the install command, or fails them under CI (``tools.require_program``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from typing import Any

from tools import require_program


def prometheus_binary() -> str:
    """The prometheus executable: ``$PROMETHEUS_BIN``, ``prometheus`` on PATH, or /usr/bin/prometheus.

    Raises:
        pytest.skip.Exception: when there is none and CI is unset (with the install command).
        pytest.fail.Exception: when there is none under CI.
    """
    return require_program("prometheus", package="prometheus", env="PROMETHEUS_BIN")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out to sockets bound to port 0 or connecting out."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            return int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port_run(count: int) -> int:
    """A base port such that ``base .. base+count-1`` are all free on 127.0.0.1 right now.

    Taken below the ephemeral range: gloo's and the store's connections take ports from it
    while the ranks start, and one of them could take a port of the run before a rank binds it.
    """
    rng = random.Random()
    low = _ephemeral_low()
    for _ in range(50):
        base = rng.randrange(10000, max(10001, low - count))
        if base + count > 65535:
            continue
        sockets = []
        try:
            for offset in range(count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"no run of {count} free ports found")


class PrometheusServer:
    """``prometheus`` scraping ``targets`` every ``scrape_interval_s`` seconds, on a free 127.0.0.1 port.

    Use as a context manager: the process is terminated (then killed) and the
    temp directory removed on exit, whatever happened.

    Args:
        targets: ``host:port`` strings, scraped as job ``job``.
        scrape_interval_s: scrape interval and timeout basis, in seconds.
        start_timeout_s: how long to wait for ``/-/ready``.
    """

    def __init__(self, targets: Iterable[str], job: str = "commdebug-workers",
                 scrape_interval_s: float = 1.0, start_timeout_s: float = 20.0) -> None:
        self.targets = list(targets)
        self.job = job
        self.scrape_interval_s = scrape_interval_s
        self.start_timeout_s = start_timeout_s
        self.port = 0
        self.url = ""
        self._process: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None
        self._log = None

    # ----------------------------------------------------------- lifecycle
    def start(self) -> PrometheusServer:
        binary = prometheus_binary()
        self._dir = tempfile.TemporaryDirectory(prefix="commdebug-prometheus-")
        root = self._dir.name
        interval = f"{int(self.scrape_interval_s * 1000)}ms"
        config = {
            "global": {"scrape_interval": interval, "scrape_timeout": interval,
                       "evaluation_interval": interval},
            "scrape_configs": [{
                "job_name": self.job,
                "static_configs": [{"targets": self.targets}],
            }],
        }
        config_path = os.path.join(root, "prometheus.yml")
        with open(config_path, "w") as handle:
            json.dump(config, handle)  # JSON is YAML
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(os.path.join(root, "prometheus.log"), "w+b")
        self._process = subprocess.Popen(
            [binary, f"--config.file={config_path}", f"--storage.tsdb.path={root}/data",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self._process.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"prometheus not ready within {self.start_timeout_s} s")

    def log(self) -> str:
        if self._log is None:
            return ""
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-4000:]

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ----------------------------------------------------------------- API
    def api(self, path: str, **params: Any) -> Any:
        return api(self.url, path, **params)

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        return query(self.url, expr, at)


def api(url: str, path: str, **params: Any) -> Any:
    """GET ``url/api/v1/path`` with ``params``; the ``data`` of a success answer.

    Raises:
        AssertionError: with Prometheus' error text when the status is not success.
    """
    pairs = []
    for key, value in params.items():
        for item in value if isinstance(value, (list, tuple)) else [value]:
            pairs.append((key, str(item)))
    full = f"{url}/api/v1/{path}"
    if pairs:
        full += "?" + urllib.parse.urlencode(pairs)
    try:
        with urllib.request.urlopen(full, timeout=10) as response:
            body = json.load(response)
    except urllib.error.HTTPError as error:
        body = json.load(error)
    if body.get("status") != "success":
        raise AssertionError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
    return body["data"]


def query(url: str, expr: str, at: float | None = None) -> list[dict]:
    """An instant query's vector (``at``: Unix seconds, default now)."""
    params: dict[str, Any] = {"query": expr}
    if at is not None:
        params["time"] = f"{at:.3f}"
    data = api(url, "query", **params)
    if data["resultType"] != "vector":
        raise AssertionError(f"{expr}: expected a vector, got {data['resultType']}")
    return data["result"]


def by_labels(result: list[dict], *labels: str) -> dict[tuple, float]:
    """``{(label values...): value}`` of an instant vector."""
    return {tuple(sample["metric"].get(label, "") for label in labels): float(sample["value"][1])
            for sample in result}
