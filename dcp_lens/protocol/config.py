"""`ProtocolConfig`: every setting of the Depth Control Protocol, in one checked object.

The library (`DepthControlProtocol(model, config=...)`), every command of the CLI (``run``,
``validate``, ``bench``, ``experiment``) and ``results.json``'s metadata (``"config"``) read the
same object. Each field carries its one command-line spelling (``flag``) and help in its
metadata, so the CLI declares the options from this class and no command spells one differently.

Importing this module imports nothing heavy (the CLI builds its parser from it before torch is
imported); names of calibration maps and metrics are checked against their registries when a
config is built.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dcp_lens.utils.errors import ConfigError, ConfigTypeError, ResourceLimitError

PROBES = ("trajectory", "none")

# Each command's defaults where they differ from `ProtocolConfig`'s (plain values, so the CLI
# reads them without importing torch). validate and the intervention run DCP on eleven and ten
# models, so fewer bootstrap draws; the benchmark times the sweep, so no bootstrap, no probe.
_T = TypeVar("_T")

COMMAND_DEFAULTS: dict[str, dict[str, Any]] = {
    "run": {"batch_size": 64},
    "validate": {"n_bootstrap": 200, "probe_points": 1000},
    "experiment": {"n_bootstrap": 200, "batch_size": 64},
    "bench": {"n_bootstrap": 0, "probe": "none"},
}


# Bounds of the size settings, checked when a config is built, before anything is allocated:
# far past what a run uses, far below what would exhaust memory (the bootstrap's draws and the
# jackknife's groups each hold a copy of per-example statistics).
MAXIMA: dict[str, int] = {
    "mixture_components": 1024,
    "calibration_points": 1 << 24,
    "noise_draws": 10_000,
    "batch_size": 1 << 20,
    "n_bootstrap": 100_000,
    "seed": 2**63 - 1,
    "probe_points": 1 << 24,
    "calibration_groups": 10_000,
}


def _option(default: _T, flag: str, help: str, **extra: object) -> _T:
    return field(default=default, metadata={"flag": flag, "help": help, **extra})


@dataclass(frozen=True)
class ProtocolConfig:
    """The settings of one DCP run (checked when built: a wrong type or range is refused with a
    `dcp_lens.utils.errors.ConfigError` naming the field, what it expects and how to fix it).

    Attributes:
        k_grid: iteration counts to test (None: every k in 1..r when r <= 8, else 1, 2, 3, 4 and
            a geometric grid (x1.5) up to and including r). Each must lie in 1..r of the model
            it runs on (checked by `DepthControlProtocol`, which knows r).
        metrics: names of `dcp_lens.protocol.metrics.METRICS` (None: all that the evaluation set
            defines).
        calibration_mode: the S control's label-free map, a name of
            `dcp_lens.protocol.calibration.CALIBRATION_MAPS` (``mean``, ``diag``, ``full``:
            pooled affine; ``mixture``: optimal transport between Gaussian mixtures).
        mixture_components: clusters of a map fitted to state samples (``mixture``).
        calibration_points: states per condition kept to fit a map fitted to state samples.
        calibration_groups: G, the calibration split's groups (example key mod G) of the
            leave-one-group-out jackknife: every map, translator and the base rate is refitted
            G times without one group, the mapped conditions are read under each on a tenth of
            the evaluation examples (at most `dcp_lens.protocol.sweep.JACKKNIFE_TOKENS` tokens
            of them), and the intervals widen by the spread (0: off, intervals
            then ignore the calibration split; 1 is refused).
        control_tokens: tokens of the evaluation the controls shift and the translators are
            read on, a fixed subsample chosen by example key (0 or ``"all"``: every example;
            None: the cap `dcp_lens.protocol.sweep.CONTROL_TOKENS`). Where it binds, each such
            cell is compared with its partner on the subsample (docs/bracket.md).
        match_confidence: score the loss metrics on readouts whose temperature is matched,
            label-free on the calibration split, to full depth's mean entropy.
        noise_draws: with a noisy initial state, evaluations averaged per example.
        batch_size: sequences per forward pass.
        n_bootstrap: paired bootstrap draws for the intervals (0: no intervals, NaN).
        seed: seed of the probe's subsamples, the maps' clustering and the bootstrap.
        probe: ``"trajectory"`` (probe s_t for every t and calibrate(truncate(k))) or ``"none"``.
        probe_points: states per side kept for the probe (a random subsample).
        skip_first_position: leave position 0 out of the calibration statistics.
        memory_budget: GiB of device memory the run plans to use (None: a share of what the
            device can give, `dcp_lens.protocol.budget.budget_bytes`); also given as text
            (``"40"``, ``"40GiB"``). It sizes the readout chunks and is checked against the
            run's estimated peak before the first batch.
    """

    k_grid: Sequence[int] | None = _option(
        None,
        "--k",
        "comma-separated k grid (default: every k if r <= 8, else 1-4 and a x1.5 grid to r)",
        kind="ints",
    )
    metrics: Sequence[str] | None = _option(
        None, "--metrics", "comma-separated metrics (default: all the task defines)", kind="names"
    )
    calibration_mode: str = _option(
        "full", "--calibration-mode", "the map fitted by calibrate (a registered map: see below)"
    )
    mixture_components: int = _option(8, "--mixture-components", "clusters of the mixture map")
    calibration_points: int = _option(
        4096, "--calibration-points", "states per condition kept to fit the mixture map"
    )
    calibration_groups: int = _option(
        10,
        "--calibration-groups",
        "calibration groups of the jackknife that puts the "
        "calibration split's variability into the intervals (0: off)",
    )
    control_tokens: int | str | None = _option(
        None,
        "--control-tokens",
        "tokens of the evaluation that shift and the translators are read on, a fixed "
        "subsample (0 or all: every example; default: the cap CONTROL_TOKENS, docs/bench.md)",
    )
    match_confidence: bool = _option(
        True, "--match-confidence", "score loss metrics at full depth's mean entropy"
    )
    noise_draws: int = _option(
        1, "--noise-draws", "noise draws averaged per example (noisy initial states only)"
    )
    batch_size: int = _option(32, "--batch-size", "sequences per forward pass")
    n_bootstrap: int = _option(1000, "--bootstrap", "paired bootstrap draws")
    seed: int = _option(0, "--seed", "seed of splits, noise, subsamples and bootstrap")
    probe: str = _option(
        "trajectory", "--probe", "the residual OOD probe over iterations, or none", choices=PROBES
    )
    probe_points: int = _option(2000, "--probe-points", "states per side kept for the probe")
    skip_first_position: bool = _option(
        False, "--skip-first-position", "leave position 0 out of the calibration statistics"
    )
    memory_budget: float | int | str | None = _option(
        None,
        "--memory-budget",
        "GiB of device memory the run plans to use (readouts are "
        "scored in chunks that fit; default: 85%% of what the device can give, its cache "
        "included)",
    )

    def __post_init__(self) -> None:
        checked = _checked({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    def grid(self, n_iterations: int) -> tuple[int, ...]:
        """The k grid on a model of ``n_iterations`` iterations: sorted, distinct, each in
        1..r (the default grid when ``k_grid`` is None)."""
        r = n_iterations
        if self.k_grid is None:
            if r <= 8:
                return tuple(range(1, r + 1))
            geometric = {1, 2, 3, 4, r}
            k = 4
            while k < r:
                geometric.add(k)
                k = -(-k * 3 // 2)  # ceil(k * 1.5)
            return tuple(sorted(geometric))
        grid = tuple(sorted(set(self.k_grid)))
        for k in grid:
            check_k(k, r)
        return grid

    def to_dict(self) -> dict[str, object]:
        """The settings as plain JSON values (tuples as lists), what ``results.json`` records."""
        return {
            key: list(value) if isinstance(value, tuple) else value
            for key, value in dataclasses.asdict(self).items()
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> ProtocolConfig:
        """A config from `to_dict`'s output (unknown keys refused)."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ConfigError(f"unknown protocol settings {unknown}; expected some of {names}.")
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        return cls(**_checked({**defaults, **data}))

    def replace(self, **changes: object) -> ProtocolConfig:
        """A copy with ``changes`` (checked like `from_dict`)."""
        return self.from_dict({**self.to_dict(), **changes})


