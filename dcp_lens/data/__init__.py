"""Small data shipped inside the package, so that the README's and the docs' examples run from an
installed wheel as well as from a clone.

============================  ==============================================================
name                          what
============================  ==============================================================
``huginn_tiny``               a tiny random-weight model in the Huginn-0125 layout (r = 4,
                              a 64-token context, a byte-level tokenizer: about 60 characters),
                              with reference outputs; load it with ``huginn:PATH``
``ouro_tiny``                 the same in the Ouro (LoopLM) layout; ``ouro:PATH``
``retrofit_llama_tiny``       the same for retrofitted recurrence from a Llama parent (the
                              dense parent in ``parent/``); ``raven-retrofit:PATH``
``retrofit_olmo_tiny``        the same from an OLMo-2 parent; ``raven-retrofit:PATH``
``stories260K``               a pretrained 260K-parameter llama2.c model and its tokenizer;
                              ``llama2c:PATH``
``tinyshakespeare``           the tiny-shakespeare corpus, 1.1 MB of plain text
============================  ==============================================================

``path(name)`` is where it lies; ``python -m dcp_lens.data NAME`` prints that path, for the
command line (``dcp-lens run --model huginn:$(python -m dcp_lens.data huginn_tiny)``).
Provenance, licences and checksums are in ``README.md`` beside this module.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from dcp_lens.utils.errors import ConfigError, MissingFileError

DATA_DIR = Path(__file__).resolve().parent

# name -> path relative to this folder
SHIPPED = {
    "huginn_tiny": "fixtures/huginn_tiny",
    "ouro_tiny": "fixtures/ouro_tiny",
    "retrofit_llama_tiny": "fixtures/retrofit_llama_tiny",
    "retrofit_olmo_tiny": "fixtures/retrofit_olmo_tiny",
    "stories260K": "stories260K",
    "tinyshakespeare": "tinyshakespeare.txt",
}


def path(name: str) -> Path:
    """The shipped file or folder ``name`` (one of `SHIPPED`), as an absolute path."""
    if name not in SHIPPED:
        raise ConfigError(
            f"no shipped data named {name!r}; expected one of {', '.join(sorted(SHIPPED))}"
        )
    found = DATA_DIR / SHIPPED[name]
    if not found.exists():
        raise MissingFileError(
            f"{found} is missing from this installation of dcp_lens; reinstall the package "
            "(pip install --force-reinstall dcp-lens) or, in a clone, run "
            "`git checkout -- dcp_lens/data`"
        )
    return found


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m dcp_lens.data NAME``: print the path of shipped data ``NAME`` (no name: list
    every name with its path). Returns the exit status."""
    names = list(sys.argv[1:] if argv is None else argv)
    if not names:
        for name in SHIPPED:
            print(f"{name}\t{path(name)}")
        return 0
    try:
        for name in names:
            print(path(name))
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


__all__ = ["DATA_DIR", "SHIPPED", "main", "path"]
