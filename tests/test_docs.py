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
FIGURE = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:\s?(?:ms|s|min|minutes|x|%|KB|KiB|MB|GB|GiB|MiB|dB)(?!\w)|e-\d+)")
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


TEST_FILE = re.compile(r"(?<![\w.-])(?:tests/)?(test_\w+\.py)\b")

# Figures that are inputs, not measurements, and so need no results file: the shape of a layout or a
# machine ("Ulysses 2 x TP 2", "Ulysses-2 x Ring-2", "8 x H100", "2 x RTX 4090")...
SHAPE = re.compile(r"(?i)\b(?:ulysses|ring|cfg|tp|usp|tensor parallel)[ -]\d+ x "
                   r"|\b\d+ x (?=(?:H|L|A)\d|RTX\b)")
# ...and, page by page, the exact phrases that state a default, a limit, a tolerance or a size the
# pack or its tests set (not what a run measured). Each says why; a measured figure never goes here.
INPUTS = {
    "README.md": {
        "32x VAE": "the model's name (its compression factor)",
        "differ by more than 10 %": "layout auto's threshold for a weighted split (auto.UNEVEN_SPEEDS)",
        "every 100 ms": "the watchdog's polling interval, a constant of the code",
        "(1e-5 in process, 1e-4 through a ComfyUI server": "the tests' tolerances",
    },
    "docs/environment.md": {
        "is 60 s later": "the margin the code adds to the collective timeout",
        "over 32 MiB": "glibc's mmap threshold, a limit of the allocator",
    },
    "docs/status.md": {
        "at most every 30 s": "how often the code reads smaps, a constant",
        "of at most 128 KiB": "the request body's limit",
    },
    "docs/testing.md": {
        "per 6 GiB": "the memory tools/test.sh allows a pytest worker, a setting",
    },
    "docs/gpu_check.md": {
        "<= 5 s after": "the `big` part's target", "growth <= 1 GiB": "the `big` part's target",
        "3x the tolerance": "the `features` part's criterion", "the 24 GB file": "the size of the model it writes",
        "the 64 MiB a device call": "the device tool's limit", "30 s after a call": "the device tool's idle release",
        "(30 s to a minute)": "the device tool's stated start time",
        "15 to 30 minutes of device time": "the device tool's budget", "H100 80 GB": "the GPU's size",
        "H200 141 GB": "the GPU's size", "In fp32: 1e-5 on CPU ranks, 1e-4 on a GPU": "the check's tolerances",
    },
    "docs/how_it_works.md": {
        "in 64 MB buckets": "the weight stream's bucket size, a default",
        "1.2 GB Wan-shaped model": "the size of the model the load benchmark builds",
    },
    "docs/layout_auto.md": {
        "4 KiB and 4 MiB (64 MiB on CUDA)": "the message sizes the calibration sends",
        "NVLink 450 GB/s or PCIe 4.0 32 GB/s": "published link bandwidths, the cost model's inputs",
        "made 2x slower": "the slowdown the weighted benchmark applies",
        "a 384 x 384 decode": "the image size the benchmark decodes",
    },
}
# The README's GPU table is generated from the stored GPU-check results by tools/gpu_table.py, and
# tests/test_gpu_check.py fails when it is stale: its figures are backed by construction.
GENERATED = re.compile(r"<!-- gpu-table:begin.*?<!-- gpu-table:end -->", re.S)


def _backs(text: str, tests_too: bool) -> bool:
    return (any(is_stored(n) for n in results_files_named(text))
            or tests_too and any((REPO / "tests" / n).is_file() for n in TEST_FILE.findall(text)))


def unbacked_figures(doc: Path, tests_too: bool) -> list[str]:
    """Each table that states a figure names a stored results file (or, with ``tests_too``, a test file
    under tests/) in itself or in the text since the previous table or heading, and each section that
    states a figure names one. Figures are what FIGURE finds once SHAPE and the page's INPUTS are cut."""
    name = str(doc.relative_to(REPO))
    text = GENERATED.sub("", prose(doc))
    for phrase in INPUTS.get(name, {}):
        text, found = re.subn(r"\s+".join(map(re.escape, phrase.split())), "", text)  # across line breaks
        assert found, f"{name}: the allowance {phrase!r} no longer matches the page; drop it"
    text = SHAPE.sub("", text)
    unbacked, context = [], ""
    for block in re.split(r"\n\s*\n", text):
        if block.lstrip().startswith("#"):
            context = ""
        if block.lstrip().startswith("|"):
            if FIGURE.search(block) and not _backs(context + block, tests_too):
                unbacked.append(f"{name}: table {block.strip().splitlines()[0][:100]}")
            context = ""
        else:
            context += "\n" + block
    sections = re.split(r"(?m)^(#{1,4} .*)$", text)
    for heading, body in [("(top)", sections[0]), *zip(sections[1::2], sections[2::2])]:
        figures = FIGURE.findall(body)
        if figures and not _backs(body, tests_too):
            unbacked.append(f"{name}: section {heading}: {', '.join(figures[:5])}")
    return unbacked


def test_every_benchmark_table_and_figure_names_the_stored_file_it_comes_from():
    """docs/benchmarks.md: every figure is a benchmark's, so only a stored results file backs it."""
    unbacked = unbacked_figures(REPO / "docs" / "benchmarks.md", tests_too=False)
    assert not unbacked, "figures without a stored results file named:\n" + "\n".join(unbacked)


def test_every_figure_in_readme_and_docs_names_a_stored_file_or_a_test():
    """README.md and every other docs page: a table or section with a measured figure (a time, a
    speed-up, an error, a memory figure, a ratio) names the stored results file it comes from or the
    test under tests/ that asserts it. An unstored observation is cut, not kept."""
    unbacked = [line for doc in _documents() if doc.name != "benchmarks.md"
                for line in unbacked_figures(doc, tests_too=True)]
    assert not unbacked, "figures without a stored results file or a test named:\n" + "\n".join(unbacked)


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


def test_the_on_paper_table_is_the_scripts_output():
    """docs/layout_auto.md's "On paper" block is what bench/paper_check.py prints: the cost model's
    predictions from the stored published figures (bench/published_peers.json), not typed by hand."""
    result = subprocess.run([sys.executable, str(REPO / "bench" / "paper_check.py")], capture_output=True,
                            text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() in (REPO / "docs" / "layout_auto.md").read_text(), result.stdout