def _checked(values: dict[str, object]) -> dict[str, Any]:
    """``values`` (every field) checked and normalised (sequences as tuples, integers as int);
    the first wrong type or range is refused with a `ConfigError` / `ConfigTypeError`."""
    values = dict(values)
    if values["k_grid"] is not None:
        values["k_grid"] = _int_tuple(values["k_grid"], "k_grid", "--k 1,2,4")
    metrics = None if values["metrics"] is None else _name_tuple(values["metrics"])
    values["metrics"] = metrics
    for name, minimum in (
        ("mixture_components", 1),
        ("calibration_points", 1),
        ("noise_draws", 1),
        ("batch_size", 1),
        ("n_bootstrap", 0),
        ("seed", 0),
        ("probe_points", 1),
        ("calibration_groups", 0),
    ):
        number = values[name] = _check_int(values[name], name, minimum)
        if number > MAXIMA[name]:
            raise ResourceLimitError(
                f"{name}={number} is past dcp-lens's bound of {MAXIMA[name]:,} (a size "
                "that would exhaust memory or never finish, or a seed past 64 bits); pass a "
                "smaller value."
            )
    values["memory_budget"] = _gib(values["memory_budget"])
    values["control_tokens"] = _control_tokens(values["control_tokens"])
    if values["calibration_groups"] == 1:
        raise ConfigError(
            "calibration_groups=1 leaves no group to refit without; pass 0 (no jackknife) or"
            " at least 2 (default 10)."
        )
    for name in ("match_confidence", "skip_first_position"):
        if not isinstance(values[name], bool):
            raise ConfigTypeError(
                f"{name}={values[name]!r} ({type(values[name]).__name__}) must be a bool; pass "
                "True or False."
            )
    for name, allowed in (("probe", PROBES), ("calibration_mode", calibration_modes())):
        if not isinstance(values[name], str) or values[name] not in allowed:
            raise ConfigError(
                f"{name}={values[name]!r} is not one of {allowed}; pass one of those names."
            )
    if metrics is not None:
        known = metric_names()
        unknown = [m for m in metrics if m not in known]
        if unknown:
            raise ConfigError(
                f"metrics {unknown} are not registered; expected a non-empty subset of {known}."
            )
    return values


