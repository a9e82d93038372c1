"""The pure parts and the command line's argument handling work where torch cannot be imported."""

import subprocess
import sys

from conftest import PYTHON_DIR

BLOCK = "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None; "


def _py(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + code], cwd=PYTHON_DIR, capture_output=True, text=True)


def test_pure_parts_import_without_torch():
    r = _py("import glmdiff_hooks as g; from glmdiff_hooks import names, shapes, rope, selection, meta, writer; "
            "assert g.expected_hooks(1, set(), True); print(g.__version__)")
    assert r.returncode == 0, r.stderr


def test_torch_names_are_lazy():
    r = _py("import glmdiff_hooks as g\n"
            "try:\n    g.capture_transformers\nexcept ImportError:\n    print('lazy')\n"
            "try:\n    g.nothing_here\nexcept AttributeError:\n    print('attr')\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["lazy", "attr"]


def test_help_and_version_without_torch():
    r = _py("from glmdiff_hooks.cli import main; main(['--help'])")
    assert r.returncode == 0 and "--gguf-name" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, "-m", "glmdiff_hooks", "--version"], cwd=PYTHON_DIR, capture_output=True,
                       text=True)
    assert r.returncode == 0 and r.stdout.startswith("glmdiff_hooks "), r.stderr


def test_missing_torch_is_an_error_exit_2():
    r = _py("from glmdiff_hooks.cli import main; "
            "sys.exit(main(['--hf', 'x', '--tokens', '1,2', '--gguf-name', 'x.gguf', '--out', 'o']))")
    assert r.returncode == 2
    assert r.stderr.startswith("glmdiff-hooks: ") and "torch" in r.stderr


def test_bad_tokens_are_a_usage_error():
    for bad in ("1,x", "", "1,-2"):
        r = _py(f"from glmdiff_hooks.cli import main; main(['--hf', 'x', '--tokens', '{bad}', '--gguf-name', 'g', "
                "'--out', 'o'])")
        assert r.returncode == 2 and "not comma-separated token ids" in r.stderr, (bad, r.stderr)
