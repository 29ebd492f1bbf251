"""The bottom stage: errors, input checks, atomic files and run snapshots, memory, devices and
torch.distributed helpers. Imports nothing else from dcp_lens."""
