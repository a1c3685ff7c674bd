"""The hybrid plugin module's share of the generated combination test
(plugin_matrix.py: [Note: the plugin matrix]); PC_PLUGIN_MATRIX=full runs
its whole option space."""

from __future__ import annotations

from pathlib import Path

import pytest
from plugin_matrix import run_matrix

pytestmark = pytest.mark.timeout(3600)


def test_every_combination_trains_correctly_or_is_refused(tmp_path: Path) -> None:
    run_matrix(["hybrid"], tmp_path / "rows.json")
