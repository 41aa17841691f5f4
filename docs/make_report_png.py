"""Make docs/report.png: the demo's report, screenshotted in headless chromium.

Runs ``commdebug-otel demo --ranks 2 --steps 4`` into a temporary folder, ``commdebug-otel report`` on its files,
and a screenshot at a fixed window size (:data:`WINDOW`): the answer, the findings, the per-rank times and the
last step's timeline. Needs Debian's ``chromium`` (``apt-get install -y chromium``); about 30 s on 2 cores.

Usage, from the repository root::

    PYTHONPATH=$PWD python docs/make_report_png.py            # writes docs/report.png
    PYTHONPATH=$PWD python docs/make_report_png.py -o x.png   # elsewhere

It says the PNG's size; docs/ keeps it under :data:`MAX_BYTES`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

WINDOW = (1280, 1700)  # px: the timeline of the demo's last step is in view
MAX_BYTES = 300_000
HERE = Path(__file__).resolve().parent


def _cli(*args: str, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "-m", "commdebug_otel.cli", *args], check=True, env=env, timeout=600,
                   stdout=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", default=str(HERE / "report.png"), help="the PNG (default docs/report.png)")
    args = parser.parse_args(argv)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("make_report_png: chromium not found: apt-get install -y chromium", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR": os.path.join(folder, "out")}
        _cli("demo", "--ranks", "2", "--steps", "4", env=env)
        page = Path(folder) / "report.html"
        _cli("report", env["OTEL_PYTHON_COMMDEBUG_OUTPUT_DIR"], "-o", str(page), env=env)
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        "--virtual-time-budget=5000", f"--window-size={WINDOW[0]},{WINDOW[1]}",
                        f"--screenshot={os.path.abspath(args.output)}", page.as_uri()],
                       check=True, capture_output=True, timeout=120)
    size = os.path.getsize(args.output)
    print(f"wrote {args.output} ({size / 1000:.0f} kB, {WINDOW[0]} x {WINDOW[1]} px)")
    if size > MAX_BYTES:
        print(f"make_report_png: {size} bytes, over the {MAX_BYTES} docs/ keeps", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
