"""What a package index would show: the license file and its text, classifiers PyPI accepts, no made-up URLs, a
changelog; and no doc that tells users to install a package that is not published."""

from __future__ import annotations

import pathlib
import re
from importlib import metadata

import pytest

tomllib = pytest.importorskip("tomllib", reason="Python 3.11's tomllib reads pyproject.toml")
ROOT = pathlib.Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_license_file_is_the_apache_2_text_the_otel_packages_ship():
    assert PROJECT["license"] == "Apache-2.0" and PROJECT["license-files"] == ["LICENSE"]
    ours = (ROOT / "LICENSE").read_text()
    shipped = next(file for file in metadata.files("opentelemetry-api") if file.name == "LICENSE")
    assert ours == shipped.read_text()
    assert ours.split("\n")[:2] == [" " * 33 + "Apache License", " " * 27 + "Version 2.0, January 2004"]


def test_classifiers_are_pypis_and_name_no_license():
    trove = pytest.importorskip("trove_classifiers")  # in the test extra
    classifiers = PROJECT["classifiers"]
    assert classifiers and set(classifiers) <= trove.classifiers
    # PEP 639: with a license expression, a License :: classifier is an error at upload.
    assert not [c for c in classifiers if c.startswith("License ::")]
    minimum = re.fullmatch(r">=3\.(\d+)", PROJECT["requires-python"]).group(1)
    versions = sorted(int(c.rsplit(".", 1)[1]) for c in classifiers if re.fullmatch(r".*Python :: 3\.\d+", c))
    assert versions[0] == int(minimum)


def test_no_urls_to_a_home_that_does_not_exist():
    assert "urls" not in PROJECT  # add them with a real repository or index page


def test_the_installed_metadata_carries_them():
    """Whatever README's `pip install .` built (reinstall after changing pyproject.toml)."""
    meta = metadata.metadata("commdebug-otel")
    assert meta["License-Expression"] == "Apache-2.0" and "LICENSE" in meta.get_all("License-File")
    assert meta.get_all("Classifier") == PROJECT["classifiers"]


def test_the_changelog_has_the_version_under_way():
    from commdebug_otel.version import __version__

    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## [Unreleased]: {__version__}, not yet published" in changelog


def test_no_doc_installs_an_unpublished_package():
    texts = [ROOT / "README.md", ROOT / "deploy" / "README.md", *(ROOT / "docs").glob("*.md"),
             *(ROOT / "commdebug_otel").rglob("*.py")]
    said = [f"{path.relative_to(ROOT)}: {line.strip()}" for path in texts for line in path.read_text().splitlines()
            if re.search(r"pip install [\"']?commdebug-otel", line)]
    assert said == []
