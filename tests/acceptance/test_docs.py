"""Every code block of the README and of the docs pages runs as written.

Fenced ```python and ```bash blocks are extracted from README.md and docs/*.md and executed from
a fresh folder that stands in for the root of a clone (its ``demos/`` links to the repository's,
so the bundled data paths in the examples resolve):

- each python block runs alone, in a fresh namespace: every block carries its own imports, so
  that a reader can copy any one of them;
- each bash block runs on its own with ``bash -euo pipefail``, with this environment's
  ``dcp-lens`` first on the PATH.

A block that is not meant to run (an install, a GPU script, a 40-minute experiment, a sketch with
placeholders) carries ``<!-- no-run: reason -->`` on the line before it and is reported as a
skipped test with its reason, so every skip is visible (``pytest -rs``). A block that runs but
takes over about 30 s carries ``<!-- slow: reason -->`` and runs under ``pytest -m slow``. The
tables of measured figures must equal what ``docs/gen_tables.py`` writes from their JSON sources.
"""

from __future__ import annotations

import importlib.util
import linecache
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_LANGUAGES = {"python", "bash"}
# Fences that are shown, not run: plain text (usage lines, schemas) and data formats.
SHOWN_LANGUAGES = {"", "text", "json", "yaml", "toml"}
MARK = re.compile(r"^<!--\s*(?P<kind>no-run|slow)\s*:\s*(?P<reason>\S.*?)\s*-->$")
README_LIMIT_BYTES = 15 * 1024


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    mark: str | None  # "no-run", "slow" or None
    reason: str

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def parse(path: Path, root: Path = ROOT) -> list[Block]:
    """Every fenced block of ``path``, with the run marker on the line before its fence."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        fence = re.match(r"^```(\S*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        start = i
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise AssertionError(f"{path.name}:{start + 1}: a code fence is never closed")
        previous = lines[start - 1].strip() if start > 0 else ""
        marker = MARK.match(previous)
        if previous.startswith("<!--") and ("no-run" in previous or "slow" in previous):
            assert marker, f"{path.name}:{start}: write `<!-- no-run: reason -->` (a reason)"
        blocks.append(
            Block(
                page=str(path.relative_to(root)),
                line=start + 1,
                language=fence.group(1),
                code="\n".join(lines[start + 1 : end]) + "\n",
                mark=marker["kind"] if marker else None,
                reason=marker["reason"] if marker else "",
            )
        )
        i = end + 1
    return blocks


BLOCKS = [block for page in PAGES for block in parse(page)]
RUN_PYTHON = [b for b in BLOCKS if b.language == "python" and b.mark != "no-run"]
# Pages whose python blocks are sketches only (each listed as a skip with its reason).
SKETCH_PAGES = {"docs/design.md"}
BASH = [b for b in BLOCKS if b.language == "bash"]
NOT_RUN_PYTHON = [b for b in BLOCKS if b.language == "python" and b.mark == "no-run"]


def _clone_root(tmp_path: Path) -> Path:
    """An empty folder that reads as a clone's root: ``demos`` links to the repository's."""
    (tmp_path / "demos").symlink_to(ROOT / "demos", target_is_directory=True)
    return tmp_path


def _environment(tmp_path: Path) -> dict[str, str]:
    """This environment's ``dcp-lens`` first, one thread, offline, caches in ``tmp_path``."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TQDM_DISABLE="1")
    env["DCP_LENS_CACHE"] = str(tmp_path / ".cache" / "dcp-lens")
    return env


def _block_param(block: Block) -> object:
    return pytest.param(
        block, id=block.name, marks=[pytest.mark.slow] if block.mark == "slow" else []
    )


def test_blocks_are_found_and_every_language_is_known() -> None:
    """The extraction sees the README's blocks, and no block hides under another language tag
    (```sh, ```console, ```py would escape the run)."""
    readme = [b for b in BLOCKS if b.page == "README.md"]
    assert {b.language for b in readme} >= {"python", "bash"}, readme
    unknown = [
        b.name + f" ({b.language})"
        for b in BLOCKS
        if b.language not in RUN_LANGUAGES | SHOWN_LANGUAGES
    ]
    assert not unknown, f"tag these blocks python or bash (or text if only shown): {unknown}"


