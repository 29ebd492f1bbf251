"""The trainer and its regimes on the tiny preset: reproducibility, resume, each regime's loss."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dcp_lens import HookedRecurrentTransformer, RecurrentConfig
from dcp_lens.training import (
    REGIMES,
    RegimeConfig,
    TrainConfig,
    build_regime_model,
    dense_config,
    evaluate_accuracy,
    every_iteration_loss,
    learning_rate,
    preset,
    regime_loss,
    sample_iterations,
    scored_cross_entropy,
    train,
    truncated_backprop_loss,
)


def weights(model: HookedRecurrentTransformer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.canonical_state_dict().items()}


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs"


def tiny_batch(config: TrainConfig, n: int = 8, offset: int = 0):
    return config.build_task().batch("train", n, offset=offset)


def float64_model(config: TrainConfig, **overrides) -> HookedRecurrentTransformer:
    cfg = RecurrentConfig.from_dict({**config.model.to_dict(), "init_std": 0.2, **overrides})
    return HookedRecurrentTransformer(cfg).to(torch.float64)


# A curriculum that advances at every evaluation, so resuming must restore its state too.
def resumable_config() -> TrainConfig:
    return preset("tiny", regime="sampled", seed=3, curriculum_threshold=0.0, eval_interval=10)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory):
    return train(resumable_config(), tmp_path_factory.mktemp("full"), progress=False)


def test_config_round_trips_through_json(tmp_path: Path):
    config = preset("tiny", regime=RegimeConfig("sampled", sampling="uniform", n_grad=2), seed=5)
    config.to_json(tmp_path / "c.json")
    again = TrainConfig.from_json(tmp_path / "c.json")
    assert again == config
    assert again.regime.max_iterations == 2 * config.model.n_iterations  # resolved default
    assert json.loads((tmp_path / "c.json").read_text())["regime"]["sampling"] == "uniform"
    deeper = dataclasses.replace(config.model, n_iterations=6)
    assert preset("tiny", regime="sampled", model=deeper).regime.max_iterations == 12


def test_stop_and_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path: Path, uninterrupted):
    config = resumable_config()
    stopped = train(config, tmp_path, stop_at_step=25, progress=False)
    assert (stopped.step, stopped.completed) == (25, False)
    assert not (tmp_path / "model").exists()
    resumed = train(config, tmp_path, progress=False)
    assert resumed.completed and resumed.step == config.steps
    assert_bit_identical(weights(resumed.model), weights(uninterrupted.model))
    assert resumed.history == uninterrupted.history
    assert resumed.accuracy_table == uninterrupted.accuracy_table
    assert len(resumed.history["curriculum"]) > 1  # the curriculum did move during the run


def run_files(folder: Path) -> dict[Path, bytes]:
    """The files of a run folder but the folder contract's records (each command is recorded)."""
    from dcp_lens.utils.folders import RESERVED

    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file() and p.name not in RESERVED}


# Fields of trainer_state.json that hold numbers, by their path in it.
STATE_NUMBERS = [
    ("history", "steps", 0, "loss"),
    ("history", "steps", 0, "iterations"),
    ("history", "curriculum", 0, "max_hops"),
    ("param_groups", 0, "lr"),
    ("param_groups", 0, "betas", 1),
]


@pytest.mark.parametrize("value", ["0.5", True])
def test_a_string_or_bool_in_the_training_state_is_refused_and_it_still_resumes(
    tmp_path: Path, uninterrupted, value
):
    from dcp_lens.training.config import CHECKPOINT_DIR
    from dcp_lens.training.state import CHECKPOINT_STATE
    from dcp_lens.utils.errors import DamagedFileError

    config = resumable_config()
    train(config, tmp_path, stop_at_step=25, progress=False)
    path = tmp_path / CHECKPOINT_DIR / CHECKPOINT_STATE
    original = path.read_bytes()
    files = run_files(tmp_path)
    for field in STATE_NUMBERS:
        *parents, last = field
        document = json.loads(original)
        holder = document
        for step in parents:
            holder = holder[step]
        holder[last] = value
        path.write_text(json.dumps(document))
        name = ".".join(str(step) for step in field)
        with pytest.raises(DamagedFileError) as refused:
            train(config, tmp_path, progress=False)
        message = str(refused.value).replace("[", ".").replace("]", "")
        assert str(path) in message and f"field {name} must be" in message, message
        assert f"(got {value!r})" in message and "--no-resume" in message, message
        path.write_bytes(original)
        assert run_files(tmp_path) == files  # nothing written but the folder's own records
    resumed = train(config, tmp_path, progress=False)
    assert_bit_identical(weights(resumed.model), weights(uninterrupted.model))
    assert resumed.history == uninterrupted.history


