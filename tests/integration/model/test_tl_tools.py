"""TransformerLens's tools that take the model or its tokenizer (``evals``, ``utilities``'
tokenizer helpers, ``tools.analysis``), each against a hand computation on a recurrent model, or
refused with the way out."""

from __future__ import annotations

from collections import Counter

import datasets
import pytest
import tokenizers
import torch
from helpers import data_path, make_model, tokens_for
from transformer_lens import evals
from transformer_lens import utilities as tl_utilities
from transformer_lens.tools import analysis

from dcp_lens import load
from dcp_lens.lenses.tuned import JacobianLens
from dcp_lens.model.hooked_recurrent_transformer import HookedRecurrentTransformer
from dcp_lens.utils.errors import UnsupportedToolError
from dcp_lens.zoo.loaders.hf_tokenizer import HFTokenizer

TEXTS = ["the cat sat on the mat. " * 6, "a dog ran far away", "one two three four five " * 4]


def byte_model(n_ctx: int = 320) -> HookedRecurrentTransformer:
    """A recurrent model on the Huginn fixture's byte-level vocabulary, with BOS (prepended by
    default) and EOS tokens, as TransformerLens's tokenizer utilities expect."""
    folder = data_path("fixtures", "huginn_tiny")
    inner = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    model = make_model(d_vocab=inner.get_vocab_size(), n_ctx=n_ctx)
    model.tokenizer = HFTokenizer(inner, bos_token="Ā", eos_token="ā", add_bos_token=True)
    return model


def close(actual: object, expected: object, atol: float, what: str) -> None:
    error = abs(float(torch.as_tensor(actual).detach()) - float(torch.as_tensor(expected).detach()))
    assert error <= atol, f"{what}: {actual} != {expected} (difference {error:.3g} > {atol})"


# ------------------------------------------------------------------- tokenizer utilities


def test_hugging_face_encode_keywords() -> None:
    tokenizer = byte_model().tokenizer
    plain = tokenizer.encode("hello", bos=False)
    assert tokenizer.encode("hello", add_special_tokens=False) == plain
    assert tokenizer.encode("hello", add_special_tokens=True) == [tokenizer.bos_token_id, *plain]
    as_tensor = tokenizer.encode("hello", return_tensors="pt")  # Hugging Face: BOS by default
    assert torch.equal(as_tensor, torch.tensor([[tokenizer.bos_token_id, *plain]]))
    with pytest.raises(ValueError, match="use None or 'pt'"):
        tokenizer.encode("hello", return_tensors="tf")


def test_tokenize_and_concatenate_is_the_texts_joined_by_eos() -> None:
    tokenizer = byte_model().tokenizer
    dataset = datasets.Dataset.from_dict({"text": TEXTS})
    rows = tl_utilities.tokenize_and_concatenate(dataset, tokenizer, max_length=16, num_proc=None)
    # By hand: every text's ids, EOS between texts, cut into rows of 15, BOS first in each.
    stream: list[int] = []
    for index, text in enumerate(TEXTS):
        stream += tokenizer.encode(text, bos=False)
        stream += [tokenizer.eos_token_id] if index < len(TEXTS) - 1 else []
    n_rows = len(stream) // 15
    expected = torch.tensor(stream[: n_rows * 15]).reshape(n_rows, 15)
    expected = torch.cat([torch.full((n_rows, 1), tokenizer.bos_token_id), expected], dim=1)
    assert torch.equal(rows[:]["tokens"], expected)