def test_marker_needs_a_reason(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- no-run -->\n```bash\nexit 1\n```\n")
    with pytest.raises(AssertionError, match="a reason"):
        parse(page, tmp_path)
    page.write_text("text\n<!-- no-run: shown only -->\n```bash\nexit 1\n```\n")
    (block,) = parse(page, tmp_path)
    assert (block.mark, block.reason, block.code, block.line) == (
        "no-run",
        "shown only",
        "exit 1\n",
        3,
    )


def test_readme_is_short() -> None:
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_LIMIT_BYTES, f"README.md is {size} bytes; move detail into docs/"


@pytest.mark.parametrize("block", [_block_param(b) for b in RUN_PYTHON])
def test_python_block_runs_alone(
    block: Block,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """One python block, alone in a fresh namespace, from a clone's root."""
    monkeypatch.chdir(_clone_root(tmp_path))
    for key, value in _environment(tmp_path).items():
        monkeypatch.setenv(key, value)
    namespace: dict[str, object] = {"__name__": "__docs__"}
    # Registered as a source file: tools that read a block's source back (nnsight's traces)
    # find it as they would a script's.
    linecache.cache[block.name] = (len(block.code), None, block.code.splitlines(True), "")
    exec(compile(block.code, block.name, "exec"), namespace)  # noqa: S102
    if block.page == "README.md":  # the example prints the validated metric it tells you to read
        printed = capsys.readouterr().out
        rows = printed.split("\n\n", 1)[0]  # the table, before the summary's lines
        assert "top1_agreement" in rows and "cross_entropy" not in rows, printed
        assert "verdict" in rows.splitlines()[0], printed  # the answer beside the shares
        assert any(word in rows for word in ("inconclusive", "mixed", " S ", " B ")), printed


def test_the_readme_says_what_its_example_shows() -> None:
    """After the example: the validated metric it prints, named first; why a share can leave
    [0, 1]; that the fixture's weights are random and how long its context is."""
    text = (ROOT / "README.md").read_text()
    (example,) = [b for b in BLOCKS if b.page == "README.md" and b.language == "python"]
    after = text.split(example.code, 1)[1].split("## ", 1)[0]
    assert after.index("`top1_agreement`") < after.index("`accuracy`")
    assert "fall below 0 or rise above 1" in after
    before = text.split(example.code, 1)[0].rsplit("## ", 1)[1]
    assert "random weights" in before and "64-token context" in before
    assert not re.search(r"about \d+ s on a laptop", text)


def test_every_page_with_python_runs_some() -> None:
    """A page whose python blocks are all marked no-run is a page of sketches: say so here."""
    for page in {b.page for b in BLOCKS if b.language == "python"} - {b.page for b in RUN_PYTHON}:
        assert page in SKETCH_PAGES, f"{page}: every python block is marked no-run"


@pytest.mark.parametrize("block", [_block_param(b) for b in NOT_RUN_PYTHON])
def test_python_block_not_run(block: Block) -> None:
    """Listed so that each python block left out shows as a skip, with its reason."""
    pytest.skip(f"{block.name} not run: {block.reason}")


@pytest.mark.parametrize("block", [_block_param(b) for b in BASH])
def test_bash_block_runs(block: Block, tmp_path: Path) -> None:
    if block.mark == "no-run":
        pytest.skip(f"{block.name} not run: {block.reason}")
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.code],
        cwd=_clone_root(tmp_path),
        env=_environment(tmp_path),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, (
        f"{block.name} exited {done.returncode}\n--- stdout\n{done.stdout[-3000:]}"
        f"\n--- stderr\n{done.stderr[-3000:]}"
    )


def _generator():
    spec = importlib.util.spec_from_file_location("gen_tables", ROOT / "docs" / "gen_tables.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_tables_match_their_sources(capsys: pytest.CaptureFixture[str]) -> None:
    """Each table of measured figures is exactly what the generator writes from its JSON."""
    generator = _generator()
    pages = generator.pages()
    assert {p.name for p in pages} >= {"validation.md", "training.md", "bench.md"}, pages
    assert generator.main(["--check"]) == 0, capsys.readouterr().err


def test_a_retyped_figure_is_caught() -> None:
    """Editing a figure by hand inside a generated block makes the page differ from its source."""
    generator = _generator()
    text = (ROOT / "docs" / "validation.md").read_text()
    begin = text.index("<!-- BEGIN GENERATED: validation")
    figure = re.compile(r"\d\.\d\d")
    match = figure.search(text, begin)
    assert match is not None
    edited = text[: match.start()] + "9.99" + text[match.end() :]
    assert edited != text
    assert generator.render(edited) == text


def test_a_width_has_its_own_block_with_its_cost(tmp_path: Path) -> None:
    """A ``validation-wN`` block is written from ``validation_wN_seed*.json`` only, with each
    seed's time and peak memory; a file that ran at another width is refused."""
    import json

    generator = _generator()
    generator.DATA = tmp_path
    document = json.loads((ROOT / "docs" / "data" / "validation_seed0.json").read_text())
    document["settings"].update(width=256, seconds=1234.5, peak_rss_mib=2048)
    (tmp_path / "validation_w256_seed0.json").write_text(json.dumps(document))
    block = "<!-- BEGIN GENERATED: validation-w256 (python docs/gen_tables.py) -->\n"
    rendered = generator.render(block + "<!-- END GENERATED: validation-w256 -->")
    assert "validation_w256_seed0.json" in rendered
    assert "seed 0: 20.6 min, 2.0 GiB peak" in rendered
    assert rendered.count("| readout_shift | accuracy |") == 1
    document["settings"]["width"] = 1024
    (tmp_path / "validation_w256_seed0.json").write_text(json.dumps(document))
    with pytest.raises(SystemExit, match="ran at width 1024, not 256"):
        generator.render(block + "<!-- END GENERATED: validation-w256 -->")


# The one test command: the README's, also on docs/install.md, and what .ci/run runs.
INSTALL_PREFIX = re.compile(r"^(python3 -m venv|\. \.venv/bin/activate|pip install)")


def _test_command(page: str) -> list[str]:
    """The stages of the page's test command (its bash block that runs pytest), without the
    install steps."""
    (block,) = [b for b in BASH if b.page == page and "pytest" in b.code]
    steps = [step.strip() for step in block.code.strip().split("&&")]
    return [step for step in steps if not INSTALL_PREFIX.match(step)]


def test_one_test_command_in_every_doc_and_in_ci() -> None:
    readme = _test_command("README.md")
    assert readme[-1].startswith("pytest") and "mypy" in readme and "lint-imports" in readme
    assert _test_command("docs/install.md") == readme
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    stages = [line for line in ci if line in readme]
    assert stages == readme, f".ci/run runs {stages}, the README says {readme}"