def test_two_runs_with_one_seed_are_bit_identical(tmp_path: Path, uninterrupted):
    again = train(resumable_config(), tmp_path / "same", progress=False)
    assert_bit_identical(weights(again.model), weights(uninterrupted.model))
    assert again.history == uninterrupted.history
    other = train(
        dataclasses.replace(resumable_config(), seed=4, steps=5), tmp_path / "other", progress=False
    )
    first = next(iter(weights(other.model)))
    assert not torch.equal(weights(other.model)[first], weights(uninterrupted.model)[first])


def test_run_folder_holds_safetensors_and_json_only(uninterrupted):
    out = uninterrupted.out_dir
    assert sorted(p.name for p in (out / "checkpoint").iterdir()) == [
        "state.safetensors",
        "trainer_state.json",
    ]
    tensors = load_file(str(out / "checkpoint" / "state.safetensors"))
    assert {"rng.sampler", "rng.torch"} <= tensors.keys()
    assert any(k.startswith("optimizer.core.0.") and k.endswith("exp_avg") for k in tensors)
    loaded = HookedRecurrentTransformer.from_pretrained(out / "model")
    assert_bit_identical(weights(loaded), weights(uninterrupted.model))
    table = json.loads((out / "accuracy_table.json").read_text())
    r = uninterrupted.config.model.n_iterations
    assert table["k_values"] == list(range(1, r + uninterrupted.config.table_extra_iterations + 1))
    history = json.loads((out / "history.json").read_text())
    assert len(history["steps"]) == uninterrupted.config.steps
    assert history["timing"]["seconds_per_step"] > 0
    with pytest.raises(ValueError, match="different config"):
        train(dataclasses.replace(uninterrupted.config, lr=1e-3), out, progress=False)
    # Resuming a finished run trains nothing and rewrites the same results.
    again = train(uninterrupted.config, out, progress=False)
    assert again.completed and again.history == uninterrupted.history
    assert_bit_identical(weights(again.model), weights(uninterrupted.model))
    assert json.loads((out / "history.json").read_text())["timing"]["seconds_per_step"] is None


@pytest.mark.parametrize("regime", REGIMES)
def test_each_regime_lowers_the_loss(tmp_path: Path, regime: str):
    result = train(preset("tiny", regime=regime), tmp_path, progress=False)
    losses = [record["loss"] for record in result.history["steps"]]
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.3
    assert all(math.isfinite(loss) for loss in losses)


def test_sampled_regime_backpropagates_through_the_last_n_grad_iterations_only():
    config = preset("tiny", regime="sampled")
    model = float64_model(config)
    batch = tiny_batch(config)
    r, n_grad = 5, 2
    kept: dict[int, torch.Tensor] = {}

    def keep(state: torch.Tensor, hook) -> None:
        state.retain_grad()
        kept[int(hook.name.split(".")[1])] = state

    with model.iterations(r):
        names = [model.state_hook_name(t) for t in (r - n_grad - 1, r - n_grad + 1)]
        with model.hooks(fwd_hooks=[(name, keep) for name in names], reset_hooks_end=False):
            loss = truncated_backprop_loss(model, batch.tokens, batch.targets, r, n_grad)
        model.reset_hooks()
    loss.backward()
    assert kept[r - n_grad - 1].grad is None  # the cut: no gradient reaches s_{r - n_grad - 1}
    assert kept[r - n_grad + 1].grad.abs().sum() > 0
    assert model.canonical_state_dict()["prelude.0.attn.W_Q"].grad.abs().sum() > 0  # via e

    # n_grad >= r is full backpropagation: the same gradient as the fixed loss; fewer differs.
    def core_grad(n: int) -> torch.Tensor:
        model.zero_grad()
        truncated_backprop_loss(model, batch.tokens, batch.targets, r, n).backward()
        return model.canonical_state_dict()["core.0.mlp.W_in"].grad.clone()

    model.zero_grad()
    scored_cross_entropy(model(batch.tokens, n_iterations=r), batch.targets).backward()
    full = model.canonical_state_dict()["core.0.mlp.W_in"].grad.clone()
    assert torch.allclose(core_grad(r), full, rtol=0, atol=1e-12)
    assert (core_grad(n_grad) - full).abs().max() > 1e-6


