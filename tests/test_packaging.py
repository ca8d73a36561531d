"""Packaging and the layout's import directions (README.md, "Layout")."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "fp8_moe_ops"


def _imported_modules(path: Path) -> set[str]:
    """Absolute names of the package modules a file imports (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "passes":
        parts = ["fp8_moe_ops", *parts]
    package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            names.add(mod)
            names.update(f"{mod}.{a.name}" for a in node.names)
    return names


def _files(*rel):
    out = []
    for r in rel:
        p = ROOT / r
        out += [p] if p.is_file() else sorted(p.rglob("*.py"))
    return out


@pytest.mark.parametrize("path", _files("fp8_moe_ops/reference.py", "fp8_moe_ops/kernels"), ids=str)
def test_kernels_and_reference_import_no_modules_integrations_or_pass(path):
    bad = ("fp8_moe_ops.modules", "fp8_moe_ops.integrations", "fp8_moe_ops.passes", "fp8_moe_ops.ops")
    imported = _imported_modules(path)
    assert not [m for m in imported if m.startswith(bad)], imported


# The reference is the numerics oracle and the CPU implementation of the ops, nothing
# else: only the op registrations and the weight-quantisation helpers may run it, so a
# kernel-vs-reference test compares two independent implementations and an edit made
# for testing cannot change production.
REFERENCE_USERS = ("fp8_moe_ops/ops.py", "fp8_moe_ops/quantization.py", "fp8_moe_ops/calibration.py")


@pytest.mark.parametrize("path", _files("fp8_moe_ops", "passes"), ids=str)
def test_only_the_op_registrations_and_quantisation_import_the_reference(path):
    if str(path.relative_to(ROOT)) in REFERENCE_USERS + ("fp8_moe_ops/reference.py",):
        return
    imported = _imported_modules(path)
    assert "fp8_moe_ops.reference" not in imported, imported


def test_reference_imports_nothing_of_the_package():
    assert not [m for m in _imported_modules(PKG / "reference.py") if m.startswith("fp8_moe_ops")]


@pytest.mark.parametrize("path", _files("fp8_moe_ops"), ids=str)
def test_package_never_imports_the_pass_bench_or_tests(path):
    imported = _imported_modules(path)
    allowed_pass_users = ("demo.py",)  # the demo is the pass's own entry point
    bad = ["bench", "tests"] + ([] if path.name in allowed_pass_users else ["fp8_moe_ops.passes"])
    assert not [m for m in imported if any(m == b or m.startswith(b + ".") for b in bad)], imported


def test_import_is_light():
    # The CPU paths need neither Triton nor transformers at import time.
    code = "import sys, fp8_moe_ops; print(sorted(m for m in ('triton', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.fixture(scope="module")
def regular_install(tmp_path_factory):
    """A non-editable install of the checkout into a fresh target folder."""
    # --no-build-isolation (no network needed): this environment must hold the build requirement.
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 69:
        pytest.skip(f"pyproject.toml's build needs setuptools>=69; this environment has {setuptools.__version__}")
    target = tmp_path_factory.mktemp("site")
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target),
         str(ROOT)],
        capture_output=True, text=True,
    )
    assert pip.returncode == 0, pip.stderr[-3000:]
    return target


def _run(args, target, cwd):
    env = dict(os.environ, PYTHONPATH=str(target))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd)


IMPORT_BOTH = "import fp8_moe_ops.passes as p, fp8_moe_ops as f; print(p.__file__); print(f.__file__)"


@pytest.mark.slow
def test_regular_install_provides_passes(regular_install, tmp_path):
    """A non-editable install maps the top-level passes/ folder to fp8_moe_ops.passes."""
    out = _run(["-c", IMPORT_BOTH], regular_install, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    passes_file, pkg_file = out.stdout.split()
    assert passes_file.startswith(str(regular_install)) and pkg_file.startswith(str(regular_install))
    assert (regular_install / "fp8_moe_ops" / "passes" / "__init__.py").exists()


@pytest.mark.slow
def test_regular_install_from_the_repository_root(regular_install):
    # From the root, the checkout's fp8_moe_ops/ (first on sys.path) shadows the installed
    # package and has no passes/: the package's source-tree finder maps it to passes/.
    out = _run(["-c", IMPORT_BOTH], regular_install, ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [str(ROOT / "passes" / "__init__.py"), str(ROOT / "fp8_moe_ops" / "__init__.py")]
    # one layer: the pass's rewrite under torch.compile and the AOTInductor package, from the root
    demo = _run(["-m", "fp8_moe_ops", "demo", "--layers", "1", "--experts", "4", "--hidden", "128", "--inter", "64",
                 "--tokens", "8"], regular_install, ROOT)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert demo.stdout.rstrip().endswith("all checks passed")


def test_editable_install_imports_passes_from_the_repository_root():
    # This environment's install is editable: from the root, fp8_moe_ops.passes is the
    # top-level passes/ folder.
    out = subprocess.run([sys.executable, "-c", IMPORT_BOTH], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.split()[0] == str(ROOT / "passes" / "__init__.py")
