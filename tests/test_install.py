"""The install lines say what works: fusedkern has no release on a package index, so the README, the docs and
the integrations' import errors install from a clone of the repository; requirements-lib.txt (the library
alone) pins what requirements.txt pins; pyproject's extras agree with requirements.txt's pins and with TRL's
own requirements."""

import importlib
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# `pip install fusedkern…` or `pip install 'fusedkern[…]'`: an install from a package index
FROM_INDEX = re.compile(r"pip install ['\"]?fusedkern\b(?!.*@)")


def pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"([A-Za-z0-9_.-]+)==([^\s#]+)", line.strip())
        if m:
            out[m.group(1).lower()] = m.group(2)
    return out


def test_no_install_from_a_package_index():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "fusedkern").rglob("*.py")),
             ROOT / "requirements-lib.txt"]
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in files
             for i, line in enumerate(p.read_text().splitlines(), 1) if FROM_INDEX.search(line)]
    assert not found, "\n".join(found)
    readme = (ROOT / "README.md").read_text()
    assert "pip install -r requirements-lib.txt -e '.[trl]'" in readme


def test_library_requirements_pin_what_the_study_pins():
    lib, full = pins(ROOT / "requirements-lib.txt"), pins(ROOT / "requirements.txt")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower() for d in project["dependencies"]}
    assert set(lib) == runtime  # the library's dependencies and nothing of the study's stack
    assert all(full[name] == version for name, version in lib.items())
    lines = [ln.strip() for ln in (ROOT / "requirements-lib.txt").read_text().splitlines()]
    assert "-e ." in lines


def test_extras_agree_with_the_pins_and_with_trl():
    requirements = pytest.importorskip("packaging.requirements")
    full = pins(ROOT / "requirements.txt")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, deps in extras.items():
        for dep in deps:
            req = requirements.Requirement(dep)
            if req.name.lower() in full:  # the tested version satisfies the extra's range
                assert req.specifier.contains(full[req.name.lower()]), (extra, dep, full[req.name.lower()])
    try:
        trl_needs = [requirements.Requirement(r) for r in metadata.requires("trl") or []]
    except metadata.PackageNotFoundError:
        pytest.skip("TRL not installed")
    trl_transformers = next(r for r in trl_needs if r.name == "transformers" and not r.marker)
    ours = next(requirements.Requirement(d) for d in extras["trl"] if d.startswith("transformers"))
    assert str(ours.specifier) == str(trl_transformers.specifier)  # no floor below what TRL itself needs


def test_trl_import_error_says_how_to_install(monkeypatch):
    trl_mod = importlib.import_module("fusedkern.integrations.trl")

    def missing(name, *args):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(trl_mod.importlib, "import_module", missing)
    with pytest.raises(ImportError, match=re.escape("pip install -e '.[trl]'")):
        trl_mod._trl_utils()


def test_transformers_import_error_says_how_to_install():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "try:\n    import fusedkern.integrations.transformers\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert "pip install -e '.[hf]'" in out.stdout, out.stdout + out.stderr
