"""Workflows with a Python entry point each, which the CLI calls: a run's report extras, the
planted-model validation, the training intervention and the benchmark."""
