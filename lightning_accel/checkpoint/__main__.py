"""``python -m lightning_accel.checkpoint verify|export ...`` (see :mod:`lightning_accel.checkpoint.cli`)."""

from lightning_accel.checkpoint.cli import main

raise SystemExit(main())
