"""The model zoo: `load(spec)` and its registry, the loaders of real checkpoints, the bundled
models, the planted-ground-truth models and the retrofit of dense checkpoints."""
