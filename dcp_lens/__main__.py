"""``python -m dcp_lens``: the ``dcp-lens`` command line (what ``torchrun -m dcp_lens`` runs)."""

from dcp_lens.cli import main

raise SystemExit(main())
