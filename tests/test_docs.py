"""The README's generated parts match the code."""
import subprocess
import sys

from conftest import REPO


def test_support_matrix_in_readme_is_generated_from_the_plans():
    result = subprocess.run([sys.executable, str(REPO / "tools" / "support_matrix.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_readme_names_the_commands_ci_runs():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert "bash tools/test.sh" in readme and "bash tools/test.sh" in ci
    assert "bash tools/demo.sh" in readme
