"""The package's imports go one way, as ``docs/architecture.md`` lays out:

* the bookkeeping modules (allocators, block manager, page tables, layouts,
  the serving simulations, the scheduler, the sweeps' drivers) import no
  numba, not even through the package: they run where numba is missing;
* ``paged_numba/kernels`` imports nothing of the package outside itself but
  the simulator's shim (``_simulator``, for the stand-ins of warp and
  tensor-core operations), so the kernels never see the wrappers;
* no kernel, and nothing the wrappers run, imports the float64 ``reference``
  (it is for the tests and the sweeps), and the reference imports no kernel.
"""
import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "paged_numba"
BOOKKEEPING = ["allocator", "block_manager", "page_tables", "layouts", "prefix_cache",
               "caching_sim", "serving_sim", "sharing_sim", "swapping", "_checks",
               "integrations.scheduler", "sweeps"]
# what may import the float64 reference: itself, the test helpers and the sweeps
REFERENCE_USERS = ("reference.py", "testing/", "sweeps/")


def package_imports(path):
    """``(line, module)`` of every import in ``path`` that names a module of
    the package, as an absolute dotted name (``paged_numba.kernels.mma``)."""
    package = list(path.relative_to(ROOT).parts[:-1])     # the module's package
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names = [mod] if node.module else [f"{mod}.{a.name}" for a in node.names]
            if node.module:      # "from .x import y" may import submodule y too
                names += [f"{mod}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [(node.lineno, n) for n in names if n.split(".")[0] == "paged_numba"]
    return found


def test_package_imports_are_found():
    """The import reader itself: relative imports at every depth."""
    imports = dict((m, n) for n, m in package_imports(PKG / "kernels" / "mma.py"))
    assert "paged_numba._simulator._rendezvous" in imports
    assert any(m.startswith("paged_numba.kernels.") for m in imports)


@pytest.mark.parametrize("module", BOOKKEEPING)
def test_bookkeeping_imports_no_numba(module):
    code = ("import sys, types; pkg = types.ModuleType('paged_numba'); "
            "pkg.__path__ = ['paged_numba']; sys.modules['paged_numba'] = pkg; "
            f"import paged_numba.{module}; "
            "assert 'numba' not in sys.modules, 'numba imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_kernels_import_only_kernels_and_the_simulator_shim():
    bad = [f"{path.relative_to(ROOT)}:{line}: {mod}"
           for path in sorted((PKG / "kernels").glob("*.py"))
           for line, mod in package_imports(path)
           if not mod.startswith(("paged_numba.kernels", "paged_numba._simulator"))]
    assert not bad, "kernels importing the package outside kernels/:\n" + "\n".join(bad)


def test_only_tests_and_sweeps_import_the_reference():
    bad = [f"{path.relative_to(ROOT)}:{line}"
           for path in sorted(PKG.rglob("*.py"))
           if not str(path.relative_to(PKG)).startswith(REFERENCE_USERS)
           for line, mod in package_imports(path)
           if mod.startswith("paged_numba.reference")]
    assert not bad, "modules importing the float64 reference:\n" + "\n".join(bad)
    ref = [mod for _, mod in package_imports(PKG / "reference.py")
           if mod.startswith("paged_numba.kernels")]
    assert not ref, f"the reference imports kernels: {ref}"