def test_bos_utilities_follow_the_tokenizer() -> None:
    model = byte_model()
    tokenizer = model.tokenizer
    tokens = model.to_tokens(["ab c", "d"])
    assert torch.equal(tl_utilities.get_tokens_with_bos_removed(tokenizer, tokens), tokens[:, 1:])
    assert tl_utilities.get_tokenizer_with_bos(tokenizer) is tokenizer  # it prepends BOS already
    texts = tl_utilities.get_input_with_manually_prepended_bos(tokenizer.bos_token, ["x", "y"])
    assert texts == ["Āx", "Āy"]
    # The BOS string is text to these tokenizers, not the BOS id: prepend_bos is the way.
    assert tokenizer.encode(texts[0], bos=False)[0] != tokenizer.bos_token_id
    assert model.to_tokens("x", prepend_bos=True)[0, 0] == tokenizer.bos_token_id
    bos_less = load("default").tokenizer
    assert tl_utilities.get_tokenizer_with_bos(bos_less) is bos_less  # no BOS: as is
    not_prepending = HFTokenizer(tokenizer.tokenizer, bos_token="Ā", add_bos_token=False)
    with pytest.raises(UnsupportedToolError, match=r"prepend_bos=True"):
        tl_utilities.get_tokenizer_with_bos(not_prepending)


# --------------------------------------------------------------------------------- evals


def test_ioi_dataset_and_eval_match_a_hand_computation() -> None:
    model = byte_model()
    tokenizer = model.tokenizer
    dataset = evals.IOIDataset(tokenizer, num_samples=6, seed=0)
    sample = dataset.samples[0] if hasattr(dataset, "samples") else None
    first = dataset[0]
    assert first["prompt"][0] == tokenizer.bos_token_id
    if sample is not None:
        assert first["prompt"][1:].tolist() == tokenizer.encode(sample["text"], bos=False)
    result = evals.ioi_eval(model, dataset=dataset, batch_size=4)
    diffs = []
    for index in range(len(dataset)):
        item = dataset[index]
        io, s = item["IO"], item["S"]
        width = min(len(io), len(s))
        start = int(torch.nonzero(io[:width] != s[:width])[0])
        logits = model(item["prompt"][None])[0, len(item["prompt"]) - len(io) + start - 1]
        diffs.append(float((logits[io[start]] - logits[s[start]]).detach()))
    close(result["Logit Difference"], sum(diffs) / len(diffs), 1e-9, "IOI logit difference")
    close(result["Accuracy"], sum(d > 0 for d in diffs) / len(diffs), 0.0, "IOI accuracy")


def test_ioi_on_a_task_vocabulary_names_the_vocabulary() -> None:
    with pytest.raises(ValueError, match="starts with no symbol of this vocabulary"):
        evals.IOIDataset(load("default").tokenizer, num_samples=2, seed=0)[0]


def test_sanity_check_is_the_loss_of_its_text() -> None:
    model = byte_model()
    loss = evals.sanity_check(model)
    close(loss, model(model.to_tokens(_SANITY_TEXT), return_type="loss"), 1e-12, "sanity_check")


_SANITY_TEXT = (
    "Many important transition points in the history of science have been moments when science "
    "'zoomed in.' At these points, we develop a visualization or tool that allows us to see the "
    "world in a new level of detail, and a new field of science develops to study the world "
    "through this lens."
)


