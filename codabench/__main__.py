"""``python -m codabench ...``: the same command line as run_bench.py (see codabench.cli)."""
from codabench.bootstrap import select_device

select_device()  # before anything imports triton: TRITON_INTERPRET=1 when there is no GPU

from codabench.cli import main  # noqa: E402

raise SystemExit(main())
