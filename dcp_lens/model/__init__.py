"""The model stage: `RecurrentConfig`, `HookedRecurrentTransformer` and its components,
tokenization, and reading and writing its own folder (`save_pretrained` / `from_pretrained`).
Imports only `dcp_lens.utils`: never the loaders, the tasks or the protocol."""
