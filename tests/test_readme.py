"""README's and the guide's Python examples run as written; README stays a short read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDE = ROOT / "docs" / "guide.md"
BLOCKS = [(page, code) for page in (README, GUIDE)
          for code in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)]


def test_readme_starts_with_the_two_commands() -> None:
    first = re.search(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    assert first is not None
    commands = [line.split("#")[0].strip() for line in first.group(1).splitlines()]
    assert commands == ["make demo", "make test"]


def test_readme_is_read_in_five_minutes() -> None:
    assert len(README.read_text().splitlines()) <= 250


@pytest.mark.parametrize("page,code", BLOCKS,
                         ids=[f"{page.stem}-block{i}" for i, (page, _) in enumerate(BLOCKS)])
def test_python_block_runs(page: Path, code: str) -> None:
    exec(compile(code, str(page), "exec"), {"__name__": "readme"})
