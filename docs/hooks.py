"""MkDocs hook: the demo notebooks (``demos/*.ipynb``) become pages under ``demos/``.

The notebooks stay where the demos and their tests keep them; this hook adds each one to the
site's files before mkdocs-jupyter converts them, so the site shows the committed outputs
(``execute: false`` in mkdocs.yml) without a copy under ``docs/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

DEMOS = Path(__file__).resolve().parent.parent / "demos"


@event_priority(100)  # before mkdocs-jupyter's own on_files, which picks up *.ipynb pages
def on_files(files: Files, config: Any) -> Files:
    for notebook in sorted(DEMOS.glob("*.ipynb")):
        files.append(
            File(
                f"demos/{notebook.name}",
                src_dir=str(DEMOS.parent),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
    return files
