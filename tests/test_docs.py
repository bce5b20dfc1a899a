"""The README's generated parts match the code; the README stays short and its links and the docs' resolve."""
import re
import subprocess
import sys
from pathlib import Path

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
    section = readme[readme.index("## The two commands"):]
    section = section[:section.index("\n## ", 1)]
    commands = re.findall(r"^\|.*\| `([^`]+)` \|$", section, re.M)
    assert commands == ["bash tools/demo.sh", "bash tools/test.sh"], commands
    # What the README says CI runs is what .ci/run runs: the full tier on 0.33.0, the smoke subset
    # (and the main job) on 0.3.75.
    assert "CI, `.ci/run`: `--full` on 0.33.0, the main job and `-m smoke` on 0.3.75" in section
    assert re.search(r"^PARALLEL_COMFYUI_VERSION=0\.33\.0 bash tools/test\.sh --full\b", ci, re.M), ci
    assert re.search(r"^PARALLEL_COMFYUI_VERSION=0\.3\.75 bash tools/test\.sh .*-m smoke", ci, re.M), ci
    assert re.search(r"^PARALLEL_COMFYUI_VERSION=0\.3\.75 bash tools/demo\.sh", ci, re.M), ci
    versions = readme[readme.index("## Tested ComfyUI versions"):]
    assert "| 0.33.0 (2026-08-22) | in CI: the whole suite, `--full` |" in versions


README_LIMIT_BYTES = 30_000  # a README a user reads in five minutes (issue 30); depth goes to docs/

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _documents():
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    anchors = set()
    for heading in re.findall(r"^#+ +(.+?) *$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        base, n = slug, 1
        while slug in anchors:
            slug, n = f"{base}-{n}", n + 1
        anchors.add(slug)
    return anchors


def test_readme_is_short():
    size = len((REPO / "README.md").read_bytes())
    assert size <= README_LIMIT_BYTES, f"README.md is {size} bytes; move depth to docs/ (limit {README_LIMIT_BYTES})"


def test_every_relative_link_in_readme_and_docs_resolves():
    broken = []
    for doc in _documents():
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)  # code blocks hold no links
        for target in LINK.findall(text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_readme_links_every_docs_page():
    readme = (REPO / "README.md").read_text()
    missing = [p.name for p in (REPO / "docs").glob("*.md") if f"docs/{p.name}" not in readme]
    assert not missing, missing
