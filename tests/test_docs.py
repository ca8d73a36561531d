"""Every ```python block of the README and docs/ runs on its own (a fresh namespace and
working directory each), so the docs cannot rot and no snippet depends on another."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [(path, i, block) for path in DOCS
          for i, block in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), re.S))]


def _needs_transformers(block: str) -> bool:
    return re.search(r"^\s*(from|import) transformers\b", block, re.M) is not None


@pytest.mark.slow
@pytest.mark.parametrize("path,i,block", BLOCKS, ids=[f"{p.name}[{i}]" for p, i, _ in BLOCKS])
def test_doc_code_block_runs_on_its_own(path, i, block, tmp_path, monkeypatch):
    if _needs_transformers(block):
        pytest.importorskip("transformers")  # an optional extra: pip install ".[transformers]"
    monkeypatch.chdir(tmp_path)  # blocks may write files (export packages)
    exec(compile(block, f"{path.name}[block {i}]", "exec"), {"__name__": f"doc_{path.stem}_{i}"})  # noqa: S102


LINK = re.compile(r"\[[^\]]*\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_links_point_to_files_that_exist(path):
    prose = re.sub(r"```.*?```|`[^`]*`", "", path.read_text(), flags=re.S)  # code is not links
    targets = [t for t in LINK.findall(prose) if "://" not in t]
    missing = [t for t in targets if not (path.parent / t).exists()]
    assert not missing, missing


def test_no_file_cites_a_document_outside_the_repository():
    # The design notes the project was started from are not part of it: what a reader
    # needs is in docs/.
    outside = re.compile(r"\b(DESIGN|NOTES|PERF|STYLE)\.md\b")
    files = [p for p in ROOT.rglob("*") if p.suffix in (".py", ".md", ".toml", ".txt") and p.is_file()
             and not any(part.startswith(".") or part in ("build", "dist") or part.endswith(".egg-info")
                         for part in p.relative_to(ROOT).parts)]
    cited = [str(p.relative_to(ROOT)) for p in files if outside.search(p.read_text(errors="ignore"))]
    assert not cited, cited
