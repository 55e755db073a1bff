"""Regenerate the generated parts of docs/ (the lifecycle diagrams) from the code.

docs/lifecycle.md holds two mermaid blocks, in this order: the operation lifecycle
(``lifecycle.mermaid()``, from TRANSITIONS) and the instance lifecycle
(``lifecycle.instance_mermaid()``, from INSTANCE_TABLE).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workers.core import lifecycle

path = Path(__file__).resolve().parent.parent / "docs" / "lifecycle.md"
text = path.read_text()
diagrams = iter([lifecycle.mermaid(), lifecycle.instance_mermaid()])
new, count = re.subn(
    r"```mermaid\n.*?```", lambda _: f"```mermaid\n{next(diagrams)}```", text, count=2, flags=re.S
)
if count != 2:
    sys.exit(f"{path}: expected 2 mermaid blocks (operation, instance), found {count}")
path.write_text(new)
print(f"{path}: {'updated' if new != text else 'up to date'}")
