"""The metrics' top-1 hits equal argmax's on hostile logits: ties everywhere, infinities, NaN,
unscored and out-of-range references, every float precision the metrics accept."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_lens.protocol.metrics import IGNORE_INDEX, per_example_metrics


def _expected_accuracy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """accuracy by argmax (NaN where a scored position's logits are not all finite)."""
    upcast = logits.to(torch.promote_types(logits.dtype, torch.float32))
    hit = (upcast.argmax(-1) == targets).to(upcast.dtype)
    scored = targets != IGNORE_INDEX
    finite = torch.isfinite(upcast).all(-1)
    bad = (~finite & scored).any(-1)
    rate = (hit * scored).sum(-1) / scored.sum(-1).clamp(min=1)
    return torch.where(bad, torch.nan, rate)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    levels=st.integers(1, 6),
    vocabulary=st.integers(1, 70),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]),
)
def test_top1_hits_are_argmaxs_on_ties_infinities_and_unscored_positions(
    seed: int, levels: int, vocabulary: int, dtype: torch.dtype
) -> None:
    generator = torch.Generator().manual_seed(seed)
    # Few distinct values: most positions have their largest logit tied.
    logits = torch.randint(0, levels, (5, 11, vocabulary), generator=generator).to(dtype)
    logits[0, 2, 0] = -torch.inf  # a -inf logit: no prediction
    logits[1, 3, -1] = torch.inf  # +inf: no prediction
    logits[2, 4, vocabulary // 2] = torch.nan  # NaN: no prediction
    targets = torch.randint(0, vocabulary, (5, 11), generator=generator)
    targets[:, 5] = logits[:, 5].float().argmax(-1)  # hits on tied positions
    targets[0, 6] = IGNORE_INDEX
    targets[1, :] = IGNORE_INDEX  # an example with nothing scored
    targets[3, 7] = vocabulary + 3  # no class of the vocabulary: never a hit, even where
    logits[3, 7, -1] = levels  # the last class (the nearest one) is the unique largest
    full = torch.randn(5, 11, vocabulary, generator=generator).log_softmax(-1)
    full_top1 = torch.randint(0, levels, (5, 11, vocabulary), generator=generator).float()
    full_top1 = full_top1.argmax(-1)
    got = per_example_metrics(
        logits, full, targets, ("accuracy", "top1_agreement"), full_top1=full_top1
    )
    expected_accuracy = _expected_accuracy(logits, targets)
    # Examples 0 and 2 have no prediction at a scored position, 3 and 4 are scored throughout.
    assert expected_accuracy[[0, 2]].isnan().all() and not expected_accuracy[3:].isnan().any()
    assert torch.equal(got["accuracy"].isnan(), expected_accuracy.isnan())
    assert torch.equal(got["accuracy"].nan_to_num(-1.0), expected_accuracy.nan_to_num(-1.0))
    # top1_agreement scores every position whose target is scored, against full's top-1.
    scored_agreement = torch.where(targets != IGNORE_INDEX, full_top1, IGNORE_INDEX)
    expected_agreement = _expected_accuracy(logits, scored_agreement)
    assert torch.equal(got["top1_agreement"].nan_to_num(-1.0), expected_agreement.nan_to_num(-1.0))


@pytest.mark.parametrize("vocabulary", [2, 513, 40_000])
def test_top1_hits_on_a_long_vocabulary_count_ties_exactly(vocabulary: int) -> None:
    """The ties are counted by summing -1 per logit below the largest, exact in float32 at any
    vocabulary below 2**24: a tie of the last two classes and a unique largest at class 0."""
    logits = torch.zeros(2, 2, vocabulary)
    logits[0, 0, -2:] = 1.0  # tied: the first of the two is the prediction
    logits[0, 1, 0] = 1.0  # unique
    logits[1] = torch.linspace(-1, 1, vocabulary)  # unique at the last class
    targets = torch.tensor([[vocabulary - 1, 0], [vocabulary - 1, vocabulary - 2]])
    got = per_example_metrics(logits, logits.log_softmax(-1), targets, ("accuracy",))
    assert torch.equal(got["accuracy"], _expected_accuracy(logits, targets))
    assert got["accuracy"].tolist() == [0.5, 0.5]
