"""``python -m dcp_lens.data NAME`` prints where the shipped data ``NAME`` lies."""

from dcp_lens.data import main

raise SystemExit(main())
