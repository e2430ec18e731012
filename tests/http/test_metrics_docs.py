"""docs/metrics.md lists every series /metrics can serve (issue 47 item 24: ten were missing)."""

from __future__ import annotations

import re
from pathlib import Path

from musegl_core.http.metrics import SERIES, FrontMetrics

DOC = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()


def served_names() -> set[str]:
    values = {key: 1.0 for key in SERIES}
    text = FrontMetrics().render(values, ready=True, restarts=0).decode()
    names = set()
    for line in text.splitlines():
        found = re.match(r"# TYPE (musegl_\w+) (\w+)", line)
        if found and not found.group(1).endswith("_created"):  # prometheus_client's companion of each counter
            name, kind = found.groups()
            names.add(name + "_total" if kind == "counter" and not name.endswith("_total") else name)
    return names


def test_every_served_series_is_documented():
    names = served_names()
    assert len(names) > 40
    missing = sorted(name for name in names if f"`{name}`" not in DOC)
    assert missing == []
