"""Regenerate the generated parts of docs/ (the lifecycle diagram) from the code."""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workers.core import lifecycle

path = Path(__file__).resolve().parent.parent / "docs" / "lifecycle.md"
text = path.read_text()
new = re.sub(
    r"```mermaid\n.*?```",
    lambda _: f"```mermaid\n{lifecycle.mermaid()}```",
    text,
    count=1,
    flags=re.S,
)
path.write_text(new)
print(f"{path}: {'updated' if new != text else 'up to date'}")
