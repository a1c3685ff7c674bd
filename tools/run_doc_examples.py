"""Run every Python example in the docs, so no page shows code that fails.

Each fenced block opened with ```python is written to a file and run. A
first line ``# run: <command>`` says how (``{file}`` is the example's path;
a leading ``torchrun`` means this interpreter's torch.distributed.run);
otherwise it runs with ``python``. Blocks fenced as ```py, ```text or
anything else are shown, not run.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
TIMEOUT_S = 300


def _command(code: str, path: Path) -> list[str]:
    first = code.splitlines()[0] if code.strip() else ""
    if not first.startswith("# run:"):
        return [sys.executable, str(path)]
    words = shlex.split(first.removeprefix("# run:").strip().replace("{file}", str(path)))
    if words and words[0] == "torchrun":
        words = [sys.executable, "-m", "torch.distributed.run", *words[1:]]
    elif words and words[0] == "python":
        words = [sys.executable, *words[1:]]
    return words


def main(root: str) -> int:
    failures, count = [], 0
    for page in sorted(Path(root).rglob("*.md")):
        for index, match in enumerate(FENCE.finditer(page.read_text()), start=1):
            count += 1
            code = match.group(1)
            with tempfile.TemporaryDirectory(prefix="pc-doc-") as tmp:
                path = Path(tmp) / f"example_{index}.py"
                path.write_text(code)
                command = _command(code, path)
                start = time.perf_counter()
                try:
                    result = subprocess.run(
                        command, cwd=tmp, capture_output=True, text=True, timeout=TIMEOUT_S
                    )
                    ok, output = result.returncode == 0, result.stdout + result.stderr
                except subprocess.TimeoutExpired:
                    ok, output = False, f"timed out after {TIMEOUT_S} s"
            label = f"{page}: example {index}"
            print(f"{'ok  ' if ok else 'FAIL'} {label} ({time.perf_counter() - start:.1f} s)")
            if not ok:
                failures.append(f"--- {label}: {' '.join(command)}\n{output[-3000:]}")
    print(f"{count - len(failures)} of {count} doc examples ran cleanly.")
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "docs"))