@pytest.mark.parametrize("name", ["wiki", "owt", "pile", "code"])
def test_data_loaders_tokenize_a_locally_cached_data_set(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the data set in the local cache (here: ``load_dataset`` answers with local text),
    each loader's rows are `tokenize_and_concatenate` of it by our tokenizer."""
    tokenizer = byte_model().tokenizer
    local = datasets.Dataset.from_dict({"text": TEXTS * 4, "content": TEXTS * 4})
    monkeypatch.setattr(evals, "load_dataset", lambda *args, **kwargs: local)
    loader = getattr(evals, f"make_{name}_data_loader")(tokenizer, batch_size=2)
    rows = torch.cat([batch["tokens"] for batch in loader])
    reference = tl_utilities.tokenize_and_concatenate(local, tokenizer)  # as the loader calls it
    expected = reference[:]["tokens"]
    # Shuffled, the last odd row dropped: every row is one of the reference's.
    assert len(rows) == len(expected) - len(expected) % 2
    assert not Counter(map(tuple, rows.tolist())) - Counter(map(tuple, expected.tolist()))


def test_data_loaders_offline_fail_before_touching_the_model() -> None:
    tokenizer = byte_model().tokenizer
    with pytest.raises(ConnectionError, match="(?i)offline"):
        evals.make_wiki_data_loader(tokenizer)


def test_evaluate_is_the_mean_loss_on_each_data_set(monkeypatch: pytest.MonkeyPatch) -> None:
    model = byte_model(n_ctx=1024)
    local = datasets.Dataset.from_dict({"text": TEXTS[1:], "content": TEXTS[1:]})
    monkeypatch.setattr(evals, "load_dataset", lambda *args, **kwargs: local)
    monkeypatch.setattr(evals, "evaluate_on_dataset", _on_cpu(evals.evaluate_on_dataset))
    losses = evals.evaluate(model, batch_size=1)
    rows = torch.as_tensor(
        tl_utilities.tokenize_and_concatenate(local, model.tokenizer)[:]["tokens"]
    )
    expected = torch.stack([model(row[None], return_type="loss") for row in rows]).mean()
    assert set(losses) == {f"{name}_loss" for name in evals.DATASET_NAMES}
    for name, loss in losses.items():
        close(loss, expected, 1e-6, name)


def _on_cpu(function):  # type: ignore[no-untyped-def]
    """TransformerLens's ``evaluate`` leaves ``evaluate_on_dataset``'s device at "cuda"."""
    return lambda model, loader, truncate=100, device=None: function(
        model, loader, truncate=truncate, device="cpu"
    )


def test_mmlu_eval_picks_the_likeliest_letter(monkeypatch: pytest.MonkeyPatch) -> None:
    model = byte_model(n_ctx=1024)
    questions = [
        {"question": "2 + 2?", "choices": ["3", "4", "5", "6"], "answer": 1, "subject": "math"},
        {"question": "Red?", "choices": ["a", "b", "c", "d"], "answer": 0, "subject": "art"},
        {"question": "Sky?", "choices": ["blue", "x", "y", "z"], "answer": 3, "subject": "art"},
    ]
    monkeypatch.setattr(evals, "make_mmlu_data_loader", lambda **kwargs: questions)
    result = evals.mmlu_eval(model, subjects="abstract_algebra")
    tokenizer = model.tokenizer
    spaced = [tokenizer.encode(f" {letter}", bos=False) for letter in "ABCD"]
    letters = [
        ids[0] if len(ids) == 1 else tokenizer.encode(letter, bos=False)[0]
        for ids, letter in zip(spaced, "ABCD", strict=True)
    ]
    correct = 0
    for item in questions:
        prompt = f"Question: {item['question']}\nChoices:\n"
        prompt += "".join(f"{'ABCD'[i]}. {c}\n" for i, c in enumerate(item["choices"]))
        logits = model(model.to_tokens(prompt + "Answer:"))[0, -1]
        correct += int(int(logits[letters].argmax()) == item["answer"])
    close(result["accuracy"], correct / len(questions), 0.0, "MMLU accuracy")


# ------------------------------------------------------------------------ tools.analysis


def _basis(matrix: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of the column space of ``matrix`` [d_model, d_head] (full rank)."""
    return torch.linalg.qr(matrix.double())[0]


@pytest.mark.parametrize("role", ["Q", "K", "V"])
def test_head_subspace_affinity_is_the_projection_kernel_by_hand(role: str) -> None:
    """On the weights as stored, per unrolled block: ``||U_O^T U_role||_F^2`` of the subspace
    a head writes (``W_O[h]``) and the subspace a later head reads (``W_role[g]``)."""
    model = make_model()
    result = analysis.attention_head_subspace_affinity(model, target_role=role)
    n = model.cfg.n_layers
    assert result.source_layer_indices == result.target_layer_indices == tuple(range(n))
    for source, target in [(0, 1), (0, n - 1), (model.block_index(1, 0), model.block_index(3, 1))]:
        for head, other in [(0, 0), (1, 3)]:
            written = _basis(model.blocks[source].attn.W_O[head].T)
            read = _basis(getattr(model.blocks[target].attn, f"W_{role}")[other])
            expected = (written.T @ read).square().sum()
            close(result.scores[source, head, target, other], expected, 1e-8, f"{role} affinity")
    assert not result.valid_mask[1, 0, 0, 0]  # forward order: a later head cannot write back


def test_collect_activations_reads_the_hook_at_each_position() -> None:
    model = make_model()
    tokens = tokens_for(model)
    positions = torch.tensor([3, 11])
    hook = f"blocks.{model.block_index(2, 1)}.hook_resid_post"
    collected = analysis.collect_activations(
        model, hook, tokens, lambda x: model(x)[:, -1, :3], positions=positions, batch_size=1
    )
    _, cache = model.run_with_cache(tokens)
    expected = cache[hook][torch.arange(2), positions]
    assert collected.shape == expected.shape
    close((collected - expected).abs().max(), 0.0, 1e-12, "collected activations")


def test_interventions_are_a_hand_patched_forward() -> None:
    """`run_with_intervention` / `intervened_logits` with a subspace interchange = the base
    forward with ``act + (source - act) B Bᵀ`` written at each example's position."""
    model = make_model()
    base, source = tokens_for(model), tokens_for(model).flip(0)
    hook = f"blocks.{model.block_index(3, 0)}.hook_resid_pre"
    positions = torch.tensor([5, 9])
    basis = torch.linalg.qr(torch.randn(32, 3, generator=torch.Generator().manual_seed(1)))[0]
    basis = basis.double()
    _, cache = model.run_with_cache(source)
    source_acts = cache[hook][torch.arange(2), positions]
    interchange = analysis.SubspaceInterchange(basis)

    def task(x: torch.Tensor) -> torch.Tensor:
        return model(x)[:, -1, :5]

    def patch(act: torch.Tensor, hook: object) -> torch.Tensor:
        act = act.clone()
        rows = act[torch.arange(2), positions]
        act[torch.arange(2), positions] = rows + (source_acts - rows) @ basis @ basis.T
        return act

    expected = model.run_with_hooks(base, fwd_hooks=[(hook, patch)])[:, -1, :5]
    for run in (analysis.run_with_intervention, analysis.intervened_logits):
        logits = run(model, hook, interchange, base, source_acts, task, positions=positions)
        close((logits - expected).abs().max(), 0.0, 1e-12, run.__name__)
    assert (expected - task(base)).abs().max() > 1e-3  # the patch moves the logits


def test_reinitialized_is_refused_naming_a_fresh_model() -> None:
    with pytest.raises(UnsupportedToolError, match=r"replace\(model\.cfg, seed="):
        analysis.reinitialized(make_model(), seed=0)


def _metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[..., -1, 3].sum() - logits[..., -1, 5].sum()


def test_node_attribution_is_activation_difference_times_gradient() -> None:
    """`attribution_patch` node scores = ``(a_clean - a_corrupt) · d metric / d a`` on the
    corrupt run, per hook point of the unrolled blocks, by hand (one pair)."""
    model = make_model()
    clean, corrupt = tokens_for(model, batch=1), tokens_for(model, batch=2)[1:]
    result = analysis.attribution_patch(model, clean, corrupt, _metric)
    index = model.block_index(2, 1)
    hooks = ["hook_embed", f"blocks.{index}.attn.hook_z", f"blocks.{index}.hook_mlp_out"]
    _, clean_cache = model.run_with_cache(clean)
    kept: dict[str, torch.Tensor] = {}

    def keep(act: torch.Tensor, hook: object) -> torch.Tensor:
        act.retain_grad()
        kept[getattr(hook, "name", "")] = act
        return act

    _metric(model.run_with_hooks(corrupt, fwd_hooks=[(h, keep) for h in hooks])).backward()
    score = {h: ((clean_cache[h] - kept[h]) * kept[h].grad).detach()[0] for h in hooks}
    for position in (0, 7, 11):
        embed = analysis.Node(kind="embed", position=position)
        close(result.node_scores[embed], score[hooks[0]][position].sum(), 1e-6, "embed node")
        for head in (0, 3):
            node = analysis.Node("attn_head_out", position, layer=index, head=head)
            close(result.node_scores[node], score[hooks[1]][position, head].sum(), 1e-6, "head")
        mlp = analysis.Node(kind="mlp_out", position=position, layer=index)
        close(result.node_scores[mlp], score[hooks[2]][position].sum(), 1e-6, "mlp node")


def test_edge_attribution_and_faithfulness_refuse_naming_head_results() -> None:
    """Both need per-head outputs in the forward (``use_attn_result``), which this model
    computes from the cache instead."""
    model = make_model()
    clean, corrupt = tokens_for(model, batch=1), tokens_for(model, batch=2)[1:]
    edge = analysis.EdgeAttributionConfig(granularity="edge")
    with pytest.raises(UnsupportedToolError, match=r"compute_head_results"):
        analysis.attribution_patch(model, clean, corrupt, _metric, edge)
    with pytest.raises(UnsupportedToolError, match=r"compute_head_results"):
        analysis.faithfulness(model, clean, corrupt, _metric, [])
    assert not model.cfg.use_attn_result  # the switches are restored


def test_das_loss_is_the_hand_patched_cross_entropy() -> None:
    """With a zero learning rate the subspace stays at its start: `fit_das`'s loss is then the
    cross-entropy of the forward patched by hand inside the returned subspace."""
    model = make_model()
    base, source = tokens_for(model), tokens_for(model).flip(0)
    hook, targets = f"blocks.{model.block_index(2, 0)}.hook_resid_post", torch.tensor([1, 2])
    last = torch.tensor([11, 11])

    def task(x: torch.Tensor) -> torch.Tensor:
        return model(x)[:, -1, :4]

    result = analysis.fit_das(
        model,
        hook,
        base,
        source,
        targets,
        task,
        rank=2,
        epochs=1,
        lr=0.0,
        base_positions=last,
        source_positions=last,
    )
    basis = result.subspace.proj.weight.detach().double()  # [d_model, rank], orthonormal
    close((basis.T @ basis - torch.eye(2, dtype=basis.dtype)).abs().max(), 0.0, 1e-6, "basis")
    _, cache = model.run_with_cache(source)
    source_acts = cache[hook][:, -1]

    def patch(act: torch.Tensor, hook: object) -> torch.Tensor:
        act = act.clone()
        act[:, -1] = act[:, -1] + (source_acts - act[:, -1]) @ basis @ basis.T
        return act

    logits = model.run_with_hooks(base, fwd_hooks=[(hook, patch)])[:, -1, :4]
    expected = torch.nn.functional.cross_entropy(logits, targets)
    close(result.losses[0], expected, 1e-6, "DAS loss")


def test_jacobian_lens_is_refused_naming_ours_which_fits() -> None:
    """TransformerLens's JacobianLens takes only its TransformerBridge: its check reads
    ``model.__class__``, which refuses naming dcp-lens's lens (fit, validate_model and readout
    alike); dcp-lens's lens of the same name fits the recurrent model, and the model's class
    reads as ever everywhere else."""
    model = make_model()
    way_out = r"dcp_lens\.lenses\.tuned\.JacobianLens\.fit\(model, tokens\)"
    with pytest.raises(UnsupportedToolError, match=way_out):
        analysis.JacobianLens.fit(model, ["x"], corpus="local", show_progress=False)
    fitted = analysis.JacobianLens(
        {0: torch.eye(model.cfg.d_model)}, n_prompts=1, d_model=model.cfg.d_model
    )
    with pytest.raises(UnsupportedToolError, match=way_out):
        fitted.validate_model(model)
    assert model.__class__ is HookedRecurrentTransformer
    assert not isinstance(model, analysis.JacobianLens)
    lens = JacobianLens.fit(model, tokens_for(model, batch=1, pos=4), iterations=[1])
    assert lens.jacobians[1].shape == (model.cfg.d_model, model.cfg.d_model)