def test_every_iteration_loss_is_the_mean_of_truncated_losses():
    config = preset("tiny", regime="every-iteration")
    model = float64_model(config)
    batch = tiny_batch(config)
    r = model.cfg.n_iterations
    loss = every_iteration_loss(model, batch.tokens, batch.targets, r)
    per_iteration = [
        scored_cross_entropy(model(batch.tokens, n_iterations=t), batch.targets)
        for t in range(1, r + 1)
    ]
    reference = torch.stack(per_iteration).mean()
    assert abs(loss.item() - reference.item()) < 1e-12
    (grad,) = torch.autograd.grad(loss, model.canonical_state_dict()["core.0.attn.W_K"])
    (reference_grad,) = torch.autograd.grad(
        reference, model.canonical_state_dict()["core.0.attn.W_K"]
    )
    assert torch.allclose(grad, reference_grad, rtol=0, atol=1e-12)
    # regime_loss dispatches to it and reports the iterations it ran.
    step_loss, ran = regime_loss(
        model, config.regime, batch.tokens, batch.targets, torch.Generator()
    )
    assert ran == r and abs(step_loss.item() - reference.item()) < 1e-12


def test_dense_model_has_the_recurrent_depth_in_distinct_blocks():
    config = preset("tiny", regime="dense")
    cfg = config.model
    depth = cfg.n_prelude + cfg.n_iterations * cfg.n_core + cfg.n_coda
    dense = build_regime_model(cfg, config.regime)
    assert dense.is_dense and dense.cfg == dense_config(cfg)
    assert dense.cfg.n_layers == len(dense.blocks) == depth == config.full_depth
    assert dense.cfg.d_model == cfg.d_model and dense.cfg.d_mlp == cfg.d_mlp
    block_params = [{id(p) for p in block.parameters()} for block in dense.blocks]
    assert len(set.union(*block_params)) == sum(len(ids) for ids in block_params)  # no sharing
    recurrent = HookedRecurrentTransformer(cfg)
    assert len(recurrent.blocks) == depth  # the same number of block applications


def test_sample_iterations_follows_the_requested_distribution():
    generator = torch.Generator().manual_seed(0)
    huginn = RegimeConfig("sampled", mean_iterations=4.0, max_iterations=64).resolved(4)
    draws = torch.tensor([sample_iterations(huginn, generator) for _ in range(4000)]).double()
    assert draws.min() >= 1 and draws.max() <= 64
    assert abs(draws.mean().item() - 5.0) < 0.15  # E[Poisson(exp(tau))] + 1 = mean + 1
    uniform = RegimeConfig("sampled", sampling="uniform", max_iterations=6).resolved(3)
    counts = torch.bincount(
        torch.tensor([sample_iterations(uniform, generator) for _ in range(6000)]), minlength=7
    )
    assert counts[0] == 0 and (counts[1:] - 1000).abs().max() < 120


def test_evaluate_accuracy_matches_direct_truncated_readouts():
    config = preset("tiny")
    task = config.build_task()
    for model in (float64_model(config), build_regime_model(config.model, RegimeConfig("dense"))):
        ks = [1, 2, model.n_iterations] if model.is_dense else [1, 3, 5]
        table = evaluate_accuracy(model, task, 40, ks, batch_size=16)
        batch = task.evaluation(40)
        hops = batch.metadata["hops"]
        for k in ks:
            if model.is_dense and k < model.cfg.n_layers:
                logits = model.readout(model(batch.tokens, stop_at_layer=k))
            elif model.is_dense:
                logits = model(batch.tokens)
            else:
                logits = model(batch.tokens, n_iterations=k)
            correct = batch.correct(logits)
            assert table.overall[k] == pytest.approx(correct.double().mean().item())
            for h in table.by_hops:
                expected = correct[hops == h].double().mean().item()
                assert table.at(h, k) == pytest.approx(expected)


def test_learning_rate_warms_up_then_decays_to_the_floor():
    config = preset("tiny", steps=100, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1)
    rates = [learning_rate(config, step) for step in range(config.steps)]
    assert rates[0] == pytest.approx(1e-4) and rates[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(rates[9:], rates[10:], strict=False))
    assert learning_rate(config, config.steps) == pytest.approx(1e-4)


