"""Write docs/plugin-rules.md from the plugins' own rules (``--check``:
fail if the page is out of date instead)."""

from __future__ import annotations

import sys
from pathlib import Path

from pc_booster.plugins import PLUGIN_OPTIONS
from pc_booster.rules import rules_markdown

PAGE = Path(__file__).resolve().parent.parent / "docs" / "plugin-rules.md"


def main(argv: list[str]) -> int:
    text = rules_markdown(PLUGIN_OPTIONS) + "\n"
    if "--check" in argv:
        if not PAGE.is_file() or PAGE.read_text() != text:
            print(f"{PAGE} is out of date: run python tools/plugin_rules.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
