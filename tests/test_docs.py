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


# ---------------------------------------------------------------- every figure has a stored file behind it
RESULTS = REPO / "bench" / "results"
# A measured figure: a number with a unit of time, speed, size or ratio, or an error like 6.0e-7.
FIGURE = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:\s?(?:ms|s|x|%|MB|GB|GiB|MiB|dB)\b|e-\d+)")
FILE_NAME = re.compile(r"(?<![\w/.-])(?:\.\./)*"
                       r"((?:bench/results/)?(?:gpu_check_[\d-]+/)?[\w.-]+\.(?:jsonl|json|md|png))")


def results_files_named(text: str) -> list[str]:
    """The stored-results names ``text`` gives: a path under bench/results/, or a name that can only be
    one (``*.jsonl``, a dated name, a GPU-check file), not a docs page or a tool's output name."""
    return [n for n in FILE_NAME.findall(text)
            if n.startswith(("bench/results/", "gpu_check_")) or n.endswith(".jsonl")
            or re.search(r"20\d\d-\d\d-\d\d", n) or re.match(r"(h100|h200|cpu_check)_", n)]


def is_stored(name: str) -> bool:
    if name.startswith("bench/results/"):
        return (REPO / name).is_file()
    return (RESULTS / name).is_file() or any(RESULTS.glob(f"gpu_check_*/{name}"))


def prose(path: Path) -> str:
    return re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # commands name output files to write


def test_every_results_file_named_in_readme_and_docs_is_stored():
    missing = [f"{doc.relative_to(REPO)}: {name}" for doc in _documents()
               for name in results_files_named(prose(doc)) if not is_stored(name)]
    assert not missing, "\n".join(missing)


def test_every_benchmark_table_and_figure_names_the_stored_file_it_comes_from():
    """docs/benchmarks.md: each table names a stored results file in itself or in the text since the
    previous table or heading, and each section that states a figure names one."""
    blocks, unbacked, context = re.split(r"\n\s*\n", prose(REPO / "docs" / "benchmarks.md")), [], ""
    for block in blocks:
        if block.lstrip().startswith("#"):
            context = ""
        if block.lstrip().startswith("|"):
            if not any(is_stored(n) for n in results_files_named(context + block)):
                unbacked.append(f"table: {block.strip().splitlines()[0][:100]}")
            context = ""
        else:
            context += "\n" + block
    sections = re.split(r"(?m)^(#{1,4} .*)$", prose(REPO / "docs" / "benchmarks.md"))
    for heading, body in [("(top)", sections[0]), *zip(sections[1::2], sections[2::2])]:
        figures = FIGURE.findall(body)
        if figures and not any(is_stored(n) for n in results_files_named(body)):
            unbacked.append(f"section {heading}: {', '.join(figures[:5])}")
    assert not unbacked, "figures without a stored results file named:\n" + "\n".join(unbacked)


def test_the_readmes_gpu_timings_lie_within_the_stored_gpu_runs():
    """Failure behaviour's figures on a GPU (a killed worker reported within, Cancel idle within) are
    the range of the stored GPU-check runs (bench/results/gpu_check_*), read here from the files."""
    readme = " ".join((REPO / "README.md").read_text().split())
    killed = re.search(r"an error within \d+ s on CPU ranks, (\d\.\d)-(\d\.\d) s on a GPU", readme)
    idle = re.search(r"idle within \d+ s \(tested; (\d\.\d) s on a GPU\)", readme)
    assert killed and idle, "the README's failure timings moved; update this test"
    import json
    rows = [row for path in RESULTS.glob("gpu_check_*/*.json") for row in json.loads(path.read_text())["rows"]
            if row["ok"]]
    errors = [r["data"]["error_after_s"] for r in rows if "error_after_s" in r["data"]]
    idles = [r["data"]["idle_s"] for r in rows if "idle_s" in r["data"]]
    assert (float(killed[1]), float(killed[2])) == (min(errors), max(errors)), errors
    assert float(idle[1]) == max(idles), idles