def test_bad_configs_are_refused_where_they_enter():
    config = preset("tiny")
    with pytest.raises(ValueError, match="does not fit the task"):
        dataclasses.replace(config, model=RecurrentConfig(d_vocab=7, n_ctx=64))
    with pytest.raises(ValueError, match="curriculum"):
        dataclasses.replace(config, curriculum="sometimes")
    with pytest.raises(ValueError, match="regime name"):
        RegimeConfig("huginn")


def test_config_files_with_unknown_keys_are_refused_by_name() -> None:
    from dcp_lens.training.config import TrainConfig
    from dcp_lens.training.regimes import RegimeConfig

    with pytest.raises(ValueError, match=r"unknown RegimeConfig keys \['bogus'\]"):
        RegimeConfig.from_dict({"name": "fixed", "bogus": 1})
    data = preset("tiny").to_dict()
    with pytest.raises(ValueError, match=r"unknown TrainConfig keys \['bogus'\]"):
        TrainConfig.from_dict({**data, "bogus": 1})
    assert TrainConfig.from_dict(data) == preset("tiny")


class Killed(BaseException):
    """Stands in for a SIGKILL: nothing in dcp-lens catches it."""


def test_a_kill_right_after_the_model_is_written_leaves_it_the_runs_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The model's files are recorded before they land: a run stopped right after writing
    ``model/`` holds them as its own (a rerun replaces them, and only them), while files a
    user puts in the folder, ``model/`` included, stay the user's through a resume and a
    restart."""
    from dcp_lens.utils.folders import MANIFEST, OutputFolder

    config = preset("tiny", steps=3, eval_interval=3, checkpoint_interval=3)
    out = tmp_path / "run"
    save = HookedRecurrentTransformer.save_pretrained

    def save_then_die(self: HookedRecurrentTransformer, path: str | Path) -> Path:
        save(self, path)
        raise Killed

    monkeypatch.setattr(HookedRecurrentTransformer, "save_pretrained", save_then_die)
    with pytest.raises(Killed):
        train(config, out, progress=False)
    monkeypatch.undo()
    users = {out / "user_notes.txt": b"mine", out / "model" / "user_notes.txt": b"mine too"}
    for path, data in users.items():
        path.write_bytes(data)

    contents = OutputFolder(out, "train").inspect()
    assert contents is not None and not contents.finished
    assert {"model/config.json", "model/model.safetensors"} <= set(contents.own)
    assert sorted(contents.foreign) == ["model/user_notes.txt", "user_notes.txt"]

    resumed = train(config, out, progress=False)
    replaced = train(config, out, resume=False, progress=False)
    assert resumed.completed and replaced.completed
    assert {path: path.read_bytes() for path in users} == users
    recorded = json.loads((out / MANIFEST).read_text())["files"]
    assert {"model/config.json", "model/model.safetensors"} <= set(recorded)
    assert not {"user_notes.txt", "model/user_notes.txt"} & set(recorded)
    assert_bit_identical(
        weights(HookedRecurrentTransformer.from_pretrained(out / "model")), weights(replaced.model)
    )


def test_files_a_user_puts_in_or_beside_the_checkpoint_are_kept(tmp_path: Path, uninterrupted):
    """A checkpoint is replaced by the files the run recorded only: a user's file in
    ``checkpoint/`` and the user's folders of the names the trainer uses while it writes one
    are kept through a resume and a restart, and the resume is still bit-identical."""
    from dcp_lens.training.config import CHECKPOINT_DIR

    config = resumable_config()
    out = tmp_path / "run"
    train(config, out, stop_at_step=15, progress=False)
    users = {
        out / CHECKPOINT_DIR / "user_notes.txt": b"in the checkpoint",
        out / f"{CHECKPOINT_DIR}.tmp" / "user_notes.txt": b"a folder of mine",
        out / f"{CHECKPOINT_DIR}.old" / "user_notes.txt": b"another folder of mine",
    }
    for path, data in users.items():
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(data)

    resumed = train(config, out, progress=False)
    assert {path: path.read_bytes() for path in users} == users
    assert_bit_identical(weights(resumed.model), weights(uninterrupted.model))
    replaced = train(config, out, resume=False, progress=False)
    assert {path: path.read_bytes() for path in users} == users
    assert_bit_identical(weights(replaced.model), weights(uninterrupted.model))
