"""Variable binding (pointer chasing): follow a chain of assignments back to a digit.

A program is ``n_lines`` assignment lines in shuffled order, every line assigning a distinct
variable, either a digit literal or another variable. The lines form chains that start from a
literal and continue through variables; the chains not queried are distractors. Queries follow
the program (or, with ``query_first``, the single query also precedes it)::

    <bos> c = b ; a = 7 ; e = 2 ; b = a ; ? c 7 ? e 2 ? a 7 ? b 7 <pad> <pad>

The hop count of a query is the number of dereferences that resolve it: the position of the
queried variable in its chain, counted from the literal (``a = 7`` queried is 1 hop, ``c`` above
is 3). The scored position of a query is its variable token, whose next token is the answer.

Splits are disjoint by construction: a program belongs to the split chosen by a stable hash of
its canonical key (its sorted lines, independent of line order, queries and seed), and each
split keeps only its own programs. So no program ever appears in two splits, for any seed.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from random import Random
from typing import ClassVar, Literal

import torch
from jaxtyping import Int
from torch import Tensor

from dcp_lens.model.loss import IGNORE_INDEX
from dcp_lens.tasks.base import (
    SPLITS,
    Split,
    Task,
    TaskBatch,
    check_batch_request,
    check_split,
    check_split_fractions,
    example_rng,
)

PAD = "<pad>"
BOS = "<bos>"
LETTERS = "abcdefghijklmnopqrstuvwxyz"
DIGITS = "0123456789"
# A program that lands in another split is redrawn; this bounds the redraws of one example.
MAX_DRAWS = 10_000
LINE_FORMATS = ("text", "token")


@dataclass(frozen=True)
class Program:
    """One variable-binding example, as text-level structure.

    Attributes:
        lines: the assignments in text order, ``(variable, value)``; value is a digit or a variable.
        queries: the queried variables, in the order they are asked.
        answers: the digit each query resolves to.
        hops: the declared hop count of each query (dereferences from the literal; >= 1).
        query_first: whether the (single) query is also stated before the program.
        line_format: ``"text"`` (``c = b ;``, four tokens per line) or ``"token"`` (``c=b``, one
            token per line).
        show_answers: whether each query's answer follows it in the sequence (``? c 7``) or not
            (``? c ? e``: the answer is only a target).
    """

    lines: tuple[tuple[str, str], ...]
    queries: tuple[str, ...]
    answers: tuple[str, ...]
    hops: tuple[int, ...]
    query_first: bool
    line_format: str = "text"
    show_answers: bool = True

    @property
    def key(self) -> str:
        """Canonical key: the sorted assignments, so reordered lines are the same program."""
        return ";".join(sorted(f"{variable}={value}" for variable, value in self.lines))

    def layout(self) -> tuple[list[str], list[int]]:
        """The token strings of the example and, per query, the position whose next token is its
        answer (the query's variable token)."""
        tokens = [BOS]
        if self.query_first:
            tokens += ["?", self.queries[0], ";"]
        for variable, value in self.lines:
            if self.line_format == "token":
                tokens.append(f"{variable}={value}")
            else:
                tokens += [variable, "=", value, ";"]
        positions = []
        for query, answer in zip(self.queries, self.answers, strict=True):
            tokens += ["?", query]
            positions.append(len(tokens) - 1)
            if self.show_answers:
                tokens.append(answer)
        return tokens, positions

    @property
    def text(self) -> str:
        """The example as space-separated tokens, without padding."""
        return " ".join(self.layout()[0])


@dataclass
class VariableBinding(Task):
    """Variable-binding programs with a known hop count per query.

    Args:
        n_variables: size of the variable alphabet (letters ``a..``), 1..26; a program uses
            ``n_lines`` of them.
        n_lines: assignment lines per program (each assigns a distinct variable).
        max_hops: longest chain drawn; ``batch(..., max_hops=h)`` overrides it per batch
            (a curriculum hook).
        queries: ``"all"`` asks every variable of the program after it, in random order.
            ``"one"`` asks one variable, whose hop count is uniform over 1..max_hops; the chains
            it is not on are distractors.
        chain_layout: how the lines are cut into chains. ``"uniform"``: chain lengths drawn
            uniformly from 1..max_hops until the lines are used up (the last chain is cut to the
            lines left); with ``queries="one"`` the queried chain is drawn first, between its
            query's hop count and max_hops long. ``"longest"``: the first chain is exactly
            max_hops long (with ``"all"``, every program asks every hop count 1..max_hops; with
            ``"one"``, the queried chain's length says nothing about the hop count), the others
            drawn as for ``"uniform"``.
        query_first: also state the single query before the program (``queries="one"`` only).
        line_format: ``"text"`` writes an assignment as four tokens, ``c = b ;``. ``"token"``
            writes it as one token, ``c=b`` (the vocabulary gains one token per possible
            assignment): a lookup is then one attention step, with no earlier layer needed to
            move a line's variable onto its value, which makes the task far quicker to learn
            from scratch. Text-format binding needs that two-layer composition first, and small
            models sit on a plateau for thousands of steps before forming it.
        show_answers: write each query's answer after it (``? c 7 ? e 2``). With ``False`` the
            answers are targets only (``? c ? e``), so a later query cannot read an earlier
            answer: with every variable queried, shown answers let a model guess a chain's value
            from the answers already given instead of following the chain.
        n_ctx: sequence length; ``None`` uses the shortest that fits (``min_n_ctx``). Longer
            sequences are padded at the end.
        seed: the task seed; example ``i`` of a split depends only on ``(seed, split, i)``.
        split_fractions: shares of program space given to (train, calibration, evaluation).

    Batch metadata: ``"hops"``, ``[batch, answer]``, the hop count of each query.
    """

    name: ClassVar[str] = "variable_binding"

    n_variables: int = 16
    n_lines: int = 8
    max_hops: int = 4
    queries: Literal["all", "one"] = "all"
    chain_layout: Literal["uniform", "longest"] = "uniform"
    query_first: bool = False
    line_format: Literal["text", "token"] = "text"
    show_answers: bool = True
    n_ctx: int | None = None  # type: ignore[assignment]  # resolved to an int in __post_init__
    seed: int = 0
    split_fractions: Sequence[float] = (0.8, 0.1, 0.1)

    _vocab: list[str] = field(init=False, repr=False, compare=False)
    _ids: dict[str, int] = field(init=False, repr=False, compare=False)
    _split_bounds: list[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 1 <= self.n_variables <= len(LETTERS):
            raise ValueError(
                f"n_variables={self.n_variables} must be between 1 and {len(LETTERS)} "
                "(one lowercase letter per variable)."
            )
        if not 1 <= self.n_lines <= self.n_variables:
            raise ValueError(
                f"n_lines={self.n_lines} must be between 1 and n_variables={self.n_variables}: "
                "every line assigns a distinct variable."
            )
        self._check_max_hops(self.max_hops)
        if self.queries not in ("all", "one"):
            raise ValueError(f"queries={self.queries!r} must be 'all' or 'one'.")
        if self.chain_layout not in ("uniform", "longest"):
            raise ValueError(f"chain_layout={self.chain_layout!r} must be 'uniform' or 'longest'.")
        if self.query_first and self.queries != "one":
            raise ValueError(
                "query_first=True needs queries='one': with queries='all' every variable is "
                "asked, so there is no single query to state first."
            )
        if self.line_format not in LINE_FORMATS:
            raise ValueError(f"line_format={self.line_format!r} must be one of {LINE_FORMATS}.")
        if self.n_ctx is None:
            self.n_ctx = self.min_n_ctx
        elif self.n_ctx < self.min_n_ctx:
            raise ValueError(
                f"n_ctx={self.n_ctx} is too short for {self.n_lines}-line programs with "
                f"queries={self.queries!r}, query_first={self.query_first}, line_format="
                f"{self.line_format!r}, show_answers={self.show_answers}: they need at least "
                f"{self.min_n_ctx} tokens. Use n_ctx >= {self.min_n_ctx} or n_ctx=None."
            )
        self.split_fractions = check_split_fractions(self.split_fractions)
        variables = LETTERS[: self.n_variables]
        self._vocab = [PAD, BOS, "=", ";", "?", *DIGITS, *variables]
        if self.line_format == "token":
            self._vocab += [
                f"{variable}={value}"
                for variable in variables
                for value in (*DIGITS, *variables)
                if value != variable
            ]
        self._ids = {token: i for i, token in enumerate(self._vocab)}
        train, calibration, _ = self.split_fractions
        self._split_bounds = [0, round(train * 2**32), round((train + calibration) * 2**32), 2**32]

    def _check_max_hops(self, max_hops: int) -> None:
        if not 1 <= max_hops <= self.n_lines:
            raise ValueError(
                f"max_hops={max_hops} must be between 1 and n_lines={self.n_lines}: a chain of "
                f"h hops takes h lines. Raise n_lines or lower max_hops."
            )

    @property
    def min_n_ctx(self) -> int:
        """Tokens in one example: BOS, 4 per line (1 with ``line_format="token"``), 3 per query
        (2 without shown answers), 3 more for ``query_first``."""
        n_queries = self.n_lines if self.queries == "all" else 1
        per_line = 1 if self.line_format == "token" else 4
        per_query = 3 if self.show_answers else 2
        return 1 + per_line * self.n_lines + per_query * n_queries + (3 if self.query_first else 0)

    @property
    def vocab(self) -> list[str]:
        """``<pad>`` (id 0), ``<bos>``, ``=``, ``;``, ``?``, the digits, the variable letters."""
        return self._vocab

    @property
    def pad_id(self) -> int:
        """Token id of ``<pad>``."""
        return self._ids[PAD]

    def encode(self, text: str) -> list[int]:
        """Token ids of whitespace-separated tokens, e.g. ``"<bos> a = 7 ; ? a 7"``."""
        try:
            return [self._ids[token] for token in text.split()]
        except KeyError as error:
            raise ValueError(
                f"token {error.args[0]!r} is not in the vocabulary {self._vocab}; tokens are "
                "separated by whitespace."
            ) from None

    def decode(self, ids: Sequence[int] | Int[Tensor, " pos"]) -> str:
        """Space-separated token strings; ``decode(encode(t)) == " ".join(t.split())``."""
        values = ids.tolist() if isinstance(ids, Tensor) else ids
        return " ".join(self._vocab[i] for i in values)

    def split_of(self, program: Program) -> Split:
        """The split a program belongs to, from a stable hash of its canonical key."""
        bucket = zlib.crc32(program.key.encode())
        for split, upper in zip(SPLITS, self._split_bounds[1:], strict=True):
            if bucket < upper:
                return split
        raise AssertionError("crc32 is below 2**32")

    def example(self, split: Split, index: int, *, max_hops: int | None = None) -> Program:
        """Example ``index`` of ``split`` (with chains up to ``max_hops``, default the task's);
        ``.hops`` gives the declared hop count of each query."""
        check_split(split)
        max_hops = self.max_hops if max_hops is None else max_hops
        self._check_max_hops(max_hops)
        rng = example_rng(self.seed, split, index)
        for _ in range(MAX_DRAWS):
            program = self._draw(rng, max_hops)
            if self.split_of(program) == split:
                return program
        raise RuntimeError(
            f"no {split} program found in {MAX_DRAWS} draws: the program space of n_variables="
            f"{self.n_variables}, n_lines={self.n_lines}, max_hops={max_hops} is too small to "
            "split. Raise n_variables or n_lines."
        )

    def _draw(self, rng: Random, max_hops: int) -> Program:
        names = rng.sample(LETTERS[: self.n_variables], self.n_lines)
        lengths = []
        if self.queries == "one":
            query_hops = rng.randint(1, max_hops)
        if self.chain_layout == "longest":
            lengths.append(max_hops)
        elif self.queries == "one":
            lengths.append(rng.randint(query_hops, max_hops))
        used = sum(lengths)
        while used < self.n_lines:
            lengths.append(min(rng.randint(1, max_hops), self.n_lines - used))
            used += lengths[-1]

        lines: list[tuple[str, str]] = []
        depth: dict[str, int] = {}
        value: dict[str, str] = {}
        start = 0
        for length in lengths:
            chain = names[start : start + length]
            start += length
            digit = DIGITS[rng.randrange(10)]
            lines.append((chain[0], digit))
            lines.extend(zip(chain[1:], chain[:-1], strict=True))
            for hops, variable in enumerate(chain, start=1):
                depth[variable] = hops
                value[variable] = digit
        rng.shuffle(lines)

        if self.queries == "one":
            asked = [names[query_hops - 1]]  # the first chain is the queried one
        else:
            asked = list(names)
            rng.shuffle(asked)
        return Program(
            lines=tuple(lines),
            queries=tuple(asked),
            answers=tuple(value[v] for v in asked),
            hops=tuple(depth[v] for v in asked),
            query_first=self.query_first,
            line_format=self.line_format,
            show_answers=self.show_answers,
        )

    def batch(
        self, split: Split, n: int, *, offset: int = 0, max_hops: int | None = None
    ) -> TaskBatch:
        """Examples ``offset .. offset + n - 1`` of ``split``: tensors ``[n, n_ctx]``; answers and
        ``metadata["hops"]`` ``[n, n_queries]``. ``max_hops`` overrides the task's for this batch
        (the curriculum hook)."""
        check_batch_request(split, n, offset, self.n_ctx)
        n_ctx = self.n_ctx
        assert n_ctx is not None
        rows, positions, answer_ids, hops = [], [], [], []
        for index in range(offset, offset + n):
            program = self.example(split, index, max_hops=max_hops)
            tokens, answer_positions = program.layout()
            rows.append([self._ids[t] for t in tokens] + [self.pad_id] * (n_ctx - len(tokens)))
            positions.append(answer_positions)
            answer_ids.append([self._ids[answer] for answer in program.answers])
            hops.append(program.hops)

        tokens_t = torch.tensor(rows, dtype=torch.long)
        positions_t = torch.tensor(positions, dtype=torch.long)
        answers = torch.tensor(answer_ids, dtype=torch.long)
        targets = torch.full_like(tokens_t, IGNORE_INDEX)
        targets.scatter_(1, positions_t, answers)
        return TaskBatch(
            tokens=tokens_t,
            targets=targets,
            scored=targets != IGNORE_INDEX,
            attention_mask=tokens_t != self.pad_id,
            answer_positions=positions_t,
            answers=answers,
            split=split,
            indices=torch.arange(offset, offset + n),
            metadata={"hops": torch.tensor(hops, dtype=torch.long)},
        )

    def hop_counts(self, batch: TaskBatch) -> dict[int, int]:
        """Number of queries in ``batch`` per hop count, for 1..max_hops (and any larger)."""
        counts = Counter(batch.metadata["hops"].flatten().tolist())
        largest = max([self.max_hops, *counts])
        return {hops: counts.get(hops, 0) for hops in range(1, largest + 1)}

    def describe(self) -> str:
        """A one-line description for reports."""
        asked = "every variable" if self.queries == "all" else "one variable"
        first = ", query first" if self.query_first else ""
        first += ", one token per line" if self.line_format == "token" else ""
        first += "" if self.show_answers else ", answers not shown"
        longest = f", one chain of {self.max_hops}" if self.chain_layout == "longest" else ""
        return (
            f"variable binding: {self.n_lines} shuffled lines over {self.n_variables} variables, "
            f"chains of 1..{self.max_hops} hops{longest}, {asked} queried{first}, "
            f"n_ctx {self.n_ctx}, seed {self.seed}"
        )
