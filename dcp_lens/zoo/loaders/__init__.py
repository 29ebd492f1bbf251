"""Loaders of real checkpoints from local files (never pickle, never code from a checkpoint).

``dcp_lens.load("huginn:PATH")``, ``load("raven-retrofit:PATH")``, ``load("ouro:PATH")``,
``load("hrm-text:PATH")``, ``load("llama2c:PATH")`` and ``load("bridge:PATH")`` dispatch here:

- `huginn`: Huginn-0125 (config.json + safetensors, original key names).
- `raven_retrofit`: retrofitted recurrence (Llama and OLMo variants), told from Huginn-0125 by its
  keys; `parent_layers` lines its dense parent's layers up with prelude, core and coda.
- `ouro`: Ouro LoopLM, as an `OuroRecurrentTransformer` with its early-exit gate.
- `hrm_text`: transformers' HRM-Text, as an `HrmRecurrentTransformer` (k counts outer cycles, the
  inner state carried beside the loop's state).
- `llama2c`: llama2.c version-0 ``.bin`` checkpoints with their tokenizer (stories260K).
- `bridge`: any dense TransformerLens 4 `TransformerBridge` (a local Hugging Face folder) as a
  `BridgeModel`, the negative control through the bridge's own hooks.
- `checkpoint_files`: safetensors reading (single or sharded), key/shape checks, meta-device build.
"""

from __future__ import annotations

from dcp_lens.model.folder import SafetensorsCheckpoint
from dcp_lens.zoo.loaders.bridge import BridgeModel, load_bridge
from dcp_lens.zoo.loaders.hrm_text import HrmRecurrentTransformer, hrm_config, load_hrm_text
from dcp_lens.zoo.loaders.huginn import huginn_config, load_huginn
from dcp_lens.zoo.loaders.llama2c import llama2c_config, load_llama2c
from dcp_lens.zoo.loaders.ouro import (
    ExitOutputs,
    OuroRecurrentTransformer,
    exit_distribution,
    load_ouro,
    ouro_config,
)
from dcp_lens.zoo.loaders.raven_retrofit import load_raven_retrofit, parent_layers, retrofit_config

__all__ = [
    "BridgeModel",
    "ExitOutputs",
    "HrmRecurrentTransformer",
    "OuroRecurrentTransformer",
    "SafetensorsCheckpoint",
    "exit_distribution",
    "hrm_config",
    "huginn_config",
    "llama2c_config",
    "load_bridge",
    "load_hrm_text",
    "load_huginn",
    "load_llama2c",
    "load_ouro",
    "load_raven_retrofit",
    "ouro_config",
    "parent_layers",
    "retrofit_config",
]
