"""Tests of `dcp_lens.tasks`: variable binding checked by an independent solver, char LM splits."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Literal

import pytest
import torch
from helpers import data_path

from dcp_lens.tasks import IGNORE_INDEX, SPLITS, TASKS, CharLM, VariableBinding, get_task
from dcp_lens.tasks.base import check_split

SHAKESPEARE = data_path("tinyshakespeare.txt")

VARIABLE_BINDING_CONFIGS = [
    {},
    {"queries": "one"},
    {"queries": "one", "query_first": True, "n_ctx": 64},
    {"n_variables": 24, "n_lines": 12, "max_hops": 8, "chain_layout": "longest"},
    {"n_variables": 16, "n_lines": 6, "max_hops": 6, "queries": "one", "chain_layout": "longest"},
    {"n_variables": 26, "n_lines": 10, "max_hops": 1, "n_ctx": 100},
    {"line_format": "token"},
    {"show_answers": False, "queries": "one", "query_first": True},
    # the default preset's task
    {
        "n_variables": 8,
        "n_lines": 8,
        "max_hops": 4,
        "chain_layout": "longest",
        "line_format": "token",
        "show_answers": False,
    },
]


# --- an independent solver, working only from the decoded text ---------------------------------


def parse(text: str) -> tuple[dict[str, str], list[tuple[str, str | None]]]:
    """The assignments and the ``(query, written answer or None)`` pairs after the program."""
    words = [w for w in text.split() if w not in ("<bos>", "<pad>")]
    assignments: dict[str, str] = {}
    asked: list[tuple[str, str | None]] = []
    i = 0
    while i < len(words):
        if words[i] == "?":
            following = words[i + 2] if i + 2 < len(words) else None
            if following == ";":  # a query stated before the program
                i += 3
            elif following is not None and following.isdigit():  # the answer is written
                asked.append((words[i + 1], following))
                i += 3
            else:
                asked.append((words[i + 1], None))
                i += 2
        elif len(words[i]) > 1 and "=" in words[i]:  # one token per line: "c=b"
            variable, value = words[i].split("=")
            assert variable not in assignments, f"{variable} assigned twice in {text!r}"
            assignments[variable] = value
            i += 1
        else:
            variable, equals, value, semicolon = words[i : i + 4]
            assert equals == "=" and semicolon == ";", f"malformed line in {text!r}"
            assert variable not in assignments, f"{variable} assigned twice in {text!r}"
            assignments[variable] = value
            i += 4
    return assignments, asked


def solve(assignments: dict[str, str], variable: str) -> tuple[str, int]:
    """The digit a variable holds and the number of dereferences it takes to get it."""
    value, steps = assignments[variable], 1
    while not value.isdigit():
        value, steps = assignments[value], steps + 1
        assert steps <= len(assignments), "cycle"
    return value, steps


def canonical(text: str) -> frozenset[str]:
    assignments, _ = parse(text)
    return frozenset(f"{v}={x}" for v, x in assignments.items())


# --- variable binding --------------------------------------------------------------------------


@pytest.mark.parametrize("config", VARIABLE_BINDING_CONFIGS)
def test_declared_hops_and_answers_match_an_independent_solver(config: dict) -> None:
    task = VariableBinding(seed=3, **config)
    for split in SPLITS:
        batch = task.batch(split, 150, max_hops=None)
        for row in range(len(batch)):
            assignments, asked = parse(task.decode(batch.tokens[row]))
            assert len(assignments) == task.n_lines
            assert len(asked) == batch.answers.shape[1]
            for j, (variable, written) in enumerate(asked):
                value, steps = solve(assignments, variable)
                assert written == (value if task.show_answers else None)
                assert task.vocab[batch.answers[row, j]] == value
                assert batch.metadata["hops"][row, j].item() == steps
                assert 1 <= steps <= task.max_hops
            if task.queries == "all":
                assert sorted(v for v, _ in asked) == sorted(assignments)


def test_query_first_states_the_query_before_the_program() -> None:
    task = VariableBinding(queries="one", query_first=True, seed=1)
    for row in task.batch("train", 50).tokens:
        words = task.decode(row).split()
        assert words[1] == "?" and words[3] == ";"
        assert words[2] == words[-2], "the query stated first is the one answered at the end"


def test_scored_positions_are_the_tokens_before_the_answers() -> None:
    task = VariableBinding(n_ctx=80, seed=2)  # padded: 57 tokens of program, 23 of padding
    batch = task.batch("train", 64)
    digits = {task.vocab.index(d) for d in "0123456789"}
    assert torch.equal(batch.scored, batch.targets != IGNORE_INDEX)
    rows, positions = batch.scored.nonzero(as_tuple=True)
    assert torch.equal(positions.view(64, -1), batch.answer_positions)
    assert torch.equal(batch.targets[rows, positions], batch.tokens[rows, positions + 1])
    assert torch.equal(batch.answers.flatten(), batch.tokens[rows, positions + 1])
    assert set(batch.answers.flatten().tolist()) <= digits
    assert (batch.tokens[rows, positions - 1] == task.vocab.index("?")).all()
    assert (batch.tokens[rows, positions + 1] != task.pad_id).all()
    # padding: exactly the masked-out positions, all at the end, never scored
    padding = batch.tokens == task.pad_id
    assert torch.equal(padding, ~batch.attention_mask)
    assert padding[:, task.min_n_ctx :].all() and not padding[:, : task.min_n_ctx].any()
    assert not (batch.scored & padding).any()


def test_one_token_lines_and_hidden_answers() -> None:
    task = VariableBinding(
        n_variables=8, n_lines=8, max_hops=4, line_format="token", show_answers=False, seed=4
    )
    assert task.n_ctx == 1 + 8 + 2 * 8
    # one token per possible assignment: a variable takes a digit or another variable
    assert len(task.vocab) == 5 + 10 + 8 + 8 * (10 + 7)
    assert "a=a" not in task.vocab and "a=b" in task.vocab and "h=9" in task.vocab
    batch = task.batch("evaluation", 64)
    text = task.decode(batch.tokens[0])
    assert task.decode(task.encode(text)) == text
    rows, positions = batch.scored.nonzero(as_tuple=True)
    # the answer is a target only: the token after a query is the next "?" or the end
    after = batch.tokens[rows, (positions + 1).clamp(max=task.n_ctx - 1)]
    last = positions == task.n_ctx - 1
    assert ((after == task.vocab.index("?")) | last).all()
    assert torch.equal(batch.targets[rows, positions], batch.answers.flatten())
    assert "one token per line, answers not shown" in task.describe()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"show_answers": False, "n_ctx": 48}, "show_answers=False: they need at least 49"),
        (
            {"line_format": "token", "n_ctx": 32},
            "line_format=.token., show_answers=True: they need at least 33",
        ),
    ],
)
def test_too_short_context_names_the_line_format(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        VariableBinding(**kwargs)


def test_splits_never_share_a_program() -> None:
    # A tiny program space (a few hundred programs): without the split-by-program rule, thousands
    # of draws per split would certainly collide.
    small = VariableBinding(n_variables=4, n_lines=2, max_hops=2, seed=0)
    large = VariableBinding(seed=0)
    for task in (small, large):
        keys = {}
        for split, n in zip(SPLITS, (2000, 1000, 1000), strict=True):
            batch = task.batch(split, n)
            keys[split] = {canonical(task.decode(row)) for row in batch.tokens}
        assert not keys["train"] & keys["calibration"]
        assert not keys["train"] & keys["evaluation"]
        assert not keys["calibration"] & keys["evaluation"]
    assert len(keys["train"]) > 1000  # the large space was really sampled


def test_splits_are_disjoint_across_seeds() -> None:
    train = VariableBinding(n_variables=5, n_lines=2, max_hops=2, seed=0).batch("train", 1000)
    evaluation = VariableBinding(n_variables=5, n_lines=2, max_hops=2, seed=1).evaluation(500)
    task = VariableBinding(n_variables=5, n_lines=2, max_hops=2)
    train_keys = {canonical(task.decode(row)) for row in train.tokens}
    evaluation_keys = {canonical(task.decode(row)) for row in evaluation.tokens}
    assert not train_keys & evaluation_keys


def test_same_seed_same_tensors_and_batches_are_slices_of_one_stream() -> None:
    a = VariableBinding(seed=5).batch("train", 40, offset=100)
    b = VariableBinding(seed=5).batch("train", 40, offset=100)
    for name in ("tokens", "targets", "scored", "answer_positions", "answers", "indices"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    assert torch.equal(a.metadata["hops"], b.metadata["hops"])
    task = VariableBinding(seed=5)
    assert torch.equal(task.evaluation(200).tokens[:100], task.evaluation(100).tokens)
    assert torch.equal(task.batch("train", 10, offset=105).tokens, a.tokens[5:15])
    assert torch.equal(task.calibration(30).tokens, task.batch("calibration", 30).tokens)


def test_different_seeds_and_splits_differ() -> None:
    a = VariableBinding(seed=0).batch("train", 64)
    b = VariableBinding(seed=1).batch("train", 64)
    assert (a.tokens != b.tokens).any(dim=1).float().mean() > 0.95
    e = VariableBinding(seed=0).batch("evaluation", 64)
    assert (a.tokens != e.tokens).any(dim=1).all()


@pytest.mark.parametrize("queries", ["one", "all"])
def test_hop_distribution_covers_every_hop_count(queries: Literal["one", "all"]) -> None:
    task = VariableBinding(n_variables=20, n_lines=10, max_hops=6, queries=queries, seed=0)
    counts = task.hop_counts(task.batch("train", 1800))
    assert list(counts) == [1, 2, 3, 4, 5, 6]
    assert all(c > 0 for c in counts.values())
    if queries == "one":  # uniform over 1..max_hops: 300 expected each
        assert all(230 < c < 370 for c in counts.values()), counts


def test_max_hops_override_is_a_curriculum_hook() -> None:
    task = VariableBinding(n_variables=20, n_lines=10, max_hops=6, queries="one", seed=0)
    batch = task.batch("train", 400, max_hops=2)
    assert set(batch.metadata["hops"].flatten().tolist()) == {1, 2}
    assert task.hop_counts(batch)[6] == 0
    longest = VariableBinding(n_variables=20, n_lines=10, max_hops=6, chain_layout="longest")
    for row in longest.batch("train", 50, max_hops=5).metadata["hops"]:
        assert set(row.tolist()) >= {1, 2, 3, 4, 5} and row.max() == 5
    with pytest.raises(ValueError, match="max_hops=11"):
        task.batch("train", 4, max_hops=11)


def test_example_gives_the_declared_hops_of_each_query() -> None:
    task = VariableBinding(seed=4)
    batch = task.batch("evaluation", 5, offset=10)
    for row in range(5):
        program = task.example("evaluation", 10 + row)
        assert list(program.hops) == batch.metadata["hops"][row].tolist()
        assert program.text == task.decode(batch.tokens[row])
        assert task.split_of(program) == "evaluation"


def test_vocabulary_is_small_and_round_trips() -> None:
    task = VariableBinding(n_variables=26, n_lines=12, max_hops=8)
    assert task.d_vocab == len(task.vocab) < 64
    assert len(set(task.vocab)) == task.d_vocab
    text = "<bos> a = 7 ; b = a ; ? b 7 <pad>"
    assert task.decode(task.encode(text)) == text
    assert task.decode(task.encode("  a =\n7 ")) == "a = 7"  # tokens are whitespace-separated
    with pytest.raises(ValueError, match="'a=' is not in the vocabulary"):
        task.encode("a= 7")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_lines": 6, "max_hops": 7}, "max_hops=7 must be between 1 and n_lines=6"),
        ({"n_variables": 8, "n_lines": 9, "max_hops": 3}, "n_lines=9 must be between 1 and"),
        ({"n_variables": 27}, "n_variables=27"),
        ({"n_lines": 8, "n_ctx": 50}, "need at least 57 tokens"),
        ({"queries": "one", "query_first": True, "n_ctx": 38}, "at least 39 tokens"),
        ({"query_first": True}, "query_first=True needs queries='one'"),
        ({"split_fractions": (0.5, 0.5, 0.0)}, "split_fractions"),
    ],
)
def test_bad_parameters_raise_errors_naming_them(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        VariableBinding(**kwargs)


def test_bad_batch_requests_raise() -> None:
    task = VariableBinding()
    with pytest.raises(ValueError, match="split='test' is not one of"):
        check_split("test")
    # with the test run's runtime type checks the Literal annotation rejects it first
    with pytest.raises((ValueError, TypeError)):
        task.batch("test", 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n=0"):
        task.batch("train", 0)


def test_registry_and_round_trip_through_json() -> None:
    assert set(TASKS) >= {"variable_binding", "char_lm"}
    task = get_task("variable_binding", n_lines=6, queries="one", seed=9)
    rebuilt = get_task(**json.loads(json.dumps(task.to_dict())))
    assert rebuilt == task
    assert torch.equal(rebuilt.evaluation(20).tokens, task.evaluation(20).tokens)
    assert "variable binding" in task.describe() and "\n" not in task.describe()
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        get_task("nope")


def test_batch_accuracy_helpers() -> None:
    task = VariableBinding(seed=0)
    batch = task.batch("train", 8).to("cpu")
    perfect = torch.nn.functional.one_hot(batch.targets.clamp(min=0), task.d_vocab).float()
    assert batch.answer_logits(perfect).shape == (8, task.n_lines, task.d_vocab)
    assert batch.correct(perfect).all()
    loss = torch.nn.functional.cross_entropy(
        (perfect * 50).flatten(0, 1), batch.targets.flatten()
    )  # ignore_index -100 is the default
    assert loss.item() < 1e-6
    wrong = perfect.roll(1, dims=-1)
    assert not batch.correct(wrong).any()


def test_large_programs_generate_deterministically() -> None:
    # Generation speed is a benchmark's business; here: a large task builds and repeats itself.
    task = VariableBinding(n_variables=24, n_lines=12, max_hops=8)
    first = [task.batch("train", 64, offset=64 * step) for step in range(3)]
    again = [task.batch("train", 64, offset=64 * step) for step in range(3)]
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.targets, b.targets)


# --- character LM ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shakespeare() -> CharLM:
    return CharLM(SHAKESPEARE, n_ctx=64, seed=0)


def test_char_lm_windows_of_different_splits_come_from_disjoint_byte_ranges(
    shakespeare: CharLM,
) -> None:
    raw = SHAKESPEARE.read_bytes()
    assert raw.isascii()  # so character offsets are byte offsets
    regions = [shakespeare.region(split) for split in SPLITS]
    assert regions[0][0] == 0 and regions[-1][1] == len(raw)
    assert all(a[1] == b[0] for a, b in zip(regions, regions[1:], strict=False))
    covered: dict[str, set[int]] = {}
    for split, (lo, hi) in zip(SPLITS, regions, strict=True):
        batch = shakespeare.batch(split, 300)
        starts = batch.metadata["start"]
        assert (starts >= lo).all() and (starts + shakespeare.n_ctx + 1 <= hi).all()
        covered[split] = set()
        for row, start in enumerate(starts.tolist()):
            window = raw[start : start + shakespeare.n_ctx + 1].decode()
            assert shakespeare.decode(batch.tokens[row]) == window[:-1]
            assert shakespeare.decode(batch.targets[row]) == window[1:]
            covered[split].update(range(start, start + shakespeare.n_ctx + 1))
    assert not covered["train"] & covered["calibration"]
    assert not covered["train"] & covered["evaluation"]
    assert not covered["calibration"] & covered["evaluation"]


def test_char_lm_scores_every_position(shakespeare: CharLM) -> None:
    batch = shakespeare.batch("train", 16)
    assert batch.tokens.shape == (16, 64)
    assert batch.scored.all() and batch.attention_mask.all()
    assert torch.equal(batch.targets[:, :-1], batch.tokens[:, 1:])
    assert torch.equal(batch.answers, batch.targets)
    assert torch.equal(batch.answer_positions[3], torch.arange(64))
    perfect = torch.nn.functional.one_hot(batch.targets, shakespeare.d_vocab).float()
    assert batch.correct(perfect).all()


def test_char_lm_is_deterministic_and_seeded(shakespeare: CharLM) -> None:
    again = CharLM(SHAKESPEARE, n_ctx=64, seed=0)
    assert torch.equal(again.evaluation(50).tokens, shakespeare.evaluation(50).tokens)
    assert torch.equal(
        again.batch("train", 8, offset=4).tokens, shakespeare.batch("train", 12).tokens[4:]
    )
    other = CharLM(SHAKESPEARE, n_ctx=64, seed=1)
    assert not torch.equal(other.evaluation(50).tokens, shakespeare.evaluation(50).tokens)


def test_char_lm_vocabulary_and_round_trip(shakespeare: CharLM) -> None:
    text = SHAKESPEARE.read_text()
    assert shakespeare.vocab == sorted(set(text))
    assert shakespeare.d_vocab == 65
    sample = text[5000:9000]
    assert shakespeare.decode(shakespeare.encode(sample)) == sample
    with pytest.raises(ValueError, match="'~' does not occur"):
        shakespeare.encode("~")
    rebuilt = get_task(**json.loads(json.dumps(shakespeare.to_dict())))
    assert torch.equal(rebuilt.batch("calibration", 5).tokens, shakespeare.calibration(5).tokens)
    assert "tinyshakespeare.txt" in shakespeare.describe()


def test_char_lm_on_any_text_file(tmp_path: Path) -> None:
    path = tmp_path / "small.txt"
    path.write_text("héllo wörld, ñ\n" * 40, encoding="utf-8")
    task = CharLM(path, n_ctx=8, seed=0)
    assert task.vocab == sorted(set("héllo wörld, ñ\n"))
    assert task.decode(task.encode("wörld ñ")) == "wörld ñ"
    assert task.batch("evaluation", 4).tokens.shape == (4, 8)
    with pytest.raises(ValueError, match="n_ctx=40 is too long for the calibration region"):
        CharLM(path, n_ctx=40)
    with pytest.raises(ValueError, match="is not a file"):
        CharLM(tmp_path / "missing.txt")


# Leaf modules a task may use: none of them imports the model (checked below).
TASK_DEPENDENCIES = (
    "dcp_lens.protocol.metrics",
    "dcp_lens.utils.errors",
    "dcp_lens.utils.checks",
    "dcp_lens.model.tokenization",  # model-free: it only calls the tokenizer the task is given
    "dcp_lens.model.loss",  # model-free: the loss functions and IGNORE_INDEX
)


def test_tasks_do_not_import_the_model() -> None:
    import dcp_lens.tasks
    import dcp_lens.zoo.registry

    # The registry is allowed too: it imports the model only inside load().
    registry = ast.parse(Path(dcp_lens.zoo.registry.__file__).read_text())
    assert not any(
        isinstance(node, ast.ImportFrom) and "hooked_recurrent" in (node.module or "")
        for node in registry.body
    )
    package = Path(dcp_lens.tasks.__file__).parent
    root = package.parent.parent  # the folder holding the dcp_lens package
    leaves = [root.joinpath(*name.split(".")).with_suffix(".py") for name in TASK_DEPENDENCIES]
    assert all(leaf.is_file() for leaf in leaves), leaves
    for source in [*package.glob("*.py"), *leaves]:
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported = [node.module]
            elif isinstance(node, ast.Import):
                imported = [alias.name for alias in node.names]
            else:
                continue
            for module in imported:
                inside = (
                    not module.startswith("dcp_lens")
                    or module.startswith(("dcp_lens.tasks", "dcp_lens.utils"))
                    or module in TASK_DEPENDENCIES
                    or module == "dcp_lens.zoo.registry"
                )
                assert inside, f"{source.name} imports {module}"
