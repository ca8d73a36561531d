"""Every ```python block of the README and docs/ runs, so the docs cannot rot."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FILES_WITH_CODE = [p for p in DOCS if "```python" in p.read_text()]


@pytest.mark.slow
@pytest.mark.parametrize("path", FILES_WITH_CODE, ids=lambda p: p.name)
def test_doc_code_blocks_run(path, tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", path.read_text(), re.S)
    assert blocks
    if any(re.search(r"^\s*(from|import) transformers\b", b, re.M) for b in blocks):
        pytest.importorskip("transformers")  # an optional extra: fp8_moe_ops[transformers]
    monkeypatch.chdir(tmp_path)  # blocks may write files (export packages)
    namespace = {"__name__": f"doc_{path.stem}"}
    for i, block in enumerate(blocks):
        code = compile(block, f"{path.name}[block {i}]", "exec")
        exec(code, namespace)  # noqa: S102 - the docs are ours
