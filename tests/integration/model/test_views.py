"""print(model) folds the unrolled view: one line per prelude, core and coda group."""

from __future__ import annotations

from helpers import make_model
from torch import nn


def test_the_blocks_fold_into_prelude_core_and_coda() -> None:
    model = make_model()  # 1 prelude block, 2 core layers x 4 iterations, 1 coda block
    text = repr(model)
    assert "(0): prelude, TransformerBlock(" in text
    assert "(1-8): core, 2 layers x 4 iterations (weights shared): TransformerBlock(" in text
    assert "(9): coda, TransformerBlock(" in text
    assert "blocks.5." not in text  # no unrolled block is listed on its own
    with model.iterations(32):
        deep = repr(model)
        assert "(1-64): core, 2 layers x 32 iterations" in deep and "(65): coda" in deep
    assert len(deep.splitlines()) == len(text.splitlines())
    # The whole listing is still there for whoever asks for it.
    assert len(nn.ModuleList.__repr__(model.blocks).splitlines()) > 10 * len(model.blocks)


def test_blocks_that_share_no_weights_fold_by_structure() -> None:
    model = make_model()
    untied = type(model.blocks)([model.blocks[0], *[nn.Identity() for _ in range(3)]])
    lines = [line.strip() for line in repr(untied).splitlines()[1:-1]]
    assert len(lines) == 2 and lines[0].startswith("(0): TransformerBlock(ln1=")
    assert lines[1] == "(1-3): 3 x Identity()"
