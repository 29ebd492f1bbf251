"""The README's training-intervention figure: accuracy against k for every condition, and S, B,
D per k, one seed of each regime side by side (the figures of intervention.html, without the rest
of the page), as one self-contained HTML file to screenshot::

    python docs/intervention_figure.py runs/lm /tmp/figure.html
    chromium --headless --no-sandbox --screenshot=docs/intervention_lm.png \
        --window-size=1400,1000 /tmp/figure.html
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import plotly.offline

from dcp_lens.protocol.results import ProtocolResults
from dcp_lens.report.html import report_figures

REGIMES = ("fixed", "sampled", "every-iteration", "dense")


def main(out: Path, destination: Path, seed: int = 0, metric: str = "accuracy") -> None:
    runs = [
        dataclasses.replace(
            ProtocolResults.load(out / "runs" / f"{regime}-seed{seed}" / "dcp"), model=regime
        )
        for regime in REGIMES
    ]
    figures = report_figures(runs)
    body = "".join(
        figures[name].to_html(full_html=False, include_plotlyjs=False)
        for name in (f"quality_{metric}", f"decomposition_{metric}")
    )
    destination.write_text(
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<script>{plotly.offline.get_plotlyjs()}</script></head>"
        f"<body style='margin:0;background:white'>{body}</body></html>\n",
        encoding="utf-8",
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
