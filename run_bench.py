"""Run codabench: ``python run_bench.py --suite {smoke,quick,full}`` (``--help`` for the flags)."""
from codabench.bootstrap import select_device

select_device()  # before anything imports triton: TRITON_INTERPRET=1 when there is no GPU

from codabench.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