def _gib(value: object) -> float | None:
    """A memory budget in GiB: None, a positive number, or text such as ``"40"`` / ``"40GiB"``."""
    if value is None:
        return None
    text: str | float = "nan"  # neither text nor a number: refused below
    if isinstance(value, str):
        text = value.strip().lower().removesuffix("gib").removesuffix("gb").removesuffix("g")
        text = text.strip()
    elif isinstance(value, int | float):
        text = value
    try:
        number = float(text)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not math.isfinite(number) or number <= 0 or number > 2**20:
        raise ConfigError(
            f"memory_budget={value!r} must be a number of GiB above 0 (e.g. 40 or '40GiB'), or "
            "None for a share of what the device can give."
        )
    return number


def _control_tokens(value: object) -> int | None:
    """The controls' cap: None (the default cap), 0 (every example; also given as ``"all"``)
    or a positive number of tokens (an int, or its digits as text)."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() == "all":
        return 0
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ConfigError(
            f"control_tokens={value!r} must be a number of tokens >= 0 (0 or 'all': read the "
            "controls on every example), or None for the default cap."
        )
    return int(value)


def check_k(k: int, n_iterations: int) -> None:
    """Refuse a k outside 1..r."""
    if not 1 <= k <= n_iterations:
        raise ConfigError(
            f"k={k} is outside [1, r={n_iterations}]: truncate, replay and shift need 1 <= k <= r; "
            "pick iteration counts of this model."
        )


def calibration_modes() -> tuple[str, ...]:
    """The registered calibration maps' names (`dcp_lens.protocol.calibration.CALIBRATION_MAPS`)."""
    from dcp_lens.protocol.calibration import CALIBRATION_MAPS

    return tuple(CALIBRATION_MAPS)


def metric_names() -> tuple[str, ...]:
    """The registered metrics' names (`dcp_lens.protocol.metrics.METRICS`)."""
    from dcp_lens.protocol.metrics import METRICS

    return tuple(METRICS)


def _check_int(value: object, name: str, minimum: int) -> int:
    """``value`` as an int, refused unless it is an integer (not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigTypeError(
            f"{name}={value!r} ({type(value).__name__}) must be an int >= {minimum}; pass an "
            "integer (not a string, float or bool)."
        )
    if value < minimum:
        raise ConfigError(f"{name}={value} must be >= {minimum}; pass a larger value.")
    return int(value)


def _int_tuple(values: object, name: str, example: str) -> tuple[int, ...]:
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise ConfigTypeError(
            f"{name}={values!r} must be a sequence of ints (e.g. {example}); pass a list or tuple."
        )
    if not values:
        raise ConfigError(f"{name} is empty; pass iteration counts in 1..r (or None: default).")
    for value in values:
        _check_int(value, f"{name} entry", 1)
    return tuple(int(value) for value in values)


def _name_tuple(values: object) -> tuple[str, ...]:
    if isinstance(values, str) or not isinstance(values, Sequence):
        raise ConfigTypeError(
            f"metrics={values!r} must be a sequence of metric names; pass e.g. ('accuracy',)."
        )
    if not values or not all(isinstance(value, str) for value in values):
        raise ConfigError(
            f"metrics={list(values)!r} must be a non-empty sequence of names of {metric_names()}."
        )
    return tuple(values)
